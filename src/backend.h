/* backend.h: the op interface every backend implements (src/cpu/, src/cuda/).
 * Layers describe work as a dt_op (an op type plus its typed parameters) and hand it to
 * backend_run. Every pointer in an op is backend memory (host memory on the CPU), allocated
 * through the backend: ops read no host memory and write none, so a whole training step can be
 * queued (and captured as a CUDA graph) with no host synchronisation; host values go in through
 * upload() and come out through to_host().
 * Contract of backward ops: activation gradients (dx) are overwritten, parameter gradients
 * (dw, db, dgamma, dbeta) are added into, so gradient accumulation is a matter of not zeroing.
 * Sums outputs (loss, hits, sums of squares) are added into, so one buffer collects a step. */
#ifndef DT_BACKEND_H
#define DT_BACKEND_H

#include <stdint.h>

#include "common.h"
#include "attention_geom.h"
#include "half.h"
#include "hash.h"
#include "optim_runs.h"

/* Every op once, in the order of dt_op_type: X(NAME, name) for DT_OP_NAME, whose parameters are
 * the union member p.name and whose implementations are cpu_name (src/cpu/cpu.h) and cuda_name
 * (src/cuda/cuda_impl.h). The enum, dt_op_names and both backends' op tables are generated from
 * it, so a new op is a line here, a union member below and a function in each backend (a missing
 * one does not compile). */
// clang-format off
#define DT_OPS(X)                                                                                                      \
  X(GEMM, gemm)                       /* C(m,n) = alpha op(A) op(B) + beta C; row-major; `batch` such products         \
                                         when > 1 */                                                                   \
  X(BIAS_ADD, bias_add)               /* y(b,c,s) += bias(c) */                                                        \
  X(BIAS_GRAD, bias_grad)             /* db(c) += sum_{b,s} dy(b,c,s) */                                               \
  X(CONV_FWD, conv_fwd)               /* y(B,O,Ho,Wo) = x(B,C,H,W) * w(O,C,K,K) */                                     \
  X(CONV_BWD_DATA, conv_bwd_data)     /* dx(B,C,H,W) = convT(dy, w) */                                                 \
  X(CONV_BWD_FILTER, conv_bwd_filter) /* dw(O,C,K,K) += corr(x, dy) */                                                 \
  X(BN_STATS, bn_stats)               /* sum(c), sumsq(c) over (b,s), in double, and the count b*s */                  \
  X(BN_FINALIZE, bn_finalize)         /* mean, invstd from the sums (training, running statistics updated) or the      \
                                         running ones */                                                               \
  X(BN_APPLY, bn_apply)               /* y = (x - mean(c)) * invstd(c) * gamma(c) + beta(c) */                         \
  X(BN_BWD_STATS, bn_bwd_stats)       /* sum_dy(c), sum_dy_xhat(c) over (b,s), in double; added to dbeta, dgamma */    \
  X(BN_BWD_APPLY, bn_bwd_apply)       /* dx from the (reduced) sums */                                                 \
  X(ACT_FWD, act_fwd)                 /* y = f(x) */                                                                   \
  X(ACT_BWD, act_bwd)                 /* dx = f'(x) dy */                                                              \
  X(POOL_FWD, pool_fwd)               /* max or average pooling, NCHW */                                               \
  X(POOL_BWD, pool_bwd)                                                                                                \
  X(GAP16_FWD, gap16_fwd)             /* y(B,C) = the mean over s of x(B,S,C), 16-bit NHWC: a global average pool */   \
  X(GAP16_BWD, gap16_bwd)             /* dx(B,S,C) = dy(B,C) / S, rounded to 16 bits */                                \
  X(DROPOUT_FWD, dropout_fwd)         /* y = x * mask / (1-p); mask from a counter-based hash of (seed, element) */    \
  X(DROPOUT_BWD, dropout_bwd)                                                                                          \
  X(ADD, add)                         /* y = a + b */                                                                  \
  X(LOSS, loss)                       /* loss sums and dlogits, weighted by 1/global count */                          \
  X(SGD, sgd)                         /* one SGD step over a flat range */                                             \
  X(ADAMW, adamw)                     /* one AdamW step over a flat range */                                           \
  X(SCALE, scale)                     /* x *= alpha */                                                                 \
  X(SUMSQ, sumsq)                     /* out[0] += sum x^2 (double), out[1] += count of non-finite values */           \
  X(CLIP, clip)                       /* x *= max_norm / (sqrt(*sumsq) + 1e-6) when sqrt(*sumsq) > max_norm */         \
  X(COPY, copy)                       /* y = x */                                                                      \
  X(INPUT, input)                     /* x(b, c, s) = (raw * scale - mean(c)) / std(c) */                              \
  X(EMA, ema)                         /* ema = decay * ema + (1 - decay) * x, over a flat range */                     \
  X(UNSCALE, unscale)                 /* x /= scaler[0] (fp16 loss scaling) */                                         \
  X(SCALER_UPDATE, scaler_update)     /* the loss scale after a step, by GradScaler's rules */                         \
  X(GATHER, gather)                   /* out(n, row) = src rows idx[0..n), widened to float (data.cache device) */     \
  X(EMBED_FWD, embed_fwd)             /* y(N, D) = wte(tok[n]) + wpe(n % T) */                                         \
  X(EMBED_BWD, embed_bwd)             /* dwte(tok[n]) += dy(n), dwpe(n % T) += dy(n), summed in a fixed order */       \
  X(LN_FWD, ln_fwd)                   /* y(N, D) = (x - mean) * rstd * gamma + beta per row; mean, rstd (N) written */ \
  X(LN_BWD, ln_bwd)                   /* dx(N, D) overwritten; dgamma, dbeta (D) added, summed over rows               \
                                         in a fixed order */                                                           \
  X(SOFTMAX_FWD, softmax_fwd)         /* y(R, T) = softmax(scale * x) per row; causal: column                          \
                                         j > r % T is masked (y = 0) */                                                \
  X(SOFTMAX_BWD, softmax_bwd)         /* dx = scale * y * (dy - sum_j dy * y), per row */                              \
  X(PERMUTE, permute)                 /* y = x with its dims permuted: y's dim i is x's dim perm[i] */              \
  X(ATTENTION_FWD, attention_fwd)     /* o = dropout(softmax(scale q k^T)) v per head, the (T, T) scores never     \
                                         stored; lse kept for the backward */                                          \
  X(ATTENTION_BWD, attention_bwd)     /* dq, dk, dv of attention_fwd, its scores computed again */                  \
  X(WEIGHTS16, weights16)             /* the 16-bit copies of a model's weights that its GEMMs and convolutions     \
                                         read (model.c's weights16), all in one pass over a table */                   \
  X(GRADS16, grads16)                 /* the 16-bit filter gradients the convolutions left (conv_bwd_filter's dw16)  \
                                         added into the FP32 gradients, all in one pass over a table */
