#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data.h"
#include "h5util.h"

static void dims_text(int nd, const hsize_t *dims, char *buf, size_t cap) {
  size_t len = (size_t)snprintf(buf, cap, "(");
  for (int i = 0; i < nd; i++)
    len += (size_t)snprintf(buf + len, cap - len, "%s%llu", i ? ", " : "", (unsigned long long)dims[i]);
  snprintf(buf + len, cap - len, "%s)", nd == 1 ? "," : "");
}

/* Opens a dataset, checking it exists. */
static hid_t open_dset(dt_data *d, const char *name, const char *key, dt_status *st) {
  if (!name[0] || name[0] != '/') {
    dt_fail(st, DT_EXIT_INPUT, "%s: %s: dataset path must start with '/', got '%s'", d->path, key, name);
    return -1;
  }
  /* check each link on the way, so a missing group is a clear message rather than an HDF5 trace */
  char part[256];
  dt_strlcpy(part, name, sizeof part);
  for (char *p = part + 1;; p++) {
    if (*p == '/' || *p == 0) {
      char save = *p;
      *p = 0;
      htri_t ok = H5Lexists(d->file, part, H5P_DEFAULT);
      if (ok <= 0) {
        char e[512] = "";
        if (ok < 0) h5_error_text(e, sizeof e);
        dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s) not found%s%s", d->path, name, key, ok < 0 ? ": " : "", e);
        return -1;
      }
      *p = save;
      if (!save) break;
    }
  }
  hid_t ds = H5Dopen2(d->file, name, H5P_DEFAULT);
  if (ds < 0) {
    char e[512];
    dt_fail(st, DT_EXIT_INPUT, "%s: cannot open dataset '%s' (%s): %s", d->path, name, key, h5_error_text(e, sizeof e));
  }
  return ds;
}

static int get_dims(hid_t ds, hsize_t *dims, int max) {
  hid_t sp = H5Dget_space(ds);
  int nd = H5Sget_simple_extent_ndims(sp);
  if (nd > 0 && nd <= max) H5Sget_simple_extent_dims(sp, dims, NULL);
  H5Sclose(sp);
  return nd;
}

/* Watches the file for a change of size from now on (data_changed): HDF5 reads past the end of a file
 * truncated under it as zeros. With HDF5's own descriptor (the sec2 driver, Linux's default), so that
 * it is the file HDF5 reads even when the path has been replaced since. */
static int watch_file(dt_data *d, dt_status *st) {
  hid_t fapl = H5Fget_access_plist(d->file);
  const int sec2 = fapl >= 0 && H5Pget_driver(fapl) == H5FD_SEC2;
  if (fapl >= 0) H5Pclose(fapl);
  int *fd = NULL;
  struct stat sb;
  if (!sec2) return 0; /* another driver: unwatched */
  if (H5Fget_vfd_handle(d->file, H5P_DEFAULT, (void **)&fd) < 0 || !fd || fstat(*fd, &sb) != 0) {
    char e[512];
    return dt_fail(st, DT_EXIT_INPUT, "%s: data.path: cannot stat the open file: %s", d->path,
                   h5_error_text(e, sizeof e));
  }
  d->fd = *fd;
  d->size = (int64_t)sb.st_size;
  d->watched = 1;
  return 0;
}

/* The size of the file now when it is no longer the size it had when opened (or -2: fstat failed);
 * -1 when unchanged or unwatched. */
static int64_t data_changed(const dt_data *d) {
  struct stat sb;
  if (!d->watched) return -1;
  if (fstat(d->fd, &sb) != 0) return -2;
  return (int64_t)sb.st_size == d->size ? -1 : (int64_t)sb.st_size;
}

/* Reads rows [lo, hi) of ds, dataset `name`, as mem_type into buf. On failure sets st naming the file,
 * the dataset and the rows: exit `code` when HDF5 fails (a corrupt file found at start-up is bad
 * input, 2; a read during training an I/O failure, 5), exit 5 when the file has changed size since
 * it was opened (truncated or rewritten under the run: what was read cannot be trusted). */
static int read_rows(const dt_data *d, hid_t ds, const char *name, hid_t mem_type, int64_t lo, int64_t hi, void *buf,
                     int code, dt_status *st) {
  char rows[64];
  if (hi - lo == 1)
    snprintf(rows, sizeof rows, "[%lld]", (long long)lo);
  else
    snprintf(rows, sizeof rows, "[%lld:%lld]", (long long)lo, (long long)hi);
  hid_t fsp = H5Dget_space(ds);
  int nd = H5Sget_simple_extent_ndims(fsp);
  hsize_t start[8] = {0}, count[8];
  H5Sget_simple_extent_dims(fsp, count, NULL);
  start[0] = (hsize_t)lo;
  count[0] = (hsize_t)(hi - lo);
  herr_t rc = H5Sselect_hyperslab(fsp, H5S_SELECT_SET, start, NULL, count, NULL);
  /* the memory space has the file's shape, which keeps HDF5 on its fast path */
  hid_t msp = H5Screate_simple(nd, count, NULL);
  if (rc >= 0) rc = H5Dread(ds, mem_type, msp, fsp, H5P_DEFAULT, buf);
  hid_t failure = rc < 0 ? H5Eget_current_stack() : -1; /* the closes would clear it before h5_error_text */
  H5Sclose(msp);
  H5Sclose(fsp);
  if (failure >= 0) H5Eset_current_stack(failure);
  const int64_t now = data_changed(d);
  if (now != -1) {
    if (rc < 0) H5Eclear2(H5E_DEFAULT);
    char was[128];
    if (now == -2)
      snprintf(was, sizeof was, "and it cannot be examined now: %s", strerror(errno));
    else
      snprintf(was, sizeof was, "now %lld", (long long)now);
    return dt_fail(st, DT_EXIT_IO,
                   "%s: reading '%s'%s: the file changed under the run (%lld bytes when opened, %s): truncated or "
                   "rewritten in place? what was read from it cannot be trusted",
                   d->path, name, rows, (long long)d->size, was);
  }
  if (rc < 0) {
    char e[512];
    return dt_fail(st, code, "%s: cannot read '%s'%s (corrupt or unreadable file?): %s", d->path, name, rows,
                   h5_error_text(e, sizeof e));
  }
  return 0;
}

