#include "checkpoint.h"
#include "comm.h"
#include "h5util.h"
#include "optim.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Reads one float32 tensor with its shape checked. */
static int read_tensor(hid_t f, const char *path, const char *group, const dt_tensor *t, float *dst, dt_status *st) {
  char e[256], name[300];
  snprintf(name, sizeof name, "%s/%s", group, t->name);
  if (H5Lexists(f, group, H5P_DEFAULT) <= 0 || H5Lexists(f, name, H5P_DEFAULT) <= 0)
    return dt_fail(st, DT_EXIT_INPUT, "%s: tensor '%s' (dataset %s) is missing", path, t->name, name);
  hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
  if (ds < 0) return dt_fail(st, DT_EXIT_INPUT, "%s: cannot open %s: %s", path, name, h5_error_text(e, sizeof e));
  hid_t sp = H5Dget_space(ds);
  hsize_t dims[8];
  int nd = H5Sget_simple_extent_ndims(sp);
  int same = nd == t->ndim;
  if (nd > 0 && nd <= 8) H5Sget_simple_extent_dims(sp, dims, NULL);
  for (int k = 0; same && k < nd; k++) same = (int64_t)dims[k] == t->dims[k];
  H5Sclose(sp);
  int rc = 0;
  if (!same) {
    char want[96] = "(", got[96] = "(";
    for (int k = 0; k < t->ndim; k++)
      snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", k ? ", " : "", (long long)t->dims[k]);
    for (int k = 0; k < nd && k < 8; k++)
      snprintf(got + strlen(got), sizeof got - strlen(got), "%s%llu", k ? ", " : "", (unsigned long long)dims[k]);
    rc = dt_fail(st, DT_EXIT_INPUT, "%s: tensor '%s' has shape %s) but the model needs %s)", path, t->name, got, want);
  } else if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, dst) < 0) {
    rc = dt_fail(st, DT_EXIT_INPUT, "%s: cannot read tensor '%s' (corrupt file: checksum or format error): %s", path,
                 t->name, h5_error_text(e, sizeof e));
  }
  H5Dclose(ds);
  return rc;
}

static hid_t open_read(const char *path, const char *what, dt_status *st) {
  char e[256];
  h5_quiet();
  if (access(path, R_OK) != 0) {
    dt_fail(st, DT_EXIT_INPUT, "%s: %s: cannot open: %s", path, what, strerror(errno));
    return -1;
  }
  hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f >= 0) return f;
  if (h5_error_is_lock())
    dt_fail(st, DT_EXIT_INPUT,
            "%s: %s: the file is locked (another process has it open for writing; on shared filesystems set "
            "HDF5_USE_FILE_LOCKING=FALSE): %s",
            path, what, h5_error_text(e, sizeof e));
  else
    dt_fail(st, DT_EXIT_INPUT, "%s: %s: not a readable HDF5 file (truncated or corrupt): %s", path, what,
            h5_error_text(e, sizeof e));
  return f;
}

/* The datasets of /model that the model has no tensor for, as a list for a message. */
typedef struct {
  const dt_model *m;
  int n;
  char list[600];
} extra_tensors;

static herr_t note_extra(hid_t obj, const char *name, const H5O_info_t *info, void *ctx) {
  (void)obj;
  extra_tensors *x = ctx;
  if (info->type != H5O_TYPE_DATASET) return 0;
  for (int i = 0; i < x->m->n_tensors; i++)
    if (!strcmp(x->m->tensors[i].name, name)) return 0;
  size_t len = strlen(x->list);
  if (x->n++ < 8)
    snprintf(x->list + len, sizeof x->list - len, "%s'%s'", len ? ", " : "", name);
  else if (x->n == 9)
    snprintf(x->list + len, sizeof x->list - len, ", ...");
  return 0;
}

/* model.init_from: every tensor of the model from /model, shapes checked; a dataset of /model that
 * the model does not have is an error too (as PyTorch's strict load_state_dict), unless
 * ignore_extra (model.init_from_ignore_extra). */
