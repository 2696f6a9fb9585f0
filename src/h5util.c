#include "h5util.h"

#include <errno.h>
#include <hdf5.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DT_SANITIZED 1
#endif
#endif

typedef struct {
  char *buf;
  size_t cap, len;
} h5_msgs;

static herr_t collect(unsigned n, const H5E_error2_t *e, void *ctx) {
  h5_msgs *m = ctx;
  if (n > 2 || !e->desc) return 0;
  m->len += (size_t)snprintf(m->buf + m->len, m->cap - m->len, "%s%s", m->len ? "; " : "", e->desc);
  if (m->len >= m->cap) m->len = m->cap - 1;
  return 0;
}

const char *h5_error_text(char *buf, size_t cap) {
  h5_msgs m = {buf, cap, 0};
  buf[0] = 0;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect, &m);
  H5Eclear2(H5E_DEFAULT);
  if (!buf[0]) snprintf(buf, cap, "unknown HDF5 error");
  return buf;
}

static herr_t find_lock(unsigned n, const H5E_error2_t *e, void *ctx) {
  (void)n;
  if (e->min_num == H5E_CANTLOCKFILE) *(int *)ctx = 1;
  return 0;
}

int h5_error_is_lock(void) {
  int found = 0;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, find_lock, &found);
  return found;
}

void h5_quiet(void) {
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

int h5_probe(const char *path, const char *what, int (*reader)(void *ctx, dt_status *st), void *ctx, double timeout_s,
             dt_status *st) {
  int fds[2];
  if (pipe(fds) != 0) return dt_fail(st, DT_EXIT_IO, "%s: %s: pipe: %s", path, what, strerror(errno));
  fflush(NULL); /* nothing buffered may be written twice */
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return dt_fail(st, DT_EXIT_IO, "%s: %s: fork: %s", path, what, strerror(errno));
  }
  if (pid == 0) {
    close(fds[0]);
#ifndef DT_SANITIZED /* sanitizers keep their handlers: a report names the crashing frame */
    /* the crash is the parent's to report: no inherited backtrace printer (Open MPI's) */
    int fatal[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
    for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++) signal(fatal[i], SIG_DFL);
#endif
    dt_status child = {0};
    reader(ctx, &child);
    ssize_t w = write(fds[1], &child, sizeof child);
    _exit(w == (ssize_t)sizeof child ? 0 : 1);
  }
  close(fds[1]);
  dt_status child = {0};
  size_t got = 0;
  int timed_out = 0;
  double deadline = dt_now() + timeout_s;
  while (got < sizeof child) {
    struct pollfd p = {fds[0], POLLIN, 0};
    double left = deadline - dt_now();
    int ready = left > 0 ? poll(&p, 1, left > 1e6 ? 1000000000 : (int)(left * 1000) + 1) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      timed_out = ready == 0;
      break;
    }
    ssize_t r = read(fds[0], (char *)&child + got, sizeof child - got);
    if (r <= 0) break; /* the child died before writing its status */
    got += (size_t)r;
  }
  close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int ws = 0;
  while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
  }
  if (got == sizeof child && WIFEXITED(ws) && WEXITSTATUS(ws) == 0) {
    if (child.code) *st = child;
    return child.code;
  }
  if (timed_out)
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s: %s: HDF5 did not finish reading the file's structure in %.0f s (dist.timeout_s); "
                   "the file is likely corrupt (check it with h5dump)",
                   path, what, timeout_s);
  if (WIFSIGNALED(ws))
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s: %s: HDF5 crashed (signal %d, %s) reading the file's structure: the file is corrupt "
                   "(check it with h5dump, or write it again)",
                   path, what, WTERMSIG(ws), strsignal(WTERMSIG(ws)));
  return dt_fail(st, DT_EXIT_INPUT,
                 "%s: %s: the HDF5 reader exited with status %d before finishing: the file is likely corrupt "
                 "(check it with h5dump, or write it again)",
                 path, what, WIFEXITED(ws) ? WEXITSTATUS(ws) : -1);
}

/* ---- files built in memory: the core driver's memory, through file image callbacks that keep it
 * after the close (HDF5 would free it) ---- */

