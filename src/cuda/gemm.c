/* gemm.c: the GEMM op through cuBLAS, as src/cpu/gemm.c's through OpenBLAS; train.precision
 * picks the compute type (the math mode is set on the handle in backend.c). A GEMM with a bias or a
 * gelu or relu epilogue runs as one cublasLtMatmul whose epilogue applies them to the FP32 sums; where
 * cuBLASLt cannot, C starts as the bias rows (kernels/elementwise.cu's k_fill_rows), cublasGemmEx
 * adds the product to it, and the activation's kernel runs after. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static operand16 stored(int64_t rows, int64_t cols) {
  return (operand16){rows, cols, dt_ld16(cols)}; /* rows of 16 bytes: cuBLAS's aligned kernels */
}

/* Under bf16, an unbatched GEMM (batch 0) with every dimension at least DT_GEMM16_MIN_DIM runs on bfloat16
 * copies of A and B in im->h16 (as PyTorch's autocast casts a linear layer's operands): twice the
 * tensor-core rate of FP32 operands, which cuBLAS runs as TF32 even under _FAST_16BF. So does any GEMM
 * with an operand in 16-bit rows already (a16, b16, c16), with no copy of such an A or B. Whether it runs so;
 * *bytes: the copies (A's, then B's, then under c16 the bias's, each 256-byte aligned), 0 for none. */
static int gemm16_plan(const cuda_impl *im, const dt_op *op, operand16 *a, operand16 *b, size_t *bytes) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  const int rows16 = q->a16 || q->b16 || q->c16; /* an operand in 16-bit rows already: this path, whatever the shape */
  *bytes = 0;
  if (rows16)
    DT_ASSERT(im->precision == DT_PREC_BF16 && q->batch <= 1 && (!q->a16 || q->a16 == DT_F16_BF16) &&
              (!q->b16 || q->b16 == DT_F16_BF16) && !(q->a16 && q->relu_y) &&
              (!q->c16 || (q->c16 == DT_F16_BF16 && q->beta == 0.0f && q->epilogue != DT_GEMM_RELU)));
  else if (im->precision != DT_PREC_BF16 || q->batch || q->m < DT_GEMM16_MIN_DIM || q->n < DT_GEMM16_MIN_DIM ||
           q->k < DT_GEMM16_MIN_DIM) /* batch 1 is attention's (B, H) product of one: not a dense layer's */
    return 0;
  *a = stored(DT_GEMM_A_ROWS(q), DT_GEMM_A_COLS(q));
  *b = q->trans_b ? stored(q->n, q->k) : stored(q->k, q->n);
  /* k_pack_bf16_rows' (fast_div is exact below 2^31); layers.h's dense_reads_w16 follows these rules, so that a
   * weight's 16-bit copy (b16) goes only to a GEMM that would copy it */
  const int64_t limit = (int64_t)1 << 31;
  const int over = (!q->a16 && a->rows * a->cols >= limit) || (!q->b16 && b->rows * b->cols >= limit);
  DT_ASSERT(!(rows16 && over)); /* device.c keeps every tensor under 2^31 values */
  if (over) return 0;
  *bytes = (q->a16 ? 0 : align256((size_t)(a->rows * a->ld16) * 2)) +
           (q->b16 ? 0 : align256((size_t)(b->rows * b->ld16) * 2)) +
           (q->c16 && q->bias ? align256((size_t)q->n * 2) : 0);
  return 1;
}

size_t cuda_gemm16_bytes(const cuda_impl *im, const dt_op *op) {
  operand16 a, b;
  size_t bytes;
  gemm16_plan(im, op, &a, &b, &bytes);
  return bytes;
}

/* cuBLASLt's workspace (im->workspace, shared with cuDNN's). cuBLAS advises 32 MiB on Hopper for
 * split-K's partial sums, which plan_for rules out; 4 MiB, its advice elsewhere, is left for the rest. */
enum { GEMM_LT_WORKSPACE = 4 << 20 };

/* The column-major problem cuBLAS sees (C^T = op(B)^T op(A)^T): the types of A and B, the
 * transposes, the shape, the leading dimensions, the alignment in bytes of each pointer (A's, B's,
 * C's, the bias's and the gelu input's, 0 for none: the heuristic reads them), the epilogue
 * (DT_GEMM_*), and C's format (c16: bfloat16 rows of dt_ld16(n), as the bias and the gelu's input). */
enum { PLAN_KEY = 15 };

