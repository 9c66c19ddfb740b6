#include "phases.h"

#include <stdio.h>
#include <stdlib.h>

#include "hist.h"
#include "log.h"

struct da_phases {
  da_hist h[DA_PH_N];
  uint64_t skipped;
};

static const char *const names[DA_PH_N] = {"admit", "batch", "worker", "backend", "loop", "reply", "total"};

da_phases *da_phases_new(void) {
  da_phases *p = malloc(sizeof(*p));
  if (p == NULL) return NULL;
  for (int i = 0; i < DA_PH_N; i++) da_hist_init(&p->h[i]);
  p->skipped = 0;
  return p;
}

void da_phases_free(da_phases *p) { free(p); }

void da_phases_add(da_phases *p, const uint64_t t[DA_PH_N]) {
  for (int i = 0; i + 1 < DA_PH_N; i++)
    if (t[i] == 0 || t[i + 1] < t[i]) {
      p->skipped++;
      return;
    }
  for (int i = 0; i + 1 < DA_PH_N; i++) da_hist_record(&p->h[i], t[i + 1] - t[i]);
  da_hist_record(&p->h[DA_PH_TOTAL], t[DA_PH_N - 1] - t[0]);
}

void da_phases_log(const da_phases *p) {
  if (p == NULL || p->h[DA_PH_TOTAL].count == 0) return;
  char line[512];
  int k = snprintf(line, sizeof(line), "phase timing, %llu decode forwards (%llu skipped), us p50 / p90:",
                   (unsigned long long)p->h[DA_PH_TOTAL].count, (unsigned long long)p->skipped);
  for (int i = 0; i < DA_PH_N && k > 0 && (size_t)k < sizeof(line); i++)
    k += snprintf(line + k, sizeof(line) - (size_t)k, "%s %s %.1f / %.1f", i == 0 ? "" : ",", names[i],
                  1e-3 * (double)da_hist_quantile(&p->h[i], 0.5), 1e-3 * (double)da_hist_quantile(&p->h[i], 0.9));
  da_log_info("%s", line);
}