// clang-format on

typedef enum {
#define DT_OP_ENUM_(NAME, name) DT_OP_##NAME,
  DT_OPS(DT_OP_ENUM_)
#undef DT_OP_ENUM_
      DT_OP_COUNT
} dt_op_type;

enum { DT_GATHER_U8, DT_GATHER_F32, DT_GATHER_F64, DT_GATHER_I32 }; /* data.h's DT_X_* order, then int32 */
enum {
  DT_ACT_RELU,
  DT_ACT_GELU,
  DT_ACT_TANH,
  DT_ACT_SIGMOID,
  DT_ACT_GELU_TANH
}; /* GELU_TANH: PyTorch's approximate='tanh' */
/* A GEMM's epilogue (one product, beta 0): GELU_TANH: aux = op(A) op(B) + bias, C = gelu_tanh(aux);
 * DGELU_TANH (no bias): C = op(A) op(B) * gelu_tanh'(aux), a gelu's input gradient; RELU: C = relu(op(A)
 * op(B) + bias), no aux (the CPU's relu passes a NaN; cuBLASLt's max(x, 0) may give 0 for one). */
enum { DT_GEMM_PLAIN, DT_GEMM_GELU_TANH, DT_GEMM_DGELU_TANH, DT_GEMM_RELU };
/* A GEMM op's A as stored, row-major: its rows and its columns (op(A) is (m, k)). */
#define DT_GEMM_A_ROWS(g) ((g)->trans_a ? (g)->k : (g)->m)
#define DT_GEMM_A_COLS(g) ((g)->trans_a ? (g)->m : (g)->k)
/* Below this in any dimension a GEMM has no tensor-core tile to fill: the CUDA backend multiplies its FP32
 * operands under bf16 rather than copy them to bfloat16 (src/cuda/gemm.c). */