struct gemm_plan {
  int64_t key[PLAN_KEY];
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c; /* column-major: op(B)^T's storage, op(A)^T's, C^T's */
  cublasLtMatmulAlgo_t algo;
  int usable; /* 0: cuBLASLt offered no algorithm: cublasGemmEx runs it, C filled with the bias first */
};

/* The largest power of two, at most 256, dividing both the address and a leading dimension's bytes. */
static int64_t alignment(const void *p, int64_t ld_bytes) {
  uint64_t v = (uint64_t)(uintptr_t)p | (uint64_t)ld_bytes | 256;
  return (int64_t)(v & (~v + 1));
}

/* A bias or a gelu epilogue on one product: cuBLASLt's work, when it can. */
size_t cuda_gemm_workspace(const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  return (q->bias || q->epilogue) && q->batch <= 1 ? GEMM_LT_WORKSPACE : 0;
}

void cuda_gemm_free(cuda_impl *im) {
  for (int i = 0; i < im->n_gemm_plans; i++) {
    gemm_plan *p = &im->gemm_plans[i];
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->c));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
  }
  free(im->gemm_plans);
  im->gemm_plans = NULL;
  im->n_gemm_plans = 0;
}

/* Whether an epilogue (DT_GEMM_*) writes or reads a gelu's input (aux). */
static int has_gelu_input(int epilogue) {
  return epilogue == DT_GEMM_GELU_TANH || epilogue == DT_GEMM_DGELU_TANH;
}

/* The plan for key (made now if new): the descriptors and the heuristic's first algorithm for
 * these alignments, with the epilogue the op asks for and a workspace of at most GEMM_LT_WORKSPACE. */
static gemm_plan *plan_for(cuda_impl *im, const int64_t key[PLAN_KEY], const void *bias, const void *aux) {
  for (int i = 0; i < im->n_gemm_plans; i++)
    if (!memcmp(im->gemm_plans[i].key, key, sizeof im->gemm_plans[i].key)) return &im->gemm_plans[i];
  im->gemm_plans = dt_realloc(im->gemm_plans, (size_t)(im->n_gemm_plans + 1) * sizeof *im->gemm_plans);
  gemm_plan *p = &im->gemm_plans[im->n_gemm_plans++];
  memset(p, 0, sizeof *p);
  memcpy(p->key, key, sizeof p->key);
  const int bf16 = (int)key[0];
  const cudaDataType ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasOperation_t tb = (cublasOperation_t)key[1], ta = (cublasOperation_t)key[2];
  const int64_t n = key[3], m = key[4], k = key[5], ldb = key[6], lda = key[7];
  /* FP32 operands: the precision's rounding (cuBLASLt has no math mode: COMPUTE_32F is FP32 FMA) */
  const cublasComputeType_t compute = bf16                            ? CUBLAS_COMPUTE_32F
                                      : im->precision == DT_PREC_FP32 ? CUBLAS_COMPUTE_32F
                                                                      : gemm_compute[im->precision];
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F));
  const int has_bias = key[11] != 0, kind = (int)key[13], c16 = key[14] != 0;
  const cublasLtEpilogue_t epilogue =
      kind == DT_GEMM_DGELU_TANH  ? CUBLASLT_EPILOGUE_DGELU
      : kind == DT_GEMM_GELU_TANH ? (has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
      : kind == DT_GEMM_RELU      ? (has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU)
                                  : CUBLASLT_EPILOGUE_BIAS;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &tb, sizeof tb));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  /* the heuristic reads the bias's and the gelu input's pointers for their alignment (in the key) */
  if (has_bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  if (has_gelu_input(kind)) {
    const int64_t aux_ld = c16 ? dt_ld16(n) : n; /* the gelu's input is laid out as C, of C's type */
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld));
  }
  /* stored (rows, cols) in column-major terms: op(X) = X^T stores X as (cols of op, rows of op) */
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, ab, tb == CUBLAS_OP_N ? n : k, tb == CUBLAS_OP_N ? k : n, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, ab, ta == CUBLAS_OP_N ? k : m, ta == CUBLAS_OP_N ? m : k, lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, c16 ? CUDA_R_16BF : CUDA_R_32F, n, m, c16 ? dt_ld16(n) : n));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = GEMM_LT_WORKSPACE;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  const uint32_t align[4] = {(uint32_t)key[8], (uint32_t)key[9], (uint32_t)key[10], (uint32_t)key[10]};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; i++)
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof align[i]));
  /* no split-K reductions: one algorithm's sums in one order, whatever the split a shape would get */
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_NONE;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                                    sizeof reductions));
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  /* any failure (NOT_SUPPORTED: no kernel takes the problem; INVALID_VALUE, as PyTorch saw for a
   * dimension of 1; no memory to load a kernel) leaves the problem to cublasGemmEx */
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(im->lt, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
  CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  p->usable = st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
              result.workspaceSize <= GEMM_LT_WORKSPACE;
  if (p->usable) {
    p->algo = result.algo;
  } else { /* for the log: a GPU where this is common would be slower than it need be */
    static const char *const epilogue_names[] = {"bias", "gelu", "gelu's derivative", "relu"};
    char line[256];
    snprintf(line, sizeof line, "cublaslt: GEMM (%lld, %lld, %lld) %s with its %s: %s, so cublasGemmEx and kernels\n",
             (long long)m, (long long)n, (long long)k, bf16 ? "bf16" : "fp32", epilogue_names[kind],
             st != CUBLAS_STATUS_SUCCESS ? cublasGetStatusName(st) : "no algorithm");
    cuda_note(im, line);
  }
  return p;
}

