#include "h5util.h"

#include <hdf5.h>
#include <stdio.h>

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
