#include "h5util.h"

#include <errno.h>
#include <hdf5.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
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