/* C(rows, n) = op(A) op(B) + bias, or its gelu or relu epilogue, through cuBLASLt, as cublasGemmEx's
 * arguments say (A and B: bfloat16 when bf16, else FP32; bias: the op's, or under c16 its bfloat16 copy);
 * 0 when cuBLASLt cannot (the caller runs cublasGemmEx and kernels for the rest). */
static int gemm_lt(cuda_impl *im, const typeof(((dt_op *)0)->p.gemm) *q, int bf16, const void *a, int64_t lda,
                   const void *b, int64_t ldb, const void *bias) {
  const int64_t elem = bf16 ? 2 : 4, ldc_bytes = q->c16 ? dt_ld16(q->n) * 2 : q->n * 4;
  /* cuBLASLt reads the bias and the gelu's input in 16-byte pieces; the gelu input's rows are whole
   * multiples of 8 values (16-bit rows are) */
  const int gelu = has_gelu_input(q->epilogue);
  if ((uintptr_t)bias % 16 || (gelu && ((uintptr_t)q->aux % 16 || (!q->c16 && q->n % 8)))) return 0;
  if (q->m < 2 || q->n < 2 || q->k < 2) return 0; /* PyTorch keeps a dimension of 1 from cuBLASLt too */
  const int64_t key[PLAN_KEY] = {bf16,
                                 q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 q->n,
                                 q->m,
                                 q->k,
                                 ldb,
                                 lda,
                                 alignment(b, ldb * elem),
                                 alignment(a, lda * elem),
                                 alignment(q->c, ldc_bytes),
                                 bias ? alignment(bias, 0) : 0,
                                 gelu ? alignment(q->aux, ldc_bytes) : 0,
                                 q->epilogue,
                                 q->c16 != 0};
  gemm_plan *p = plan_for(im, key, bias, q->aux);
  if (!p->usable) return 0;
  if (bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  if (gelu)
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &q->aux, sizeof q->aux));
  const float zero = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(im->lt, p->desc, &q->alpha, b, p->a, a, p->b, &zero, q->c, p->c, q->c, p->c, &p->algo,
                              im->workspace, GEMM_LT_WORKSPACE, im->stream));
  im->gemm_epilogues++;
  return 1;
}

/* The bfloat16 operands of a GEMM on the 16-bit path (gemm16_plan, bytes16 of copies): a 16-bit A or B (a16,
 * b16) as it is, else its copy in im->h16. A dense layer's dy is A of both its weight gradient and, next, its
 * input gradient (layer_dense.c): the second takes the copy the first left at the start of h16, and the
 * first sums its bias gradient (a_col_sums) as it copies. With a 16-bit C the bias is read as a bfloat16 copy
 * (cuBLASLt's epilogue takes C's type). Sets *a_op, *b_op and *bias; returns A's copy (NULL: a16), laid out as
 * layout says, for cuda_hold_dy16. */
