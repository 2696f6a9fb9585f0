/* fuzz_h5.h: what the HDF5 harnesses share (each includes it once): a small CNN config whose
 * data.path is one file per process, rewritten with each input, built in LLVMFuzzerInitialize. */
#ifndef DT_FUZZ_H5_H
#define DT_FUZZ_H5_H

#define _GNU_SOURCE
#include <stdio.h>
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

/* The probe's child. A sanitizer report there is blamed on HDF5 when its first frame outside
 * libc (by name or glibc source path) and the
 * sanitizer runtime is in libhdf5, else on us; the child then exits 1 (HDF5's, the
 * harness skips the input) or FUZZ_OUR_CRASH (ours, the harness aborts). Installed in the child
 * only: libFuzzer's own death callback (which saves the crashing input) stays in the parent. */
#define FUZZ_PROBE_TIMEOUT_S 20.0
enum { FUZZ_OUR_CRASH = 97 };

typedef struct {
  int (*reader)(void *ctx, dt_status *st);
  void *ctx;
} fuzz_child;

static int fuzz_blame_hdf5; /* the child's verdict, set by the report callback */

static void fuzz_on_report(const char *report) {
  for (const char *p = report; (p = strstr(p, "\n    #")); p++) {
    const char *eol = strchr(p + 1, '\n');
    size_t n = eol ? (size_t)(eol - p) : strlen(p);
    char line[512];
    snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), p);
    if (strstr(line, "libc.so") || strstr(line, "sysdeps/") || strstr(line, " in __interceptor_") ||
        strstr(line, " in __asan") || strstr(line, " in __sanitizer") || strstr(line, " in __ubsan") ||
        strstr(line, "libclang_rt"))
      continue;
    fuzz_blame_hdf5 = strstr(line, "libhdf5") != NULL;
    return;
  }
}

static void fuzz_on_death(void) {
  _exit(fuzz_blame_hdf5 ? 1 : FUZZ_OUR_CRASH);
}

static int fuzz_child_reader(void *ctx, dt_status *st) {
  const fuzz_child *c = ctx;
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
