/* layer_norm.c: batchnorm{momentum, eps, sync} over (B, C, H, W) per channel, or (B, D) per feature.
 * Tensors as PyTorch: weight, bias (params); running_mean, running_var (buffers).
 * Training normalises with the batch statistics (biased variance) and updates the running ones
 * with the unbiased variance; sync: true reduces the sums over all ranks in forward and backward. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key bn_keys[] = {
    {"momentum", DT_KEY_FLOAT, A(momentum), "0.1", 0, 1, NULL, "running statistics momentum (PyTorch's)"},
    {"eps", DT_KEY_FLOAT, A(eps), "1e-5", 0, 1, NULL, "added to the variance"},
    {"sync", DT_KEY_BOOL, A(sync), "false", 1, 0, NULL, "batch statistics across all ranks"},
};

typedef struct {
  float *mean, *invstd; /* (C) backend memory: what forward used */
  double *sums;         /* host (3C): sum, sumsq, count | sum_dy, sum_dy_xhat */
  double *dev_sums;     /* (2C) backend memory for the stats ops */
  float *host_f;        /* host (4C) scratch */
  double count;         /* rows*spatial behind the last forward's statistics */
} bn_state;

static int bn_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  (void)st;
  l->out = l->in;
  int64_t c = l->in.c;
  layer_add_tensor(l, "weight", 0, 1, &c);
  layer_add_tensor(l, "bias", 0, 1, &c);
  layer_add_tensor(l, "running_mean", 1, 1, &c);
  layer_add_tensor(l, "running_var", 1, 1, &c);
  return 0;
}

static void bn_init(dt_layer *l, float *params, float *bufs, uint64_t seed) {
  (void)seed;
  int64_t c = l->in.c;
  for (int64_t i = 0; i < c; i++) {
    params[l->tensors[0].offset + i] = 1.0f;
    params[l->tensors[1].offset + i] = 0.0f;
    bufs[l->tensors[2].offset + i] = 0.0f;
    bufs[l->tensors[3].offset + i] = 1.0f;
  }
}

static void bn_alloc(dt_layer *l, dt_backend *be, int64_t max_batch) {
  (void)max_batch;
  int64_t c = l->in.c;
  bn_state *s = dt_calloc(1, sizeof *s);
  s->mean = be->alloc(be, (size_t)c * sizeof(float));
  s->invstd = be->alloc(be, (size_t)c * sizeof(float));
  s->dev_sums = (double *)be->alloc(be, (size_t)(2 * c) * sizeof(double));
  s->sums = dt_calloc((size_t)(2 * c + 1), sizeof(double));
  s->host_f = dt_calloc((size_t)(4 * c), sizeof(float));
  l->priv = s;
}

static void bn_release(dt_layer *l, dt_backend *be) {
  bn_state *s = l->priv;
  if (!s) return;
  be->free(be, s->mean);
  be->free(be, s->invstd);
  be->free(be, s->dev_sums);
  free(s->sums);
  free(s->host_f);
}

static int64_t spatial(const dt_layer *l) {
  return l->in.h * l->in.w;
}

static void bn_forward(dt_layer *l, dt_pass *pass, const float *x) {
  bn_state *s = l->priv;
  dt_backend *be = pass->be;
  int64_t c = l->in.c;
  float *mean = s->host_f, *invstd = s->host_f + c, *rm = s->host_f + 2 * c, *rv = s->host_f + 3 * c;
  float *bufs_rm = pass->bufs + l->tensors[2].offset, *bufs_rv = pass->bufs + l->tensors[3].offset;
  be->to_host(be, rm, bufs_rm, (size_t)c * sizeof(float));
  be->to_host(be, rv, bufs_rv, (size_t)c * sizeof(float));
  if (pass->training) {
    dt_op op = {.type = DT_OP_BN_STATS};
    op.p.bn_stats = (typeof(op.p.bn_stats)){
        .b = pass->batch, .c = c, .s = spatial(l), .x = x, .sum = s->dev_sums, .sumsq = s->dev_sums + c};
    if (pass->batch > 0)
      backend_run(be, &op);
    else
      memset(s->sums, 0, (size_t)(2 * c) * sizeof(double)),
          be->to_device(be, s->dev_sums, s->sums, (size_t)(2 * c) * sizeof(double));
    be->to_host(be, s->sums, s->dev_sums, (size_t)(2 * c) * sizeof(double));
    s->sums[2 * c] = (double)(pass->batch * spatial(l));
    if (l->args.sync && pass->allreduce_sum) pass->allreduce_sum(pass->ctx, s->sums, (int)(2 * c + 1));
    double n = s->sums[2 * c];
    s->count = n;
    float m = (float)l->args.momentum;
    for (int64_t i = 0; i < c; i++) {
      double mu = n > 0 ? s->sums[i] / n : 0.0;
      double var = n > 0 ? s->sums[c + i] / n - mu * mu : 0.0;
      if (var < 0) var = 0;
      mean[i] = (float)mu;
      invstd[i] = (float)(1.0 / sqrt(var + l->args.eps));
      if (n > 0) {
        double unbiased = n > 1 ? var * n / (n - 1) : var;
        rm[i] = (1 - m) * rm[i] + m * (float)mu;
        rv[i] = (1 - m) * rv[i] + m * (float)unbiased;
      }
    }
    be->to_device(be, bufs_rm, rm, (size_t)c * sizeof(float));
    be->to_device(be, bufs_rv, rv, (size_t)c * sizeof(float));
  } else {
    for (int64_t i = 0; i < c; i++) {
      mean[i] = rm[i];
      invstd[i] = (float)(1.0 / sqrt((double)rv[i] + l->args.eps));
    }
  }
  be->to_device(be, s->mean, mean, (size_t)c * sizeof(float));
  be->to_device(be, s->invstd, invstd, (size_t)c * sizeof(float));
  const float *gamma = pass->params + l->tensors[0].offset, *beta = pass->params + l->tensors[1].offset;
  dt_op ap = {.type = DT_OP_BN_APPLY};
  ap.p.bn_apply = (typeof(ap.p.bn_apply)){.b = pass->batch,
                                          .c = c,
                                          .s = spatial(l),
                                          .x = x,
                                          .mean = s->mean,
                                          .invstd = s->invstd,
                                          .gamma = gamma,
                                          .beta = beta,
                                          .y = l->y};
  backend_run(be, &ap);
}

