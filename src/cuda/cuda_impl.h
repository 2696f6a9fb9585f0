/* cuda_impl.h: private to the CUDA backend (src/cuda/): its state, the helpers its files share, and
 * one function per op, cuda_<name> for backend.h's DT_OPS entry X(NAME, name), declared here by
 * family as the CPU's are in src/cpu/cpu.h. gemm.c and conv.c go through cuBLAS and cuDNN (as
 * src/cpu/gemm.c and conv.c through OpenBLAS and oneDNN); ops.c runs the rest through kernels/,
 * grouped by the kernels/ file of each family. backend.c generates the op table from DT_OPS, so an
 * op without its function here does not compile.
 * An op function only queues work on im->stream (no host synchronisation: graph capture); a failed
 * launch is reported by cuda_run after it returns. */
#ifndef DT_CUDA_IMPL_H
#define DT_CUDA_IMPL_H

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stdint.h>

#include "backend.h"
#include "cuda_check.h"
#include "kernels.h"

/* Kept out of libddp_train_cuda.so's exported symbols, as when they were static: the binary that
 * loads it exports its own (-rdynamic), and a name in both would resolve to the binary's. */
#pragma GCC visibility push(hidden)

typedef struct conv_plan conv_plan; /* conv.c */
typedef struct gemm_plan gemm_plan; /* gemm.c */

typedef struct {
  void *p;
  size_t bytes;
} cuda_block; /* a device buffer of cuda_device_malloc and its size */

typedef struct {
  dt_backend *be; /* owner: its generation is bumped when an internal buffer moves */
  int device;
  int precision; /* DT_PREC_*: the math of GEMMs, convolutions and the fused attention's products */
  int cc;        /* the device's compute capability, major * 10 + minor */
  int attention_tc; /* the fused attention's products on tensor cores: bf16, 8.0 or later, code built for it */
  cudaStream_t stream;
  cublasHandle_t blas;
  cublasLtHandle_t lt;   /* a GEMM with a bias or a gelu: its epilogue applies them */
  gemm_plan *gemm_plans; /* gemm.c's: one per cuBLASLt problem seen: grows */
  int n_gemm_plans;
  int64_t gemm_epilogues; /* GEMMs whose bias or gelu cuBLASLt's epilogue applied so far */
  cudnnHandle_t dnn;
  conv_plan *plans; /* conv.c's: one per convolution shape and batch size seen: grows */
  int n_plans;
  char *notes; /* the plans made since take_notes last took them, a line each (dt_malloc'd), or NULL */
  void *workspace;
  size_t workspace_bytes;
  uint16_t *h16; /* device: a convolution's operands in 16 bits (bf16, fp16), or a GEMM's (bf16) */
  size_t h16_bytes;
  /* The dy whose 16-bit copy the op just run left in h16 (at dy16_at, laid out as dy16_layout says),
   * for the op right after it: a convolution's backward data after its backward filter, a dense
   * layer's input gradient after its weight gradient (layer_conv.c and layer_dense.c run each pair
   * back to back). NULL once any other op or copy has run or h16 has moved (cuda_forget_dy16). */
  const float *dy16_of;
  const uint16_t *dy16_at;
  int64_t dy16_layout[4]; /* DY16_NHWC (b, c, positions) or DY16_ROWS (rows, cols, row length) */
  int64_t dy16_reuses;    /* packs of dy skipped so far */
  int64_t col_sums_copied; /* bias gradients summed as their dy was copied to bfloat16 (gemm.a_col_sums) */
  double *partials; /* device: per-block or per-sample pairs, summed in a fixed order */
  size_t partials_bytes;
  unsigned *tickets; /* device: the batchnorm statistics kernels' counts of blocks done, zero between launches */
  size_t tickets_bytes;
  char *stage;              /* pinned host staging for upload(): two halves of stage_half bytes */
  size_t stage_half;        /* bytes in each half */
  size_t stage_used;        /* bytes used in the current half */
  int stage_cur;            /* the half being filled */
  cudaEvent_t staged[2][2]; /* [half][queue: 0 the stream, 1 copy]: after the last copy out of each half */
  cudaStream_t copy;        /* upload_ahead's copies, overlapping the stream's work */
  cudaEvent_t copied;       /* the last upload_ahead: the stream waits for it */
  cudaEvent_t cleared;      /* after the last allocation's memset on the stream: copies wait for it */
  cudaEvent_t marks[2];     /* be->mark's: the end of the last step queued in each slot */
  int64_t marks_made, mark_seq[2]; /* marks recorded so far; the number of each slot's last */
  int64_t retired_after;           /* marks_made when a buffer was last retired */
  int capturing;            /* between capture_begin and capture_end */
  void *retired[8];         /* buffers outgrown during a capture: freed once the stream drains */
  int n_retired;
  cuda_block *blocks; /* (n_blocks, of cap_blocks) every live buffer of cuda_device_malloc: be->mem_used's count */
  int n_blocks, cap_blocks;
} cuda_impl;

