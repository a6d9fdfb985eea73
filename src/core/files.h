/* Files and text for the library's readers and writers: one whole-file
 * reader and one growable text buffer. */
#ifndef LONGMOE_FILES_H
#define LONGMOE_FILES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "longmoe/core.h"

/* Open `path` for reading if it is a regular file. The open does not block
 * (a FIFO without a writer, a device) and the type is checked on the opened
 * descriptor, so nothing that is not a regular file is ever read: a
 * directory, FIFO, device or socket is LM_ERR_IO "'path' is a FIFO (named
 * pipe), not a regular file". *fd receives a blocking descriptor, *size (may
 * be NULL) the file's size. Every reader of an input path opens through
 * this (lm_read_file, the shard reader). */
lm_status lm_open_regular(const char *path, int *fd, int64_t *size);
/* 1 when both paths exist and name the same file (device and inode): an
 * output that would overwrite an input. */
int lm_same_file(const char *a, const char *b);

/* The whole of `path` ("-": standard input) in a new malloc'd buffer with a
 * NUL after its last byte; *len (may be NULL) receives the byte count.
 * max_bytes > 0 refuses a larger file (LM_ERR_IO naming the path); 0: no
 * limit. Errors: LM_ERR_IO (open or read failed, not a regular file;
 * message with the cause),
 * LM_ERR_MEMORY. */
lm_status lm_read_file(const char *path, size_t max_bytes, char **bytes, size_t *len);
/* The bound of the run's text files (config.json, trainer.json, latest, metrics.jsonl). */
#define LM_TEXT_FILE_MAX ((size_t)1 << 30)

/* A growable NUL-terminated text: start it zeroed (lm_text t = {0}). After a
 * failed allocation `failed` is set and every later call does nothing, so a
 * writer checks once at the end. */
typedef struct {
    char *s;       /* the text (NULL until something was added) */
    size_t n, cap; /* its length; the allocation */
    int failed;    /* an allocation failed: the text is incomplete */
} lm_text;

/* Room for `extra` more bytes and the NUL after them: 1, or 0 after a failure. */
int lm_text_reserve(lm_text *t, size_t extra);
void lm_text_put(lm_text *t, const char *s, size_t n);
void lm_text_puts(lm_text *t, const char *s);
void lm_text_printf(lm_text *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void lm_text_free(lm_text *t);

#endif
