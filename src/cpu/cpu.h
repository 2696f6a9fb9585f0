/* cpu.h: private to the CPU backend (src/cpu/): its state and one function per op, cpu_<name> for
 * backend.h's DT_OPS entry X(NAME, name), declared here by family. A family file mirrors the
 * kernels/ file of its name (norm.c beside kernels/norm.cu); gemm.c and conv.c go through OpenBLAS
 * and oneDNN as src/cuda/gemm.c and conv.c go through cuBLAS and cuDNN. backend.c generates the op
 * table from DT_OPS, so an op without its function here does not compile.
 * An op function runs its op to completion (OpenMP inside; BLAS with the backend's threads), and
 * gives the same bits on every run with the same threads. */
#ifndef DT_CPU_H
#define DT_CPU_H

#include "backend.h"
#include "dnnl.h"

/* The elementwise and reduction loops are built three times, for AVX-512 (x86-64-v4), AVX2 + FMA
 * (v3) and the baseline, and the loader picks the widest the CPU has: one portable binary that
 * streams activations at the width of the machine it runs on. -ffp-contract=off keeps the FMA of v3
 * and v4 out of their arithmetic, so elementwise results are the same bits in all three. */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* Per-thread workspaces, grown on first use at each new shape (the first steps). */
typedef struct {
  float **col; /* [threads] im2col of one sample (C*K*K, Ho*Wo) */
  size_t col_bytes;
  float **dw; /* [threads] private filter gradients (O, C*K*K) */
  size_t dw_bytes;
  int threads;
  cpu_dnnl *dnnl; /* oneDNN's convolutions; NULL: im2col + GEMM for all */
} cpu_impl;

/* Column loops (embed_bwd, ln_bwd) go over chunks of this many columns (a cache line), rows in
 * increasing order. */
enum { COL_CHUNK = 16 };

/* gemm.c (OpenBLAS) */
void cpu_gemm(cpu_impl *im, const dt_op *op);

/* conv.c (oneDNN, or im2col + OpenBLAS) */
void cpu_conv_fwd(cpu_impl *im, const dt_op *op);
/* The scratch the convolutions among ops[0..n) take (backend.h's scratch). */
size_t cpu_conv_scratch(cpu_impl *im, const dt_op *ops, int n);
void cpu_conv_bwd_data(cpu_impl *im, const dt_op *op);
void cpu_conv_bwd_filter(cpu_impl *im, const dt_op *op);

/* norm.c: batchnorm and layernorm */
void cpu_bn_stats(cpu_impl *im, const dt_op *op);
void cpu_bn_finalize(cpu_impl *im, const dt_op *op);
void cpu_bn_apply(cpu_impl *im, const dt_op *op);
void cpu_bn_bwd_stats(cpu_impl *im, const dt_op *op);
void cpu_bn_bwd_apply(cpu_impl *im, const dt_op *op);
void cpu_ln_fwd(cpu_impl *im, const dt_op *op);
void cpu_ln_bwd(cpu_impl *im, const dt_op *op);

/* elementwise.c */
/* 16-bit operands (backend.h's x16, y16, dy16), which training gives only the CUDA backend (model.c picks
 * them there) and the op tests give both: x16 (B, S, C) in half.h's `format` widened to a new FP32 (B, C, S)
 * copy that the caller frees, and x (B, C, S) rounded to nearest even into x16 (B, S, C); an FP32 buffer of
 * n values for a 16-bit output. Format 0 (the operand is FP32): NULL, nothing to do. */
float *cpu_fp32_for(int format, int64_t n);
float *cpu_widen16(const void *x16, int format, int64_t b, int64_t c, int64_t s);
void cpu_narrow16(const float *x, void *x16, int format, int64_t b, int64_t c, int64_t s);
/* The same for the 16-bit row layout (backend.h's gemm.c16, a16, loss.logits16): (rows, cols) FP32 and rows
 * of dt_ld16(cols) 16-bit values, whose padding is neither read nor written. */
float *cpu_widen_rows(const void *x16, int format, int64_t rows, int64_t cols);
void cpu_narrow_rows(const float *x, void *x16, int format, int64_t rows, int64_t cols);
void cpu_bias_add(cpu_impl *im, const dt_op *op);
void cpu_bias_grad(cpu_impl *im, const dt_op *op);
void cpu_act_fwd(cpu_impl *im, const dt_op *op);
void cpu_act_bwd(cpu_impl *im, const dt_op *op);
void cpu_dropout_fwd(cpu_impl *im, const dt_op *op);
void cpu_dropout_bwd(cpu_impl *im, const dt_op *op);
void cpu_add(cpu_impl *im, const dt_op *op);
void cpu_scale(cpu_impl *im, const dt_op *op);
void cpu_sumsq(cpu_impl *im, const dt_op *op);
void cpu_input(cpu_impl *im, const dt_op *op);
void cpu_clip(cpu_impl *im, const dt_op *op);
void cpu_copy(cpu_impl *im, const dt_op *op);
void cpu_gather(cpu_impl *im, const dt_op *op);
void cpu_weights16(cpu_impl *im, const dt_op *op);
void cpu_grads16(cpu_impl *im, const dt_op *op);

/* pool.c */
void cpu_pool_fwd(cpu_impl *im, const dt_op *op);
void cpu_pool_bwd(cpu_impl *im, const dt_op *op);
void cpu_gap16_fwd(cpu_impl *im, const dt_op *op);
void cpu_gap16_bwd(cpu_impl *im, const dt_op *op);

/* loss.c */
void cpu_loss(cpu_impl *im, const dt_op *op);

/* optim.c: optimizer steps, fp16 loss scaling, EMA */
void cpu_sgd(cpu_impl *im, const dt_op *op);
void cpu_adamw(cpu_impl *im, const dt_op *op);
void cpu_unscale(cpu_impl *im, const dt_op *op);
void cpu_scaler_update(cpu_impl *im, const dt_op *op);
void cpu_ema(cpu_impl *im, const dt_op *op);

/* transformer.c: embeddings, softmax, permute */
void cpu_embed_fwd(cpu_impl *im, const dt_op *op);
void cpu_embed_bwd(cpu_impl *im, const dt_op *op);
void cpu_softmax_fwd(cpu_impl *im, const dt_op *op);
void cpu_softmax_bwd(cpu_impl *im, const dt_op *op);
void cpu_permute(cpu_impl *im, const dt_op *op);

/* attention.c: the fused attention */
void cpu_attention_fwd(cpu_impl *im, const dt_op *op);
void cpu_attention_bwd(cpu_impl *im, const dt_op *op);

#endif
