/* kernels.h: C entry points of the CUDA kernels (kernels/ *.cu files), called by src/cuda/.
 * Every pointer is device memory unless named host_*; every call is asynchronous on `stream`.
 * Shapes follow backend.h's op comments. Element counts stay below 2^31 (main.c refuses larger
 * tensors for --device cuda): the kernels split indices with 32-bit fast division. */
#ifndef DT_KERNELS_H
#define DT_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "attention_geom.h"
#include "half.h"
#include "optim_runs.h"

#ifdef __cplusplus
extern "C" {
#endif

/* elementwise.cu */
void k_bias_add(cudaStream_t s, float *y, const float *bias, int64_t b, int64_t c, int64_t sp);
/* y (m, n) = bias (n) on every row (a GEMM with a bias starts from it) */
void k_fill_rows(cudaStream_t s, float *y, const float *bias, int64_t m, int64_t n);
void k_bias_grad(cudaStream_t s, const float *dy, float *db, int64_t b, int64_t c, int64_t sp);
/* a fused relu's backward and its linear's bias gradient in one pass: dy (b, c) set to +0 in place where
 * relu_y (b, c) is not positive, then db (c) += its column sums, as k_bias_grad's (sp 1) */
void k_relu_bias_grad(cudaStream_t s, float *dy, const float *relu_y, float *db, int64_t b, int64_t c);
void k_act_fwd(cudaStream_t s, int kind, const float *x, float *y, int64_t n);
/* A 16-bit GEMM's bias and gelu, or gelu derivative, where cuBLASLt's epilogue cannot: (m, n) values in bfloat16
 * rows of ld. pre += round(bias) (bias NULL: none), rounded, and y (NULL: none) = the tanh gelu of that FP32
 * sum, rounded; dx = gelu_tanh'(aux) dx, rounded. */
void k_bias_gelu_bf16_rows(cudaStream_t s, uint16_t *pre, const float *bias, uint16_t *y, int64_t m, int64_t n,
                           int64_t ld);
void k_dgelu_tanh_bf16_rows(cudaStream_t s, const uint16_t *aux, uint16_t *dx, int64_t m, int64_t n, int64_t ld);
void k_act_bwd(cudaStream_t s, int kind, const float *x, const float *y, const float *dy, float *dx, int64_t n);
void k_dropout(cudaStream_t s, const float *x, float *y, int64_t n, float p, uint64_t seed, const uint64_t *step_seed);
void k_clip(cudaStream_t s, float *x, int64_t n, float max_norm, const double *sumsq);
void k_add(cudaStream_t s, const float *a, const float *b, float *y, int64_t n, int relu);
// 16-bit values in half.h's format (backend.h's add.h16, act_bwd.h16: the relu's only)
void k_add16(cudaStream_t s, const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n, int relu, int format);
void k_relu_bwd16(cudaStream_t s, const uint16_t *x, const uint16_t *dy, uint16_t *dx, int64_t n, int format);
void k_scale(cudaStream_t s, float *x, float alpha, int64_t n);
/* out(n, row) = rows idx[0..n) of src; type: backend.h's DT_GATHER_* (0 uint8, 1 float, 2 double: out is
 * float; 3 int32: out is int32) */
void k_gather(cudaStream_t s, int type, const void *src, const int32_t *idx, void *out, int64_t n, int64_t row);
/* Sums that must come out bit-identical on every run are not accumulated with atomics: blocks
 * write partial pairs into `pairs` and one block adds them in a fixed order. */
enum { K_SUM_BLOCKS = 256 }; /* blocks of k_sumsq: pairs holds 2 * K_SUM_BLOCKS doubles */

/* out[0] += sum x^2 (double), out[1] += count of non-finite values (as double) */
void k_sumsq(cudaStream_t s, const float *x, int64_t n, double *out, double *pairs);
/* out[0], out[1] += the sums of pairs[2i] and pairs[2i + 1] over i < n, in an order fixed by n */
void k_sum_pairs(cudaStream_t s, const double *pairs, int64_t n, double *out);
/* x16: x as 16-bit NHWC (B, S, C) in that format (half.h), else FP32 (B, C, S) */
void k_input(cudaStream_t s, const float *raw, float *x, int x16, int64_t b, int64_t c, int64_t sp, float scale,
             const float *mean, const float *std);

/* convert.cu: x (B, C, S) FP32 to y (B, S, C) in bfloat16 (bf16 = 1) or IEEE half, rounded to
 * nearest even; and back, added into x when accumulate */
void k_pack16(cudaStream_t s, const float *x, uint16_t *y, int64_t b, int64_t c, int64_t sp, int bf16);
void k_unpack16(cudaStream_t s, const uint16_t *y, float *x, int64_t b, int64_t c, int64_t sp, int bf16,
                int accumulate);
/* x (rows, cols) FP32, row-major, to y (rows, ld) in bfloat16 rounded to nearest even (ld >= cols, the
 * padding left as it is; rows * cols < 2^31) */
void k_pack_bf16_rows(cudaStream_t s, const float *x, uint16_t *y, int64_t rows, int64_t cols, int64_t ld);
/* The same, db(cols) += x's column sums too, in double (a dense layer's bias gradient from its dy): chunks of
 * rows, at least K_PACK_SUMS_ROWS_MIN each and about K_PACK_SUMS_BLOCKS blocks in all, into partials
 * (k_pack_bf16_rows_chunks(rows, cols) x cols doubles), then each column's chunks added in order. */
enum { K_PACK_SUMS_BLOCKS = 2048, K_PACK_SUMS_ROWS_MIN = 64 };
int64_t k_pack_bf16_rows_chunks(int64_t rows, int64_t cols);
void k_pack_bf16_rows_sums(cudaStream_t s, const float *x, uint16_t *y, int64_t rows, int64_t cols, int64_t ld,
                           float *db, double *partials);
/* The sums alone, of x (rows, cols) already bfloat16 rows of ld (a 16-bit dy), in the same chunks and order. */
void k_bf16_rows_sums(cudaStream_t s, const uint16_t *x, int64_t rows, int64_t cols, int64_t ld, float *db,
                      double *partials);
/* The weights16 op (backend.h): every entry of table (n, device memory) copied from params to w16, rows the
 * entries' rows in all (half.h's dt_weight16) */
void k_weights16(cudaStream_t s, const float *params, uint16_t *w16, const dt_weight16 *table, int n, int64_t rows);
/* The grads16 op: every entry of table with grad (n consecutive entries, rows in all) added from g16 into grads */
void k_grads16(cudaStream_t s, float *grads, const uint16_t *g16, const dt_weight16 *table, int n, int64_t rows);

/* optim.cu: one pass over the flat parameter buffer */
/* hyper: the step's values, uploaded by the host (SGD: lr; AdamW: lr, lr / bc1, sqrt(bc2)) */
/* skip: NULL, or a count that, above 0, makes the step leave everything as it is; nonfinite: NULL, or
 * a count the number of g's non-finite values is added to (whole numbers: the same sum in any order);
 * runs: NULL (wd on every value), or (n_runs, device memory) each run's weight decay (optim_runs.h) */
void k_sgd(cudaStream_t s, float *p, const float *g, float *mom, int64_t n, const float *hyper, const double *skip,
           double *nonfinite, float momentum, float wd, const dt_decay_run *runs, int n_runs, int nesterov);
void k_adamw(cudaStream_t s, float *p, const float *g, float *m, float *v, int64_t n, const float *hyper,
             const double *skip, double *nonfinite, float b1, float b2, float eps, float wd, const dt_decay_run *runs,
             int n_runs);
/* fp16 loss scaling (backend.h's DT_OP_UNSCALE and DT_OP_SCALER_UPDATE) */
void k_unscale(cudaStream_t s, float *x, int64_t n, const float *scaler);
void k_scaler_update(cudaStream_t s, float *scaler, const double *overflow, int64_t growth_interval, float growth,
                     float backoff);
void k_ema(cudaStream_t s, float *ema, const float *x, int64_t n, float decay);

/* norm.cu: batchnorm over (B, C, S) per channel (sums as backend.h's ops), and layernorm per row.
 * The statistics' sums run over each channel's n = B * S positions in k_bn_chunks(n) chunks, summed into
 * `partials`, then over the chunks in an order fixed by the shapes, by the last block to finish: in tiers
 * of K_BN_TIER chunks where there are more (the tiers' sums follow the chunks' in partials, k_bn_partials
 * doubles in all). `tickets` (k_bn_tickets) count the blocks done: zero when allocated, and left so by
 * every launch. */
enum { K_BN_CHUNKS = 64, K_BN_CHUNK_MIN = 16384, K_BN_TIER = 64 };
static inline int64_t k_bn_chunks(int64_t n) {
  const int64_t most = K_BN_CHUNKS, chunks = (n + K_BN_CHUNK_MIN - 1) / K_BN_CHUNK_MIN;
  return chunks < 1 ? 1 : chunks > most ? most : chunks;
}
static inline int64_t k_bn_tiers(int64_t chunks) {
  return (chunks + K_BN_TIER - 1) / K_BN_TIER;
}
static inline int64_t k_bn_partials(int64_t chunks, int64_t c) {
  return 2 * c * (chunks + (k_bn_tiers(chunks) > 1 ? k_bn_tiers(chunks) : 0));
}
/* groups: C (FP32) or (C + 31) / 32 (16-bit) */
static inline int64_t k_bn_tickets(int64_t chunks, int64_t groups) {
  return groups * (k_bn_tiers(chunks) + 1);
}
/* backend.h's bn_stats.finalize: k_bn_finalize's work in training on the sums just added, by the kernel that
 * adds each channel's (mean NULL: none) */
typedef struct {
  float momentum, eps;
  float *mean, *invstd, *running_mean, *running_var;
} k_bn_fin;
void k_bn_stats(cudaStream_t s, const float *x, int64_t b, int64_t c, int64_t sp, double *sums, double *partials,
                unsigned *tickets, k_bn_fin fin);
void k_bn_finalize(cudaStream_t s, int64_t c, int training, float momentum, float eps, const double *sums, float *mean,
                   float *invstd, float *running_mean, float *running_var);
/* relu: the fused relu of backend.h's bn ops (forward applies it; backward masks dy where z <= 0) */
void k_bn_apply(cudaStream_t s, int relu, const float *x, float *y, int64_t b, int64_t c, int64_t sp, const float *mean,
                const float *invstd, const float *gamma, const float *beta);
void k_bn_bwd_stats(cudaStream_t s, int relu, const float *x, const float *dy, int64_t b, int64_t c, int64_t sp,
                    const float *mean, const float *invstd, const float *gamma, const float *beta, double *sums,
                    float *dgamma, float *dbeta, double *partials, unsigned *tickets);
void k_bn_bwd_apply(cudaStream_t s, int relu, const float *x, const float *dy, float *dx, int64_t b, int64_t c,
                    int64_t sp, const double *count, const float *mean, const float *invstd, const float *gamma,
                    const float *beta, const double *sums);
/* The same on a convolution's output as cuDNN wrote it (backend.h's x16): x and dx 16-bit (B, S, C) in
 * `format` (half.h's DT_F16_BF16 or DT_F16_HALF), y and dy FP32 (B, C, S); the same roundings. A block
 * sums 32 channels, so the positions go in more chunks, k_bn16_chunks(n, c), at least K_BN16_CHUNK_MIN
 * positions each and about K_BN16_BLOCKS blocks in all; a group of 32 channels takes one channel's tickets. */
enum { K_BN16_BLOCKS = 2048, K_BN16_CHUNK_MIN = 128 };
static inline int64_t k_bn16_chunks(int64_t n, int64_t c) {
  const int64_t groups = (c + 31) / 32, most = K_BN16_BLOCKS / groups,
                chunks = (n + K_BN16_CHUNK_MIN - 1) / K_BN16_CHUNK_MIN;
  return chunks < 1 || most < 1 ? 1 : chunks > most ? most : chunks;
}
void k_bn16_stats(cudaStream_t s, const uint16_t *x, int format, int64_t b, int64_t c, int64_t sp, double *sums,
                  double *partials, unsigned *tickets, k_bn_fin fin);
/* y16 and dy16 (a convolution reads y next): y and dy 16-bit (B, S, C) in the same format, else FP32 (B, C, S) */
void k_bn16_apply(cudaStream_t s, int relu, const uint16_t *x, int format, void *y, int y16, int64_t b, int64_t c,
                  int64_t sp, const float *mean, const float *invstd, const float *gamma, const float *beta);
void k_bn16_bwd_stats(cudaStream_t s, int relu, const uint16_t *x, int format, const void *dy, int dy16, int64_t b,
                      int64_t c, int64_t sp, const float *mean, const float *invstd, const float *gamma,
                      const float *beta, double *sums, float *dgamma, float *dbeta, double *partials,
                      unsigned *tickets);
void k_bn16_bwd_apply(cudaStream_t s, int relu, const uint16_t *x, int format, const void *dy, int dy16, uint16_t *dx,
                      int64_t b, int64_t c, int64_t sp, const double *count, const float *mean, const float *invstd,
                      const float *gamma, const float *beta, const double *sums);
/* layernorm (backend.h's DT_OP_LN_*): dgamma and dbeta are summed per chunk of rows into `partials`
 * (2 * K_LN_CHUNKS * d doubles), then over chunks in order. No atomics: the same bits every run. */
enum { K_LN_CHUNKS = 64 };
/* y16, dy16: y written, dy read, as bfloat16 rows of dt_ld16(d) values (else FP32 rows of d) */
void k_ln_fwd(cudaStream_t s, const float *x, const float *gamma, const float *beta, void *y, int y16, float *mean,
              float *rstd, int64_t n, int64_t d, float eps);
/* dx (NULL: none) overwritten, plus dx_add (NULL: nothing) */
void k_ln_bwd(cudaStream_t s, const float *x, const void *dy, int dy16, const float *gamma, const float *mean,
              const float *rstd, float *dx, const float *dx_add, float *dgamma, float *dbeta, int64_t n, int64_t d,
              double *partials);

/* pool.cu: max (argmax kept) and average pooling, NCHW, no padding */
void k_pool_fwd(cudaStream_t s, int kind, const float *x, float *y, int32_t *argmax, int64_t b, int64_t c, int64_t h,
                int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo);
void k_pool_bwd(cudaStream_t s, int kind, const float *dy, const int32_t *argmax, float *dx, int64_t b, int64_t c,
                int64_t h, int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo);
/* max pooling of 16-bit NHWC values (bf16: bfloat16, else IEEE half), argmax (B, Ho, Wo, C) */
void k_pool16_fwd(cudaStream_t s, const uint16_t *x, uint16_t *y, int32_t *argmax, int64_t b, int64_t c, int64_t h,
                  int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo, int bf16);
void k_pool16_bwd(cudaStream_t s, const uint16_t *dy, const int32_t *argmax, uint16_t *dx, int64_t b, int64_t c,
                  int64_t h, int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo, int bf16);
// backend.h's gap16_fwd and gap16_bwd
void k_gap16_fwd(cudaStream_t s, const uint16_t *x, int format, float *y, int64_t b, int64_t sp, int64_t c);
void k_gap16_bwd(cudaStream_t s, const float *dy, uint16_t *dx, int format, int64_t b, int64_t sp, int64_t c);

/* loss.cu: per-sample losses added to out[0], hits to out[1] (doubles; per-sample pairs in
 * `pairs`, 2 * b doubles, added in a fixed order); dlogits weighted by `weight` (1 / global count)
 * (or weight_dev[0], read on the device, unless NULL) and by grad_scale[0] unless it is NULL; cross-entropy rows
 * labelled ignore_index (>= 0; -1: none) add nothing; distill (DT_DISTILL_*, 0: none) mixes in the teacher's
 * logits (b, k) as backend.h's loss op says; logits16 (DT_F16_BF16): logits and dlogits are bfloat16 rows of
 * dt_ld16(k) values, both 16-byte aligned */
void k_loss(cudaStream_t s, int kind, const void *logits, int logits16, const int32_t *labels, const float *targets,
            void *dlogits, int64_t b, int64_t k, float label_smoothing, int32_t ignore_index, double weight,
            const double *weight_dev, const float *grad_scale, int distill, float alpha, float temperature,
            const float *teacher, double *out, double *pairs);

/* transformer.cu: backend.h's DT_OP_EMBED_*, SOFTMAX_* and PERMUTE. The embedding gradient adds
 * rows in increasing order (as the CPU: the same bits). No atomics: results are the same on every
 * run. */
void k_embed_fwd(cudaStream_t s, const float *tokens, const float *wte, const float *wpe, float *y, int64_t n,
                 int64_t t, int64_t d);
void k_embed_bwd(cudaStream_t s, const float *tokens, const float *dy, float *dwte, float *dwpe, int64_t n, int64_t t,
                 int64_t d, int64_t vocab);
void k_softmax_fwd(cudaStream_t s, const float *x, float *y, int64_t rows, int64_t t, int causal, float scale);
void k_softmax_bwd(cudaStream_t s, const float *y, const float *dy, float *dx, int64_t rows, int64_t t, int causal,
                   float scale);
/* y = x with dims permuted (y's dim i is x's dim perm[i]); ndim 2..5, perm checked by the caller */
void k_permute(cudaStream_t s, const float *x, float *y, int ndim, const int64_t *dims, const int *perm);

/* attention.cu: backend.h's DT_OP_ATTENTION_* (hd <= DT_ATTENTION_MAX_HD); each returns the error of
 * opting its kernels in to the shared memory they take (the launches' are cudaGetLastError's). No
 * atomics: the same bits on every run. tensor_cores: the tile products in bfloat16 on tensor cores
 * (compute capability 8.0 and later only), else FP32. */
/* *built: whether the device runs the tensor-core kernels as built (their code compiled from PTX for
 * compute capability 8.0 or later: a build whose newest PTX is older has them trap even on an 8.0 GPU). */
cudaError_t k_attention_tensor_cores_built(int *built);
/* q, k, v, o (dout, dq, dk, dv): FP32, or bfloat16 (uint16_t) where g->io16 */
cudaError_t k_attention_fwd(cudaStream_t s, const dt_attention_geom *g, int tensor_cores, const void *q, const void *k,
                            const void *v, void *o, float *lse);
cudaError_t k_attention_bwd(cudaStream_t s, const dt_attention_geom *g, int tensor_cores, const void *q, const void *k,
                            const void *v, const void *o, const float *lse, const void *dout, float *delta, void *dq,
                            void *dk, void *dv);

#ifdef __cplusplus
}
#endif

#endif
