// cublas.cc: the cuBLAS entry points the project uses, on the stand-in. Column-major GEMM with
// transposes, leading dimensions, alpha/beta (host or device pointer mode), strided batches and
// GemmEx types (float, half, bfloat16, double). The math mode decides the numerics: FP32 stays
// FP32 unless CUBLAS_TF32_TENSOR_OP_MATH or a FAST compute type allows reduced inputs, which are
// then rounded as tensor cores would read them. Matrices must be device memory inside one live
// allocation; the work is queued on the handle's stream like any other.
#include <cblas.h>
#include <cublas_v2.h>
#include <string.h>

#include <vector>

#include "gpusim.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  int device = 0;
};

namespace gpusim {
namespace {

Handles<cublasContext> handles;

cublasContext *ctx_of(cublasHandle_t h) {
  return handles.has(h) ? h : nullptr;
}

size_t type_size(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_64F: return 8;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    default: return 0;
  }
}

double load(const void *p, cudaDataType t, size_t i) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float *>(p)[i];
    case CUDA_R_64F: return static_cast<const double *>(p)[i];
    case CUDA_R_16F: return half_to_float(static_cast<const uint16_t *>(p)[i]);
    case CUDA_R_16BF: return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
    default: return 0;
  }
}

void store(void *p, cudaDataType t, size_t i, double v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float *>(p)[i] = (float)v; break;
    case CUDA_R_64F: static_cast<double *>(p)[i] = v; break;
    case CUDA_R_16F: static_cast<uint16_t *>(p)[i] = float_to_half((float)v); break;
    case CUDA_R_16BF: static_cast<uint16_t *>(p)[i] = float_to_bf16((float)v); break;
    default: break;
  }
}

// How the inputs are read: as given, or reduced to TF32, half or bfloat16 first.
enum Reduce { EXACT, TF32, HALF, BF16 };

struct Gemm {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc, batch;
  long long sa, sb, sc;
  const void *a, *b;
  void *c;
  cudaDataType at, bt, ct;
  bool f64;  // compute in double
  Reduce reduce;
  double alpha, beta;
  const void *alpha_dev, *beta_dev;  // device pointer mode: read when the work runs
};

// The extent in elements of a column-major (rows x cols) matrix with leading dimension ld.
size_t extent(int rows, int cols, int ld) {
  return rows && cols ? (size_t)(cols - 1) * (size_t)ld + (size_t)rows : 0;
}

const Allocation *check_matrix(const char *api, const char *name, const void *p, cudaDataType t, int rows, int cols,
                               int ld, long long stride, int batch, int dev) {
  size_t n = extent(rows, cols, ld);
  if (!n || !batch) return nullptr;
  n += (size_t)(batch - 1) * (size_t)stride;
  const Allocation *a = device_range(p, n * type_size(t), dev);
  if (!a)
    fatal(
        "%s: matrix %s (%d x %d, ld %d%s) at %p, %s, does not lie inside one live allocation of device %d: cuBLAS "
        "would read or write out of bounds",
        api, name, rows, cols, ld, batch > 1 ? ", batched" : "", p, describe_address(p).c_str(), dev);
  return a;
}

