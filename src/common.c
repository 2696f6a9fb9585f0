#include "common.h"

#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int dt_fail(dt_status *st, int code, const char *fmt, ...) {
  if (st->code != 0) return st->code;
  st->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(st->msg, sizeof st->msg, fmt, ap);
  va_end(ap);
  return code;
}

/* The rank comes from MPI itself, so no global is needed; -1 before MPI_Init. */
_Noreturn void dt_abort(const char *file, int line, const char *what) {
  int up = 0, down = 0, rank = -1;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  fprintf(stderr, "ddp_train: bug: rank %d: %s:%d: %s\n", rank, file, line, what);
  fflush(stderr);
  if (up && !down) MPI_Abort(MPI_COMM_WORLD, DT_EXIT_ABORT);
  abort();
}

_Noreturn void dt_die(const char *fmt, ...) {
  int up = 0, down = 0, rank = -1;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "ddp_train: error: rank %d: %s\n", rank, msg);
  fflush(stderr);
  if (up && !down) MPI_Abort(MPI_COMM_WORLD, DT_EXIT_ABORT);
  exit(DT_EXIT_ABORT);
}

static _Noreturn void oom(size_t bytes) {
  dt_die(
      "out of host memory allocating %zu bytes (%.1f MiB); lower train.batch_size or train.global_batch_size, "
      "or use more ranks",
      bytes, (double)bytes / 1048576.0);
}

void *dt_malloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) oom(bytes);
  return p;
}

void *dt_calloc(size_t count, size_t size) {
  void *p = calloc(count ? count : 1, size ? size : 1);
  if (!p) oom(count * size);
  return p;
}

void *dt_realloc(void *p, size_t bytes) {
  void *q = realloc(p, bytes ? bytes : 1);
  if (!q) oom(bytes);
  return q;
}

char *dt_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = dt_malloc(n);
  memcpy(p, s, n);
  return p;
}

double dt_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void dt_strlcpy(char *dst, const char *src, size_t cap) {
  if (cap == 0) return;
  size_t n = strlen(src);
  if (n >= cap) n = cap - 1;
  memcpy(dst, src, n);
  dst[n] = 0;
}
