#include "checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static herr_t first_msg(unsigned n, const H5E_error2_t *e, void *ctx) {
  char *buf = ctx;
  if (n == 0 && e->desc) snprintf(buf, 256, "%s", e->desc);
  return 0;
}

static const char *h5_msg(char *buf) {
  buf[0] = 0;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, first_msg, buf);
  H5Eclear2(H5E_DEFAULT);
  return buf[0] ? buf : "unknown HDF5 error";
}

int ckpt_read_model(const char *path, const dt_model *m, float *params, float *bufs, dt_status *st) {
  char e[256];
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
  if (access(path, R_OK) != 0)
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.init_from: cannot open: %s", path, strerror(errno));
  hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return dt_fail(st, DT_EXIT_INPUT, "%s: model.init_from: not a readable HDF5 file: %s", path, h5_msg(e));
  int rc = 0;
  for (int i = 0; i < m->n_tensors && !rc; i++) {
    const dt_tensor *t = &m->tensors[i];
    char name[200];
    snprintf(name, sizeof name, "/model/%s", t->name);
    if (H5Lexists(f, "/model", H5P_DEFAULT) <= 0 || H5Lexists(f, name, H5P_DEFAULT) <= 0) {
      rc = dt_fail(st, DT_EXIT_INPUT, "%s: tensor '%s' (dataset %s) is missing", path, t->name, name);
      break;
    }
    hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
    hid_t sp = H5Dget_space(ds);
    hsize_t dims[8];
    int nd = H5Sget_simple_extent_ndims(sp);
    int same = nd == t->ndim;
    if (nd > 0 && nd <= 8) H5Sget_simple_extent_dims(sp, dims, NULL);
    for (int k = 0; same && k < nd; k++) same = (int64_t)dims[k] == t->dims[k];
    H5Sclose(sp);
    if (!same) {
      char want[96] = "(", got[96] = "(";
      for (int k = 0; k < t->ndim; k++)
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", k ? ", " : "", (long long)t->dims[k]);
      for (int k = 0; k < nd && k < 8; k++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%llu", k ? ", " : "", (unsigned long long)dims[k]);
      rc = dt_fail(st, DT_EXIT_INPUT, "%s: tensor '%s' has shape %s) but the model needs %s)", path, t->name, got, want);
    } else if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                       (t->is_buffer ? bufs : params) + t->offset) < 0) {
      rc = dt_fail(st, DT_EXIT_INPUT, "%s: cannot read tensor '%s' (corrupt file?): %s", path, t->name, h5_msg(e));
    }
    H5Dclose(ds);
  }
  H5Fclose(f);
  return rc;
}

static int fsync_path(const char *path, int dir) {
  int fd = open(path, dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  close(fd);
  return rc;
}

static int write_attr_str(hid_t obj, const char *name, const char *value) {
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

static int write_attr_i64(hid_t obj, const char *name, int64_t value) {
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
  herr_t rc = a < 0 ? -1 : H5Awrite(a, H5T_NATIVE_INT64, &value);
  if (a >= 0) H5Aclose(a);
  H5Sclose(sp);
  return rc < 0 ? -1 : 0;
}

int ckpt_write_model(const char *path, const dt_model *m, const float *params, const float *bufs, const dt_config *cfg,
                     int world, int64_t step, dt_status *st) {
  char tmp[1200], e[256];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_LATEST); /* metadata checksums */
  hid_t f = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  H5Pclose(fapl);
  if (f < 0) return dt_fail(st, DT_EXIT_IO, "%s: cannot create: %s (%s)", tmp, h5_msg(e), strerror(errno));
  int bad = 0;
  hid_t g = H5Gcreate2(f, "/model", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  bad |= g < 0;
  for (int i = 0; i < m->n_tensors && !bad; i++) {
    const dt_tensor *t = &m->tensors[i];
    hsize_t dims[4];
    for (int k = 0; k < t->ndim; k++) dims[k] = (hsize_t)t->dims[k];
    hid_t sp = H5Screate_simple(t->ndim, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, t->ndim, dims);
    H5Pset_fletcher32(dcpl); /* checksummed data, verified on read */
    hid_t ds = H5Dcreate2(g, t->name, H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    bad |= ds < 0 || H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, (t->is_buffer ? bufs : params) + t->offset) < 0;
    if (ds >= 0) H5Dclose(ds);
    H5Pclose(dcpl);
    H5Sclose(sp);
  }
  if (g >= 0) H5Gclose(g);
  if (!bad) {
    hid_t meta = H5Gcreate2(f, "/meta", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    bad |= meta < 0 || write_attr_str(meta, "config", cfg->effective) || write_attr_str(meta, "version", DT_VERSION) ||
           write_attr_i64(meta, "world_size", world) || write_attr_i64(meta, "step", step);
    if (meta >= 0) H5Gclose(meta);
  }
  if (bad) h5_msg(e);
  if (H5Fclose(f) < 0) bad = 1;
  if (bad) {
    unlink(tmp);
    return dt_fail(st, DT_EXIT_IO, "%s: writing failed: %s", path, e[0] ? e : strerror(errno));
  }
  char dir[1200];
  dt_strlcpy(dir, path, sizeof dir);
  if (fsync_path(tmp, 0) || rename(tmp, path) || fsync_path(dirname(dir), 1)) {
    int err = errno;
    unlink(tmp);
    return dt_fail(st, DT_EXIT_IO, "%s: committing failed: %s", path, strerror(err));
  }
  return 0;
}
