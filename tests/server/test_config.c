/*
 * test_config.c — detattnd's config table (server/config.c): defaults, the config file,
 * the environment and flags in that order of precedence, bounds and cross-setting errors.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "da.h"
#include "testutil.h"

static da_config cfg;
static char err[1024];
static char cfg_path[256];

static int load(char *const argv[], char *const envp[]) {
  int argc = 0;
  while (argv[argc]) argc++;
  err[0] = '\0';
  return da_config_load(&cfg, argc, argv, envp, err, sizeof(err));
}

static void setup(void) {
  snprintf(cfg_path, sizeof(cfg_path), "/tmp/detattn-test-config-%d.ini", (int)getpid());
}

static void teardown(void) { unlink(cfg_path); }

START_TEST(defaults_form_a_valid_model) {
  char *argv[] = {"detattnd", NULL};
  ck_assert_int_eq(load(argv, NULL), 0);
  da_model m = {.n_layers = cfg.layers, .n_q_heads = cfg.q_heads, .n_kv_heads = cfg.kv_heads,
                .head_dim = cfg.head_dim, .dtype = (da_dtype)cfg.dtype, .scale = (float)cfg.scale};
  da_numerics nu = {cfg.split_tokens, cfg.tile_tokens};
  da_model_defaults(&m);
  char msg[256];
  ck_assert_msg(da_model_check(&m, &nu, msg, sizeof(msg)) == 0, "%s", msg);
  ck_assert_int_eq(cfg.split_tokens, DA_DEFAULT_SPLIT_TOKENS);
  ck_assert_int_eq(cfg.tile_tokens, DA_DEFAULT_TILE_TOKENS);
  ck_assert_str_eq(da_config_backend_name(&cfg), "auto");
  ck_assert_int_eq(cfg.help, 0);
}
END_TEST

START_TEST(default_listen_uses_xdg_runtime_dir_then_tmp) {
  char *argv[] = {"detattnd", NULL};
  char *env[] = {"XDG_RUNTIME_DIR=/run/user/4242", NULL};
  ck_assert_int_eq(load(argv, env), 0);
  ck_assert_str_eq(cfg.listen, "ipc:///run/user/4242/detattn/detattnd.sock");
  ck_assert_int_eq(load(argv, NULL), 0);
  char want[128];
  snprintf(want, sizeof(want), "ipc:///tmp/detattn-%u/detattnd.sock", (unsigned)getuid());
  ck_assert_str_eq(cfg.listen, want);
}
END_TEST

START_TEST(file_overrides_defaults) {
  da_test_write_file(cfg_path, "; comment\n[detattnd]\nlayers = 7\ndtype = fp16\nsoftcap = 30.5\nlisten = tcp://127.0.0.1:0\n");
  char *argv[] = {"detattnd", "--config", cfg_path, NULL};
  ck_assert_msg(load(argv, NULL) == 0, "%s", err);
  ck_assert_int_eq(cfg.layers, 7);
  ck_assert_int_eq(cfg.dtype, DA_FP16);
  ck_assert(cfg.softcap == 30.5);
  ck_assert_str_eq(cfg.listen, "tcp://127.0.0.1:0");
}
END_TEST

START_TEST(env_overrides_file_and_flags_override_env) {
  da_test_write_file(cfg_path, "layers = 7\nkv-tokens = 4096\nq-heads = 16\n");
  char *env[] = {"DETATTND_LAYERS=9", "DETATTND_KV_TOKENS=2048", NULL};
  char *argv[] = {"detattnd", "--config", cfg_path, "--layers", "11", NULL};
  ck_assert_msg(load(argv, env) == 0, "%s", err);
  ck_assert_int_eq(cfg.layers, 11);     /* flag > env > file */
  ck_assert_int_eq(cfg.kv_tokens, 2048); /* env > file */
  ck_assert_int_eq(cfg.q_heads, 16);     /* file > default */
}
END_TEST

