/* gemm.c: the GEMM op through cuBLAS, as src/cpu/gemm.c's through OpenBLAS; train.precision
 * picks the compute type (the math mode is set on the handle in backend.c). A GEMM with a bias starts
 * from it (kernels/elementwise.cu's k_fill_rows). */
#include "cuda_impl.h"

/* FP32 operands; the inputs rounded on tensor cores as train.precision says, FP32 accumulation. */
static const cublasComputeType_t gemm_compute[] = {[DT_PREC_FP32] = CUBLAS_COMPUTE_32F_PEDANTIC,
                                                   [DT_PREC_TF32] = CUBLAS_COMPUTE_32F_FAST_TF32,
                                                   [DT_PREC_BF16] = CUBLAS_COMPUTE_32F_FAST_16BF,
                                                   [DT_PREC_FP16] = CUBLAS_COMPUTE_32F_FAST_16F};

/* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, and so do
 * their leading dimensions (at least 1, even when k is 0) and batch strides. */
void cuda_gemm(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  if (!q->m || !q->n) return; /* a rank with no rows this batch */
  int64_t lda = q->trans_a ? q->m : q->k, ldb = q->trans_b ? q->k : q->n;
  const cublasOperation_t ta = q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (q->batch > 1) {
    DT_ASSERT(q->batch < ((int64_t)1 << 31) && !q->bias);
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, CUDA_R_32F, (int)(ldb > 1 ? ldb : 1),
        q->stride_b, q->a, CUDA_R_32F, (int)(lda > 1 ? lda : 1), q->stride_a, &q->beta, q->c, CUDA_R_32F, (int)q->n,
        q->stride_c, (int)q->batch, gemm_compute[im->precision], CUBLAS_GEMM_DEFAULT));
    return;
  }
  /* with a bias, C starts as the bias rows and the GEMM adds to it (beta 1), one rounding as on the CPU */
  const float one = 1.0f, *beta = &q->beta;
  if (q->bias) {
    DT_ASSERT(q->beta == 0.0f);
    k_fill_rows(im->stream, q->c, q->bias, q->m, q->n);
    beta = &one;
  }
  CUBLAS_CHECK(cublasGemmEx(im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, CUDA_R_32F,
                            (int)(ldb > 1 ? ldb : 1), q->a, CUDA_R_32F, (int)(lda > 1 ? lda : 1), beta, q->c,
                            CUDA_R_32F, (int)q->n, gemm_compute[im->precision], CUBLAS_GEMM_DEFAULT));
}
