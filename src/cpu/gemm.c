/* gemm.c: the GEMM op through OpenBLAS (one product, a batch of them, or one starting from a
 * bias); the CUDA side is src/cuda/gemm.c (cuBLAS). */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

static void gemm_one(const typeof(((dt_op *)0)->p.gemm) *q, int64_t i) {
  int64_t lda = q->trans_a ? q->m : q->k, ldb = q->trans_b ? q->k : q->n;
  cblas_sgemm(CblasRowMajor, q->trans_a ? CblasTrans : CblasNoTrans, q->trans_b ? CblasTrans : CblasNoTrans, (int)q->m,
              (int)q->n, (int)q->k, q->alpha, q->a + i * q->stride_a, (int)(lda > 1 ? lda : 1), q->b + i * q->stride_b,
              (int)(ldb > 1 ? ldb : 1), q->beta, q->c + i * q->stride_c, (int)q->n);
}

/* 16-bit rows (a16, b16, c16): those operands widened to FP32 and the op run on FP32 buffers; C, and a gelu
 * epilogue's aux with it, rounded to nearest even from the FP32 results, as the CUDA backend rounds its FP32
 * sums (under c16 a bias is rounded to bfloat16 first, and DGELU reads the widened aux). */
static void gemm_rows16(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  DT_ASSERT(q->batch <= 1 && !(q->a16 && q->relu_y) && (!q->c16 || (q->beta == 0.0f && q->epilogue != DT_GEMM_RELU)));
  const int aux16 = q->c16 && q->epilogue;
  float *a = q->a16 ? cpu_widen_rows(q->a, q->a16, DT_GEMM_A_ROWS(q), DT_GEMM_A_COLS(q)) : NULL;
  float *b = q->b16 ? cpu_widen_rows(q->b, q->b16, q->trans_b ? q->n : q->k, q->trans_b ? q->k : q->n) : NULL;
  float *c = cpu_fp32_for(q->c16, q->m * q->n), *aux = NULL, *bias = NULL;
  if (aux16)
    aux = q->epilogue == DT_GEMM_DGELU_TANH ? cpu_widen_rows(q->aux, q->c16, q->m, q->n)
                                            : cpu_fp32_for(q->c16, q->m * q->n);
  if (q->c16 && q->bias) {
    bias = dt_malloc((size_t)q->n * sizeof(float));
    for (int64_t j = 0; j < q->n; j++) bias[j] = dt_from_16(dt_to_16(q->bias[j], q->c16), q->c16);
  }
  dt_op fp32 = *op;
  fp32.p.gemm.a16 = fp32.p.gemm.b16 = fp32.p.gemm.c16 = 0;
  if (a) fp32.p.gemm.a = a;
  if (b) fp32.p.gemm.b = b;
  if (c) fp32.p.gemm.c = c;
  if (aux) fp32.p.gemm.aux = aux;
  if (bias) fp32.p.gemm.bias = bias;
  cpu_gemm(im, &fp32);
  if (c) cpu_narrow_rows(c, q->c, q->c16, q->m, q->n);
  if (aux && q->epilogue == DT_GEMM_GELU_TANH) cpu_narrow_rows(aux, q->aux, q->c16, q->m, q->n);
  free(a), free(b), free(c), free(aux), free(bias);
}

/* The products one by one with a threaded GEMM each, or, when there are at least as many products
 * as threads, in parallel with a single-threaded GEMM each (as conv_fwd's). The threaded GEMM is
 * called outside any parallel region: inside even an if(0) one, OpenBLAS's own region is nested,
 * and libgomp starts fresh threads for it on every call while the pool's threads spin. */
