/*
 * log.h — detattnd's log: one line per event on stderr, "<UTC time> <level> <message>".
 * Thread: any thread; each line is written with one stdio call.
 */
#ifndef DA_LOG_H
#define DA_LOG_H

typedef enum da_log_level {
  DA_LOG_ERROR = 0,
  DA_LOG_WARN = 1,
  DA_LOG_INFO = 2,
  DA_LOG_DEBUG = 3,
} da_log_level;

/* Lines above this level are dropped. Set once at start-up, before threads start. */
void da_log_set_level(da_log_level level);
da_log_level da_log_get_level(void);
const char *da_log_level_name(da_log_level level);

void da_log(da_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define da_log_error(...) da_log(DA_LOG_ERROR, __VA_ARGS__)
#define da_log_warn(...) da_log(DA_LOG_WARN, __VA_ARGS__)
#define da_log_info(...) da_log(DA_LOG_INFO, __VA_ARGS__)
#define da_log_debug(...)                                        \
  do {                                                           \
    if (da_log_get_level() >= DA_LOG_DEBUG) da_log(DA_LOG_DEBUG, __VA_ARGS__); \
  } while (0)

#endif /* DA_LOG_H */
