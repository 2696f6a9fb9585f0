/* backend.h: the op interface every backend implements (CPU now, CUDA in backend_cuda.c).
 * Layers describe work as a dt_op (an op type plus its typed parameters) and hand it to
 * backend_run; a backend implements the whole op set in one switch. Buffers are backend memory
 * (host memory on the CPU), allocated once at start-up through the backend.
 * Contract of backward ops: activation gradients (dx) are overwritten, parameter gradients
 * (dw, db, dgamma, dbeta) are added into, so gradient accumulation is a matter of not zeroing. */
#ifndef DT_BACKEND_H
#define DT_BACKEND_H

#include <stdint.h>

#include "common.h"
#include "hash.h"

typedef enum {
  DT_OP_GEMM,            /* C(m,n) = alpha op(A) op(B) + beta C; row-major */
  DT_OP_BIAS_ADD,        /* y(b,c,s) += bias(c) */
  DT_OP_BIAS_GRAD,       /* db(c) += sum_{b,s} dy(b,c,s) */
  DT_OP_CONV_FWD,        /* y(B,O,Ho,Wo) = x(B,C,H,W) * w(O,C,K,K) */
  DT_OP_CONV_BWD_DATA,   /* dx(B,C,H,W) = convT(dy, w) */
  DT_OP_CONV_BWD_FILTER, /* dw(O,C,K,K) += corr(x, dy) */
  DT_OP_BN_STATS,        /* sum(c), sumsq(c) over (b,s), in double */
  DT_OP_BN_APPLY,        /* y = (x - mean(c)) * invstd(c) * gamma(c) + beta(c) */
  DT_OP_BN_BWD_STATS,    /* sum_dy(c), sum_dy_xhat(c) over (b,s), in double */
  DT_OP_BN_BWD_APPLY,    /* dx from the reduced sums; dgamma, dbeta added */
  DT_OP_ACT_FWD,         /* y = f(x) */
  DT_OP_ACT_BWD,         /* dx = f'(x) dy */
  DT_OP_POOL_FWD,        /* max or average pooling, NCHW */
  DT_OP_POOL_BWD,
  DT_OP_DROPOUT_FWD, /* y = x * mask / (1-p); mask from a counter-based hash of (seed, element) */
  DT_OP_DROPOUT_BWD,
  DT_OP_ADD,   /* y = a + b */
  DT_OP_LOSS,  /* loss sums and dlogits, weighted by 1/global count */
  DT_OP_SGD,   /* one SGD step over a flat range */
  DT_OP_ADAMW, /* one AdamW step over a flat range */
  DT_OP_SCALE, /* x *= alpha */
  DT_OP_SUMSQ, /* out = sum x^2 (double) and count of non-finite values */
  DT_OP_INPUT, /* x(b, c, s) = (raw * scale - mean(c)) / std(c); raw is float on the host */
  DT_OP_EMA,   /* ema = decay * ema + (1 - decay) * x, over a flat range */
  DT_OP_COUNT
} dt_op_type;

enum { DT_ACT_RELU, DT_ACT_GELU, DT_ACT_TANH, DT_ACT_SIGMOID };
enum { DT_POOL_MAX, DT_POOL_AVG };
enum { DT_LOSS_CROSS_ENTROPY, DT_LOSS_MSE };

typedef struct {
  int64_t b, c, h, w; /* input (B,C,H,W) */
  int64_t o, k, stride, pad;
  int64_t ho, wo; /* output spatial size */
} dt_conv_geom;

