/* layer_norm.c: batchnorm{momentum, eps, sync} over (B, C, H, W) per channel, or (B, D) per feature;
 * layernorm{eps} over the last dim of each row ((B, D), or (B, T, D) per position).
 * Tensors as PyTorch: weight, bias (params); running_mean, running_var (batchnorm's buffers).
 * Training normalises with the batch statistics (biased variance) and updates the running ones
 * with the unbiased variance; sync: true reduces the sums over all ranks in forward and backward. */
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
  float *mean, *invstd; /* (C): what forward used */
  double *stats;        /* (2C + 1): forward sums and count, reduced over ranks when sync */
  double *grad_sums;    /* (2C): backward sums */
} bn_state;             /* all backend memory: the step never reads them on the host */

/* Both norms: out = in, an affine weight and bias per channel (C); exit 2 with `refusal` for an
 * input of rank `refused`. */
static int affine_setup(dt_layer *l, int refused, const char *refusal, dt_status *st) {
  if (l->in.rank == refused) return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s %s", l->where, l->name, refusal);
  l->out = l->in;
  int64_t c = l->in.c;
  layer_add_tensor(l, "weight", 0, 1, &c);
  layer_add_tensor(l, "bias", 0, 1, &c);
  return 0;
}

static int bn_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  if (affine_setup(l, 2, "batchnorm: the input is a sequence; use layernorm", st)) return st->code;
  int64_t c = l->in.c;
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

/* Per channel, from backend memory (not activation memory): train.recompute's second forward
 * reuses mean and invstd. */
static void bn_alloc(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch) {
  (void)acts;
  (void)max_batch;
  int64_t c = l->in.c;
  bn_state *s = dt_calloc(1, sizeof *s);
  s->mean = be->alloc(be, (size_t)c * sizeof(float));
  s->invstd = be->alloc(be, (size_t)c * sizeof(float));
  s->stats = (double *)be->alloc(be, (size_t)(2 * c + 1) * sizeof(double));
  s->grad_sums = (double *)be->alloc(be, (size_t)(2 * c) * sizeof(double));
  l->priv = s;
}

static void bn_release(dt_layer *l, dt_backend *be) {
  bn_state *s = l->priv;
  if (!s) return;
  be->free(be, s->mean);
  be->free(be, s->invstd);
  be->free(be, s->stats);
  be->free(be, s->grad_sums);
}

static int64_t spatial(const dt_layer *l) {
  return l->in.h * l->in.w;
}

static void bn_apply(dt_layer *l, dt_pass *pass, const float *x) {
  bn_state *s = l->priv;
  dt_op ap = {.type = DT_OP_BN_APPLY,
              .p.bn_apply = {.relu = l->fused_relu,
                             .b = pass->batch,
                             .c = l->in.c,
                             .s = spatial(l),
                             .x = x,
                             .x16 = l->x16,
                             .y16 = l->y16,
                             .mean = s->mean,
                             .invstd = s->invstd,
                             .gamma = pass->params + l->tensors[0].offset,
                             .beta = pass->params + l->tensors[1].offset,
                             .y = l->y}};
  backend_run(pass->be, &ap);
}

/* Under train.recompute, the second forward applies the first one's mean and invstd: the running
 * statistics are not updated twice, nor are synchronised sums reduced again. */
static void bn_forward(dt_layer *l, dt_pass *pass, const float *x) {
  bn_state *s = l->priv;
  dt_backend *be = pass->be;
  int64_t c = l->in.c;
  if (pass->recomputing) {
    bn_apply(l, pass, x);
    return;
  }
  const dt_bn_finalize_args fin = {.c = c,
                                   .training = pass->training,
                                   .momentum = (float)l->args.momentum,
                                   .eps = (float)l->args.eps,
                                   .sums = s->stats,
                                   .mean = s->mean,
                                   .invstd = s->invstd,
                                   .running_mean = pass->bufs + l->tensors[2].offset,
                                   .running_var = pass->bufs + l->tensors[3].offset};
  const int sync = l->args.sync && pass->allreduce_sum;
  if (pass->training) { /* local statistics: finalized by the op that sums them (one kernel fewer on CUDA) */
    dt_op op = {.type = DT_OP_BN_STATS,
                .p.bn_stats = {.b = pass->batch,
                               .c = c,
                               .s = spatial(l),
                               .x = x,
                               .x16 = l->x16,
                               .sums = s->stats,
                               .finalize = sync ? NULL : &fin}};
    backend_run(be, &op);
    if (sync) pass->allreduce_sum(pass->ctx, s->stats, (int)(2 * c + 1));
  }
  if (!pass->training || sync) {
    dt_op op = {.type = DT_OP_BN_FINALIZE, .p.bn_finalize = fin};
    backend_run(be, &op);
  }
  bn_apply(l, pass, x);
}

/* Parameter gradients take the local sums (the gradient allreduce sums them); dx needs the
 * global ones when the statistics were global. */
