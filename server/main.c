/* detattnd: the deterministic attention daemon. Settings: see `detattnd --help`. */
#include <stdio.h>

#include "config.h"
#include "daemon.h"
#include "fault.h"
#include "log.h"

extern char **environ;

int main(int argc, char **argv) {
  static da_config cfg;
  char err[1024];
  da_fault_init();
  if (da_config_load(&cfg, argc, argv, environ, err, sizeof(err)) != 0) {
    /* The settings read before the bad one apply: --log-format json, if it came first. */
    if (cfg.log_format == DA_LOG_JSON) {
      da_log_set_format(DA_LOG_JSON);
      da_log_field f = DA_LF_STR("error", err);
      da_log_event(DA_LOG_ERROR, "bad_config", &f, 1, "detattnd: %s", err);
    } else {
      fprintf(stderr, "detattnd: %s\n", err);
    }
    return DA_EXIT_CONFIG;
  }
  if (cfg.help) {
    da_config_help(stdout);
    return DA_EXIT_OK;
  }
  if (cfg.print_config) {
    da_config_example(stdout);
    return DA_EXIT_OK;
  }
  da_log_set_level((da_log_level)cfg.log_level);
  da_log_set_format((da_log_format)cfg.log_format);
  return da_daemon_main(&cfg);
}
