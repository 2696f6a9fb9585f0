/* ema.h: an exponential moving average of the weights, as timm's ModelEmaV2: after every
 * optimizer step, every parameter and batchnorm running statistic becomes
 * decay * ema + (1 - decay) * value, in FP32. It starts as a copy of the model. The EMA is the
 * same on every rank by construction (the weights are), so it is never communicated.
 * Owns: its two flat buffers (backend memory), laid out as the model's. */
#ifndef DT_EMA_H
#define DT_EMA_H

#include "backend.h"

typedef struct {
  double decay;
  int64_t n_params, n_bufs;
  float *params, *bufs;
} dt_ema;

/* Allocates the EMA as a copy of params (n_params) and bufs (n_bufs), backend memory. */
void ema_init(dt_ema *e, dt_backend *be, double decay, const float *params, int64_t n_params, const float *bufs,
              int64_t n_bufs);
/* One update from the model's current params and bufs. */
void ema_update(dt_ema *e, dt_backend *be, const float *params, const float *bufs);
void ema_free(dt_ema *e, dt_backend *be);

#endif
