#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

static da_log_level cur_level = DA_LOG_INFO;

static const char *const names[] = {"error", "warn", "info", "debug"};

void da_log_set_level(da_log_level level) { cur_level = level; }
da_log_level da_log_get_level(void) { return cur_level; }

const char *da_log_level_name(da_log_level level) {
  return (unsigned)level < sizeof(names) / sizeof(names[0]) ? names[level] : "?";
}

void da_log(da_log_level level, const char *fmt, ...) {
  if (level > cur_level) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char when[32];
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  fprintf(stderr, "%s.%03ldZ detattnd %s: %s\n", when, ts.tv_nsec / 1000000L, da_log_level_name(level),
          msg);
}