static int read_model(const char *path, const dt_model *m, float *params, float *bufs, int ignore_extra,
                      const char *what, dt_status *st) {
  hid_t f = open_read(path, what, st);
  if (f < 0) return st->code;
  for (int i = 0; i < m->n_tensors && !st->code; i++) {
    const dt_tensor *t = &m->tensors[i];
    read_tensor(f, path, "/model", t, (t->is_buffer ? bufs : params) + t->offset, st);
  }
  if (!st->code && !ignore_extra) {
    extra_tensors x = {.m = m};
    hid_t g = H5Gopen2(f, "/model", H5P_DEFAULT);
    char e[256];
    if (g < 0 || H5Ovisit2(g, H5_INDEX_NAME, H5_ITER_NATIVE, note_extra, &x, H5O_INFO_BASIC) < 0)
      dt_fail(st, DT_EXIT_INPUT, "%s: %s: cannot list /model: %s", path, what, h5_error_text(e, sizeof e));
    else if (x.n)
      dt_fail(st, DT_EXIT_INPUT,
              "%s: %s: %d tensor%s in /model that this model does not have: %s (another model's, or a head weight "
              "where this model ties its head to the embedding?)%s",
              path, what, x.n, x.n > 1 ? "s" : "", x.list,
              strcmp(what, "model.init_from") ? ""
                                              : "; set model.init_from_ignore_extra: true to load the model's "
                                                "tensors and leave those");
    if (g >= 0) H5Gclose(g);
  }
  H5Fclose(f);
  return st->code;
}

static int attr_str(hid_t obj, const char *name, const char *value) {
  hid_t t = H5Tcopy(H5T_C_S1);
  H5Tset_size(t, strlen(value) + 1);
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = a < 0 ? -1 : H5Awrite(a, t, value);
  if (a >= 0) H5Aclose(a);
  H5Sclose(sp);
  H5Tclose(t);
  return rc < 0 ? -1 : 0;
}

