/* gemm.c: the GEMM op through cuBLAS, as src/cpu/gemm.c's through OpenBLAS; train.precision
 * picks the compute type (the math mode is set on the handle in backend.c). A GEMM with a bias starts
 * from it (kernels/elementwise.cu's k_fill_rows). */
#include "cuda_impl.h"

/* FP32 operands; the inputs rounded on tensor cores as train.precision says, FP32 accumulation. */
static const cublasComputeType_t gemm_compute[] = {[DT_PREC_FP32] = CUBLAS_COMPUTE_32F_PEDANTIC,
                                                   [DT_PREC_TF32] = CUBLAS_COMPUTE_32F_FAST_TF32,
                                                   [DT_PREC_BF16] = CUBLAS_COMPUTE_32F_FAST_16BF,
                                                   [DT_PREC_FP16] = CUBLAS_COMPUTE_32F_FAST_16F};

/* A row-major operand as stored: rows x cols, and the row length of its bfloat16 copy. */
typedef struct {
  int64_t rows, cols, ld16;
} operand16;

/* Below this in any dimension a GEMM has no tensor-core tile to fill, and copying its operands
 * would cost more than it saves. */
enum { GEMM16_MIN_DIM = 16 };

static operand16 stored(int64_t rows, int64_t cols) {
  return (operand16){rows, cols, (cols + 7) / 8 * 8}; /* rows of 16 bytes: cuBLAS's aligned kernels */
}

/* Under bf16, an unbatched GEMM (batch 0) with every dimension at least GEMM16_MIN_DIM runs on bfloat16
 * copies of A and B in im->h16 (as PyTorch's autocast casts a linear layer's operands): twice the
 * tensor-core rate of FP32 operands, which cuBLAS runs as TF32 even under _FAST_16BF. Their bytes
 * (A's copy, then B's, each 256-byte aligned), or 0 for a GEMM on FP32 operands. */
static size_t gemm16_plan(const cuda_impl *im, const dt_op *op, operand16 *a, operand16 *b) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  if (im->precision != DT_PREC_BF16 || q->batch || q->m < GEMM16_MIN_DIM || q->n < GEMM16_MIN_DIM ||
      q->k < GEMM16_MIN_DIM) /* batch 1 is attention's (B, H) product of one: not a dense layer's */
    return 0;
  *a = q->trans_a ? stored(q->k, q->m) : stored(q->m, q->k);
  *b = q->trans_b ? stored(q->n, q->k) : stored(q->k, q->n);
  const int64_t limit = (int64_t)1 << 31; /* k_pack_bf16_rows' (fast_div is exact below 2^31) */
  if (a->rows * a->cols >= limit || b->rows * b->cols >= limit) return 0;
  return align256((size_t)(a->rows * a->ld16) * 2) + align256((size_t)(b->rows * b->ld16) * 2);
}

size_t cuda_gemm16_bytes(const cuda_impl *im, const dt_op *op) {
  operand16 a, b;
  return gemm16_plan(im, op, &a, &b);
}

/* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, and so do
 * their leading dimensions (at least 1, even when k is 0) and batch strides. */
void cuda_gemm(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  operand16 a, b;
  const size_t bytes16 = q->m && q->n ? gemm16_plan(im, op, &a, &b) : 0;
  if (!bytes16) cuda_forget_dy16(im); /* only the bfloat16 path below reuses or holds one */
  if (!q->m || !q->n) return;         /* a rank with no rows this batch */
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
  if (bytes16) {
    /* A dense layer's dy is A of both its weight gradient and, next, its input gradient (layer_dense.c):
     * the second takes the copy the first left at the start of h16. */
    uint16_t *a16 = cuda_grow_device(im, (void **)&im->h16, &im->h16_bytes, bytes16, "16-bit GEMM operands");
    uint16_t *b16 = a16 + align256((size_t)(a.rows * a.ld16) * 2) / 2;
    const int64_t layout[4] = {DY16_ROWS, a.rows, a.cols, a.ld16};
    if (cuda_dy16_held(im, q->a, a16, layout))
      im->dy16_reuses++;
    else
      k_pack_bf16_rows(im->stream, q->a, a16, a.rows, a.cols, a.ld16);
    k_pack_bf16_rows(im->stream, q->b, b16, b.rows, b.cols, b.ld16);
    CUBLAS_CHECK(cublasGemmEx(im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, b16, CUDA_R_16BF,
                              (int)b.ld16, a16, CUDA_R_16BF, (int)a.ld16, beta, q->c, CUDA_R_32F, (int)q->n,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    cuda_hold_dy16(im, q->a, a16, layout); /* A as it was: C never aliases it (cuBLAS's contract) */
    return;
  }
  CUBLAS_CHECK(cublasGemmEx(im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, CUDA_R_32F,
                            (int)(ldb > 1 ? ldb : 1), q->a, CUDA_R_32F, (int)(lda > 1 ? lda : 1), beta, q->c,
                            CUDA_R_32F, (int)q->n, gemm_compute[im->precision], CUBLAS_GEMM_DEFAULT));
}
