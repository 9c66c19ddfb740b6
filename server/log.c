#include "log.h"

#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static da_log_level cur_level = DA_LOG_INFO;
static da_log_format cur_format = DA_LOG_TEXT;

static const char *const names[] = {"error", "warn", "info", "debug"};

void da_log_set_level(da_log_level level) { cur_level = level; }
da_log_level da_log_get_level(void) { return cur_level; }
void da_log_set_format(da_log_format format) { cur_format = format; }
da_log_format da_log_get_format(void) { return cur_format; }

const char *da_log_level_name(da_log_level level) {
  return (unsigned)level < sizeof(names) / sizeof(names[0]) ? names[level] : "?";
}

/* "2026-11-24T10:00:00.123Z" */
static void now_utc(char *out, size_t outlen) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char when[24];
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(out, outlen, "%.19s.%03dZ", when, (int)(ts.tv_nsec / 1000000L) % 1000);
}

static int json_line(char *buf, int buflen, da_log_level level, const char *event, const da_log_field *fields,
                     int n, const char *msg) {
  char when[40];
  now_utc(when, sizeof when);
  cJSON *o = cJSON_CreateObject(), *f = NULL;
  int ok = o != NULL && cJSON_AddStringToObject(o, "time", when) && cJSON_AddStringToObject(o, "level", da_log_level_name(level)) &&
           cJSON_AddStringToObject(o, "event", event) && cJSON_AddStringToObject(o, "msg", msg) &&
           (f = cJSON_AddObjectToObject(o, "fields")) != NULL;
  for (int i = 0; ok && i < n; i++) {
    const da_log_field *x = &fields[i];
    switch (x->type) {
    case DA_LOG_F_STR: ok = cJSON_AddStringToObject(f, x->key, x->s ? x->s : "") != NULL; break;
    case DA_LOG_F_INT: ok = cJSON_AddNumberToObject(f, x->key, (double)x->i) != NULL; break;
    case DA_LOG_F_NUM: ok = cJSON_AddNumberToObject(f, x->key, x->f) != NULL; break;
    case DA_LOG_F_BOOL: ok = cJSON_AddBoolToObject(f, x->key, x->i != 0) != NULL; break;
    }
  }
  char *s = ok ? cJSON_PrintUnformatted(o) : NULL;
  cJSON_Delete(o);
  int len;
  if (s == NULL)
    len = snprintf(buf, (size_t)buflen, "{\"time\":\"%s\",\"level\":\"error\",\"event\":\"log_failed\",\"msg\":\"out of "
                   "memory formatting a log line\",\"fields\":{}}", when);
  else {
    len = snprintf(buf, (size_t)buflen, "%s", s);
    cJSON_free(s);
  }
  return len < buflen ? len : buflen - 1;
}

int da_log_format_line(char *buf, int buflen, da_log_level level, const char *event, const da_log_field *fields,
                       int n, const char *msg) {
  if (buflen <= 0) return 0;
  if (cur_format == DA_LOG_JSON) return json_line(buf, buflen, level, event, fields, n, msg);
  char when[40];
  now_utc(when, sizeof when);
  int len = snprintf(buf, (size_t)buflen, "%s detattnd %s: %s", when, da_log_level_name(level), msg);
  return len < buflen ? len : buflen - 1;
}

/* A JSON line holds the message twice (msg, and fields) plus escapes: room for both. */
#define LINE_MAX_BYTES 8192

static void emit(da_log_level level, const char *event, const da_log_field *fields, int n, const char *msg) {
  char line[LINE_MAX_BYTES];
  da_log_format_line(line, sizeof line, level, event, fields, n, msg);
  fprintf(stderr, "%s\n", line);
}

void da_log(da_log_level level, const char *fmt, ...) {
  if (level > cur_level) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  emit(level, "message", NULL, 0, msg);
}

void da_log_event(da_log_level level, const char *event, const da_log_field *fields, int n, const char *fmt, ...) {
  if (level > cur_level) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  emit(level, event, fields, n, msg);
}

void da_log_listening(const char *url) {
  if (cur_format == DA_LOG_TEXT) {
    fprintf(stderr, "listening on %s\n", url);
    return;
  }
  char msg[1024];
  snprintf(msg, sizeof msg, "listening on %s", url);
  da_log_field f = DA_LF_STR("url", url);
  emit(DA_LOG_INFO, "listening", &f, 1, msg);
}
