/* detattnd: the deterministic attention daemon. Settings: see `detattnd --help`. */
#include <stdio.h>

#include "config.h"
#include "daemon.h"
#include "log.h"

extern char **environ;

int main(int argc, char **argv) {
  static da_config cfg;
  char err[1024];
  if (da_config_load(&cfg, argc, argv, environ, err, sizeof(err)) != 0) {
    fprintf(stderr, "detattnd: %s\n", err);
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
  return da_daemon_main(&cfg);
}