/* Compares x's trailing dims with model.input, ignoring leading 1s on either side. */
static int shape_matches(int nd, const hsize_t *dims, const dt_shape *in) {
  int64_t want[3];
  int nw = 0;
  if (in->rank == 1)
    want[nw++] = in->c;
  else
    want[0] = in->c, want[1] = in->h, want[2] = in->w, nw = 3;
  int a = 1, b = 0;
  while (a < nd - 1 && dims[a] == 1 && nd - a > nw - b) a++;
  while (b < nw - 1 && want[b] == 1 && nw - b > nd - a) b++;
  if (nd - a != nw - b) return 0;
  for (; a < nd; a++, b++)
    if ((int64_t)dims[a] != want[b]) return 0;
  return 1;
}

/* Whether data.cache `cache` holds a rank's `bytes` of rows in host memory: memory and device do (device
 * from host memory), auto under 4 GiB. */
static int cache_holds(int cache, size_t bytes) {
  return cache == DT_CACHE_MEMORY || cache == DT_CACHE_DEVICE || (cache == DT_CACHE_AUTO && bytes < ((size_t)4 << 30));
}

/* Whether a token split's tokens are held in memory under data.cache `cache` (data.h). */
static int tokens_in_memory(const dt_split *s, int cache, size_t *bytes) {
  *bytes = (size_t)s->tok_count * (s->tok_type == DT_TOK_U16 ? sizeof(uint16_t) : sizeof(int32_t));
  return cache_holds(cache, *bytes);
}

/* Checks tokens [at, at + n) of the split's stretch (buf, tok_type each) against the vocabulary, and
 * counts each row's targets that are not ignore_index into s->row_targets when it is kept. */
static int check_tokens(dt_data *d, dt_split *s, const void *buf, int64_t at, int64_t n, int two_d, int64_t vocab,
                        int64_t ignore, dt_status *st) {
  const int64_t t = s->row_elems, first = two_d ? s->lo * (t + 1) : s->lo * t;
  for (int64_t i = 0; i < n; i++) {
    const int64_t q = at + i; /* within the stretch */
    const int32_t v = token_at(s->tok_type, buf, i);
    if (v < 0 || v >= vocab) {
      if (two_d)
        return dt_fail(st, DT_EXIT_INPUT, "%s: '%s'[%lld, %lld] = %d: token outside [0, %lld) (the model's vocabulary)",
                       d->path, s->x_name, (long long)(s->lo + q / (t + 1)), (long long)(q % (t + 1)), v,
                       (long long)vocab);
      return dt_fail(st, DT_EXIT_INPUT, "%s: '%s'[%lld] = %d: token outside [0, %lld) (the model's vocabulary)",
                     d->path, s->x_name, (long long)(first + q), v, (long long)vocab);
    }
    if (s->row_targets && v != ignore) { /* a target: a row's tokens 1..T (a stream's windows share ends) */
      if (two_d && q % (t + 1))
        s->row_targets[q / (t + 1)]++;
      else if (!two_d && q > 0)
        s->row_targets[(q - 1) / t]++;
    }
  }
  return 0;
}

/* A token model's split (see data.h): this rank's rows held in memory (as uint16 or int32) or left in
 * the file, every token checked either way; the file's are read in pieces of a few MiB. A probe
 * (cache DT_CACHE_PROBE) reads only the first and last window: the real open checks the rest. */
