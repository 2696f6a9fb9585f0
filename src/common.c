#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

static int fsync_dir(const char *path) {
  int fd = open(path, O_RDONLY | O_DIRECTORY);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  close(fd);
  return rc;
}

/* Writes len bytes to path atomically: into path.tmp.PID, fsynced, renamed over path, then the
 * directory fsynced. Exit 5 naming path and what was written on any failure, the temporary removed. */
int dt_write_atomic(const char *path, const void *data, size_t len, const char *what, dt_status *st) {
  char tmp[1200], dir[1200];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return dt_fail(st, DT_EXIT_IO, "%s: cannot create: %s", tmp, strerror(errno));
  const char *p = data;
  int err = 0;
  while (len && !err) {
    ssize_t w = write(fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      err = w < 0 ? errno : EIO;
    else
      p += w, len -= (size_t)w;
  }
  if (!err && fsync(fd)) err = errno;
  if (close(fd) && !err) err = errno;
  if (err) {
    unlink(tmp);
    return dt_fail(st, DT_EXIT_IO, "%s: writing %s failed: %s", path, what, strerror(err));
  }
  dt_strlcpy(dir, path, sizeof dir);
  char *slash = strrchr(dir, '/');
  if (slash)
    *slash = 0;
  else
    snprintf(dir, sizeof dir, ".");
  if (rename(tmp, path) || fsync_dir(dir)) {
    err = errno;
    unlink(tmp);
    return dt_fail(st, DT_EXIT_IO, "%s: committing %s failed: %s", path, what, strerror(err));
  }
  return 0;
}