START_TEST(config_file_may_come_from_the_environment) {
  da_test_write_file(cfg_path, "head-dim = 64\n");
  char env[300];
  snprintf(env, sizeof(env), "DETATTND_CONFIG=%s", cfg_path);
  char *envp[] = {env, NULL};
  char *argv[] = {"detattnd", NULL};
  ck_assert_msg(load(argv, envp) == 0, "%s", err);
  ck_assert_int_eq(cfg.head_dim, 64);
}
END_TEST

START_TEST(flag_equals_form_and_separate_value_agree) {
  char *a1[] = {"detattnd", "--page-tokens=32", "--log-level=debug", NULL};
  ck_assert_msg(load(a1, NULL) == 0, "%s", err);
  int pt = cfg.page_tokens, ll = cfg.log_level;
  char *a2[] = {"detattnd", "--page-tokens", "32", "--log-level", "debug", NULL};
  ck_assert_msg(load(a2, NULL) == 0, "%s", err);
  ck_assert_int_eq(cfg.page_tokens, pt);
  ck_assert_int_eq(cfg.log_level, ll);
  ck_assert_int_eq(pt, 32);
}
END_TEST

START_TEST(flag_out_of_bounds_names_setting_and_bounds) {
  char *argv[] = {"detattnd", "--layers", "0", NULL};
  ck_assert_int_eq(load(argv, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "layers") && strstr(err, "[1, 4096]") && strstr(err, "flag"), "%s", err);
}
END_TEST

START_TEST(env_out_of_bounds_names_the_variable) {
  char *env[] = {"DETATTND_TILE_TOKENS=1000", NULL};
  char *argv[] = {"detattnd", NULL};
  ck_assert_int_eq(load(argv, env), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "DETATTND_TILE_TOKENS") && strstr(err, "1000"), "%s", err);
}
END_TEST

START_TEST(file_errors_name_file_and_line) {
  da_test_write_file(cfg_path, "layers = 4\n\nhead-dim = 5000\n");
  char *argv[] = {"detattnd", "--config", cfg_path, NULL};
  ck_assert_int_eq(load(argv, NULL), DETATTN_INVALID_ARGUMENT);
  char want[300];
  snprintf(want, sizeof(want), "%s:3:", cfg_path);
  ck_assert_msg(strstr(err, want) && strstr(err, "head-dim"), "%s", err);
  da_test_write_file(cfg_path, "no-such-setting = 1\n");
  ck_assert_int_eq(load(argv, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "no-such-setting"), "%s", err);
}
END_TEST

START_TEST(missing_config_file_is_an_error) {
  char *argv[] = {"detattnd", "--config", "/nonexistent/detattnd.conf", NULL};
  ck_assert_int_eq(load(argv, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "/nonexistent/detattnd.conf"), "%s", err);
}
END_TEST

START_TEST(malformed_values_are_rejected) {
  const char *bad[][2] = {{"--layers", "12x"}, {"--layers", ""},      {"--softcap", "nan"},
                          {"--dtype", "fp32"}, {"--backend", "tpu"}, {"--kv-tokens", "-5"}};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    char *argv[] = {"detattnd", (char *)bad[i][0], (char *)bad[i][1], NULL};
    ck_assert_msg(load(argv, NULL) == DETATTN_INVALID_ARGUMENT, "%s %s accepted", bad[i][0], bad[i][1]);
    ck_assert_msg(strstr(err, bad[i][0] + 2), "%s %s: message '%s' does not name it", bad[i][0],
                  bad[i][1], err);
  }
}
END_TEST

START_TEST(unknown_flag_and_missing_value_are_rejected) {
  char *a1[] = {"detattnd", "--no-such-flag", "1", NULL};
  ck_assert_int_eq(load(a1, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "no-such-flag"), "%s", err);
  char *a2[] = {"detattnd", "--layers", NULL};
  ck_assert_int_eq(load(a2, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "needs a value"), "%s", err);
  char *a3[] = {"detattnd", "stray", NULL};
  ck_assert_int_eq(load(a3, NULL), DETATTN_INVALID_ARGUMENT);
}
END_TEST