void run_gemm(const Gemm &g) {
  double alpha = g.alpha, beta = g.beta;
  if (g.alpha_dev) alpha = g.f64 ? *(const double *)g.alpha_dev : *(const float *)g.alpha_dev;
  if (g.beta_dev) beta = g.f64 ? *(const double *)g.beta_dev : *(const float *)g.beta_dev;
  CBLAS_TRANSPOSE ta = g.ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                  tb = g.tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans;
  int ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
  int br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
  bool plain = g.at == CUDA_R_32F && g.bt == CUDA_R_32F && g.ct == CUDA_R_32F && g.reduce == EXACT && !g.f64;
  static std::vector<float> A, B, C;  // scratch, reused (work runs one op at a time)
  for (int bi = 0; bi < g.batch; bi++) {
    const char *a = (const char *)g.a + (size_t)bi * g.sa * type_size(g.at);
    const char *b = (const char *)g.b + (size_t)bi * g.sb * type_size(g.bt);
    char *c = (char *)g.c + (size_t)bi * g.sc * type_size(g.ct);
    if (beta == 0)  // C is not read: it may hold anything, even NaN
      for (int j = 0; j < g.n; j++)
        for (int i = 0; i < g.m; i++) store(c, g.ct, (size_t)j * g.ldc + i, 0.0);
    if (plain) {  // FP32 in, FP32 out, FP32 accumulation
      if (g.k)
        cblas_sgemm(CblasColMajor, ta, tb, g.m, g.n, g.k, (float)alpha, (const float *)a, g.lda, (const float *)b,
                    g.ldb, (float)beta, (float *)c, g.ldc);
      else if (beta != 1)
        for (int j = 0; j < g.n; j++)
          for (int i = 0; i < g.m; i++) ((float *)c)[(size_t)j * g.ldc + i] *= (float)beta;
      continue;
    }
    // other types: gather the operands densely, reduced as the compute type allows
    auto reduce = [&](double v) -> double {
      switch (g.reduce) {
        case TF32: return to_tf32((float)v);
        case HALF: return half_to_float(float_to_half((float)v));
        case BF16: return bf16_to_float(float_to_bf16((float)v));
        default: return v;
      }
    };
    std::vector<double> Ad((size_t)ar * ac), Bd((size_t)br * bc), Cd((size_t)g.m * g.n, 0.0);
    for (int j = 0; j < ac; j++)
      for (int i = 0; i < ar; i++) Ad[(size_t)j * ar + i] = reduce(load(a, g.at, (size_t)j * g.lda + i));
    for (int j = 0; j < bc; j++)
      for (int i = 0; i < br; i++) Bd[(size_t)j * br + i] = reduce(load(b, g.bt, (size_t)j * g.ldb + i));
    if (g.f64) {
      if (g.k)
        cblas_dgemm(CblasColMajor, ta, tb, g.m, g.n, g.k, 1.0, Ad.data(), ar ? ar : 1, Bd.data(), br ? br : 1, 0.0,
                    Cd.data(), g.m ? g.m : 1);
    } else {  // FP32 accumulation, as the device does
      A.assign(Ad.begin(), Ad.end());
      B.assign(Bd.begin(), Bd.end());
      C.assign(Cd.size(), 0.0f);
      if (g.k)
        cblas_sgemm(CblasColMajor, ta, tb, g.m, g.n, g.k, 1.0f, A.data(), ar ? ar : 1, B.data(), br ? br : 1, 0.0f,
                    C.data(), g.m ? g.m : 1);
      Cd.assign(C.begin(), C.end());
    }
    for (int j = 0; j < g.n; j++)
      for (int i = 0; i < g.m; i++) {
        size_t at = (size_t)j * g.ldc + i;
        double v;
        if (g.f64) {
          v = alpha * Cd[(size_t)j * g.m + i] + (beta != 0 ? beta * load(c, g.ct, at) : 0.0);
        } else {
          float vf = (float)alpha * (float)Cd[(size_t)j * g.m + i];
          if (beta != 0) vf += (float)beta * (float)load(c, g.ct, at);
          v = vf;
        }
        store(c, g.ct, at, v);
      }
  }
}