static void bn_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  bn_state *s = l->priv;
  dt_backend *be = pass->be;
  int64_t c = l->in.c;
  dt_op op = {.type = DT_OP_BN_BWD_STATS,
              .p.bn_bwd_stats = {.b = pass->batch,
                                 .c = c,
                                 .s = spatial(l),
                                 .relu = l->fused_relu,
                                 .x = x,
                                 .x16 = l->x16,
                                 .dy16 = l->y16,
                                 .dy = l->dy,
                                 .mean = s->mean,
                                 .invstd = s->invstd,
                                 .gamma = pass->params + l->tensors[0].offset,
                                 .beta = pass->params + l->tensors[1].offset,
                                 .sums = s->grad_sums,
                                 .dgamma = pass->grads + l->tensors[0].offset,
                                 .dbeta = pass->grads + l->tensors[1].offset}};
  backend_run(be, &op);
  if (l->args.sync && pass->allreduce_sum) pass->allreduce_sum(pass->ctx, s->grad_sums, (int)(2 * c));
  if (!dx) return;
  dt_op ap = {.type = DT_OP_BN_BWD_APPLY,
              .p.bn_bwd_apply = {.b = pass->batch,
                                 .c = c,
                                 .s = spatial(l),
                                 .relu = l->fused_relu,
                                 .count = s->stats + 2 * c,
                                 .x = x,
                                 .x16 = l->x16,
                                 .dy16 = l->y16,
                                 .dy = l->dy,
                                 .mean = s->mean,
                                 .invstd = s->invstd,
                                 .gamma = pass->params + l->tensors[0].offset,
                                 .beta = pass->params + l->tensors[1].offset,
                                 .sums = s->grad_sums,
                                 .dx = dx}};
  backend_run(be, &ap);
}

static int64_t bn_flops(const dt_layer *l) {
  return 4 * shape_size(l->in);
}

const dt_layer_ops dt_layer_batchnorm = {.kind = "batchnorm",
                                         .traits = DT_LAYER_NORM | DT_LAYER_FUSES_RELU | DT_LAYER_BATCHNORM,
                                         .keys = bn_keys,
                                         .n_keys = 3,
                                         .setup = bn_setup,
                                         .init = bn_init,
                                         .alloc = bn_alloc,
                                         .forward = bn_forward,
                                         .backward = bn_backward,
                                         .release = bn_release,
                                         .flops = bn_flops};

static const dt_key ln_keys[] = {
    {"eps", DT_KEY_FLOAT, A(eps), "1e-5", 0, 1, NULL, "added to the variance"},
};

typedef struct {
  float *mean, *rstd; /* (max_batch * rows per sample): what forward used, for backward */
} ln_state;

static int ln_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  return affine_setup(l, 3, "layernorm: expects vectors or a sequence, got an image", st);
}

static void ln_init(dt_layer *l, float *params, float *bufs, uint64_t seed) {
  (void)bufs;
  (void)seed;
  for (int64_t i = 0; i < l->in.c; i++) {
    params[l->tensors[0].offset + i] = 1.0f;
    params[l->tensors[1].offset + i] = 0.0f;
  }
}

static void ln_alloc(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch) {
  (void)be;
  ln_state *s = dt_calloc(1, sizeof *s);
  l->priv = s;
  size_t bytes = (size_t)shape_rows(l->in, max_batch) * sizeof(float);
  acts_take(acts, &s->mean, bytes);
  acts_take(acts, &s->rstd, bytes);
}

static void ln_forward(dt_layer *l, dt_pass *pass, const float *x) {
  ln_state *s = l->priv;
  dt_op op = {.type = DT_OP_LN_FWD,
              .p.ln_fwd = {.n = shape_rows(l->in, pass->batch),
                           .d = l->in.c,
                           .eps = (float)l->args.eps,
                           .x = x,
                           .gamma = pass->params + l->tensors[0].offset,
                           .beta = pass->params + l->tensors[1].offset,
                           .y = l->y,
                           .mean = s->mean,
                           .rstd = s->rstd,
                           .y16 = l->y16}};
  backend_run(pass->be, &op);
}

static void ln_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  ln_state *s = l->priv;
  dt_op op = {.type = DT_OP_LN_BWD,
              .p.ln_bwd = {.n = shape_rows(l->in, pass->batch),
                           .d = l->in.c,
                           .x = x,
                           .dy = l->dy,
                           .gamma = pass->params + l->tensors[0].offset,
                           .mean = s->mean,
                           .rstd = s->rstd,
                           .dx = dx,
                           .dx_add = dx && l->dx_adds ? l->dx_adds->dy : NULL,
                           .dgamma = pass->grads + l->tensors[0].offset,
                           .dbeta = pass->grads + l->tensors[1].offset,
                           .dy16 = l->y16}};
  backend_run(pass->be, &op);
}

static void ln_memory(const dt_layer *l, int64_t batch, int threads, dt_memory *mem) {
  (void)threads;
  mem->activations += 2 * (size_t)shape_rows(l->in, batch) * sizeof(float);
}

const dt_layer_ops dt_layer_layernorm = {.kind = "layernorm",
                                         .traits = DT_LAYER_NORM | DT_LAYER_ADDS_DX,
                                         .keys = ln_keys,
                                         .n_keys = 1,
                                         .setup = ln_setup,
                                         .init = ln_init,
                                         .alloc = ln_alloc,
                                         .forward = ln_forward,
                                         .backward = ln_backward,
                                         .flops = bn_flops,
                                         .memory = ln_memory};