/* cudaMalloc of a device buffer, counted in be->mem_used (and mem_peak); the size is kept for
 * cuda_device_free. Returns cudaMalloc's status (nothing counted on failure). */
cudaError_t cuda_device_malloc(cuda_impl *im, void **p, size_t bytes);
/* cudaFree of a buffer from cuda_device_malloc (NULL: nothing), taken off the count. The caller has waited
 * for the work that uses it. */
void cuda_device_free(cuda_impl *im, void *p);

/* A failed allocation: out of memory gets the batch-size advice; any other error (a sticky one
 * left by earlier asynchronous work) is reported as it is. */

/* Grows a device buffer (im->workspace, im->h16, im->partials, im->tickets) to `need` bytes; `what` names it
 * in the out-of-memory message. Bumps the backend's generation when the buffer moves. */
void *cuda_grow_device(cuda_impl *im, void **buf, size_t *have, size_t need, const char *what);

static inline size_t align256(size_t n) {
  return (n + 255) & ~(size_t)255;
}

/* The 16-bit format (half.h's DT_F16_*) this run's convolutions compute in: bf16 and fp16 only, else 0. */
static inline int cuda_format16(const cuda_impl *im) {
  return im->precision == DT_PREC_BF16 ? DT_F16_BF16 : im->precision == DT_PREC_FP16 ? DT_F16_HALF : DT_F16_NONE;
}

/* conv.c: destroys the convolution plans and frees their workspace and 16-bit operands (shut-down). */
void cuda_conv_free(cuda_impl *im);
/* conv.c: plans convolution g now (kept), and raises *workspace and *h16 to the cuDNN workspace and
 * the 16-bit operands (train.precision bf16, fp16) it needs: its filter's too unless the op reads the
 * model's copy (w16). */
void cuda_conv_scratch(cuda_impl *im, const dt_conv_geom *g, int w16, size_t *workspace, size_t *h16);
/* The layouts of a held 16-bit dy (im->dy16_layout[0]): conv.c's NHWC copies, gemm.c's padded rows. */
enum { DY16_NHWC = 1, DY16_ROWS = 2 };
/* backend.c: appends a line (ending in a newline) to im->notes, for the log. */
void cuda_note(cuda_impl *im, const char *line);
/* backend.c: the held 16-bit dy may be stale from here on (any op but a backward data or a GEMM, any
 * copy, h16 grown). */
void cuda_forget_dy16(cuda_impl *im);
/* Whether h16 at `at` holds dy's 16-bit copy in layout, left there by the op run just before. */
int cuda_dy16_held(const cuda_impl *im, const float *dy, const uint16_t *at, const int64_t layout[4]);
/* Notes that h16 at `at` holds dy's 16-bit copy in layout, for the op run next. */
void cuda_hold_dy16(cuda_impl *im, const float *dy, const uint16_t *at, const int64_t layout[4]);
/* ops.c: the bytes of partial sums (im->partials) op needs; 0 for an op without them. */
size_t cuda_partials_bytes(const dt_op *op);
/* ops.c: the bytes of tickets (im->tickets) op needs; 0 for an op without them. */
size_t cuda_tickets_bytes(const dt_op *op);