static void bn_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  bn_state *s = l->priv;
  dt_backend *be = pass->be;
  int64_t c = l->in.c;
  dt_op op = {.type = DT_OP_BN_BWD_STATS};
  op.p.bn_bwd_stats = (typeof(op.p.bn_bwd_stats)){.b = pass->batch,
                                                  .c = c,
                                                  .s = spatial(l),
                                                  .x = x,
                                                  .dy = l->dy,
                                                  .mean = s->mean,
                                                  .invstd = s->invstd,
                                                  .sum_dy = s->dev_sums,
                                                  .sum_dy_xhat = s->dev_sums + c};
  if (pass->batch > 0) {
    backend_run(be, &op);
    be->to_host(be, s->sums, s->dev_sums, (size_t)(2 * c) * sizeof(double));
  } else {
    memset(s->sums, 0, (size_t)(2 * c) * sizeof(double));
  }
  /* Parameter gradients use the local sums (the gradient allreduce sums them);
   * dx needs the global ones when statistics were global. */
  float *dgamma = pass->grads + l->tensors[0].offset, *dbeta = pass->grads + l->tensors[1].offset;
  float *hg = s->host_f, *hb = s->host_f + c;
  be->to_host(be, hg, dgamma, (size_t)c * sizeof(float));
  be->to_host(be, hb, dbeta, (size_t)c * sizeof(float));
  for (int64_t i = 0; i < c; i++) {
    hg[i] += (float)s->sums[c + i];
    hb[i] += (float)s->sums[i];
  }
  be->to_device(be, dgamma, hg, (size_t)c * sizeof(float));
  be->to_device(be, dbeta, hb, (size_t)c * sizeof(float));
  if (l->args.sync && pass->allreduce_sum) pass->allreduce_sum(pass->ctx, s->sums, (int)(2 * c));
  if (!dx || pass->batch == 0) return;
  be->to_device(be, s->dev_sums, s->sums, (size_t)(2 * c) * sizeof(double));
  dt_op ap = {.type = DT_OP_BN_BWD_APPLY};
  ap.p.bn_bwd_apply = (typeof(ap.p.bn_bwd_apply)){.b = pass->batch,
                                                  .c = c,
                                                  .s = spatial(l),
                                                  .count = s->count,
                                                  .x = x,
                                                  .dy = l->dy,
                                                  .mean = s->mean,
                                                  .invstd = s->invstd,
                                                  .gamma = pass->params + l->tensors[0].offset,
                                                  .sum_dy = s->dev_sums,
                                                  .sum_dy_xhat = s->dev_sums + c,
                                                  .dx = dx,
                                                  .dgamma = NULL,
                                                  .dbeta = NULL};
  backend_run(be, &ap);
}

static int64_t bn_flops(const dt_layer *l) {
  return 4 * shape_size(l->in);
}

const dt_layer_ops dt_layer_batchnorm = {.kind = "batchnorm",
                                         .keys = bn_keys,
                                         .n_keys = 3,
                                         .setup = bn_setup,
                                         .init = bn_init,
                                         .alloc = bn_alloc,
                                         .forward = bn_forward,
                                         .backward = bn_backward,
                                         .release = bn_release,
                                         .flops = bn_flops};