static int open_token_split(dt_data *d, dt_split *s, const char *xkey, const dt_model *m, int64_t lo_frac_r, int world,
                            int contiguous, int cache, dt_status *st) {
  char dt[128];
  const int probe = cache == DT_CACHE_PROBE;
  hid_t dx = open_dset(d, s->x_name, xkey, st);
  if (dx < 0) return st->code;
  hsize_t xd[8];
  int xn = get_dims(dx, xd, 8), rc = 0;
  const int64_t t = m->tokens, vocab = m->n_classes;
  dims_text(xn, xd, dt, sizeof dt);
  hid_t ty = H5Dget_type(dx);
  H5T_class_t cls = H5Tget_class(ty);
  const int narrow = cls == H5T_INTEGER && H5Tget_sign(ty) == H5T_SGN_NONE && H5Tget_size(ty) <= 2;
  H5Tclose(ty);
  if (cls != H5T_INTEGER || !((xn == 2 && (int64_t)xd[1] == t + 1) || xn == 1)) {
    rc = dt_fail(st, DT_EXIT_INPUT,
                 "%s: dataset '%s' (%s) is %s %s; a token model with model.input [%lld] needs integer tokens (N, %lld) "
                 "or a flat stream (L,)",
                 d->path, s->x_name, xkey, cls == H5T_INTEGER ? "integer" : "non-integer", dt, (long long)t,
                 (long long)(t + 1));
    goto out;
  }
  int64_t len = (int64_t)xd[0];
  s->tok_stride = xn == 2 ? t + 1 : t;
  s->tok_type = narrow ? DT_TOK_U16 : DT_TOK_I32;
  s->tok_ignore = m->loss.ignore_index_set;
  s->n = xn == 2 ? len : (len > t ? (len - 1) / t : 0);
  s->row_elems = t;
  s->x_type = DT_X_F32, s->x_elem = sizeof(float);
  s->y_k = 0;
  s->lo = contiguous ? split_lo(s->n, world, (int)lo_frac_r) : 0;
  s->hi = contiguous ? split_lo(s->n, world, (int)lo_frac_r + 1) : s->n;
  int64_t rows = s->hi - s->lo;
  /* the values rows [lo, hi) span: as rows of the dataset, or a stretch of the stream */
  int64_t first = xn == 2 ? s->lo : s->lo * t, count = rows ? (rows - 1) * s->tok_stride + t + 1 : 0;
  s->tok_count = count;
  if (probe) { /* the rows this rank holds, at both ends (the chunk index is walked to reach them) */
    int32_t *ends = dt_malloc((size_t)(2 * (t + 1)) * sizeof(int32_t));
    int64_t last = xn == 2 ? s->hi - 1 : first + count - (t + 1);
    const char *x = s->x_name;
    if (rows)
      rc = xn == 2 ? read_rows(d, dx, x, H5T_NATIVE_INT32, s->lo, s->lo + 1, ends, DT_EXIT_INPUT, st) ||
                         read_rows(d, dx, x, H5T_NATIVE_INT32, last, last + 1, ends + t + 1, DT_EXIT_INPUT, st)
                   : read_rows(d, dx, x, H5T_NATIVE_INT32, first, first + t + 1, ends, DT_EXIT_INPUT, st) ||
                         read_rows(d, dx, x, H5T_NATIVE_INT32, last, last + t + 1, ends + t + 1, DT_EXIT_INPUT, st);
    rc = rc ? st->code : 0;
    free(ends);
    goto out;
  }
  const hid_t mt = narrow ? H5T_NATIVE_UINT16 : H5T_NATIVE_INT32;
  const size_t elem = narrow ? sizeof(uint16_t) : sizeof(int32_t);
  size_t bytes;
  if (tokens_in_memory(s, cache, &bytes)) {
    s->tokens = dt_malloc(bytes ? bytes : 1);
    if (count && (rc = xn == 2 ? read_rows(d, dx, s->x_name, mt, s->lo, s->hi, s->tokens, DT_EXIT_INPUT, st)
                               : read_rows(d, dx, s->x_name, mt, first, first + count, s->tokens, DT_EXIT_INPUT, st)))
      goto out;
    rc = check_tokens(d, s, s->tokens, 0, count, xn == 2, vocab, m->loss.ignore_index, st);
    d->cached = 1;
    goto out;
  }
  /* left in the file: checked piece by piece (whole rows of a 2-D dataset), and kept open */
  if (s->tok_ignore) s->row_targets = dt_calloc((size_t)(rows ? rows : 1), sizeof(int32_t));
  const int64_t per_piece = xn == 2 ? (((int64_t)1 << 20) / (t + 1) > 0 ? ((int64_t)1 << 20) / (t + 1) : 1)
                                    : (int64_t)1 << 20; /* rows of a 2-D dataset, else tokens */
  void *piece = dt_malloc((size_t)(xn == 2 ? per_piece * (t + 1) : per_piece) * elem);
  const int64_t end = xn == 2 ? s->hi : first + count;
  for (int64_t at = xn == 2 ? s->lo : first; at < end && !rc; at += per_piece) {
    const int64_t n = end - at < per_piece ? end - at : per_piece;
    rc = read_rows(d, dx, s->x_name, mt, at, at + n, piece, DT_EXIT_INPUT, st);
    if (!rc)
      rc = xn == 2 ? check_tokens(d, s, piece, (at - s->lo) * (t + 1), n * (t + 1), 1, vocab, m->loss.ignore_index, st)
                   : check_tokens(d, s, piece, at - first, n, 0, vocab, m->loss.ignore_index, st);
  }
  free(piece);
  if (!rc) s->dset_x = dx, dx = -1;
out:
  if (dx >= 0) H5Dclose(dx);
  return rc;
}

