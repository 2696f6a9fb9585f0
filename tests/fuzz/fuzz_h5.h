/* fuzz_h5.h: what the HDF5 harnesses share (each includes it once): a small CNN config whose
 * data.path is one file per process, rewritten with each input, built in LLVMFuzzerInitialize. */
#ifndef DT_FUZZ_H5_H
#define DT_FUZZ_H5_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <ucontext.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <hdf5.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>

#include "config.h"
#include "h5util.h"
#include "model.h"

typedef struct {
  char data_path[256];
  dt_config cfg;
  dt_model model;
} fuzz_setup;

/* Builds the config and model once. Aborts on failure (the harness itself is broken then). */
static inline void fuzz_setup_init(fuzz_setup *f) {
  setenv("HDF5_USE_FILE_LOCKING", "FALSE", 1);
  h5_quiet();
  snprintf(f->data_path, sizeof f->data_path, "/dev/shm/ddp_train_fuzz_%d.h5", (int)getpid());
  char text[2048], cfg_path[256];
  snprintf(text, sizeof text,
           "model:\n  input: [1, 6, 6]\n  layers: [{conv2d: {out: 4, kernel: 3, pad: 1}}, {batchnorm: {}}, relu,\n"
           "    {maxpool: {kernel: 2}}, flatten, {linear: {out: 3}}]\n"
           "data: {path: %s, scale: 0.00392156862745098}\ntrain: {batch_size: 4}\noptim: {momentum: 0.9}\n",
           f->data_path);
  snprintf(cfg_path, sizeof cfg_path, "/dev/shm/ddp_train_fuzz_%d.yaml", (int)getpid());
  FILE *c = fopen(cfg_path, "w");
  if (!c || fputs(text, c) < 0 || fclose(c)) abort();
  dt_status st = {0};
  if (config_load(&f->cfg, cfg_path, NULL, 0, &st) || model_build(&f->model, &f->cfg, &st)) {
    fprintf(stderr, "fuzz setup: %s\n", st.msg);
    abort();
  }
  unlink(cfg_path);
}

static fuzz_setup setup; /* the harness's fixed config and model, built once */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_setup_init(&setup);
  return 0;
}

/* Writes one input to the data file. */
static inline void fuzz_write(const fuzz_setup *f, const uint8_t *data, size_t size) {
  FILE *o = fopen(f->data_path, "wb");
  if (!o || fwrite(data, 1, size, o) != size || fclose(o)) abort();
}

/* A malformed file is a user error (2) or an I/O error (5) with a message: anything else is a bug. */
static inline void fuzz_check(const char *harness, const dt_status *st) {
  if (st->code == 0) return;
  if ((st->code != DT_EXIT_INPUT && st->code != DT_EXIT_IO) || !st->msg[0]) {
    fprintf(stderr, "%s: unexpected outcome: code %d: %s\n", harness, st->code, st->msg);
    abort();
  }
}

/* The probe's child decides who crashed: HDF5 (it exits 1; the harness skips the input) or us
 * (FUZZ_OUR_CRASH; the harness aborts). Set up in the child only: libFuzzer's death callback
 * (which saves the crashing input) stays the parent's.
 * - A fatal signal (HDF5's crashes are SEGVs) is caught by our handler, which walks the stack
 *   through the signal frame: the first frame outside libc and outside the sanitizer runtime's
 *   named entry points (interceptors such as memcpy) decides, by its module.
 * - A sanitizer report without a signal (ASan's checks are in our code only; HDF5 reaches them
 *   through interceptors) is read from the report text, the frames of its last ERROR only: the
 *   text also holds the warnings the process printed before (the parent's, inherited), and
 *   when that buffer is full the report is missing and the crash counts as ours. */
#define FUZZ_PROBE_TIMEOUT_S 20.0
enum { FUZZ_OUR_CRASH = 97 };

typedef struct {
  int (*reader)(void *ctx, dt_status *st);
  void *ctx;
} fuzz_child;

static int fuzz_blame_hdf5; /* the child's verdict from a sanitizer report */