void cpu_gemm(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  if (q->a16 || q->b16 || q->c16) {
    gemm_rows16(im, op);
    return;
  }
  if (q->relu_y) { /* the relu's backward on A in place, as its own op would run it, then the rest */
    DT_ASSERT(q->batch <= 1);
    const int64_t n = DT_GEMM_A_ROWS(q) * DT_GEMM_A_COLS(q);
    dt_op mask = {.type = DT_OP_ACT_BWD};
    mask.p.act_bwd = (typeof(mask.p.act_bwd)){
        .kind = DT_ACT_RELU, .n = n, .x = q->relu_y, .y = q->relu_y, .dy = q->a, .dx = (float *)q->a};
    cpu_act_bwd(im, &mask);
    dt_op rest = *op;
    rest.p.gemm.relu_y = NULL;
    cpu_gemm(im, &rest);
    return;
  }
  if (q->a_col_sums) { /* bias_grad's op on A as stored, then the product */
    DT_ASSERT(q->batch <= 1);
    dt_op sums = {.type = DT_OP_BIAS_GRAD};
    sums.p.bias_grad = (typeof(sums.p.bias_grad)){
        .b = DT_GEMM_A_ROWS(q), .c = DT_GEMM_A_COLS(q), .s = 1, .dy = q->a, .db = q->a_col_sums};
    cpu_bias_grad(im, &sums);
    dt_op product = *op;
    product.p.gemm.a_col_sums = NULL;
    cpu_gemm(im, &product);
    return;
  }
  if (!q->m || !q->n) return;        /* a rank with no rows this batch */
  if (q->epilogue == DT_GEMM_RELU) { /* the product, then the relu in place as the layer would run it */
    DT_ASSERT(q->beta == 0.0f && q->batch <= 1);
    dt_op product = *op;
    product.p.gemm.epilogue = DT_GEMM_PLAIN;
    cpu_gemm(im, &product);
    dt_op act = {.type = DT_OP_ACT_FWD};
    act.p.act_fwd = (typeof(act.p.act_fwd)){.kind = DT_ACT_RELU, .n = q->m * q->n, .x = q->c, .y = q->c};
    cpu_act_fwd(im, &act);
    return;
  }
  if (q->epilogue) { /* the product, then the gelu's op as a layer of its own would run it */
    DT_ASSERT(q->beta == 0.0f && q->batch <= 1 && q->aux && (q->epilogue == DT_GEMM_GELU_TANH || !q->bias));
    dt_op product = *op;
    product.p.gemm.epilogue = DT_GEMM_PLAIN;
    if (q->epilogue == DT_GEMM_GELU_TANH) product.p.gemm.c = q->aux;
    cpu_gemm(im, &product);
    dt_op act = {.type = q->epilogue == DT_GEMM_GELU_TANH ? DT_OP_ACT_FWD : DT_OP_ACT_BWD};
    if (act.type == DT_OP_ACT_FWD) {
      act.p.act_fwd = (typeof(act.p.act_fwd)){.kind = DT_ACT_GELU_TANH, .n = q->m * q->n, .x = q->aux, .y = q->c};
      cpu_act_fwd(im, &act);
    } else { /* in place: dx[i] = gelu_tanh'(x[i]) dy[i] */
      act.p.act_bwd =
          (typeof(act.p.act_bwd)){.kind = DT_ACT_GELU_TANH, .n = q->m * q->n, .x = q->aux, .dy = q->c, .dx = q->c};
      cpu_act_bwd(im, &act);
    }
    return;
  }
  if (q->bias) { /* C starts as the bias rows and the GEMM adds to it: one pass fewer over C */
    DT_ASSERT(q->beta == 0.0f && q->batch <= 1);
    typeof(((dt_op *)0)->p.gemm) with = *q;
    with.beta = 1.0f;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q->m; r++) memcpy(q->c + r * q->n, q->bias, (size_t)q->n * sizeof(float));
    gemm_one(&with, 0);
    return;
  }
  int64_t batch = q->batch > 1 ? q->batch : 1;
  if (batch > 1 && batch >= im->threads) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; i++) gemm_one(q, i);
  } else {
    for (int64_t i = 0; i < batch; i++) gemm_one(q, i);
  }
}