enum { DT_GEMM16_MIN_DIM = 16 };
enum { DT_POOL_MAX, DT_POOL_AVG };
enum { DT_LOSS_CROSS_ENTROPY, DT_LOSS_MSE };
enum { DT_DISTILL_NONE, DT_DISTILL_KL, DT_DISTILL_MSE }; /* distill.loss: how a teacher's logits join the loss */

typedef struct {
  int64_t b, c, h, w; /* input (B,C,H,W) */
  int64_t o, k, stride, pad;
  int64_t ho, wo; /* output spatial size */
} dt_conv_geom;

/* Pooling forward and backward: one geometry, each op reading the pointers it needs. */
typedef struct {
  int kind; /* DT_POOL_MAX or DT_POOL_AVG */
  int64_t b, c, h, w, k, stride, ho, wo;
  const float *x, *dy;
  float *y, *dx;
  int32_t *argmax; /* max pooling only, (B,C,Ho,Wo): written forward, read backward; each the index of its
                      window's maximum in its (H, W) plane */
  int nhwc16;      /* 0, or half.h's DT_F16_* (max pooling; CUDA under bf16 and fp16, between a batchnorm's y16
                      and a conv2d's in16): x and dx in that format as (B, H, W, C), y and dy as (B, Ho, Wo, C),
                      and argmax as (B, Ho, Wo, C) */
} dt_pool_args;

/* Batch statistics from bn_stats' sums (the bn_finalize op, or bn_stats' own finalize). */
typedef struct {
  int64_t c;
  int training;
  float momentum, eps;
  const double *sums;                /* (2C + 1) of bn_stats (reduced over ranks when sync); training only */
  float *mean, *invstd;              /* (C), written */
  float *running_mean, *running_var; /* (C): updated in training (unbiased variance), read otherwise */
} dt_bn_finalize_args;