/* x's shape against model.input, and its element type (uint8, float32 or float64). */
static int check_x(dt_data *d, dt_split *s, hid_t dx, const char *xkey, const dt_model *m, dt_status *st) {
  char dt[128];
  hsize_t xd[8];
  int xn = get_dims(dx, xd, 8);
  if (xn < 2)
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s: dataset '%s' (%s): expected (N, C, H, W), (N, H, W) or (N, D), got %d dimensions", d->path,
                   s->x_name, xkey, xn);
  dims_text(xn, xd, dt, sizeof dt);
  if (!shape_matches(xn, xd, &m->input)) {
    char in[64];
    shape_text(m->input, in, sizeof in);
    return dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s) has shape %s, which does not match model.input %s",
                   d->path, s->x_name, xkey, dt, in);
  }
  s->n = (int64_t)xd[0];
  s->row_elems = shape_size(m->input);
  hid_t t = H5Dget_type(dx);
  H5T_class_t cls = H5Tget_class(t);
  size_t sz = H5Tget_size(t);
  H5T_sign_t sign = cls == H5T_INTEGER ? H5Tget_sign(t) : H5T_SGN_NONE;
  H5Tclose(t);
  if (cls == H5T_INTEGER && sz == 1 && sign == H5T_SGN_NONE)
    s->x_type = DT_X_U8, s->x_elem = 1;
  else if (cls == H5T_FLOAT && sz == 4)
    s->x_type = DT_X_F32, s->x_elem = 4;
  else if (cls == H5T_FLOAT && sz == 8)
    s->x_type = DT_X_F64, s->x_elem = 8;
  else
    return dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s): element type must be uint8, float32 or float64", d->path,
                   s->x_name, xkey);
  return 0;
}

/* y's rows against x's, and its type and shape against the loss: class labels (N,) for
 * cross_entropy, targets (N, outputs) for mse (y_k). */
static int check_y(dt_data *d, dt_split *s, hid_t dy, const char *ykey, const dt_model *m, dt_status *st) {
  hsize_t yd[8];
  int yn = get_dims(dy, yd, 8);
  if (yn < 1 || (int64_t)yd[0] != s->n) {
    char ydt[128];
    dims_text(yn, yd, ydt, sizeof ydt);
    return dt_fail(st, DT_EXIT_INPUT, "%s: '%s' has %lld rows but '%s' has shape %s: x and y lengths differ", d->path,
                   s->x_name, (long long)s->n, s->y_name, ydt);
  }
  hid_t t = H5Dget_type(dy);
  H5T_class_t cls = H5Tget_class(t);
  H5Tclose(t);
  if (m->loss.kind == DT_LOSS_CROSS_ENTROPY) {
    if (cls != H5T_INTEGER || yn != 1)
      return dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s): cross_entropy needs integer class labels shaped (N,)",
                     d->path, s->y_name, ykey);
    s->y_k = 0;
    return 0;
  }
  int64_t k = yn == 1 ? 1 : (int64_t)yd[1];
  if ((cls != H5T_FLOAT && cls != H5T_INTEGER) || yn > 2 || k != m->n_outputs)
    return dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s): mse needs float targets shaped (N, %lld)", d->path,
                   s->y_name, ykey, (long long)m->n_outputs);
  s->y_k = k;
  return 0;
}

/* This rank's rows [lo, hi) of y into memory: labels (each checked against the outputs) or targets. */
static int read_y(dt_data *d, dt_split *s, hid_t dy, const dt_model *m, dt_status *st) {
  int64_t rows = s->hi - s->lo;
  if (s->y_k) {
    s->targets = dt_malloc((size_t)(rows * s->y_k + 1) * sizeof(float));
    return rows ? read_rows(d, dy, s->y_name, H5T_NATIVE_FLOAT, s->lo, s->hi, s->targets, DT_EXIT_INPUT, st) : 0;
  }
  s->labels = dt_malloc((size_t)(rows ? rows : 1) * sizeof(int32_t));
  if (rows && read_rows(d, dy, s->y_name, H5T_NATIVE_INT32, s->lo, s->hi, s->labels, DT_EXIT_INPUT, st))
    return st->code;
  for (int64_t i = 0; i < rows; i++)
    if (s->labels[i] < 0 || s->labels[i] >= m->n_outputs)
      return dt_fail(st, DT_EXIT_INPUT, "%s: '%s'[%lld] = %d: label outside [0, %lld) (the model has %lld outputs)",
                     d->path, s->y_name, (long long)(s->lo + i), s->labels[i], (long long)m->n_outputs,
                     (long long)m->n_outputs);
  return 0;
}

/* The bytes of a split's x rows [lo, hi) as stored, and whether data.cache `cache` holds them in host
 * memory (memory or device, or auto under 4 GiB). */
static int x_in_memory(const dt_split *s, int cache, size_t *bytes) {
  *bytes = (size_t)(s->hi - s->lo) * (size_t)s->row_elems * s->x_elem;
  return cache_holds(cache, *bytes);
}

/* Where x's rows live: in host memory (x_in_memory), read now or left pending for data_fill
 * (defer); or in the file, read batch by batch (s->dset_x). Takes *dx when it keeps the dataset
 * open (then -1). */
