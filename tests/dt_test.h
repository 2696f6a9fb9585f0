/* dt_test.h: helpers shared by the cmocka unit tests. */
#ifndef DT_TEST_H
#define DT_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

/* Writes text to a fresh temporary file; returns its path (static buffer per call site is not
 * needed: the caller owns the returned string). */
static inline char *write_tmp(const char *text) {
  char *path = strdup("/tmp/ddp_train_test_XXXXXX.yaml");
  int fd = mkstemps(path, 5);
  if (fd < 0) fail_msg("mkstemps failed");
  size_t n = strlen(text);
  if (write(fd, text, n) != (ssize_t)n) fail_msg("write failed");
  close(fd);
  return path;
}

#define assert_contains(haystack, needle)                                       \
  do {                                                                          \
    const char *h_ = (haystack), *n_ = (needle);                                \
    if (!strstr(h_, n_)) fail_msg("expected \"%s\" in message:\n  %s", n_, h_); \
  } while (0)

#endif
