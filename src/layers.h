/* layers.h: the layer kinds, one family per file (layer_*.c). */
#ifndef DT_LAYERS_H
#define DT_LAYERS_H

#include "model.h"

extern const dt_layer_ops dt_layer_linear;    /* layer_dense.c */
extern const dt_layer_ops dt_layer_conv2d;    /* layer_conv.c */
extern const dt_layer_ops dt_layer_batchnorm; /* layer_norm.c */
extern const dt_layer_ops dt_layer_maxpool;   /* layer_pool.c */
extern const dt_layer_ops dt_layer_avgpool;
extern const dt_layer_ops dt_layer_global_avgpool;
extern const dt_layer_ops dt_layer_relu; /* layer_activation.c */
extern const dt_layer_ops dt_layer_gelu;
extern const dt_layer_ops dt_layer_tanh;
extern const dt_layer_ops dt_layer_sigmoid;
extern const dt_layer_ops dt_layer_dropout;
extern const dt_layer_ops dt_layer_flatten;
extern const dt_layer_ops dt_layer_residual;  /* layer_residual.c */
extern const dt_layer_ops dt_layer_embedding; /* layer_embedding.c */
extern const dt_layer_ops dt_layer_layernorm; /* layer_norm.c */
extern const dt_layer_ops dt_layer_attention; /* layer_attention.c */

/* PyTorch's nn.Linear initialisation of every tensor of l: uniform(+-1/sqrt(in)). layer_dense.c. */
void dense_init(dt_layer *l, float *params, float *bufs, uint64_t seed);
/* The GEMM op of a dense product (rows, in, out), its pointers unset: the forward y = x W^T, the
 * weight gradient dW += dy^T x, or the input gradient dx = dy W. layer_dense.c. */
enum { DENSE_FWD, DENSE_DW, DENSE_DX };
dt_op dense_gemm(int kind, int64_t rows, int64_t in, int64_t out);
/* Whether a dense product (rows, in, out) whose layer has w16 reads its weight's bfloat16 copy: where its GEMMs
 * run on bfloat16 operands anyway (src/cuda/gemm.c's gemm16_plan: one in 16-bit rows already, x16 or y16, or
 * every dimension at least DT_GEMM16_MIN_DIM, as pick_weights16 checked in and out; A's copy under 2^31
 * values), so that the copy changes no result: its format, else 0 (W read as it is). layer_dense.c. */
int dense_reads_w16(int w16, int64_t rows, int64_t in, int64_t out, int x16, int y16);
/* Queues y(rows, out) = x(rows, in) W^T + bias (bias NULL: none); W (out, in), or its bfloat16 copy w16 (NULL:
 * none; dense_reads_w16); and, when gelu_y is not NULL, gelu_y = gelu_tanh(y) in the same GEMM: the gelu after
 * it; or with relu, y = relu(x W^T + bias) (the relu after it). x16, y16 (half.h's format, 0: FP32): x is read
 * from, y (and gelu_y) written in 16-bit rows (backend.h's gemm.a16 and c16; no relu with y16). layer_dense.c. */
void dense_forward(dt_backend *be, int64_t rows, int64_t in, int64_t out, const float *x, const float *w,
                   const void *w16, const float *bias, float *y, float *gelu_y, int relu, int x16, int y16);
/* Queues dW += dy^T x and dbias += column sums of dy (NULL: none) in one GEMM op, dx = dy W (NULL: none), times
 * gelu_tanh'(dgelu_x) (rows, in) when dgelu_x is not NULL: the input gradient of the gelu before. relu_y: NULL,
 * or (rows, out) the output of a relu the forward applied: dy (then written) is first masked in place where it
 * is not positive, by the same op (gemm.relu_y). y16: dy is in 16-bit rows (the forward's y16; gemm.a16, no
 * relu_y); x16: x is, and dx (and dgelu_x) are written so (gemm.b16, c16). */
void dense_backward(dt_backend *be, int64_t rows, int64_t in, int64_t out, const float *x, const float *w,
                    const void *w16, const float *dy, const float *relu_y, float *dw, float *dbias, float *dx,
                    float *dgelu_x, int x16, int y16);

/* The dense products (rows, in, out, has an epilogue: a bias, a gelu or a relu, y16: its y in 16-bit rows, has a
 * bias, x16: its x in 16-bit rows, w16: its weight's 16-bit copy read, dense_reads_w16) of a linear layer (one) or
 * an attention layer (its two projections, (rows, C, 3C, 1, heads16, 1, x16, w16) and (rows, C, C, 1, 0, 1,
 * heads16, w16)) over
 * `batch` rows, in products; 0 for any other layer. dense_forward and dense_backward run each as up to three
 * GEMMs (the memory estimate asks the backend for their scratch). layer_dense.c. */
int layer_dense_products(const dt_layer *l, int64_t batch, int64_t products[2][8]);

/* Weight i's 16-bit copy (the model's weights16, dt_layer's w16_off) as pass has it, or NULL where l has none. */
static inline const void *layer_w16(const dt_layer *l, const dt_pass *pass, int i) {
  DT_ASSERT(!l->w16 || pass->weights16);
  return l->w16 ? (const void *)(pass->weights16 + l->w16_off[i]) : NULL;
}

/* The gradient of the relu that l applies (fused_relu), l->dy, masked in place where l->y, the relu's output,
 * is not positive: the relu's own backward, bit for bit (a residual's and a linear's; n values, as y16).
 * layers.c. */
void layer_mask_relu_dy(dt_layer *l, dt_pass *pass, int64_t n);

/* A conv2d layer's convolution of `batch` rows into *g (its scratch is the backend's: the memory
 * estimate asks the backend, backend.h's scratch); 0 for any other layer. layer_conv.c. */
int layer_conv_geom(const dt_layer *l, int64_t batch, dt_conv_geom *g);

#endif