static int place_x(dt_data *d, dt_split *s, hid_t *dx, int cache, int defer, dt_status *st) {
  int64_t rows = s->hi - s->lo;
  size_t bytes;
  int in_memory = x_in_memory(s, cache, &bytes);
  if (in_memory && defer && cache != DT_CACHE_DEVICE && rows) {
    s->x = dt_malloc(bytes);
    s->x_pending = 1;
    s->dset_x = *dx;
    *dx = -1;
    d->cached = 1;
  } else if (in_memory) {
    s->x = dt_malloc(bytes ? bytes : 1);
    hid_t mt = s->x_type == DT_X_U8 ? H5T_NATIVE_UINT8 : s->x_type == DT_X_F32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_DOUBLE;
    if (rows && read_rows(d, *dx, s->x_name, mt, s->lo, s->hi, s->x, DT_EXIT_INPUT, st)) return st->code;
    d->cached = 1;
  } else {
    s->dset_x = *dx;
    *dx = -1;
  }
  return 0;
}

/* One split: its datasets checked against the model, this rank's rows [lo, hi) (contiguous
 * sharding: rank lo_frac_r's share of world; else all), y read, x placed (defer: leave a
 * host-memory cache of x unread, x_pending, for data_fill). */
static int open_split(dt_data *d, dt_split *s, const char *xkey, const char *ykey, const dt_model *m, int64_t lo_frac_r,
                      int world, int contiguous, int cache, int defer, dt_status *st) {
  if (m->tokens) {
    if (cache == DT_CACHE_DEVICE)
      return dt_fail(st, DT_EXIT_INPUT, "data.cache: device is not available for token models yet (use auto)");
    return open_token_split(d, s, xkey, m, lo_frac_r, world, contiguous, cache, st);
  }
  hid_t dx = open_dset(d, s->x_name, xkey, st);
  if (dx < 0) return st->code;
  hid_t dy = open_dset(d, s->y_name, ykey, st);
  if (dy < 0) {
    H5Dclose(dx);
    return st->code;
  }
  int rc = check_x(d, s, dx, xkey, m, st);
  if (!rc) rc = check_y(d, s, dy, ykey, m, st);
  if (!rc) {
    s->lo = contiguous ? split_lo(s->n, world, (int)lo_frac_r) : 0;
    s->hi = contiguous ? split_lo(s->n, world, (int)lo_frac_r + 1) : s->n;
    rc = read_y(d, s, dy, m, st);
  }
  if (!rc) rc = place_x(d, s, &dx, cache, defer, st);
  if (dx >= 0) H5Dclose(dx);
  H5Dclose(dy);
  return rc;
}

/* Exit 2: split s (key names its dataset) holds no row, or no whole sequence of a token model. */
static int empty_split(const dt_data *d, const dt_split *s, const char *key, const dt_model *m, const char *advice,
                       dt_status *st) {
  if (m->tokens)
    return dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s) holds no sequence of %lld tokens (model.input + 1)%s",
                   d->path, s->x_name, key, (long long)m->tokens + 1, advice);
  return dt_fail(st, DT_EXIT_INPUT, "%s: dataset '%s' (%s) has no rows%s", d->path, s->x_name, key, advice);
}

static int open_splits(dt_data *d, const dt_config *cfg, const dt_model *m, int world, int rank, int cache,
                       dt_status *st) {
  memset(d, 0, sizeof *d);
  d->file = -1;
  d->train.dset_x = d->val.dset_x = -1;
  const dt_config_values *v = &cfg->v;
  dt_strlcpy(d->path, v->data_path, sizeof d->path);
  h5_quiet();
  struct stat sb;
  if (stat(d->path, &sb) != 0)
    return dt_fail(st, DT_EXIT_INPUT, "%s: data.path: cannot open: %s%s", d->path, strerror(errno),
                   errno != ENOENT ? ""
                   : m->tokens     ? " (`make text-data` writes data/fortunes.h5; `--dry-run --set data.path=` shows "
                                     "the model without data)"
                                   : " (for Fashion-MNIST, run `make data`)");
  if (H5Fis_hdf5(d->path) <= 0) {
    char e[512];
    h5_error_text(e, sizeof e);
    return dt_fail(st, DT_EXIT_INPUT, "%s: data.path: not a readable HDF5 file (corrupt or another format): %s",
                   d->path, e);
  }
  d->file = H5Fopen(d->path, H5F_ACC_RDONLY, H5P_DEFAULT);
  if (d->file < 0) {
    char e[512];
    int lock = h5_error_is_lock(); /* not a search of the text: "sblock" of a truncated file's message */
    h5_error_text(e, sizeof e);
    return dt_fail(st, DT_EXIT_INPUT, "%s: cannot open HDF5 file: %s%s", d->path, e,
                   lock ? " (the file is locked; on shared filesystems set HDF5_USE_FILE_LOCKING=FALSE)" : "");
  }
  if (watch_file(d, st)) return st->code;
  dt_strlcpy(d->train.x_name, v->train_x, sizeof d->train.x_name);
  dt_strlcpy(d->train.y_name, v->train_y, sizeof d->train.y_name);
  if (open_split(d, &d->train, "data.train.x", "data.train.y", m, rank, world, v->sharding == DT_SHARD_CONTIGUOUS,
                 cache, 1, st))
    return st->code;
  d->has_val = v->val_x[0] != 0;
  if (d->has_val) {
    dt_strlcpy(d->val.x_name, v->val_x, sizeof d->val.x_name);
    dt_strlcpy(d->val.y_name, v->val_y, sizeof d->val.y_name);
    /* validation: every rank holds its contiguous 1/W */
    if (open_split(d, &d->val, "data.val.x", "data.val.y", m, rank, world, 1, cache, 0, st)) return st->code;
  }
  if (d->train.n == 0) return empty_split(d, &d->train, "data.train.x", m, "", st);
  if (d->has_val && d->val.n == 0) /* its metrics would be 0/0: a fake best checkpoint, a fake early stop */
    return empty_split(d, &d->val, "data.val.x", m, "; leave data.val.x empty to train without validation", st);
  return 0;
}