/* gemm.c (cuBLAS, cuBLASLt) */
void cuda_gemm(cuda_impl *im, const dt_op *op);
/* gemm.c: destroys the cuBLASLt plans (shut-down). */
void cuda_gemm_free(cuda_impl *im);
/* gemm.c: the workspace (im->workspace) GEMM op takes: cuBLASLt's, for a bias or a gelu epilogue. */
size_t cuda_gemm_workspace(const dt_op *op);
/* gemm.c: the bytes of bfloat16 operands (in im->h16) GEMM op needs; 0 for one on FP32 operands. */
size_t cuda_gemm16_bytes(const cuda_impl *im, const dt_op *op);

/* conv.c (cuDNN) */
void cuda_conv_fwd(cuda_impl *im, const dt_op *op);
void cuda_conv_bwd_data(cuda_impl *im, const dt_op *op);
void cuda_conv_bwd_filter(cuda_impl *im, const dt_op *op);

/* ops.c, kernels/norm.cu: batchnorm and layernorm */
void cuda_bn_stats(cuda_impl *im, const dt_op *op);
void cuda_bn_finalize(cuda_impl *im, const dt_op *op);
void cuda_bn_apply(cuda_impl *im, const dt_op *op);
void cuda_bn_bwd_stats(cuda_impl *im, const dt_op *op);
void cuda_bn_bwd_apply(cuda_impl *im, const dt_op *op);
void cuda_ln_fwd(cuda_impl *im, const dt_op *op);
void cuda_ln_bwd(cuda_impl *im, const dt_op *op);

/* ops.c, kernels/elementwise.cu */
void cuda_bias_add(cuda_impl *im, const dt_op *op);
void cuda_bias_grad(cuda_impl *im, const dt_op *op);
void cuda_act_fwd(cuda_impl *im, const dt_op *op);
void cuda_act_bwd(cuda_impl *im, const dt_op *op);
void cuda_dropout_fwd(cuda_impl *im, const dt_op *op);
void cuda_dropout_bwd(cuda_impl *im, const dt_op *op);
void cuda_add(cuda_impl *im, const dt_op *op);
void cuda_scale(cuda_impl *im, const dt_op *op);
void cuda_sumsq(cuda_impl *im, const dt_op *op);
void cuda_input(cuda_impl *im, const dt_op *op);
void cuda_clip(cuda_impl *im, const dt_op *op);
void cuda_copy(cuda_impl *im, const dt_op *op);
void cuda_gather(cuda_impl *im, const dt_op *op);
void cuda_weights16(cuda_impl *im, const dt_op *op);
void cuda_grads16(cuda_impl *im, const dt_op *op);

/* ops.c, kernels/pool.cu */
void cuda_pool_fwd(cuda_impl *im, const dt_op *op);
void cuda_pool_bwd(cuda_impl *im, const dt_op *op);
void cuda_gap16_fwd(cuda_impl *im, const dt_op *op);
void cuda_gap16_bwd(cuda_impl *im, const dt_op *op);

/* ops.c, kernels/loss.cu */
void cuda_loss(cuda_impl *im, const dt_op *op);

/* ops.c, kernels/optim.cu: optimizer steps, fp16 loss scaling, EMA */
void cuda_sgd(cuda_impl *im, const dt_op *op);
void cuda_adamw(cuda_impl *im, const dt_op *op);
void cuda_unscale(cuda_impl *im, const dt_op *op);
void cuda_scaler_update(cuda_impl *im, const dt_op *op);
void cuda_ema(cuda_impl *im, const dt_op *op);

/* ops.c, kernels/transformer.cu: embeddings, softmax, permute */
void cuda_embed_fwd(cuda_impl *im, const dt_op *op);
void cuda_embed_bwd(cuda_impl *im, const dt_op *op);
void cuda_softmax_fwd(cuda_impl *im, const dt_op *op);
void cuda_softmax_bwd(cuda_impl *im, const dt_op *op);
void cuda_permute(cuda_impl *im, const dt_op *op);
/* ops.c, kernels/attention.cu: fused attention */
void cuda_attention_fwd(cuda_impl *im, const dt_op *op);
void cuda_attention_bwd(cuda_impl *im, const dt_op *op);

#pragma GCC visibility pop

#endif