START_TEST(cross_setting_errors_are_reported) {
  char *a1[] = {"detattnd", "--q-heads", "12", "--kv-heads", "8", NULL};
  ck_assert_int_eq(load(a1, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "q heads"), "%s", err);
  char *a2[] = {"detattnd", "--split-tokens", "100", NULL};
  ck_assert_int_eq(load(a2, NULL), DETATTN_INVALID_ARGUMENT);
  char *a3[] = {"detattnd", "--page-tokens", "24", NULL};
  ck_assert_int_eq(load(a3, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "power of two"), "%s", err);
  char *a4[] = {"detattnd", "--max-batch-tokens", "1000", "--max-request-tokens", "900", NULL};
  ck_assert_int_eq(load(a4, NULL), DETATTN_INVALID_ARGUMENT);
  ck_assert_msg(strstr(err, "max-batch-tokens"), "%s", err);
  char *a5[] = {"detattnd", "--listen", "http://x", NULL};
  ck_assert_int_eq(load(a5, NULL), DETATTN_INVALID_ARGUMENT);
}
END_TEST

START_TEST(help_stops_parsing_and_lists_every_flag) {
  char *argv[] = {"detattnd", "--help", "--layers", "0", NULL};
  ck_assert_int_eq(load(argv, NULL), 0);
  ck_assert_int_eq(cfg.help, 1);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  da_config_help(f);
  fclose(f);
  const char *flags[] = {"--listen", "--backend", "--kv-tokens", "--split-tokens", "--max-message-bytes",
                         "--log-level", "--wait-us", "--max-batch-tokens", "--softcap", "--scale"};
  for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++)
    ck_assert_msg(strstr(buf, flags[i]), "help lacks %s", flags[i]);
  ck_assert_ptr_nonnull(strstr(buf, "DETATTND_KV_TOKENS"));
  free(buf);
}
END_TEST

START_TEST(example_config_parses_back_to_the_defaults) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  da_config_example(f);
  fclose(f);
  /* Uncomment every "; name = value" line: the file then sets every setting explicitly. */
  FILE *out = fopen(cfg_path, "w");
  ck_assert_ptr_nonnull(out);
  for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n"))
    fprintf(out, "%s\n", line[0] == ';' && strchr(line, '=') && line[1] != ' ' ? line + 1 : line);
  fclose(out);
  free(buf);
  char *plain[] = {"detattnd", NULL};
  ck_assert_int_eq(load(plain, NULL), 0);
  da_config defaults = cfg;
  char *argv[] = {"detattnd", "--config", cfg_path, NULL};
  ck_assert_msg(load(argv, NULL) == 0, "%s", err);
  memset(defaults.config_file, 0, sizeof(defaults.config_file));
  memset(cfg.config_file, 0, sizeof(cfg.config_file));
  ck_assert_msg(memcmp(&defaults, &cfg, sizeof(cfg)) == 0, "explicit defaults differ from built-in ones");
}
END_TEST

int main(void) {
  Suite *s = suite_create("server_config");
  TCase *tc = tcase_create("config");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, defaults_form_a_valid_model);
  tcase_add_test(tc, default_listen_uses_xdg_runtime_dir_then_tmp);
  tcase_add_test(tc, file_overrides_defaults);
  tcase_add_test(tc, env_overrides_file_and_flags_override_env);
  tcase_add_test(tc, config_file_may_come_from_the_environment);
  tcase_add_test(tc, flag_equals_form_and_separate_value_agree);
  tcase_add_test(tc, flag_out_of_bounds_names_setting_and_bounds);
  tcase_add_test(tc, env_out_of_bounds_names_the_variable);
  tcase_add_test(tc, file_errors_name_file_and_line);
  tcase_add_test(tc, missing_config_file_is_an_error);
  tcase_add_test(tc, malformed_values_are_rejected);
  tcase_add_test(tc, unknown_flag_and_missing_value_are_rejected);
  tcase_add_test(tc, cross_setting_errors_are_reported);
  tcase_add_test(tc, help_stops_parsing_and_lists_every_flag);
  tcase_add_test(tc, example_config_parses_back_to_the_defaults);
  suite_add_tcase(s, tc);
  return da_test_run(s);
}