typedef struct {
  const dt_config *cfg;
  const dt_model *m;
  int world, rank;
} probe_args;

/* In the h5_probe child: the structure of both splits, the labels, and the first and last row
 * this rank holds of each (the chunk index is walked to reach them); no x cache. */
static int probe_splits(void *ctx, dt_status *st) {
  const probe_args *a = ctx;
  dt_data d;
  if (!open_splits(&d, a->cfg, a->m, a->world, a->rank, DT_CACHE_PROBE, st)) {
    dt_split *splits[2] = {&d.train, d.has_val ? &d.val : NULL};
    for (int k = 0; k < 2 && splits[k] && !st->code; k++) {
      dt_split *s = splits[k];
      if (s->hi == s->lo || a->m->tokens) continue; /* a token split's probe has read its ends */
      int64_t rows[2] = {s->lo, s->hi - 1};
      float *x = dt_malloc((size_t)(2 * s->row_elems) * sizeof(float));
      float *targets = dt_malloc((size_t)(2 * s->y_k + 1) * sizeof(float));
      int32_t *labels = dt_malloc((size_t)(2 * a->m->n_labels) * sizeof(int32_t));
      data_gather(&d, s, rows, 2, x, labels, targets, st);
      free(x);
      free(targets);
      free(labels);
    }
  }
  data_close(&d);
  return st->code;
}

int data_open(dt_data *d, const dt_config *cfg, const dt_model *m, int world, int rank, dt_status *st) {
  memset(d, 0, sizeof *d);
  d->file = -1;
  d->train.dset_x = d->val.dset_x = -1;
  probe_args a = {cfg, m, world, rank};
  if (h5_probe(cfg->v.data_path, "data.path", probe_splits, &a, cfg->v.timeout_s, st)) return st->code;
  return open_splits(d, cfg, m, world, rank, cfg->v.cache, st);
}

/* A split's host memory (data_held_bytes). */
static size_t split_held_bytes(const dt_split *s, int tokens, int cache) {
  const size_t rows = (size_t)(s->hi - s->lo);
  size_t bytes;
  if (tokens) /* the tokens the rows span, or without them each row's count of targets (ignore_index) */
    return tokens_in_memory(s, cache, &bytes) ? bytes : s->tok_ignore ? rows * sizeof(int32_t) : 0;
  size_t x;
  const size_t y = s->y_k ? rows * (size_t)s->y_k * sizeof(float) : rows * sizeof(int32_t);
  return y + (x_in_memory(s, cache, &x) ? x : 0);
}

size_t data_held_bytes(const dt_data *d, int cache, int tokens) {
  if (!d->train.n) return 0; /* not opened (--dry-run without data) */
  return split_held_bytes(&d->train, tokens, cache) + (d->has_val ? split_held_bytes(&d->val, tokens, cache) : 0);
}

int data_fill(dt_data *d, dt_status *st) {
  dt_split *s = &d->train;
  if (!s->x_pending) return 0;
  hid_t mt = s->x_type == DT_X_U8 ? H5T_NATIVE_UINT8 : s->x_type == DT_X_F32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_DOUBLE;
  /* a corrupt chunk is bad input, found late (exit 2); a file changed since data_open, exit 5 */
  int rc = read_rows(d, s->dset_x, s->x_name, mt, s->lo, s->hi, s->x, DT_EXIT_INPUT, st);
  H5Dclose(s->dset_x);
  s->dset_x = -1;
  s->x_pending = 0;
  return rc; /* on failure the loader makes no more batches */
}

static void split_free(dt_split *s) {
  free(s->x);
  free(s->tokens);
  s->tokens = NULL;
  free(s->row_targets);
  s->row_targets = NULL;
  free(s->labels);
  free(s->targets);
  if (s->dset_x >= 0) H5Dclose(s->dset_x);
  s->x = NULL;
  s->labels = NULL;
  s->targets = NULL;
  s->dset_x = -1;
}

void data_close(dt_data *d) {
  split_free(&d->train);
  split_free(&d->val);
  if (d->file >= 0) H5Fclose(d->file);
  d->file = -1;
}

