/* The test harness itself (tests/test.h): a case that calls SKIP is printed as
 * skipped with its reason and never counted as passed; a program whose every
 * case skipped exits TEST_SKIP_CODE (ctest's SKIP_RETURN_CODE, so ctest lists
 * it as skipped); passes with skips exit 0 with the skips in the summary line;
 * a failure exits 1 whatever else happened. Each scenario runs in a child
 * process with fresh counters and its stdout in a file. */
#include <unistd.h>

#include "test.h"

static char dir[256];
static int ran_the_body;

static void case_passes(void) { CHECK(1 + 1 == 2, "arithmetic"); }
static void case_fails(void) { CHECK(1 + 1 == 3, "an expected failure inside a child"); }
static void case_skips(void) {
    if (1 + 1 == 2) SKIP("widget %d not installed", 7);
    CHECK(0, "the body after SKIP ran");
}
static void case_records_that_it_ran(void) { ran_the_body = 1; }

/* Run scenario `which` in a child, its stdout into `out`; returns its exit code. */
static int in_child(int which, const char *out) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen(out, "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(99);
        test_passed_count = test_failed_count = test_skipped_count = 0;
        if (which == 0) RUN(case_skips);
        if (which == 1) {
            RUN(case_passes);
            RUN(case_skips);
        }
        if (which == 2) {
            RUN(case_skips);
            RUN(case_fails);
        }
        if (which == 3) {
            test_skip_all("no widget device visible");
            RUN(case_records_that_it_ran);
            RUN(case_passes);
            if (ran_the_body) printf("the body ran\n");
        }
        _exit(test_summary()); /* test_summary flushes stdout */
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_every_case_skipped_exits_the_skip_code_with_the_reason(void) {
    const char *out = test_path(dir, "all-skipped.txt");
    int rc = in_child(0, out);
    CHECK(rc == TEST_SKIP_CODE, "exit code %d, want %d", rc, TEST_SKIP_CODE);
    CHECK(test_file_has(out, "skip case_skips"), "the case is not printed as skipped");
    CHECK(test_file_has(out, "widget 7 not installed"), "the reason is not printed");
    CHECK(test_file_has(out, "0 passed, 0 failed, 1 skipped"), "the summary does not count the skip");
}

static void test_passes_with_skips_exit_0_and_show_the_skips(void) {
    const char *out = test_path(dir, "mixed.txt");
    int rc = in_child(1, out);
    CHECK(rc == 0, "exit code %d, want 0", rc);
    CHECK(test_file_has(out, "ok   case_passes") && test_file_has(out, "skip case_skips"), "the cases' lines");
    CHECK(test_file_has(out, "1 passed, 0 failed, 1 skipped"), "the summary line");
}

static void test_a_failure_exits_1_even_beside_skips(void) {
    const char *out = test_path(dir, "failed.txt");
    int rc = in_child(2, out);
    CHECK(rc == 1, "exit code %d, want 1", rc);
    CHECK(test_file_has(out, "0 passed, 1 failed, 1 skipped"), "the summary line");
}

static void test_skip_all_skips_every_case_without_running_it(void) {
    const char *out = test_path(dir, "skip-all.txt");
    int rc = in_child(3, out);
    CHECK(rc == TEST_SKIP_CODE, "exit code %d, want %d", rc, TEST_SKIP_CODE);
    CHECK(test_file_has(out, "0 passed, 0 failed, 2 skipped"), "the summary line");
    CHECK(test_file_has(out, "no widget device visible"), "the reason is not printed");
    char *text = test_slurp(out, NULL);
    CHECK(text && !strstr(text, "the body ran"), "a case ran although every case was to be skipped");
    free(text);
}

int main(void) {
    if (test_make_tmpdir(dir, sizeof dir, "harness")) return 1;
    RUN(test_every_case_skipped_exits_the_skip_code_with_the_reason);
    RUN(test_passes_with_skips_exit_0_and_show_the_skips);
    RUN(test_a_failure_exits_1_even_beside_skips);
    RUN(test_skip_all_skips_every_case_without_running_it);
    test_remove_tree(dir);
    return test_summary();
}