typedef struct {
  dt_op_type type;
  union {
    struct {
      int trans_a, trans_b;
      int64_t m, n, k;
      float alpha, beta;
      const float *a, *b;
      float *c;
      int64_t batch;                        /* 0 or 1: one product; else product i uses a + i * stride_a, ... */
      int64_t stride_a, stride_b, stride_c; /* elements between consecutive products (batch > 1) */
      const float *bias;                    /* NULL, or (n): then C = alpha op(A) op(B) + bias on each row
                                               (one product, beta 0): the CPU starts C at the bias */
      int epilogue; /* DT_GEMM_*: a gelu or a relu applied to C as it is written, or a gelu's derivative */
      float *aux;   /* (m, n), the gelu's input: written by GELU_TANH, read by DGELU_TANH; RELU: unused */
      int c16;      /* 0, or half.h's DT_F16_BF16 (the CUDA backend under bf16): C written in bfloat16 as rows of
                       dt_ld16(n) values, their padding left as it is (a loss's logits16, a linear's y16); one
                       product, beta 0, no relu epilogue. With a bias, it is rounded to bfloat16 first (as
                       autocast casts it); a gelu epilogue's aux is in C's format and rows too, written rounded
                       from the same FP32 sum as the gelu (GELU_TANH) or read (DGELU_TANH) */
      int a16;      /* 0, or A stored so already (rows of dt_ld16 of its stored columns: a loss's 16-bit dlogits, a
                       linear's 16-bit dy or x), read as it is; one product */
      int b16;      /* 0, or B stored so already (a linear's 16-bit x, the B of its weight gradient; its weight's copy
                       in the model's weights16, the B of its forward and input gradient); one product */
      float *a_col_sums;   /* NULL, or (A's stored columns): += the sums of A's columns as stored (a16: of its
                              bfloat16 values), in double, as bias_grad's (a dense layer's bias gradient, from the
                              dy its weight gradient reads: CUDA under bf16 sums it as it copies dy to bfloat16);
                              one product */
      const float *relu_y; /* NULL, or (A as stored) a fused relu's output: A (then writable: a dense layer's dy)
                              is first set to +0 in place where relu_y is not positive, the relu's backward, and
                              the sums and the product read it so (CUDA in FP32 masks and sums in one pass); one
                              product, no a16 */
    } gemm;
    struct {
      int64_t b, c, s;
      float *y;
      const float *bias;
    } bias_add;
    struct {
      int64_t b, c, s;
      const float *dy;
      float *db;
    } bias_grad;
    struct {
      dt_conv_geom g;
      const float *x, *w;
      float *y;
      void *x16; /* NULL, or where a backend that convolves 16-bit copies (CUDA under bf16, fp16) leaves
                    x's, (B, C, H, W) as NHWC, for conv_bwd_filter of the same x */
      int y16;   /* 0 (y FP32), or half.h's DT_F16_*: y is written in that format as (B, Ho, Wo, O), NHWC, as
                    cuDNN computes it (CUDA: the precision's format), for a batchnorm's x16 */
      int in16;  /* 0, or x is in that format as (B, H, W, C) already (a batchnorm's y16, or the input op's x16):
                    read as it is, no x16 copy; so for conv_bwd_filter's x and conv_bwd_data's dx */
      int w16;   /* 0, or w is the weights' copy in that format as (O, K, K, C) (the model's weights16, made by
                    the weights16 op; the backend's format): read as it is, no copy; so for conv_bwd_data */
    } conv_fwd;
    struct {
      dt_conv_geom g;
      const float *dy, *w;
      float *dx;
      int dy16; /* 0 (dy FP32), or dy's 16-bit format as (B, Ho, Wo, O): conv_fwd's y16, a batchnorm's dx */
      int in16; /* as conv_fwd's: dx written so */
      int w16;  /* as conv_fwd's */
    } conv_bwd_data;
    struct {
      dt_conv_geom g;
      const float *x, *dy;
      float *dw;
      const void *x16; /* NULL, or conv_fwd's x16 of this x, read instead of copying x again */
      int dy16;        /* as conv_bwd_data's */
      int in16;        /* as conv_fwd's: x read so */
      int dw16;        /* 0 (added into dw), or the gradient is written, not added, as (O, K, K, C) in that 16-bit
                          format (the backend's) at dw: the model's grads16, which the grads16 op adds into the FP32
                          gradients (one launch for many convolutions, where each widened its own) */
    } conv_bwd_filter;
    struct {
      int64_t b, c, s;
      const float *x;
      double *sums; /* (2C + 1): sum(c), sumsq(c), then the count b * s */
      const dt_bn_finalize_args *finalize; /* NULL, or (training, statistics not synchronised over ranks) the
                                              bn_finalize of these sums, run by the same op */
      int x16;      /* 0: x (B, C, S) FP32; half.h's DT_F16_*: x in that format as (B, S, C), NHWC (a conv_fwd's
                       y16), and so is bn_bwd_apply's dx; y and dy stay FP32 (B, C, S) */
    } bn_stats;
    dt_bn_finalize_args bn_finalize;
    struct {
      int64_t b, c, s;
      int relu; /* y = relu(z): the relu that follows, fused (model.fuse) */
      const float *x, *mean, *invstd, *gamma, *beta;
      float *y; /* z = (x - mean) * (invstd * gamma) + beta, in that order of roundings */
      int x16;  /* as bn_stats' */
      int y16;  /* 0, or (with x16, the same format) y written as x is, 16-bit NHWC, for a conv_fwd's in16 */
    } bn_apply;
    struct {
      int64_t b, c, s;
      int relu; /* dy is the fused relu's output gradient: masked where z (recomputed from x) <= 0 */
      const float *x, *dy, *mean, *invstd;
      const float *gamma, *beta; /* (C): read when relu */
      double *sums;              /* (2C): sum_dy(c), sum_dy_xhat(c), written */
      float *dgamma, *dbeta;     /* (C): the local sums added (the gradient allreduce sums them) */
      int x16;                   /* as bn_stats' */
      int dy16;                  /* 0, or (with x16) dy is as x is: bn_apply's y16 */
    } bn_bwd_stats;
    struct {
      int64_t b, c, s;
      int relu;            /* as bn_bwd_stats */
      const double *count; /* the forward's count (sums[2C] of bn_stats): global when statistics were */
      const float *x, *dy, *mean, *invstd, *gamma;
      const float *beta;  /* (C): read when relu */
      const double *sums; /* (2C) of bn_bwd_stats, reduced over ranks when sync */
      float *dx;          /* (B, C, S) FP32, or as x when x16: rounded to nearest even */
      int x16;            /* as bn_stats' */
      int dy16;           /* as bn_bwd_stats' */
    } bn_bwd_apply;
    struct {
      int kind;
      int64_t n;
      const float *x;
      float *y;
    } act_fwd;
    struct {
      int kind;
      int64_t n;
      const float *x, *y, *dy;
      float *dx;
      int h16; /* 0, or half.h's DT_F16_* (relu only): x, y, dy and dx hold n 16-bit values in that format */
    } act_bwd;
    dt_pool_args pool_fwd; /* x -> y (and argmax) */
    dt_pool_args pool_bwd; /* dy (and argmax) -> dx */
    struct {
      int64_t b, s, c;
      int format;    /* half.h's DT_F16_* of x */
      const void *x; /* (B, S, C) 16-bit: a residual's 16-bit sums */
      float *y;      /* (B, C) FP32: (sum over s, in order, of x) / S */
    } gap16_fwd;
    struct {
      int64_t b, s, c;
      int format;
      const float *dy; /* (B, C) FP32 */
      void *dx;        /* (B, S, C) 16-bit: dy / S rounded to nearest even */
    } gap16_bwd;
    struct {
      int64_t n;
      float p;
      uint64_t seed;             /* the layer's part of the mask's seed */
      const uint64_t *step_seed; /* (1): the micro-batch's part, mixed in as dt_hash64(seed ^ *step_seed) */
      const float *x;
      float *y;
    } dropout_fwd;
    struct {
      int64_t n;
      float p;
      uint64_t seed;
      const uint64_t *step_seed;
      const float *dy;
      float *dx;
    } dropout_bwd;
    struct {
      int64_t n;
      const float *a, *b;
      float *y;
      int relu; /* y = relu(a + b): the relu after a residual, fused (model.fuse); NaN passes, as act_fwd's */
      int h16;  /* 0, or half.h's DT_F16_*: a, b and y hold n 16-bit values in that format (a residual's 16-bit
                   NHWC sums), added in FP32 and rounded to nearest even */
    } add;
    struct {
      int kind;
      int64_t b, k;
      float label_smoothing;
      int ignore; /* cross_entropy: rows labelled ignore_index add no loss, hit or gradient */
      int32_t ignore_index;
      double weight;            /* 1/global count */
      const double *weight_dev; /* (1) or NULL: the weight, read when the op runs (a captured step replays with
                                   the value uploaded for it) */
      const float *grad_scale;  /* (1) or NULL: dlogits also multiplied by it (fp16 loss scaling) */
      const float *logits;
      const int32_t *labels;
      const float *targets;
      float *dlogits;
      double *sums; /* (2): += sum of per-sample losses, += hits */
      /* distillation (distill != DT_DISTILL_NONE): each row's loss is (1 - alpha) own + alpha d, where d is
         T^2 KL(softmax(teacher / T) || softmax(logits / T)) (kl) or mean_k (logits - teacher)^2 (mse); rows
         cross_entropy ignores add neither */
      int distill;
      float alpha, temperature;
      const float *teacher; /* (b, k) the teacher's logits */
      int logits16;         /* 0, or DT_F16_BF16: logits and dlogits in bfloat16, rows of dt_ld16(k) values whose
                               padding is left as it is (a GEMM's c16 and, for the backward, its a16); the
                               targets and the teacher's logits stay FP32 */
    } loss;
    struct {
      int64_t n;
      float momentum, weight_decay;
      int nesterov;
      const float *
          hyper; /* (2): lr, and 1 on the first step (the momentum buffer starts as the gradient), uploaded each step */
      const double *skip; /* (1) or NULL: no update when it is above 0 (an fp16 step that overflowed) */
      double *nonfinite;  /* (1) or NULL: the count of grad's non-finite values is added to it (a rank alone
                             checks its gradients as it steps, not in a pass of their own) */
      float *param;
      const float *grad;
      float *mom;
      const dt_decay_run *runs; /* NULL: weight_decay on every value; else (n_runs, backend memory, the first at
                                   0, in order) each run's own, in one pass over all of them */
      int n_runs;
    } sgd;
    struct {
      int64_t n;
      float beta1, beta2, eps, weight_decay;
      const float *hyper; /* (3): lr, lr / (1 - beta1^t), sqrt(1 - beta2^t) for step t, uploaded each step */
      const double *skip; /* (1) or NULL: as sgd's */
      double *nonfinite;  /* (1) or NULL: as sgd's */
      float *param;
      const float *grad;
      float *m, *v;
      const dt_decay_run *runs; /* as sgd's */
      int n_runs;
    } adamw;
    struct {
      int64_t n;
      float alpha;
      float *x;
    } scale;
    struct {
      int64_t n;
      const float *x;
      double *out; /* (2): += sum x^2, += count of non-finite values */
    } sumsq;
    struct {
      int64_t n;
      float max_norm;
      const double *sumsq; /* (1) */
      float *x;
    } clip;
    struct {
      int64_t n;
      const float *scaler; /* (2): the loss scale, good steps */
      float *x;
    } unscale;
    struct {
      const double *overflow; /* (1): non-finite gradient values after unscaling */
      int64_t growth_interval;
      float growth, backoff;
      float *scaler; /* (2): scale *= backoff and good steps = 0 after an overflow; else good steps + 1, and at
                        growth_interval scale *= growth (unless that overflows) and good steps = 0 */
    } scaler_update;
    struct {
      int64_t n, row; /* rows taken, values per row */
      int type;       /* DT_GATHER_*: src's type; out is float, or int32 for DT_GATHER_I32 */
      const void *src;
      const int32_t *idx; /* (n) row numbers in src */
      void *out;
    } gather;
    struct {
      int64_t n;
      const float *x;
      float *y;
    } copy;
    struct {
      const float *params;      /* flat: the weights as they are now */
      uint16_t *w16;            /* their copies, each at its entry's dst */
      const dt_weight16 *table; /* (n) in order of row0 */
      int n;
      int64_t rows; /* the entries' rows, all together */
    } weights16;
    struct {
      float *grads;             /* flat: the FP32 gradients, each entry's added into at its src */
      const uint16_t *g16;      /* the 16-bit gradients, each at its entry's dst (the model's grads16) */
      const dt_weight16 *table; /* (n) consecutive entries of a weights16 table; those without grad skipped */
      int n;
      int64_t rows; /* the entries' rows, all together: from table[0].row0 */
    } grads16;
    struct {
      int64_t n, t, d, vocab; /* n = B * T rows */
      const float *tokens;    /* (N) token ids as floats, each in [0, vocab) (checked when the data is read) */
      const float *wte;       /* (vocab, D) */
      const float *wpe;       /* (T, D) or NULL: no positions */
      float *y;               /* (N, D) */
    } embed_fwd;
    struct {
      int64_t n, t, d, vocab;
      const float *tokens, *dy; /* (N), (N, D) */
      float *dwte, *dwpe;       /* added into; dwpe NULL when there are no positions */
    } embed_bwd;
    struct {
      int64_t n, d;
      float eps;
      const float *x, *gamma, *beta; /* (N, D), (D), (D) */
      float *y;                      /* (N, D) */
      float *mean, *rstd;            /* (N), written for the backward */
      int y16; /* 0, or DT_F16_BF16 (CUDA under bf16): y written in bfloat16 rows of dt_ld16(D) values, rounded
                  once from the FP32 value (a layernorm before a linear or attention layer reading it so) */
    } ln_fwd;
    struct {
      int64_t n, d;
      const float *x, *dy, *gamma, *mean, *rstd;
      int dy16;              /* 0, or DT_F16_BF16: dy in bfloat16 rows of dt_ld16(D) values (that layer's 16-bit dx) */
      float *dx;             /* (N, D) overwritten; NULL: only the parameter gradients */
      const float *dx_add;   /* (N, D) or NULL: added to dx as it is written, each value rounded first (a
                                residual's gradient through its identity shortcut) */
      float *dgamma, *dbeta; /* (D) added into */
    } ln_bwd;
    struct {
      int64_t rows, t; /* rows of t values; causal rows are (., T, T) score matrices */
      int causal;
      float scale;
      const float *x;
      float *y;
    } softmax_fwd;
    struct {
      int64_t rows, t;
      int causal;
      float scale;
      const float *y, *dy;
      float *dx; /* overwritten */
    } softmax_bwd;
    struct {
      int ndim;        /* 2..5 */
      int64_t dims[5]; /* x's dims, row-major */
      int perm[5];     /* y's dim i is x's dim perm[i] */
      const float *x;
      float *y;
    } permute;
    struct {
      dt_attention_geom g;
      const float *q, *k, *v; /* as the geometry says */
      float *o;
      float *lse; /* (B, H, T): log of each row's sum of exp(scale q k^T), for the backward */
    } attention_fwd;
    struct {
      dt_attention_geom g;
      const float *q, *k, *v, *o, *lse, *dout; /* the forward's inputs and outputs; dout as o */
      float *delta;                            /* (B, H, T) scratch: each row's dout . o */
      float *dq, *dk, *dv;                     /* as q, k, v; overwritten */
    } attention_bwd;
    struct {
      int64_t b, c, s;
      float scale;
      const float *mean, *std; /* (C); NULL: none */
      const float *raw;
      float *x;
      int x16; /* 0, or (CUDA) half.h's format: x written as 16-bit NHWC (B, S, C), rounded to nearest even,
                  for a first conv2d that reads it so (its in16; model.c's pick_input16) */
    } input;
    struct {
      int64_t n;
      float decay;
      const float *x;
      float *ema;
    } ema;
  } p;
} dt_op;