static void fuzz_on_report(const char *report) {
  const char *last = NULL;
  for (const char *p = report; (p = strstr(p, "ERROR: ")); p++) last = p;
  if (!last) return;
  /* A frame is "#N 0xPC in NAME LOCATION": LOCATION is "(module+0xOFF)" without debug information
   * (the sanitizer runtime, libc, HDF5), a relative source path for glibc, or an absolute path
   * for code built here (ours). */
  for (const char *p = last; (p = strstr(p, "\n    #")); p++) {
    const char *eol = strchr(p + 1, '\n');
    size_t n = eol ? (size_t)(eol - p) : strlen(p);
    char line[512];
    snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), p);
    if (strstr(line, "libhdf5")) {
      fuzz_blame_hdf5 = 1;
      return;
    }
    const char *in = strstr(line, " in ");
    const char *loc = in ? strchr(in + 4, ' ') : NULL;
    if (loc && loc[1] == '/') return; /* ours: fuzz_blame_hdf5 stays 0 */
  }
}

static void fuzz_on_death(void) {
  _exit(fuzz_blame_hdf5 ? 1 : FUZZ_OUR_CRASH);
}

static void fuzz_on_signal(int sig, siginfo_t *info, void *uc) {
  (void)sig;
  (void)info;
  void *frames[64];
  int n = backtrace(frames, 64), from = 0;
  /* the interrupted frame: the faulting pc, below the handler and the signal trampoline */
  void *pc = (void *)((ucontext_t *)uc)->uc_mcontext.gregs[REG_RIP];
  while (from < n && frames[from] != pc) from++;
  Dl_info self, d;
  int hdf5 = 0;
  dladdr((void *)fuzz_on_signal, &self);
  for (int i = from; i < n; i++) {
    if (!dladdr(frames[i], &d) || !d.dli_fname || strstr(d.dli_fname, "libc.so")) continue;
    if (d.dli_fbase == self.dli_fbase && d.dli_sname && strcmp(d.dli_sname, "LLVMFuzzerTestOneInput"))
      continue; /* a named entry point of our binary: an interceptor (our own code has no dynamic names) */
    hdf5 = strstr(d.dli_fname, "libhdf5") != NULL;
    break;
  }
  _exit(hdf5 ? 1 : FUZZ_OUR_CRASH);
}

static int fuzz_child_reader(void *ctx, dt_status *st) {
  const fuzz_child *c = ctx;
  void *warm[2];
  backtrace(warm, 2); /* loads the unwinder now, not inside the signal handler */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = fuzz_on_signal;
  sa.sa_flags = SA_SIGINFO;
  int fatal[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
  for (size_t i = 0; i < sizeof fatal / sizeof fatal[0]; i++) sigaction(fatal[i], &sa, NULL);
  __asan_set_error_report_callback(fuzz_on_report);
  __sanitizer_set_death_callback(fuzz_on_death);
  return c->reader(c->ctx, st);
}

/* h5_probe with the child's blame set up. Returns 1 when HDF5 itself crashed or hung in the child
 * (the caller skips the input); aborts when our code crashed there. */
static inline int fuzz_probe(const char *harness, const char *path, int (*reader)(void *, dt_status *), void *ctx,
                             dt_status *probe) {
  fuzz_child c = {reader, ctx};
  h5_probe(path, "probe", fuzz_child_reader, &c, FUZZ_PROBE_TIMEOUT_S, probe);
  char ours[64];
  snprintf(ours, sizeof ours, ": the HDF5 reader exited with status %d", FUZZ_OUR_CRASH);
  if (strstr(probe->msg, ours)) {
    fprintf(stderr, "%s: the reader crashed in our code in the probe's child (its report is above)\n", harness);
    abort();
  }
  return probe->code == DT_EXIT_INPUT &&
         (strstr(probe->msg, ": HDF5 crashed (signal") || strstr(probe->msg, ": the HDF5 reader exited with status") ||
          strstr(probe->msg, ": HDF5 did not finish reading"));
}

/* The probe's child ran the same reader: same outcome, same message (less the "probe" label). */
static inline void fuzz_check_same(const char *harness, const dt_status *probe, const dt_status *st) {
  if (probe->code != st->code || strcmp(probe->msg, st->msg)) {
    fprintf(stderr, "%s: the probe said code %d '%s' but the reader said code %d '%s'\n", harness, probe->code,
            probe->msg, st->code, st->msg);
    abort();
  }
}

/* After the reader has closed what it opened, no HDF5 object may remain open (a handle left open
 * on an error path would hold the file and its memory for the rest of the run). */
static inline void fuzz_check_closed(const char *harness) {
  ssize_t open = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
  if (open != 0) {
    fprintf(stderr, "%s: %zd HDF5 objects left open\n", harness, open);
    abort();
  }
}

#endif
