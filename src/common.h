/* common.h: status, exit codes, always-on asserts and allocation wrappers.
 * Bugs abort through dt_abort (MPI_Abort when MPI is up) with file, line and rank.
 * User errors travel as a dt_status back to main, which exits with the code. */
#ifndef DT_COMMON_H
#define DT_COMMON_H

#include <stddef.h>
#include <stdint.h>

#define DT_VERSION "0.1.0"

/* Exit codes: a documented contract (README "Exit codes"). */
enum {
  DT_EXIT_OK = 0,
  DT_EXIT_INPUT = 2,   /* usage, config or data validation */
  DT_EXIT_PEER = 3,    /* peer failure or collective timeout */
  DT_EXIT_NUMERIC = 4, /* NaN/Inf in loss or gradients */
  DT_EXIT_IO = 5,      /* file I/O failure */
  DT_EXIT_STOPPED = 75 /* stopped by signal or time limit after a checkpoint */
};

/* train.precision: the math of convolutions and matrix products (src/cuda/gemm.c, conv.c). */
enum { DT_PREC_FP32, DT_PREC_TF32, DT_PREC_BF16, DT_PREC_FP16 };

/* A user-facing error: code 0 means ok; msg is printed once by main. */
typedef struct {
  int code;
  char msg[2048];
} dt_status;

/* Sets st (if st->code is still 0) and returns code. printf-style. */
int dt_fail(dt_status *st, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

_Noreturn void dt_abort(const char *file, int line, const char *what);

/* A resource failure that no rank can recover from (out of memory): prints
 * "ddp_train: error: rank R: <message>" and aborts the job with code 70. */
_Noreturn void dt_die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define DT_EXIT_ABORT 70

/* Always-on assert for bugs (not for input validation). */
#define DT_ASSERT(cond)                                                    \
  do {                                                                     \
    if (!(cond)) dt_abort(__FILE__, __LINE__, "assertion failed: " #cond); \
  } while (0)

/* Allocation wrappers: abort with the requested size, never return NULL.
 * The caller owns the result and frees it with free(). */
void *dt_malloc(size_t bytes);
void *dt_calloc(size_t count, size_t size);
void *dt_realloc(void *p, size_t bytes);
char *dt_strdup(const char *s);

/* Monotonic wall time in seconds. */
double dt_now(void);

/* Bounded string copy that always terminates. */
void dt_strlcpy(char *dst, const char *src, size_t cap);

/* Writes len bytes to path atomically: into path.tmp.PID, fsynced, renamed over path, then the
 * directory fsynced. Exit 5 naming path and what was written on any failure, the temporary removed. */
int dt_write_atomic(const char *path, const void *data, size_t len, const char *what, dt_status *st);

#endif