/* The op names ("gemm", ...), indexed by dt_op_type: DT_OPS's second column (src/cpu/backend.c). */
extern const char *const dt_op_names[DT_OP_COUNT];

typedef struct dt_backend dt_backend;
struct dt_backend {
  const char *name;
  void (*run)(dt_backend *be, const dt_op *op);
  float *(*alloc)(dt_backend *be, size_t bytes); /* zeroed; aborts on failure naming the size */
  void (*free)(dt_backend *be, void *p);
  /* Synchronous copies (they wait for queued work): for start-up, checkpoints, evaluation. */
  void (*to_device)(dt_backend *be, void *dst, const void *src, size_t bytes);
  void (*to_host)(dt_backend *be, void *dst, const void *src, size_t bytes);
  /* Queued host-to-device copy: src may be reused as soon as it returns. */
  void (*upload)(dt_backend *be, void *dst, const void *src, size_t bytes);
  /* The same, overlapping work already queued (CUDA: on a copy stream): only into memory that no
   * queued work uses (the caller has waited for its last reader); work queued after it sees it. */
  void (*upload_ahead)(dt_backend *be, void *dst, const void *src, size_t bytes);
  /* Queued device-to-host copy into dst (memory from alloc_host), valid once the work queued
   * before a later mark() has been reached(). */
  void (*download)(dt_backend *be, void *dst, const void *src, size_t bytes);
  /* Marks the work queued so far as step `slot`'s (0 or 1: a step may be queued while the one
   * before still runs); reached(slot) is 1 once all of it has completed (never blocks). Marking a
   * slot again moves its mark. The CPU's work is done when queued. */
  void (*mark)(dt_backend *be, int slot);
  int (*reached)(dt_backend *be, int slot);
  /* Host memory the device copies to and from asynchronously (pinned on CUDA). */
  void *(*alloc_host)(dt_backend *be, size_t bytes);
  void (*free_host)(dt_backend *be, void *p);
  void (*zero)(dt_backend *be, void *p, size_t bytes); /* queued */
  /* Work capture (CUDA graphs); NULL where the backend has none. Between capture_begin and
   * capture_end, queued work (ops, zero, device collectives on `stream`) is recorded, not run;
   * capture_end returns it as a graph, which replay queues again as one piece of work, reading
   * memory as it is then. A graph keeps the pointers it was captured with: one captured before
   * `generation` last changed must not be replayed. graph_free waits for queued work first. */
  void (*capture_begin)(dt_backend *be);
  void *(*capture_end)(dt_backend *be);
  void (*replay)(dt_backend *be, void *graph);
  void (*graph_free)(dt_backend *be, void *graph);
  void (*sync)(dt_backend *be);
  void (*destroy)(dt_backend *be);
  /* What the backend chose since the last call, a line each, for the log (CUDA: each new
   * convolution's cuDNN algorithms), or NULL; the caller frees it. NULL where it has none. */
  char *(*take_notes)(dt_backend *be);
  /* The bytes of scratch the backend will hold to run ops[0..n) (described, not run: their pointers
   * are not read): each of its scratch buffers at the most any of them needs (the CPU's oneDNN
   * blocked copies and scratchpads or im2col columns; the CUDA backend's cuDNN workspace, 16-bit
   * convolution and GEMM operands and partial sums). Plans made to answer (primitives, algorithms) are kept
   * for the run; nothing is allocated. */
  size_t (*scratch)(dt_backend *be, const dt_op *ops, int n);
  int threads;
  int host_memory;    /* buffers are host memory (CPU): MPI can use them directly */
  void *stream;       /* the backend's work queue for device collectives (a cudaStream_t); NULL on the CPU */
  int64_t generation; /* bumped when the backend moves an internal buffer: captured work must be captured again */
  /* Device memory allocated on the backend's device (bytes as requested): every buffer, workspace
   * and scratch of the backend, and what others allocate there and count (backend_count_device),
   * now and at most since the backend was made. Zero on the CPU, whose buffers are host memory (a
   * run measures its process there: memory.h). */
  size_t mem_used, mem_peak;
  void *impl;
};