typedef struct {
  dt_op_type type;
  union {
    struct {
      int trans_a, trans_b;
      int64_t m, n, k;
      float alpha, beta;
      const float *a, *b;
      float *c;
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
    } conv_fwd;
    struct {
      dt_conv_geom g;
      const float *dy, *w;
      float *dx;
    } conv_bwd_data;
    struct {
      dt_conv_geom g;
      const float *x, *dy;
      float *dw;
    } conv_bwd_filter;
    struct {
      int64_t b, c, s;
      const float *x;
      double *sum, *sumsq;
    } bn_stats;
    struct {
      int64_t b, c, s;
      const float *x, *mean, *invstd, *gamma, *beta;
      float *y;
    } bn_apply;
    struct {
      int64_t b, c, s;
      const float *x, *dy, *mean, *invstd;
      double *sum_dy, *sum_dy_xhat;
    } bn_bwd_stats;
    struct {
      int64_t b, c, s;
      double count; /* global samples*s behind the sums */
      const float *x, *dy, *mean, *invstd, *gamma;
      const double *sum_dy, *sum_dy_xhat;
      float *dx, *dgamma, *dbeta;
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
    } act_bwd;
    struct {
      int kind;
      int64_t b, c, h, w, k, stride, ho, wo;
      const float *x;
      float *y;
      int32_t *argmax; /* argmax: max pooling only, (B,C,Ho,Wo) */
    } pool_fwd;
    struct {
      int kind;
      int64_t b, c, h, w, k, stride, ho, wo;
      const float *dy;
      const int32_t *argmax;
      float *dx;
    } pool_bwd;
    struct {
      int64_t n;
      float p;
      uint64_t seed;
      const float *x;
      float *y;
    } dropout_fwd;
    struct {
      int64_t n;
      float p;
      uint64_t seed;
      const float *dy;
      float *dx;
    } dropout_bwd;
    struct {
      int64_t n;
      const float *a, *b;
      float *y;
    } add;
    struct {
      int kind;
      int64_t b, k;
      float label_smoothing;
      double weight; /* 1/global count */
      const float *logits;
      const int32_t *labels;
      const float *targets;
      float *dlogits;
      double *loss_sum, *correct; /* host outputs: sum of per-sample losses, hits */
    } loss;
    struct {
      int64_t n;
      float lr, momentum, weight_decay;
      int nesterov;
      int first; /* first: momentum buffer starts as grad */
      float *param;
      const float *grad;
      float *mom;
    } sgd;
    struct {
      int64_t n;
      float lr, beta1, beta2, eps, weight_decay;
      int64_t step; /* step counts from 1 */
      float *param;
      const float *grad;
      float *m, *v;
    } adamw;
    struct {
      int64_t n;
      float alpha;
      float *x;
    } scale;
    struct {
      int64_t n;
      const float *x;
      double *sumsq;
      int64_t *nonfinite;
    } sumsq;
    struct {
      int64_t b, c, s;
      float scale;
      const float *mean, *std; /* mean/std (C) on the host; NULL: none */
      const float *raw;
      float *x;
    } input;
    struct {
      int64_t n;
      float decay;
      const float *x;
      float *ema;
    } ema;
  } p;
} dt_op;

/* The op names, indexed by dt_op_type (static-asserted against DT_OP_COUNT). */
extern const char *const dt_op_names[DT_OP_COUNT];

typedef struct dt_backend dt_backend;
struct dt_backend {
  const char *name;
  void (*run)(dt_backend *be, const dt_op *op);
  float *(*alloc)(dt_backend *be, size_t bytes); /* zeroed; aborts on failure naming the size */
  void (*free)(dt_backend *be, void *p);
  void (*to_device)(dt_backend *be, void *dst, const void *src, size_t bytes);
  void (*to_host)(dt_backend *be, void *dst, const void *src, size_t bytes);
  void (*zero)(dt_backend *be, void *p, size_t bytes);
  void (*sync)(dt_backend *be);
  void (*destroy)(dt_backend *be);
  int threads;
  int host_memory; /* buffers are host memory (CPU): MPI can use them directly */
  void *stream;    /* the backend's work queue for device collectives (a cudaStream_t); NULL on the CPU */
  void *impl;
};

static inline void backend_run(dt_backend *be, const dt_op *op) {
  be->run(be, op);
}

/* CPU backend with `threads` threads for BLAS and loops. Caller owns; destroy frees. */
dt_backend *backend_cpu_create(int threads);

/* CUDA backend on visible device `device` (backend_cuda.c; only in CUDA builds). */
dt_backend *backend_cuda_create(int device);

#endif