static uint16_t *gemm16_operands(cuda_impl *im, const dt_op *op, const operand16 *a, const operand16 *b,
                                 size_t bytes16, const void **a_op, const void **b_op, const void **bias,
                                 int64_t layout[4]) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  /* NULL when nothing is copied (a16 and b16 without a bias, or k 0: no rows, and cuBLAS reads no A or B) */
  uint16_t *h16 =
      bytes16 ? cuda_grow_device(im, (void **)&im->h16, &im->h16_bytes, bytes16, "16-bit GEMM operands") : NULL;
  const size_t a_bytes = q->a16 ? 0 : align256((size_t)(a->rows * a->ld16) * 2),
               b_bytes = q->b16 ? 0 : align256((size_t)(b->rows * b->ld16) * 2);
  uint16_t *a16 = q->a16 ? NULL : h16, *b16 = q->b16 ? NULL : h16 + a_bytes / 2;
  layout[0] = DY16_ROWS, layout[1] = a->rows, layout[2] = a->cols, layout[3] = a->ld16;
  if (q->a16) {
    cuda_forget_dy16(im); /* the next copy takes the start of h16 */
  } else if (cuda_dy16_held(im, q->a, a16, layout)) {
    im->dy16_reuses++;
    if (q->a_col_sums) k_bias_grad(im->stream, q->a, q->a_col_sums, a->rows, a->cols, 1);
  } else if (q->a_col_sums) { /* a dense layer's dy: its bias gradient summed as it is copied */
    double *partials = cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op),
                                        "bias gradient sums");
    k_pack_bf16_rows_sums(im->stream, q->a, a16, a->rows, a->cols, a->ld16, q->a_col_sums, partials);
    im->col_sums_copied++;
  } else {
    k_pack_bf16_rows(im->stream, q->a, a16, a->rows, a->cols, a->ld16);
  }
  if (b16) k_pack_bf16_rows(im->stream, q->b, b16, b->rows, b->cols, b->ld16);
  *bias = q->bias;
  if (q->c16 && q->bias) {
    uint16_t *bias16 = h16 + (a_bytes + b_bytes) / 2;
    k_pack_bf16_rows(im->stream, q->bias, bias16, 1, q->n, q->n);
    *bias = bias16;
  }
  *a_op = q->a16 ? (const void *)q->a : a16, *b_op = q->b16 ? (const void *)q->b : b16;
  return a16;
}

/* C as gemm_lt would write it where cuBLASLt cannot, through cublasGemmEx on the operands as given (of type
 * `type`, column-major as cuda_gemm swaps them). An FP32 C starts as the bias rows and the GEMM adds to it (beta
 * 1; one rounding either way, as on the CPU), then the gelu's, its derivative's or the relu's kernel runs. A
 * 16-bit C takes the product rounded into the gelu's input (GELU_TANH), else into C, then one kernel adds the
 * FP32 bias and writes the gelu, or multiplies C by the gelu's derivative at aux: a rounding more than
 * cuBLASLt's epilogue (of the product, before the bias or the derivative). */
static void gemm_apart(cuda_impl *im, const typeof(((dt_op *)0)->p.gemm) *q, const void *a_op, int64_t lda_op,
                       const void *b_op, int64_t ldb_op, cudaDataType type, cublasComputeType_t compute) {
  const cublasOperation_t ta = q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (q->c16 && (q->bias || q->epilogue)) {
    const float zero = 0.0f;
    void *dest = q->epilogue == DT_GEMM_GELU_TANH ? (void *)q->aux : (void *)q->c;
    CUBLAS_CHECK(cublasGemmEx(im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, b_op, type, (int)ldb_op,
                              a_op, type, (int)lda_op, &zero, dest, CUDA_R_16BF, (int)dt_ld16(q->n), compute,
                              CUBLAS_GEMM_DEFAULT));
    if (q->epilogue == DT_GEMM_DGELU_TANH)
      k_dgelu_tanh_bf16_rows(im->stream, (const uint16_t *)q->aux, (uint16_t *)q->c, q->m, q->n, dt_ld16(q->n));
    else
      k_bias_gelu_bf16_rows(im->stream, (uint16_t *)dest, q->bias, q->epilogue ? (uint16_t *)q->c : NULL, q->m, q->n,
                            dt_ld16(q->n));
    return;
  }
  const float one = 1.0f, *beta = &q->beta;
  float *dest = q->epilogue == DT_GEMM_GELU_TANH ? q->aux : q->c; /* a gelu's input first */
  if (q->bias) k_fill_rows(im->stream, dest, q->bias, q->m, q->n), beta = &one;
  CUBLAS_CHECK(cublasGemmEx(im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, b_op, type, (int)ldb_op,
                            a_op, type, (int)lda_op, beta, dest, q->c16 ? CUDA_R_16BF : CUDA_R_32F,
                            (int)(q->c16 ? dt_ld16(q->n) : q->n), compute, CUBLAS_GEMM_DEFAULT));
  if (q->epilogue == DT_GEMM_GELU_TANH) k_act_fwd(im->stream, DT_ACT_GELU_TANH, q->aux, q->c, q->m * q->n);
  if (q->epilogue == DT_GEMM_DGELU_TANH) /* in place: c = gelu_tanh'(aux) c */
    k_act_bwd(im->stream, DT_ACT_GELU_TANH, q->aux, NULL, q->c, q->c, q->m * q->n);
  if (q->epilogue == DT_GEMM_RELU) k_act_fwd(im->stream, DT_ACT_RELU, q->c, q->c, q->m * q->n); /* in place */
}

/* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, and so do
 * their leading dimensions (at least 1, even when k is 0) and batch strides. */
void cuda_gemm(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  operand16 a = {0}, b = {0};
  size_t bytes16 = 0;
  const int on16 = q->m && q->n && gemm16_plan(im, op, &a, &b, &bytes16);
  DT_ASSERT(!q->a_col_sums || q->batch <= 1);
  DT_ASSERT(!q->relu_y || (q->batch <= 1 && !q->a16));
  /* only the bfloat16 path below reuses or holds one, and a masked A is not what an earlier copy holds */
  if (!on16 || q->relu_y) cuda_forget_dy16(im);
  const int64_t a_rows = DT_GEMM_A_ROWS(q), a_cols = DT_GEMM_A_COLS(q);
  if (q->a_col_sums && q->a16) { /* a 16-bit dy's bias gradient, from its bfloat16 values */
    double *partials = cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op),
                                        "bias gradient sums");
    k_bf16_rows_sums(im->stream, (const uint16_t *)q->a, a_rows, a_cols, dt_ld16(a_cols), q->a_col_sums, partials);
  } else if (q->relu_y && q->a_col_sums && !on16) { /* the relu's backward and the sums in one pass */
    k_relu_bias_grad(im->stream, (float *)q->a, q->relu_y, q->a_col_sums, a_rows, a_cols);
  } else {
    if (q->relu_y) k_act_bwd(im->stream, DT_ACT_RELU, q->relu_y, q->relu_y, q->a, (float *)q->a, a_rows * a_cols);
    if (q->a_col_sums && !on16) /* else summed as A is copied to bfloat16 below */
      k_bias_grad(im->stream, q->a, q->a_col_sums, a_rows, a_cols, 1);
  }
  if (!q->m || !q->n) return; /* a rank with no rows this batch */
  int64_t lda = q->trans_a ? q->m : q->k, ldb = q->trans_b ? q->k : q->n;
  if (q->batch > 1) {
    const cublasOperation_t ta = q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    DT_ASSERT(q->batch < ((int64_t)1 << 31) && !q->bias);
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, CUDA_R_32F, (int)(ldb > 1 ? ldb : 1),
        q->stride_b, q->a, CUDA_R_32F, (int)(lda > 1 ? lda : 1), q->stride_a, &q->beta, q->c, CUDA_R_32F, (int)q->n,
        q->stride_c, (int)q->batch, gemm_compute[im->precision], CUBLAS_GEMM_DEFAULT));
    return;
  }
  /* A bias, a gelu or its derivative: cuBLASLt's epilogue applies it as C is written; else gemm_apart */
  DT_ASSERT((!q->bias && !q->epilogue) || q->beta == 0.0f);
  const void *a_op = q->a, *b_op = q->b, *bias = q->bias;
  int64_t lda_op = lda > 1 ? lda : 1, ldb_op = ldb > 1 ? ldb : 1;
  cudaDataType type = CUDA_R_32F;
  cublasComputeType_t compute = gemm_compute[im->precision];
  uint16_t *a16 = NULL;
  int64_t layout[4] = {0};
  if (on16) {
    a16 = gemm16_operands(im, op, &a, &b, bytes16, &a_op, &b_op, &bias, layout);
    lda_op = a.ld16, ldb_op = b.ld16, type = CUDA_R_16BF, compute = CUBLAS_COMPUTE_32F;
  }
  /* the workspace whether or not cuBLASLt takes the GEMM, as the memory estimate counts it */
  if (cuda_gemm_workspace(op))
    cuda_grow_device(im, &im->workspace, &im->workspace_bytes, GEMM_LT_WORKSPACE, "cuBLASLt workspace");
  if (!cuda_gemm_workspace(op) || !gemm_lt(im, q, on16, a_op, lda_op, b_op, ldb_op, bias))
    gemm_apart(im, q, a_op, lda_op, b_op, ldb_op, type, compute);
  if (on16 && !q->a16) cuda_hold_dy16(im, q->a, a16, layout); /* A as it was: C never aliases it (cuBLAS's) */
}