/* Counts bytes allocated (bytes > 0) or freed (bytes < 0) on the backend's device. */
static inline void backend_count_device(dt_backend *be, int64_t bytes) {
  be->mem_used = (size_t)((int64_t)be->mem_used + bytes);
  if (be->mem_used > be->mem_peak) be->mem_peak = be->mem_used;
}

static inline void backend_run(dt_backend *be, const dt_op *op) {
  be->run(be, op);
}

/* Queues y = x over n floats (backend memory). */
static inline void backend_copy(dt_backend *be, float *y, const float *x, int64_t n) {
  dt_op op = {.type = DT_OP_COPY, .p.copy = {.n = n, .x = x, .y = y}};
  backend_run(be, &op);
}

/* The CPU backend's convolutions: im2col + GEMM for all (the reference the tests compare oneDNN's
 * with); oneDNN's direct ones where it has them (cpu/dnnl.c); or also its Winograd for 3x3 stride 1
 * (train.conv_algo auto). */
enum { DT_CPU_CONV_IM2COL, DT_CPU_CONV_DIRECT, DT_CPU_CONV_WINOGRAD };
/* CPU backend with `threads` threads for BLAS and loops. Caller owns; destroy frees.
 * backend_cpu_create: DT_CPU_CONV_DIRECT. */
dt_backend *backend_cpu_create(int threads);
dt_backend *backend_cpu_create_with(int threads, int conv);
/* The convolutions a CPU backend has run through oneDNN, and those of them by Winograd. */
int64_t backend_cpu_onednn_runs(const dt_backend *be);
int64_t backend_cpu_winograd_runs(const dt_backend *be);
/* Input reorders its convolutions skipped, reusing the blocked copy the convolution before made. */
int64_t backend_cpu_reorders_saved(const dt_backend *be);

/* CUDA backend on visible device `device` (src/cuda/; only in CUDA builds). */
dt_backend *backend_cuda_create(int device, int precision);
/* 16-bit packs of dy its backward-data convolutions skipped, reusing the backward filter's before. */
int64_t backend_cuda_dy16_reuses(const dt_backend *be);
/* Bias gradients summed as their dy was copied to bfloat16 (gemm.a_col_sums under bf16). */
int64_t backend_cuda_col_sums_copied(const dt_backend *be);
/* GEMMs whose bias, gelu or relu cuBLASLt's epilogue applied (the others run them as kernels). */
int64_t backend_cuda_gemm_epilogues(const dt_backend *be);

#endif
