/* The helpers of testutil.h that use Check; the rest are in testutil.c. */
#include <check.h>
#include <stdio.h>

#include "testutil.h"

int da_test_run_runner(SRunner *sr) {
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr), ran = srunner_ntests_run(sr);
  srunner_free(sr);
  if (ran == 0) fprintf(stderr, "no test ran: CK_RUN_SUITE or CK_RUN_CASE selects no tcase of this program\n");
  return failed || ran == 0 ? 1 : 0;
}

int da_test_run(Suite *s) { return da_test_run_runner(srunner_create(s)); }

void da_test_add_cases(Suite *s, const da_test_case *cases, size_t n, void (*setup)(void), void (*teardown)(void),
                       int timeout_s) {
  for (size_t i = 0; i < n; i++) {
    TCase *t = tcase_create(cases[i].name);
    tcase_add_checked_fixture(t, setup, teardown);
    tcase_set_timeout(t, timeout_s);
    tcase_add_test(t, cases[i].test);
    suite_add_tcase(s, t);
  }
}

void da_test_write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}