cublasStatus_t submit(cublasContext *ctx, const char *api, Gemm g, const void *alpha, const void *beta) {
  if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if ((g.ta != CUBLAS_OP_N && g.ta != CUBLAS_OP_T && g.ta != CUBLAS_OP_C) ||
      (g.tb != CUBLAS_OP_N && g.tb != CUBLAS_OP_T && g.tb != CUBLAS_OP_C))
    return CUBLAS_STATUS_INVALID_VALUE;
  int ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
  int br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
  if (g.lda < (ar > 1 ? ar : 1) || g.ldb < (br > 1 ? br : 1) || g.ldc < (g.m > 1 ? g.m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!type_size(g.at) || !type_size(g.bt) || !type_size(g.ct)) return CUBLAS_STATUS_NOT_SUPPORTED;
  Stream *s = stream_of(ctx->stream);
  if (!s) return CUBLAS_STATUS_EXECUTION_FAILED;
  // alpha and beta: host values read now, or device values read when the work runs
  size_t scalar = g.f64 ? 8 : 4;
  for (int i = 0; i < 2; i++) {
    const void *p = i ? beta : alpha;
    const char *name = i ? "beta" : "alpha";
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    if (ctx->pointer_mode == CUBLAS_POINTER_MODE_HOST) {
      if (in_device_region(p))
        fatal("%s: %s (%p) is device memory but the handle's pointer mode is CUBLAS_POINTER_MODE_HOST", api, name, p);
      double v = g.f64 ? *(const double *)p : *(const float *)p;
      (i ? g.beta : g.alpha) = v;
    } else {
      if (!device_range(p, scalar, ctx->device))
        fatal("%s: %s (%p) is %s but the handle's pointer mode is CUBLAS_POINTER_MODE_DEVICE", api, name, p,
              describe_address(p).c_str());
      (i ? g.beta_dev : g.alpha_dev) = p;
    }
  }
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;  // nothing to compute
  std::unique_ptr<FnOp> op(new FnOp);
  const Allocation *used[3] = {check_matrix(api, "A", g.a, g.at, ar, ac, g.lda, g.sa, g.batch, ctx->device),
                               check_matrix(api, "B", g.b, g.bt, br, bc, g.ldb, g.sb, g.batch, ctx->device),
                               check_matrix(api, "C", g.c, g.ct, g.m, g.n, g.ldc, g.sc, g.batch, ctx->device)};
  for (const Allocation *a : used)
    if (a) op->uses.push_back(a);
  for (int i = 0; i < 2; i++) {
    const void *p = i ? g.beta_dev : g.alpha_dev;
    if (p) op->uses.push_back(find_allocation(p));
    declare_access(op.get(), p, scalar, false);
  }
  // the bytes each matrix spans (hazard.cc); C is read too unless beta is a host 0
  auto span = [&](int rows, int cols, int ld, long long stride, cudaDataType t) {
    size_t n = extent(rows, cols, ld);
    return n ? (n + (size_t)(g.batch - 1) * (size_t)stride) * type_size(t) : 0;
  };
  declare_access(op.get(), g.a, span(ar, ac, g.lda, g.sa, g.at), false);
  declare_access(op.get(), g.b, span(br, bc, g.ldb, g.sb, g.bt), false);
  if (g.beta_dev || g.beta != 0) declare_access(op.get(), g.c, span(g.m, g.n, g.ldc, g.sc, g.ct), false);
  declare_access(op.get(), g.c, span(g.m, g.n, g.ldc, g.sc, g.ct), true);
  char what[160];
  snprintf(what, sizeof what, "%s (m %d, n %d, k %d)", api, g.m, g.n, g.k);
  op->what = what;
  op->fn = [g]() { run_gemm(g); };
  if (enqueue(s, std::move(op)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;  // a capture refused it
  return CUBLAS_STATUS_SUCCESS;
}

// The reduced precision the math mode and compute type allow for FP32 inputs (TF32 needs compute
// capability 8.0: below it FP32 stays FP32). The FAST_16F and FAST_16BF compute types *allow*
// cuBLAS to round the inputs to half or bfloat16 and do not oblige it: it may pick a TF32 or FP32
// kernel for a shape. The stand-in picks one of the three per shape, from GPUSIM_SEED, the same
// each call (a kernel choice is per shape), so that results must hold whichever is picked.
Reduce reduction(const cublasContext *ctx, cublasComputeType_t ct, int m, int n, int k) {
  bool has_tf32 = config().cc_major >= 8;
  auto pick = [&](Reduce r16) {
    uint64_t key = config().seed * 0x9e3779b97f4a7c15ULL ^ ((uint64_t)m << 42) ^ ((uint64_t)n << 21) ^ (uint64_t)k;
    switch (Rng(key).below(3)) {
      case 0: return r16;
      case 1: return has_tf32 ? TF32 : EXACT;
      default: return EXACT;
    }
  };
  switch (ct) {
    case CUBLAS_COMPUTE_32F_FAST_TF32: return has_tf32 ? TF32 : EXACT;
    case CUBLAS_COMPUTE_32F_FAST_16F: return pick(HALF);
    case CUBLAS_COMPUTE_32F_FAST_16BF: return pick(BF16);
    case CUBLAS_COMPUTE_32F: return has_tf32 && (ctx->math & 0xf) == CUBLAS_TF32_TENSOR_OP_MATH ? TF32 : EXACT;
    default: return EXACT;
  }
}

}  // namespace
}  // namespace gpusim

using namespace gpusim;

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
  ApiLock lock;
  Device *d = current_device();
  if (!d) return CUBLAS_STATUS_NOT_INITIALIZED;
  cublasContext *c = handles.add(new cublasContext);
  c->device = d->index;
  *h = c;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  ApiLock lock;
  if (!handles.remove(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!stream_of(s)) return CUBLAS_STATUS_INVALID_VALUE;
  c->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  *s = c->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  int base = mode & 0xf;
  if (base != CUBLAS_DEFAULT_MATH && base != CUBLAS_TENSOR_OP_MATH && base != CUBLAS_PEDANTIC_MATH &&
      base != CUBLAS_TF32_TENSOR_OP_MATH)
    return CUBLAS_STATUS_INVALID_VALUE;
  c->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t h, cublasMath_t *mode) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  *mode = c->math;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t mode) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
  c->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t *mode) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  *mode = c->pointer_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetProperty(libraryPropertyType type, int *value) {
  switch (type) {
    case MAJOR_VERSION: *value = CUBLAS_VER_MAJOR; break;
    case MINOR_VERSION: *value = CUBLAS_VER_MINOR; break;
    case PATCH_LEVEL: *value = CUBLAS_VER_PATCH; break;
    default: return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
#define N(x) \
  case x: return #x;
    N(CUBLAS_STATUS_SUCCESS)
    N(CUBLAS_STATUS_NOT_INITIALIZED)
    N(CUBLAS_STATUS_ALLOC_FAILED)
    N(CUBLAS_STATUS_INVALID_VALUE)
    N(CUBLAS_STATUS_ARCH_MISMATCH)
    N(CUBLAS_STATUS_MAPPING_ERROR)
    N(CUBLAS_STATUS_EXECUTION_FAILED)
    N(CUBLAS_STATUS_INTERNAL_ERROR)
    N(CUBLAS_STATUS_NOT_SUPPORTED)
    N(CUBLAS_STATUS_LICENSE_ERROR)
#undef N
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char *cublasGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    default: return "an internal operation failed";
  }
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                              const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                              float *C, int ldc) {
  return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta, float *C, int ldc,
                                         long long sc, int batch) {
  ApiLock lock;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  Gemm g = {
      ta, tb, m,       n,      k, lda,        ldb,        ldc,        batch, sa,
      sb, sc, A,       B,      C, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, false, reduction(c, CUBLAS_COMPUTE_32F, m, n, k),
      0,  0,  nullptr, nullptr};
  if ((c->math & 0xf) == CUBLAS_PEDANTIC_MATH) g.reduce = EXACT;
  return submit(c, batch == 1 && !sa ? "cublasSgemm" : "cublasSgemmStridedBatched", g, alpha, beta);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType at, int lda,
                                          long long sa, const void *B, cudaDataType bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType ct, int ldc, long long sc, int batch,
                                          cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  ApiLock lock;
  (void)algo;
  cublasContext *c = ctx_of(h);
  if (!c) return CUBLAS_STATUS_NOT_INITIALIZED;
  bool f64 = compute == CUBLAS_COMPUTE_64F || compute == CUBLAS_COMPUTE_64F_PEDANTIC;
  bool f32 = compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_PEDANTIC ||
             compute == CUBLAS_COMPUTE_32F_FAST_TF32 || compute == CUBLAS_COMPUTE_32F_FAST_16F ||
             compute == CUBLAS_COMPUTE_32F_FAST_16BF;
  if (!f64 && !f32) return CUBLAS_STATUS_NOT_SUPPORTED;
  // the type combinations cuBLAS documents for these compute types
  if (f64 && (at != CUDA_R_64F || bt != CUDA_R_64F || ct != CUDA_R_64F)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (f32 && (at != bt || at == CUDA_R_64F || (at == CUDA_R_32F && ct != CUDA_R_32F) || (ct != CUDA_R_32F && ct != at)))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  Gemm g = {ta, tb, m,       n,      k, lda, ldb, ldc, batch, sa,
            sb, sc, A,       B,      C, at,  bt,  ct,  f64,   at == CUDA_R_32F ? reduction(c, compute, m, n, k) : EXACT,
            0,  0,  nullptr, nullptr};
  if ((c->math & 0xf) == CUBLAS_PEDANTIC_MATH || compute == CUBLAS_COMPUTE_32F_PEDANTIC) g.reduce = EXACT;
  return submit(c, batch == 1 && !sa ? "cublasGemmEx" : "cublasGemmStridedBatchedEx", g, alpha, beta);
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B, cudaDataType bt,
                            int ldb, const void *beta, void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo) {
  return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc, 0, 1,
                                    compute, algo);
}

}  // extern "C"
