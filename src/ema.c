#include "ema.h"

#include <string.h>

static void copy(dt_backend *be, float *dst, const float *src, int64_t n) {
  /* a device-to-device copy through the op set: ema = 0 * ema + 1 * src */
  if (n) {
    be->zero(be, dst, (size_t)n * sizeof(float));
    dt_op op = {.type = DT_OP_EMA, .p.ema = {.n = n, .decay = 0.0f, .x = src, .ema = dst}};
    backend_run(be, &op);
  }
}

void ema_init(dt_ema *e, dt_backend *be, double decay, const float *params, int64_t n_params, const float *bufs,
              int64_t n_bufs) {
  memset(e, 0, sizeof *e);
  e->decay = decay;
  e->n_params = n_params;
  e->n_bufs = n_bufs;
  e->params = be->alloc(be, (size_t)(n_params ? n_params : 1) * sizeof(float));
  e->bufs = be->alloc(be, (size_t)(n_bufs ? n_bufs : 1) * sizeof(float));
  copy(be, e->params, params, n_params);
  copy(be, e->bufs, bufs, n_bufs);
}

void ema_update(dt_ema *e, dt_backend *be, const float *params, const float *bufs) {
  dt_op op = {.type = DT_OP_EMA, .p.ema = {.n = e->n_params, .decay = (float)e->decay, .x = params, .ema = e->params}};
  if (e->n_params) backend_run(be, &op);
  op.p.ema = (typeof(op.p.ema)){.n = e->n_bufs, .decay = (float)e->decay, .x = bufs, .ema = e->bufs};
  if (e->n_bufs) backend_run(be, &op);
}

void ema_free(dt_ema *e, dt_backend *be) {
  if (e->params) be->free(be, e->params);
  if (e->bufs) be->free(be, e->bufs);
  memset(e, 0, sizeof *e);
}