static int attr_num(hid_t obj, const char *name, hid_t file_type, hid_t mem_type, const void *value) {
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(obj, name, file_type, sp, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = a < 0 ? -1 : H5Awrite(a, mem_type, value);
  if (a >= 0) H5Aclose(a);
  H5Sclose(sp);
  return rc < 0 ? -1 : 0;
}

static int write_group(hid_t f, const char *group, const dt_model *m, const float *params, const float *bufs,
                       int params_only) {
  hid_t g = H5Gcreate2(f, group, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (g < 0) return -1;
  int bad = 0;
  for (int i = 0; i < m->n_tensors && !bad; i++) {
    const dt_tensor *t = &m->tensors[i];
    if (params_only && t->is_buffer) continue;
    hsize_t dims[4];
    for (int k = 0; k < t->ndim; k++) dims[k] = (hsize_t)t->dims[k];
    hid_t sp = H5Screate_simple(t->ndim, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, t->ndim, dims);
    H5Pset_fletcher32(dcpl);
    hid_t ds = H5Dcreate2(g, t->name, H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    bad |= ds < 0 || H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                              (t->is_buffer ? bufs : params) + t->offset) < 0;
    if (ds >= 0) H5Dclose(ds);
    H5Pclose(dcpl);
    H5Sclose(sp);
  }
  H5Gclose(g);
  return bad ? -1 : 0;
}

/* Closes f, an h5_image's file, and writes the image to path atomically (dt_write_atomic). Exit 5
 * naming path when HDF5 failed before (bad) or at the close, or the write failed. */
static int commit_image(hid_t f, h5_image *im, int bad, const char *path, const char *what, dt_status *st) {
  char e[256] = "";
  if (bad) h5_error_text(e, sizeof e);
  if (H5Fclose(f) < 0 && !bad) bad = 1, h5_error_text(e, sizeof e);
  size_t len = bad ? 0 : h5_image_length(im);
  if (!bad && !len) snprintf(e, sizeof e, "HDF5 left no complete file in memory");
  int rc = len ? dt_write_atomic(path, im->buf, len, what, st)
               : dt_fail(st, DT_EXIT_IO, "%s: writing %s failed: %s", path, what, e);
  h5_image_free(im);
  return rc;
}

int ckpt_write(const char *path, const dt_model *m, const dt_ckpt_data *d, const dt_config *cfg, dt_status *st) {
  char e[256];
  const dt_train_state *ts = &d->ts;
  const dt_optim_ops *optim = dt_optim_kinds[ts->optim];
  int states = 0;
  while (states < DT_OPTIM_MAX_STATES && d->opt[states]) states++;
  /* the image grows in steps of its tensors' size and a margin for the metadata */
  size_t hint = (size_t)(m->n_params * (1 + states) + m->n_bufs) * sizeof(float) + ((size_t)1 << 20);
  if (d->ema_params) hint += (size_t)(m->n_params + m->n_bufs) * sizeof(float);
  h5_image im;
  hid_t f = h5_image_create(&im, path, hint);
  if (f < 0)
    return dt_fail(st, DT_EXIT_IO, "%s: cannot create the checkpoint in memory: %s", path, h5_error_text(e, sizeof e));
  int bad = write_group(f, "/model", m, d->params, d->bufs, 0);
  if (!bad && states) bad |= H5Gclose(H5Gcreate2(f, "/optim", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)) < 0;
  for (int k = 0; k < states && !bad; k++) {
    char g[64];
    snprintf(g, sizeof g, "/optim/%s", optim->state_names[k]);
    bad |= write_group(f, g, m, d->opt[k], NULL, 1);
  }
  if (!bad && d->ema_params) bad |= write_group(f, "/ema", m, d->ema_params, d->ema_bufs, 0);
  if (!bad) {
    hid_t meta = H5Gcreate2(f, "/meta", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    bad |= meta < 0 || attr_str(meta, "config", cfg->effective) || attr_str(meta, "version", DT_VERSION) ||
           attr_str(meta, "optimizer", optim->name) ||
           attr_num(meta, "world_size", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->world_size) ||
           attr_num(meta, "step", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->step) ||
           attr_num(meta, "epoch", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->epoch) ||
           attr_num(meta, "micro", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->micro) ||
           attr_num(meta, "global_batch", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->global_batch) ||
           attr_num(meta, "seed", H5T_STD_U64LE, H5T_NATIVE_UINT64, &ts->seed) ||
           attr_num(meta, "bad_evals", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->bad_evals) ||
           attr_num(meta, "best_metric", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &ts->best_metric) ||
           attr_num(meta, "best_val_acc", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &ts->best_val_acc) ||
           attr_num(meta, "optimizer_step", H5T_STD_I64LE, H5T_NATIVE_INT64, &ts->optim_step) ||
           (ts->loss_scale > 0 &&
            (attr_num(meta, "loss_scale", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &ts->loss_scale) ||
             attr_num(meta, "loss_scale_growth", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &ts->scale_growth)));
    if (meta >= 0) H5Gclose(meta);
  }
  return commit_image(f, &im, bad, path, "the checkpoint", st);
}

/* Replaces dir/latest with name, atomically. */
static int write_latest(const char *dir, const char *name, dt_status *st) {
  char path[1200], line[300];
  snprintf(path, sizeof path, "%s/latest", dir);
  int n = snprintf(line, sizeof line, "%s\n", name);
  return dt_write_atomic(path, line, (size_t)n, "the latest pointer", st);
}

static int64_t step_of(const char *name) {
  long long s;
  char tail[8];
  if (sscanf(name, "step-%lld.h%7s", &s, tail) == 2 && !strcmp(tail, "5")) return s;
  return -1;
}

static int cmp_desc(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* Step numbers of dir's step files, newest first (caller frees). */
static int64_t *list_steps(const char *dir, int *n) {
  *n = 0;
  DIR *dp = opendir(dir);
  if (!dp) return NULL;
  int cap = 16;
  int64_t *steps = dt_malloc((size_t)cap * sizeof *steps);
  struct dirent *de;
  while ((de = readdir(dp))) {
    int64_t s = step_of(de->d_name);
    if (s < 0) continue;
    if (*n == cap) steps = dt_realloc(steps, (size_t)(cap *= 2) * sizeof *steps);
    steps[(*n)++] = s;
  }
  closedir(dp);
  qsort(steps, (size_t)*n, sizeof *steps, cmp_desc);
  return steps;
}

/* Keeps step `current` and the newest `others` other step files; deletes the rest. */
static void prune_steps(const char *dir, int64_t others, int64_t current) {
  int n;
  int64_t *steps = list_steps(dir, &n);
  int64_t kept = 0;
  for (int i = 0; i < n; i++) {
    if (steps[i] == current || kept++ < others) continue;
    char path[1200];
    snprintf(path, sizeof path, "%s/step-%08lld.h5", dir, (long long)steps[i]);
    unlink(path);
  }
  free(steps);
}

/* The pid of a temporary file of ours (NAME.tmp.PID, NAME a step file, best.h5 or latest), else -1. */
static long tmp_pid(const char *name) {
  const char *t = strstr(name, ".tmp.");
  if (!t) return -1;
  while (strstr(t + 1, ".tmp.")) t = strstr(t + 1, ".tmp.");
  char base[256];
  size_t n = (size_t)(t - name);
  if (n >= sizeof base) return -1;
  memcpy(base, name, n);
  base[n] = 0;
  if (step_of(base) < 0 && strcmp(base, "best.h5") && strcmp(base, "latest")) return -1;
  char *end;
  errno = 0;
  long pid = strtol(t + 5, &end, 10);
  return errno || end == t + 5 || *end || pid <= 0 ? -1 : pid;
}

/* Whether pid may still be writing: another process of this program's name, running on this host
 * (by /proc/PID/comm; without /proc, any process). This process writes one file at a time, so a
 * temporary file of its own pid is a crashed run's that had it before. */
static int writer_alive(long pid) {
  if (pid == (long)getpid() || (kill((pid_t)pid, 0) != 0 && errno == ESRCH)) return 0;
  char mine[64] = "", theirs[64] = "", path[64];
  FILE *f = fopen("/proc/self/comm", "r");
  if (!f) return 1;
  if (!fgets(mine, sizeof mine, f)) mine[0] = 0;
  fclose(f);
  snprintf(path, sizeof path, "/proc/%ld/comm", pid);
  if (!(f = fopen(path, "r"))) return 0; /* gone since */
  if (!fgets(theirs, sizeof theirs, f)) theirs[0] = 0;
  fclose(f);
  return mine[0] && !strcmp(mine, theirs);
}

int ckpt_clean_stale(const char *dir, int *removed) {
  int live = 0, gone = 0;
  DIR *dp = opendir(dir);
  struct dirent *de;
  while (dp && (de = readdir(dp))) {
    long pid = tmp_pid(de->d_name);
    if (pid < 0) continue;
    if (writer_alive(pid)) {
      live++;
      continue;
    }
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    gone += unlink(path) == 0;
  }
  if (dp) closedir(dp);
  if (removed) *removed = gone;
  return live;
}

int ckpt_save_step(const char *dir, int64_t keep, const dt_model *m, const dt_ckpt_data *d, const dt_config *cfg,
                   char *written, size_t cap, dt_status *st) {
  char name[64], path[1200];
  snprintf(name, sizeof name, "step-%08lld.h5", (long long)d->ts.step);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  /* Another live writer's temporary file counts as a checkpoint. The oldest go first, so that the
   * directory never holds more than `keep` checkpoints, the one being written included; but the
   * newest stays until its successor is in (with keep 1 the only one). */
  const int64_t live = ckpt_clean_stale(dir, NULL);
  int64_t others = keep - 1 - live;
  if (keep > 1) prune_steps(dir, others > 1 ? others : 1, d->ts.step);
  if (ckpt_write(path, m, d, cfg, st) || write_latest(dir, name, st)) return st->code;
  dt_strlcpy(written, path, cap);
  prune_steps(dir, others > 0 ? others : 0, d->ts.step);
  return 0;
}

static int read_attr(hid_t meta, const char *name, hid_t mem_type, void *out) {
  if (H5Aexists(meta, name) <= 0) return -1;
  hid_t a = H5Aopen(meta, name, H5P_DEFAULT);
  herr_t rc = H5Aread(a, mem_type, out);
  H5Aclose(a);
  return rc < 0 ? -1 : 0;
}

static char *read_attr_str(hid_t meta, const char *name) {
  if (H5Aexists(meta, name) <= 0) return NULL;
  hid_t a = H5Aopen(meta, name, H5P_DEFAULT);
  hid_t t = H5Aget_type(a);
  size_t n = H5Tget_size(t);
  char *buf = dt_calloc(n + 1, 1);
  hid_t mt = H5Tcopy(H5T_C_S1);
  H5Tset_size(mt, n);
  if (H5Aread(a, mt, buf) < 0) buf[0] = 0;
  H5Tclose(mt);
  H5Tclose(t);
  H5Aclose(a);
  return buf;
}

static int read_meta(const char *path, dt_train_state *ts, char **config_text, dt_status *st) {
  *config_text = NULL;
  hid_t f = open_read(path, "checkpoint", st);
  if (f < 0) return st->code;
  hid_t meta = H5Lexists(f, "/meta", H5P_DEFAULT) > 0 ? H5Gopen2(f, "/meta", H5P_DEFAULT) : -1;
  char *optim = NULL;
  if (meta < 0 || read_attr(meta, "step", H5T_NATIVE_INT64, &ts->step) ||
      read_attr(meta, "epoch", H5T_NATIVE_INT64, &ts->epoch) ||
      read_attr(meta, "micro", H5T_NATIVE_INT64, &ts->micro) ||
      read_attr(meta, "global_batch", H5T_NATIVE_INT64, &ts->global_batch) ||
      read_attr(meta, "world_size", H5T_NATIVE_INT64, &ts->world_size) ||
      read_attr(meta, "seed", H5T_NATIVE_UINT64, &ts->seed) ||
      read_attr(meta, "bad_evals", H5T_NATIVE_INT64, &ts->bad_evals) ||
      read_attr(meta, "best_metric", H5T_NATIVE_DOUBLE, &ts->best_metric) ||
      read_attr(meta, "best_val_acc", H5T_NATIVE_DOUBLE, &ts->best_val_acc) ||
      !(optim = read_attr_str(meta, "optimizer")) || !(*config_text = read_attr_str(meta, "config"))) {
    char e[256];
    dt_fail(st, DT_EXIT_INPUT, "%s: not a ddp_train checkpoint (the /meta attributes are missing or unreadable: %s)",
            path, h5_error_text(e, sizeof e));
  }
  ts->loss_scale = ts->scale_growth = 0; /* optional: written by fp16 runs */
  ts->optim_step = ts->step;             /* optional: older files skipped no update */
  if (!st->code && H5Aexists(meta, "optimizer_step") > 0 &&
      (read_attr(meta, "optimizer_step", H5T_NATIVE_INT64, &ts->optim_step) || ts->optim_step < 0 ||
       ts->optim_step > ts->step)) {
    char e[256];
    dt_fail(st, DT_EXIT_INPUT, "%s: /meta optimizer_step is unreadable or outside [0, step]: %s", path,
            h5_error_text(e, sizeof e));
  }
  if (!st->code && H5Aexists(meta, "loss_scale") > 0 &&
      (read_attr(meta, "loss_scale", H5T_NATIVE_DOUBLE, &ts->loss_scale) ||
       read_attr(meta, "loss_scale_growth", H5T_NATIVE_DOUBLE, &ts->scale_growth) || !(ts->loss_scale > 0))) {
    char e[256];
    dt_fail(st, DT_EXIT_INPUT, "%s: /meta loss_scale or loss_scale_growth is unreadable or not positive: %s", path,
            h5_error_text(e, sizeof e));
  }
  if (!st->code) {
    ts->optim = optim_index(optim);
    if (ts->optim < 0) dt_fail(st, DT_EXIT_INPUT, "%s: unknown optimizer '%s' in /meta", path, optim);
  }
  free(optim);
  if (meta >= 0) H5Gclose(meta);
  H5Fclose(f);
  if (st->code) {
    free(*config_text);
    *config_text = NULL;
  }
  return st->code;
}

static int load(const char *path, const dt_model *m, dt_ckpt_data *d, char **config_text, dt_status *st) {
  if (read_meta(path, &d->ts, config_text, st)) return st->code;
  hid_t f = open_read(path, "checkpoint", st);
  if (f < 0) return st->code;
  dt_train_state *ts = &d->ts;
  for (int i = 0; i < m->n_tensors && !st->code; i++) {
    const dt_tensor *t = &m->tensors[i];
    read_tensor(f, path, "/model", t, (t->is_buffer ? d->bufs : d->params) + t->offset, st);
  }
  for (int k = 0; k < DT_OPTIM_MAX_STATES && !st->code; k++) {
    float *dst = d->opt[k];
    const char *state = dt_optim_kinds[ts->optim]->state_names[k];
    if (!dst || !state) continue;
    char g[64];
    snprintf(g, sizeof g, "/optim/%s", state);
    for (int i = 0; i < m->n_tensors && !st->code; i++)
      if (!m->tensors[i].is_buffer) read_tensor(f, path, g, &m->tensors[i], dst + m->tensors[i].offset, st);
  }
  d->has_ema = d->ema_params && !st->code && H5Lexists(f, "/ema", H5P_DEFAULT) > 0;
  for (int i = 0; i < m->n_tensors && d->has_ema && !st->code; i++) {
    const dt_tensor *t = &m->tensors[i];
    read_tensor(f, path, "/ema", t, (t->is_buffer ? d->ema_bufs : d->ema_params) + t->offset, st);
  }
  H5Fclose(f);
  if (st->code) {
    free(*config_text);
    *config_text = NULL;
  }
  return st->code;
}

/* The readers run first in an h5_probe child (a corrupt file can crash HDF5 itself); a child
 * still reading after this long is killed (dist.timeout_s's default). */
#define CKPT_PROBE_TIMEOUT_S 600.0

typedef struct {
  const char *path;
  const dt_model *m;
  dt_ckpt_data *d;
  float *params, *bufs;
  int ignore_extra;
  const char *what;
  dt_train_state *ts;
} probe_args;

static int probe_model(void *ctx, dt_status *st) {
  probe_args *a = ctx;
  return read_model(a->path, a->m, a->params, a->bufs, a->ignore_extra, a->what, st);
}

static int probe_meta(void *ctx, dt_status *st) {
  probe_args *a = ctx;
  char *text = NULL;
  read_meta(a->path, a->ts, &text, st);
  free(text);
  return st->code;
}

static int probe_load(void *ctx, dt_status *st) {
  probe_args *a = ctx;
  char *text = NULL;
  load(a->path, a->m, a->d, &text, st);
  free(text);
  return st->code;
}

int ckpt_read_model(const char *path, const dt_model *m, float *params, float *bufs, int ignore_extra, const char *what,
                    dt_status *st) {
  probe_args a = {.path = path, .m = m, .params = params, .bufs = bufs, .ignore_extra = ignore_extra, .what = what};
  if (h5_probe(path, what, probe_model, &a, CKPT_PROBE_TIMEOUT_S, st)) return st->code;
  return read_model(path, m, params, bufs, ignore_extra, what, st);
}

int ckpt_share_model(const char *path, dt_model *m, int ignore_extra, const char *what, dt_comm *comm) {
  dt_status st = {0};
  dt_backend *be = m->be;
  const size_t pbytes = (size_t)m->n_params * sizeof(float), bbytes = (size_t)m->n_bufs * sizeof(float);
  float *hp = dt_malloc(pbytes ? pbytes : 1), *hb = dt_malloc(bbytes ? bbytes : 1);
  be->to_host(be, hp, m->params, pbytes);
  be->to_host(be, hb, m->bufs, bbytes);
  if (comm->rank == 0 && path[0]) ckpt_read_model(path, m, hp, hb, ignore_extra, what, &st);
  int code = comm_agree(comm, &st);
  if (!code) {
    comm_bcast(comm, hp, pbytes, 0);
    comm_bcast(comm, hb, bbytes, 0);
    be->to_device(be, m->params, hp, pbytes);
    be->to_device(be, m->bufs, hb, bbytes);
  }
  free(hp);
  free(hb);
  return code;
}

int ckpt_read_meta(const char *path, dt_train_state *ts, char **config_text, dt_status *st) {
  *config_text = NULL;
  probe_args a = {.path = path, .ts = ts};
  if (h5_probe(path, "checkpoint", probe_meta, &a, CKPT_PROBE_TIMEOUT_S, st)) return st->code;
  return read_meta(path, ts, config_text, st);
}

int ckpt_load(const char *path, const dt_model *m, dt_ckpt_data *d, char **config_text, dt_status *st) {
  *config_text = NULL;
  probe_args a = {.path = path, .m = m, .d = d};
  if (h5_probe(path, "checkpoint", probe_load, &a, CKPT_PROBE_TIMEOUT_S, st)) return st->code;
  return load(path, m, d, config_text, st);
}

int ckpt_write_predictions(const char *path, const float *logits, const int32_t *labels, int64_t n, int64_t k,
                           dt_status *st) {
  char e[256];
  h5_image im;
  hid_t f = h5_image_create(&im, path, (size_t)(n * (k + 1)) * 4 + ((size_t)1 << 20));
  if (f < 0) return dt_fail(st, DT_EXIT_IO, "%s: cannot create in memory: %s", path, h5_error_text(e, sizeof e));
  hsize_t dims[2] = {(hsize_t)n, (hsize_t)k};
  hid_t sp = H5Screate_simple(2, dims, NULL);
  hid_t ds = H5Dcreate2(f, "/logits", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  int bad = ds < 0 || (n && H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, logits) < 0);
  if (ds >= 0) H5Dclose(ds);
  H5Sclose(sp);
  if (!bad && labels) {
    sp = H5Screate_simple(1, dims, NULL);
    ds = H5Dcreate2(f, "/labels", H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    bad = ds < 0 || (n && H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels) < 0);
    if (ds >= 0) H5Dclose(ds);
    H5Sclose(sp);
  }
  return commit_image(f, &im, bad, path, "predictions", st);
}

int ckpt_candidates(const char *dir, char names[][1024], int max) {
  int count = 0;
  char path[1200], line[512];
  snprintf(path, sizeof path, "%s/latest", dir);
  FILE *f = fopen(path, "r");
  if (f) {
    if (fgets(line, sizeof line, f)) {
      line[strcspn(line, "\r\n")] = 0;
      if (line[0] && count < max) snprintf(names[count++], 1024, "%s/%s", dir, line);
    }
    fclose(f);
  }
  int n;
  int64_t *steps = list_steps(dir, &n);
  for (int i = 0; i < n && count < max; i++) {
    char p[1024];
    snprintf(p, sizeof p, "%s/step-%08lld.h5", dir, (long long)steps[i]);
    int dup = 0;
    for (int j = 0; j < count && !dup; j++) dup = !strcmp(names[j], p);
    if (!dup) snprintf(names[count++], 1024, "%s", p);
  }
  free(steps);
  return count;
}

/* ---- --resume: finding, checking and loading a checkpoint for this run ---- */

/* Keys whose change makes a checkpoint unusable: the model, and what decides the data order
 * and the optimizer state. Everything else may change on resume (README "Resuming"). */
static const char *const frozen_keys[] = {"model.input",   "model.layers",   "model.loss",
                                          "optim.name",    "train.seed",     "data.shuffle",
                                          "data.sharding", "data.drop_last", "train.grad_accum"};

static const char *find_line(const char *text, const char *key, size_t *len) {
  size_t k = strlen(key);
  for (const char *p = text; p && *p;) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    if (n > k && !strncmp(p, key, k) && p[k] == ':') {
      *len = n;
      return p;
    }
    p = nl ? nl + 1 : NULL;
  }
  return NULL;
}

static int check_compatible(const char *path, const char *stored, const dt_config *cfg, const dt_train_state *ts,
                            int64_t global_batch, dt_status *st) {
  for (size_t i = 0; i < sizeof frozen_keys / sizeof *frozen_keys; i++) {
    size_t la = 0, lb = 0;
    const char *a = find_line(stored, frozen_keys[i], &la), *b = find_line(cfg->effective, frozen_keys[i], &lb);
    if (!a || !b || la != lb || strncmp(a, b, la))
      return dt_fail(st, DT_EXIT_INPUT,
                     "cannot resume from %s: %s differs\n  checkpoint: %.*s\n  config:     %.*s\n"
                     "(README \"Resuming\" lists what may change)%s",
                     path, frozen_keys[i], (int)la, a ? a : "(none)", (int)lb, b ? b : "(none)",
                     cfg->auto_batch[0] && !strcmp(frozen_keys[i], "train.grad_accum")
                         ? "; train.batch_size auto chose another split here: set train.batch_size, "
                           "train.global_batch_size and train.grad_accum to the checkpoint's"
                         : "");
  }
  if (ts->global_batch != global_batch)
    return dt_fail(st, DT_EXIT_INPUT,
                   "cannot resume from %s: its global batch was %lld, this run's is %lld, so the "
                   "data position cannot carry over; set train.global_batch_size to %lld",
                   path, (long long)ts->global_batch, (long long)global_batch, (long long)ts->global_batch);
  return 0;
}

void ckpt_data_alloc(dt_ckpt_data *d, const dt_model *m, const dt_config_values *v) {
  const int states = dt_optim_kinds[v->optim]->n_states(v), ema = v->ema_decay > 0;
  memset(d, 0, sizeof *d);
  size_t pb = (size_t)(m->n_params ? m->n_params : 1) * sizeof(float),
         bb = (size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float);
  d->params = dt_malloc(pb);
  d->bufs = dt_malloc(bb);
  for (int k = 0; k < states; k++) d->opt[k] = dt_malloc(pb);
  if (ema) {
    d->ema_params = dt_malloc(pb);
    d->ema_bufs = dt_malloc(bb);
  }
}

void ckpt_data_free(dt_ckpt_data *d) {
  free(d->params);
  free(d->bufs);
  for (int k = 0; k < DT_OPTIM_MAX_STATES; k++) free(d->opt[k]);
  free(d->ema_params);
  free(d->ema_bufs);
  memset(d, 0, sizeof *d);
}

int ckpt_resume(const char *which, const dt_config *cfg, dt_model *m, dt_comm *comm, dt_ckpt_data *d, int *resumed) {
  dt_status st = {0};
  const dt_config_values *v = &cfg->v;
  int states = dt_optim_kinds[v->optim]->n_states(v);
  ckpt_data_alloc(d, m, v);
  int64_t W = comm->size;
  int64_t G = config_global_batch(v, (int)W) * v->grad_accum;
  int found = 0;
  if (comm->rank == 0) {
    char names[64][1024];
    int n = 0;
    int is_auto = !strcmp(which, "auto");
    if (is_auto) {
      if (!v->ckpt_dir[0])
        dt_fail(&st, DT_EXIT_INPUT, "--resume auto needs checkpoint.dir");
      else
        n = ckpt_candidates(v->ckpt_dir, names, 64);
    } else {
      snprintf(names[0], sizeof names[0], "%s", which);
      n = 1;
    }
    for (int i = 0; i < n && !st.code && !found; i++) {
      char *stored = NULL;
      dt_status ls = {0};
      /* the stored config first: a changed model is the user's error, not a reason to fall back */
      if (!ckpt_read_meta(names[i], &d->ts, &stored, &ls) && check_compatible(names[i], stored, cfg, &d->ts, G, &st)) {
        free(stored);
        break;
      }
      free(stored);
      stored = NULL;
      if (!ls.code && !ckpt_load(names[i], m, d, &stored, &ls)) {
        found = 1;
        printf("resuming from %s%s\n", names[i], i ? " (the newest good checkpoint)" : "");
      } else if (!is_auto) {
        st = ls;
      } else {
        fprintf(stderr, "ddp_train: warning: %s%s\n", ls.msg, i + 1 < n ? "; falling back to an older checkpoint" : "");
      }
      free(stored);
    }
    if (is_auto && !found && !st.code) {
      if (n)
        dt_fail(&st, DT_EXIT_INPUT, "--resume auto: none of the %d checkpoints in %s could be loaded", n, v->ckpt_dir);
      else
        printf("no checkpoint in %s: starting from the beginning\n", v->ckpt_dir);
    }
    fflush(stdout);
  }
  int code = comm_agree(comm, &st);
  if (code) return code;
  comm_bcast(comm, &found, sizeof found, 0);
  *resumed = found;
  if (!found) return 0;
  comm_bcast(comm, d->params, (size_t)m->n_params * sizeof(float), 0);
  comm_bcast(comm, d->bufs, (size_t)m->n_bufs * sizeof(float), 0);
  for (int k = 0; k < states; k++) comm_bcast(comm, d->opt[k], (size_t)m->n_params * sizeof(float), 0);
  comm_bcast(comm, &d->has_ema, sizeof d->has_ema, 0);
  if (d->has_ema) {
    comm_bcast(comm, d->ema_params, (size_t)m->n_params * sizeof(float), 0);
    comm_bcast(comm, d->ema_bufs, (size_t)m->n_bufs * sizeof(float), 0);
  }
  comm_bcast(comm, &d->ts, sizeof d->ts, 0);
  dt_backend *be = m->be;
  be->to_device(be, m->params, d->params, (size_t)m->n_params * sizeof(float));
  be->to_device(be, m->bufs, d->bufs, (size_t)m->n_bufs * sizeof(float));
  return 0;
}