static void convert_row(const dt_split *s, const void *src, float *dst) {
  int64_t n = s->row_elems;
  if (s->x_type == DT_X_U8)
    for (int64_t i = 0; i < n; i++) dst[i] = (float)((const uint8_t *)src)[i];
  else if (s->x_type == DT_X_F32)
    memcpy(dst, src, (size_t)n * sizeof(float));
  else
    for (int64_t i = 0; i < n; i++) dst[i] = (float)((const double *)src)[i];
}

int data_gather(dt_data *d, dt_split *s, const int64_t *idx, int64_t n, float *x, int32_t *labels, float *targets,
                dt_status *st) {
  if (s->tok_stride) { /* inputs: a window's first T tokens; labels: its last T */
    const int64_t t = s->row_elems;
    int32_t *w = s->tokens ? NULL : dt_malloc((size_t)(t + 1) * sizeof(int32_t)); /* a window from the file */
    const int two_d = s->tok_stride == t + 1;
    for (int64_t i = 0; i < n; i++) {
      const int64_t r = idx[i];
      DT_ASSERT(r >= s->lo && r < s->hi);
      if (w && read_rows(d, s->dset_x, s->x_name, H5T_NATIVE_INT32, two_d ? r : r * t, two_d ? r + 1 : r * t + t + 1, w,
                         DT_EXIT_IO, st)) {
        free(w);
        return st->code;
      }
      const int64_t at = (r - s->lo) * s->tok_stride;
      for (int64_t j = 0; j < t; j++) {
        const int32_t in = w ? w[j] : split_token(s, at + j), next = w ? w[j + 1] : split_token(s, at + j + 1);
        x[i * t + j] = (float)in; /* exact below 2^24 */
        labels[i * t + j] = next;
      }
    }
    free(w);
    return 0;
  }
  unsigned char row[8 * 4096];
  int from_cache = s->x && !s->x_pending; /* pending: the first batch, read row by row */
  void *tmp = from_cache                                                 ? NULL
              : s->row_elems * (int64_t)s->x_elem <= (int64_t)sizeof row ? (void *)row
                                                                         : dt_malloc((size_t)s->row_elems * s->x_elem);
  hid_t mt = s->x_type == DT_X_U8 ? H5T_NATIVE_UINT8 : s->x_type == DT_X_F32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_DOUBLE;
  for (int64_t i = 0; i < n; i++) {
    int64_t r = idx[i];
    DT_ASSERT(r >= s->lo && r < s->hi);
    if (from_cache) {
      convert_row(s, (const char *)s->x + (size_t)(r - s->lo) * (size_t)s->row_elems * s->x_elem, x + i * s->row_elems);
    } else {
      if (read_rows(d, s->dset_x, s->x_name, mt, r, r + 1, tmp, DT_EXIT_IO, st)) {
        if (tmp != row) free(tmp);
        return st->code;
      }
      convert_row(s, tmp, x + i * s->row_elems);
    }
    if (s->y_k == 0)
      labels[i] = s->labels[r - s->lo];
    else
      memcpy(targets + i * s->y_k, s->targets + (r - s->lo) * s->y_k, (size_t)s->y_k * sizeof(float));
  }
  if (tmp && tmp != row) free(tmp);
  return 0;
}

/* ---- loader ---- */

static void seq_position(const dt_loader *L, int64_t seq, int64_t *epoch, int64_t *step) {
  int64_t abs = L->start_step + seq, steps = L->sampler->steps;
  *epoch = L->start_epoch + abs / steps;
  *step = abs % steps;
}

/* Fills slot for sequence number seq; 0 or error in L->st. Caller holds no lock. */
static int fill(dt_loader *L, dt_batch *b, int64_t seq, dt_status *st) {
  seq_position(L, seq, &b->epoch, &b->step);
  b->count = sampler_batch(L->sampler, b->epoch, b->step, L->idx, &b->global_count);
  for (int64_t i = 0; i < b->count; i++) b->rows[i] = (int32_t)(L->idx[i] - L->data->train.lo);
  if (L->indices_only) return 0;
  return data_gather(L->data, &L->data->train, L->idx, b->count, b->x, b->labels, b->targets, st);
}

/* The training cache that data_open left pending, read by the loader's thread once the first batch
 * is out: the first step need not wait for the whole dataset. Called and returns with L->mu held. */
static void fill_cache(dt_loader *L) {
  pthread_mutex_unlock(&L->mu);
  dt_status st = {0};
  data_fill(L->data, &st);
  pthread_mutex_lock(&L->mu);
  if (st.code && !L->st.code) L->st = st, L->err_seq = L->next_fill; /* the batch after those made */
  L->filling = 0;
  pthread_cond_broadcast(&L->cv);
}