/* An image left by an earlier open of the same h5_image (image_free keeps a closed one as if final)
 * is released when HDF5 starts a new one, from image_malloc or from image_realloc of NULL. (H5Fcreate
 * first opens its name as it is: h5_image_create gives it one that cannot exist, so that no file
 * is read in, but a leak should HDF5 ever open twice is not left to that.) */
static void drop_earlier_image(h5_image *im, const void *ptr) {
  if (im->buf && ptr != im->buf) {
    free(im->buf);
    im->buf = NULL;
  }
  im->closed = 0;
}

static void *image_malloc(size_t size, H5FD_file_image_op_t op, void *udata) {
  (void)op;
  h5_image *im = udata;
  drop_earlier_image(im, NULL);
  im->buf = dt_malloc(size ? size : 1);
  im->cap = size;
  return im->buf;
}

static void *image_memcpy(void *dst, const void *src, size_t size, H5FD_file_image_op_t op, void *udata) {
  (void)op, (void)udata;
  return memcpy(dst, src, size);
}

static void *image_realloc(void *ptr, size_t size, H5FD_file_image_op_t op, void *udata) {
  (void)op;
  h5_image *im = udata;
  drop_earlier_image(im, ptr);
  im->buf = dt_realloc(ptr, size ? size : 1);
  im->cap = size;
  return im->buf;
}

static herr_t image_free(void *ptr, H5FD_file_image_op_t op, void *udata) {
  h5_image *im = udata;
  if (op == H5FD_FILE_IMAGE_OP_FILE_CLOSE && ptr == im->buf) {
    im->closed = 1; /* the final image: h5_image_free releases it */
    return 0;
  }
  if (ptr == im->buf) im->buf = NULL, im->cap = 0;
  free(ptr);
  return 0;
}

static void *image_udata_copy(void *udata) {
  return udata;
}

static herr_t image_udata_free(void *udata) {
  (void)udata;
  return 0;
}

hid_t h5_image_create(h5_image *im, const char *name, size_t size_hint) {
  memset(im, 0, sizeof *im);
  h5_quiet();
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  if (fapl < 0) return -1;
  H5FD_file_image_callbacks_t cb = {
      image_malloc, image_memcpy, image_realloc, image_free, image_udata_copy, image_udata_free, im};
  /* H5Fcreate first opens its name without creating it, to see whether HDF5 has that file open, and
   * the core driver reads whatever file is there into memory: a checkpoint about to be replaced
   * (best.h5 at every new best), or a stale file of any size at its name. Under /dev/null no file
   * can be (ENOTDIR); with no backing store the create itself touches no disk. */
  char *image_name = dt_malloc(strlen(name) + 11);
  sprintf(image_name, "/dev/null/%s", name);
  hid_t f = -1;
  if (H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_LATEST) >= 0 && /* checksummed metadata */
      H5Pset_fapl_core(fapl, size_hint > 65536 ? size_hint : 65536, 0) >= 0 &&
      H5Pset_file_image_callbacks(fapl, &cb) >= 0)
    f = H5Fcreate(image_name, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  H5Pclose(fapl);
  free(image_name);
  return f;
}

size_t h5_image_length(const h5_image *im) {
  /* superblock version 2 or 3 (the 1.10 format): signature, version, size of offsets O, size of
   * lengths, flags, then base, extension and end-of-file addresses of O bytes each, little-endian */
  static const unsigned char sig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  const unsigned char *b = im->buf;
  if (!im->closed || !b || im->cap < 48 || memcmp(b, sig, 8) || (b[8] != 2 && b[8] != 3)) return 0;
  const int o = b[9];
  if (o < 1 || o > 8 || (size_t)(12 + 3 * o) > im->cap) return 0;
  uint64_t eof = 0;
  for (int i = 0; i < o; i++) eof |= (uint64_t)b[12 + 2 * o + i] << (8 * i);
  return eof >= 48 && eof <= im->cap ? (size_t)eof : 0;
}

void h5_image_free(h5_image *im) {
  free(im->buf);
  memset(im, 0, sizeof *im);
}
