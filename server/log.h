/*
 * log.h — detattnd's log: one line per event on stderr, in one of two formats.
 *
 *  text  "<UTC time> detattnd <level>: <message>" (the default, for people).
 *  json  one JSON object per line (cJSON), for log collectors:
 *          {"time":"2026-11-24T10:00:00.123Z","level":"info","event":"backend",
 *           "msg":"backend cuda (sm_90), ...","fields":{"backend":"cuda","split_tokens":512}}
 *        time is RFC 3339 UTC with milliseconds; level is error|warn|info|debug; event is a
 *        stable snake_case name ("message" for lines logged without one); msg is the text
 *        line's message; fields holds the event's typed values (empty for "message").
 *
 * One line is special: the readiness line. In text format it is the bare
 * "listening on <url>" that scripts and tests wait for; in json it is the event
 * "listening" with the url field.
 *
 * Thread: any thread; each line is written with one stdio call. Set the level and format
 * once at start-up, before threads start.
 */
#ifndef DA_LOG_H
#define DA_LOG_H

#include <stdint.h>

typedef enum da_log_level {
  DA_LOG_ERROR = 0,
  DA_LOG_WARN = 1,
  DA_LOG_INFO = 2,
  DA_LOG_DEBUG = 3,
} da_log_level;

typedef enum da_log_format {
  DA_LOG_TEXT = 0,
  DA_LOG_JSON = 1,
} da_log_format;

/* Lines above this level are dropped. */
void da_log_set_level(da_log_level level);
da_log_level da_log_get_level(void);
const char *da_log_level_name(da_log_level level);
void da_log_set_format(da_log_format format);
da_log_format da_log_get_format(void);

/* One typed field of an event. Build them with the DA_LF_* macros. */
typedef enum da_log_ftype { DA_LOG_F_STR, DA_LOG_F_INT, DA_LOG_F_NUM, DA_LOG_F_BOOL } da_log_ftype;
typedef struct da_log_field {
  const char *key;
  da_log_ftype type;
  const char *s;
  int64_t i;
  double f;
} da_log_field;

#define DA_LF_STR(k, v) ((da_log_field){.key = (k), .type = DA_LOG_F_STR, .s = (v)})
#define DA_LF_INT(k, v) ((da_log_field){.key = (k), .type = DA_LOG_F_INT, .i = (int64_t)(v)})
#define DA_LF_NUM(k, v) ((da_log_field){.key = (k), .type = DA_LOG_F_NUM, .f = (double)(v)})
#define DA_LF_BOOL(k, v) ((da_log_field){.key = (k), .type = DA_LOG_F_BOOL, .i = !!(v)})

/* A plain message: event "message", no fields. */
void da_log(da_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* An event with n typed fields; fmt/... is its human message (the text format prints only
 * that). */
void da_log_event(da_log_level level, const char *event, const da_log_field *fields, int n, const char *fmt,
                  ...) __attribute__((format(printf, 5, 6)));

/* The readiness line: "listening on <url>" (text) or the event "listening" (json), at info
 * level whatever the log level. */
void da_log_listening(const char *url);

/* Writes one log line of the current format to buf (without the newline), as da_log_event
 * would print it; for tests. Returns the length, truncated to buflen - 1. */
int da_log_format_line(char *buf, int buflen, da_log_level level, const char *event, const da_log_field *fields,
                       int n, const char *msg);

#define da_log_error(...) da_log(DA_LOG_ERROR, __VA_ARGS__)
#define da_log_warn(...) da_log(DA_LOG_WARN, __VA_ARGS__)
#define da_log_info(...) da_log(DA_LOG_INFO, __VA_ARGS__)
#define da_log_debug(...)                                        \
  do {                                                           \
    if (da_log_get_level() >= DA_LOG_DEBUG) da_log(DA_LOG_DEBUG, __VA_ARGS__); \
  } while (0)

#endif /* DA_LOG_H */
