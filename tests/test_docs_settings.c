/* The GPU code's environment variables and their table in docs/cuda.md
 * ("Settings of the GPU code") are the same list: every "LONGMOE_..." string
 * literal of the sources (src/, the names getenv reads) has a row in the
 * table, and every row names a variable the sources read. Run from the
 * repository root (ctest's working directory). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "files.h"
#include "test.h"

#define MAX_NAMES 128
#define NAME_LEN 64

typedef struct {
    char name[MAX_NAMES][NAME_LEN];
    int n;
} name_set;

static int has_name(const name_set *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->name[i], name)) return 1;
    return 0;
}

static void add_name(name_set *s, const char *p, size_t len) {
    char buf[NAME_LEN];
    if (len >= NAME_LEN) return;
    memcpy(buf, p, len);
    buf[len] = 0;
    if (has_name(s, buf)) return;
    CHECK(s->n < MAX_NAMES, "more than %d names", MAX_NAMES);
    if (s->n < MAX_NAMES) snprintf(s->name[s->n++], NAME_LEN, "%s", buf);
}

static int name_char(char c) { return (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

/* the whole file (lm_read_file), or NULL */
static char *read_all(const char *path) {
    char *text = NULL;
    return lm_read_file(path, 0, &text, NULL) == LM_OK ? text : NULL;
}

/* every "LONGMOE_[A-Z0-9_]+" string literal of text (the whole literal: the name and nothing else) */
static void literals_of(const char *text, name_set *s) {
    for (const char *p = text; (p = strstr(p, "\"LONGMOE_")) != NULL; p++) {
        const char *q = p + 1;
        while (name_char(*q)) q++;
        if (*q == '"') add_name(s, p + 1, (size_t)(q - p - 1));
    }
}

static int source_file(const char *name) {
    const char *dot = strrchr(name, '.');
    return dot && (!strcmp(dot, ".c") || !strcmp(dot, ".h") || !strcmp(dot, ".cu") || !strcmp(dot, ".cuh"));
}

/* the literals of every source file under dir; returns the files read */
static int scan_dir(const char *dir, name_set *s) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int files = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            files += scan_dir(path, s);
        } else if (S_ISREG(st.st_mode) && source_file(e->d_name)) {
            char *text = read_all(path);
            CHECK(text != NULL, "cannot read %s", path);
            if (text) literals_of(text, s);
            free(text);
            files++;
        }
    }
    closedir(d);
    return files;
}

/* the names of the table rows "| `LONGMOE_...` |" of text */
static void table_rows_of(const char *text, name_set *s) {
    for (const char *p = text; (p = strstr(p, "\n| `LONGMOE_")) != NULL; p++) {
        const char *a = p + 4, *q = a;
        while (name_char(*q)) q++;
        if (*q == '`') add_name(s, a, (size_t)(q - a));
    }
}

static void test_every_variable_has_a_row_and_every_row_a_variable(void) {
    name_set *src = calloc(1, sizeof *src), *doc = calloc(1, sizeof *doc);
    const int files = scan_dir("src", src);
    char *text = read_all("docs/cuda.md");
    CHECK(files > 50 && text != NULL, "read %d source files and %s docs/cuda.md (run from the repository root)",
          files, text ? "" : "not");
    if (text) table_rows_of(text, doc);
    /* the table lists 19 variables today: a scan that found few of them is broken, not clean */
    CHECK(src->n >= 10 && doc->n >= 10, "%d variables in the sources, %d rows in the table", src->n, doc->n);
    for (int i = 0; i < src->n; i++)
        CHECK(has_name(doc, src->name[i]), "%s is read by the sources but has no row in docs/cuda.md's settings table",
              src->name[i]);
    for (int i = 0; i < doc->n; i++)
        CHECK(has_name(src, doc->name[i]), "docs/cuda.md's settings table lists %s, which no source reads",
              doc->name[i]);
    printf("    %d variables, %d source files\n", src->n, files);
    free(text);
    free(src);
    free(doc);
}

/* the scanners on text of their own: what counts and what does not */
static void test_the_scanners_take_whole_names_only(void) {
    name_set *s = calloc(1, sizeof *s), *t = calloc(1, sizeof *t);
    literals_of("getenv(\"LONGMOE_A_1\"); \"LONGMOE_B=%s\" \"LONGMOE_C\" LONGMOE_D \"LONGMOE_A_1\"", s);
    CHECK(s->n == 2 && has_name(s, "LONGMOE_A_1") && has_name(s, "LONGMOE_C"), "literals: %d names", s->n);
    table_rows_of("x\n| `LONGMOE_X` | a |\n| `LONGMOE_Y=1` | b |\n|`LONGMOE_Z` |\n| `LONGMOE_W` | c |", t);
    CHECK(t->n == 2 && has_name(t, "LONGMOE_X") && has_name(t, "LONGMOE_W"), "rows: %d names", t->n);
    free(s);
    free(t);
}

int main(void) {
    RUN(test_the_scanners_take_whole_names_only);
    RUN(test_every_variable_has_a_row_and_every_row_a_variable);
    return test_summary();
}