static void *loader_main(void *arg) {
  dt_loader *L = arg;
  h5_quiet(); /* a thread-safe HDF5 keeps the error printing per thread */
  pthread_mutex_lock(&L->mu);
  for (;;) {
    if (L->st.code) { /* no batch after a failed one, no fill, and no more HDF5 calls here */
      L->filling = 0;
      pthread_cond_broadcast(&L->cv);
      while (!L->stop) pthread_cond_wait(&L->cv, &L->mu);
      break;
    }
    if (L->filling && !L->stop && L->next_fill > 0) {
      fill_cache(L);
      continue;
    }
    while (!L->stop && (L->next_fill - L->next_take >= 1 || L->slots[L->next_fill % 2].ready)) {
      /* at most one batch ahead of the one the consumer holds */
      pthread_cond_wait(&L->cv, &L->mu);
    }
    if (L->stop) break;
    int64_t seq = L->next_fill;
    int64_t e, s;
    seq_position(L, seq, &e, &s);
    if (e >= L->end_epoch) {
      if (L->filling) { /* no batch left to make (a finished run resumed): the cache is not needed */
        L->filling = 0;
        pthread_cond_broadcast(&L->cv);
      }
      pthread_cond_wait(&L->cv, &L->mu);
      continue;
    }
    dt_batch *b = &L->slots[seq % 2];
    pthread_mutex_unlock(&L->mu);
    dt_status st = {0};
    fill(L, b, seq, &st);
    pthread_mutex_lock(&L->mu);
    if (st.code && !L->st.code) L->st = st, L->err_seq = seq;
    b->ready = 1;
    L->next_fill++;
    pthread_cond_broadcast(&L->cv);
  }
  pthread_mutex_unlock(&L->mu);
  return NULL;
}

void loader_start(dt_loader *L, dt_data *d, dt_sampler *s, const dt_model *m, int64_t start_epoch, int64_t start_step,
                  int64_t end_epoch, int indices_only) {
  memset(L, 0, sizeof *L);
  L->indices_only = indices_only;
  L->data = d;
  L->sampler = s;
  L->start_epoch = start_epoch;
  L->start_step = start_step;
  L->end_epoch = end_epoch;
  int64_t cap = sampler_max_local(s);
  L->idx = dt_malloc((size_t)cap * sizeof(int64_t));
  for (int i = 0; i < 2; i++) {
    L->slots[i].x = dt_malloc((size_t)(cap * shape_size(m->input)) * sizeof(float));
    L->slots[i].labels = dt_malloc((size_t)(cap * m->n_labels + 1) * sizeof(int32_t));
    L->slots[i].rows = dt_malloc((size_t)(cap ? cap : 1) * sizeof(int32_t));
    L->slots[i].targets = dt_malloc((size_t)(cap * (m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1)) * sizeof(float));
  }
  pthread_mutex_init(&L->mu, NULL);
  pthread_cond_init(&L->cv, NULL);
  /* HDF5 without thread safety must stay on one thread: then batches are read in the caller. */
  hbool_t safe = 0;
  H5is_library_threadsafe(&safe);
  L->threaded = d->cached || safe;
  L->filling = d->train.x_pending && L->threaded;
  if (L->threaded && pthread_create(&L->thread, NULL, loader_main, L) != 0) L->threaded = L->filling = 0;
  if (!L->threaded) data_fill(d, &L->st); /* here and now: no thread to do it behind the first step */
}

void loader_wait_filled(dt_loader *L) {
  pthread_mutex_lock(&L->mu);
  while (L->filling) pthread_cond_wait(&L->cv, &L->mu);
  pthread_mutex_unlock(&L->mu);
}

dt_batch *loader_next(dt_loader *L, int ahead, dt_status *st) {
  double t0 = dt_now();
  pthread_mutex_lock(&L->mu);
  if (ahead && L->filling && !L->slots[L->next_take % 2].ready) { /* the first steps do not wait on the fill */
    pthread_mutex_unlock(&L->mu);
    return NULL;
  }
  /* release the batch handed out last time */
  if (L->next_take > 0) {
    L->slots[(L->next_take - 1) % 2].ready = 0;
    pthread_cond_broadcast(&L->cv);
  }
  dt_batch *b = &L->slots[L->next_take % 2];
  if (!L->threaded) {
    pthread_mutex_unlock(&L->mu);
    if (L->st.code) { /* loader_start's fill failed */
      *st = L->st;
      return NULL;
    }
    if (fill(L, b, L->next_take, st)) return NULL;
    b->ready = 1;
    L->next_fill = ++L->next_take;
    L->wait_s += dt_now() - t0;
    return b;
  }
  /* an error belongs to the batch it stopped: the batches before it are handed out first, so that
   * every rank fails at the same step */
  while (!b->ready && !(L->st.code && L->err_seq <= L->next_take)) pthread_cond_wait(&L->cv, &L->mu);
  if (L->st.code && L->err_seq <= L->next_take) {
    *st = L->st;
    pthread_mutex_unlock(&L->mu);
    return NULL;
  }
  L->next_take++;
  pthread_cond_broadcast(&L->cv);
  pthread_mutex_unlock(&L->mu);
  L->wait_s += dt_now() - t0;
  return b;
}

void loader_stop(dt_loader *L) {
  pthread_mutex_lock(&L->mu);
  L->stop = 1;
  pthread_cond_broadcast(&L->cv);
  pthread_mutex_unlock(&L->mu);
  if (L->threaded) pthread_join(L->thread, NULL);
  pthread_mutex_destroy(&L->mu);
  pthread_cond_destroy(&L->cv);
  for (int i = 0; i < 2; i++) {
    free(L->slots[i].x);
    free(L->slots[i].labels);
    free(L->slots[i].rows);
    free(L->slots[i].targets);
  }
  free(L->idx);
  memset(L, 0, sizeof *L);
}
