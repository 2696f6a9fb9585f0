// cublas.cc: the cuBLAS entry points the project uses, on the stand-in. Column-major GEMM with
// transposes, leading dimensions, alpha/beta (host or device pointer mode), strided batches and
// GemmEx types (float, half, bfloat16, double). The math mode decides the numerics: FP32 stays
// FP32 unless CUBLAS_TF32_TENSOR_OP_MATH or a FAST compute type allows reduced inputs, which are
// then rounded as tensor cores would read them. Matrices must be device memory inside one live
// allocation; the work is queued on the handle's stream like any other. cuBLASLt's matmul (the
// bias epilogue, the heuristic's algorithms and what they were chosen for) shares the GEMM.
#include <cblas.h>
#include <cublasLt.h>
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
  const void *bias = nullptr;        // cuBLASLt's BIAS epilogue: one value per row of C, of C's type
  // cuBLASLt's GELU epilogues: GELU_AUX writes the gelu's input to aux (C's type, leading dimension
  // aux_ld) and gelu(it) to C; DGELU multiplies the product by the gelu's derivative at aux
  int gelu = 0;  // 0, GELU_AUX or DGELU below
  void *aux = nullptr;
  int aux_ld = 0;
  // cuBLASLt's RELU epilogues: max(v, 0), documented so; as CUTLASS's maximum, a NaN gives 0 (and -0 gives
  // +0), where ddp_train's own relu passes them: what the hardware does is for the GPU's op tests to show
  bool relu = false;
};
enum { GELU_AUX = 1, DGELU = 2 };

// The tanh form of the gelu (what cuBLASLt's GELU epilogues compute) and its derivative.
float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
float gelu_tanh_grad(float x) {
  float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
}

// The epilogue's gelu on the value v of C(i, j).
float gelu_epilogue(const Gemm &g, int i, int j, float v) {
  if (g.gelu == GELU_AUX) {
    store(g.aux, g.ct, (size_t)j * g.aux_ld + i, v);
    return gelu_tanh(v);
  }
  return v * gelu_tanh_grad((float)load(g.aux, g.ct, (size_t)j * g.aux_ld + i));
}

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
      if (g.bias)  // the epilogue: added to the FP32 result, one rounding
        for (int j = 0; j < g.n; j++)
          for (int i = 0; i < g.m; i++) ((float *)c)[(size_t)j * g.ldc + i] += ((const float *)g.bias)[i];
      if (g.gelu)
        for (int j = 0; j < g.n; j++)
          for (int i = 0; i < g.m; i++) {
            float *v = (float *)c + (size_t)j * g.ldc + i;
            *v = gelu_epilogue(g, i, j, *v);
          }
      if (g.relu)
        for (int j = 0; j < g.n; j++)
          for (int i = 0; i < g.m; i++) {
            float *v = (float *)c + (size_t)j * g.ldc + i;
            *v = *v > 0.0f ? *v : 0.0f;
          }
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
          if (g.bias) vf += (float)load(g.bias, g.ct, (size_t)i);
          if (g.gelu) vf = gelu_epilogue(g, i, j, vf);
          if (g.relu) vf = vf > 0.0f ? vf : 0.0f;
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
  // a capture refused it, or a fault broke the context (kernel_faults)
  if (enqueue(s, std::move(op)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  return CUBLAS_STATUS_SUCCESS;
}

// The reduced precision the math mode and compute type allow for FP32 inputs (TF32 needs compute
// capability 8.0: below it FP32 stays FP32). The FAST_16F and FAST_16BF compute types *allow*
// cuBLAS to round the inputs to half or bfloat16 and do not oblige it: it may pick a TF32 or FP32
// kernel for a shape. The stand-in picks one of the three per shape, from GPUSIM_SEED, the same
// each call (a kernel choice is per shape), so that results must hold whichever is picked.
Reduce reduction(cublasMath_t math, cublasComputeType_t ct, int m, int n, int k) {
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
    case CUBLAS_COMPUTE_32F: return has_tf32 && (math & 0xf) == CUBLAS_TF32_TENSOR_OP_MATH ? TF32 : EXACT;
    default: return EXACT;
  }
}

// ---- cuBLASLt: descriptors, the heuristic's algorithms, and checks of the pointers against them ----

struct LtDesc {
  cublasComputeType_t compute;
  cudaDataType scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = nullptr;
  int32_t bias_type = -1;  // -1: D's type
  void *aux = nullptr;     // the GELU epilogues' input matrix
  int64_t aux_ld = 0;
  int32_t aux_type = -1;  // -1: D's type
};

struct LtLayout {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};

struct LtPref {
  uint64_t max_workspace = 0;
  uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_MASK;  // the split-K reduction schemes allowed
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: the alignment the pointers are promised to have
};

Handles<LtDesc> lt_descs;
Handles<LtLayout> lt_layouts;
Handles<LtPref> lt_prefs;

// An algorithm as the stand-in's heuristic hands it out: what it was chosen for (a hash of the
// descriptors), the alignments it relies on (A, B, C, D from the preference, the bias pointer's
// as the descriptor held it) and the workspace it needs.
enum : uint64_t { LT_ALGO_MAGIC = 0x67707573696d4c74ULL };  // "gpusimLt"
struct LtAlgo {
  uint64_t magic, fingerprint;
  uint32_t align[6];  // A, B, C, D, the bias, the gelu's input
  uint64_t workspace;
};
static_assert(sizeof(LtAlgo) <= sizeof(cublasLtMatmulAlgo_t), "LtAlgo fits cuBLASLt's algorithm");

uint64_t lt_fingerprint(const LtDesc *d, const LtLayout *l[4]) {
  uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 0x100000001b3ULL; };
  mix((uint64_t)d->compute), mix((uint64_t)d->scale), mix((uint64_t)d->ta), mix((uint64_t)d->tb);
  mix(d->epilogue), mix((uint64_t)(int64_t)d->bias_type), mix((uint64_t)d->aux_ld), mix((uint64_t)(int64_t)d->aux_type);
  for (int i = 0; i < 4; i++) mix((uint64_t)l[i]->type), mix(l[i]->rows), mix(l[i]->cols), mix((uint64_t)l[i]->ld);
  return h;
}

// The largest power of two (at most 256) that divides the address and the leading dimension's bytes.
uint32_t alignment_of(const void *p, uint64_t ld_bytes) {
  uint64_t v = (uint64_t)(uintptr_t)p | ld_bytes | 256;
  return (uint32_t)(v & (~v + 1));
}

// GELU_AUX for the forward epilogues, DGELU for the backward one, else 0.
int lt_gelu(const LtDesc *d) {
  if (d->epilogue == CUBLASLT_EPILOGUE_GELU_AUX || d->epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) return GELU_AUX;
  return d->epilogue == CUBLASLT_EPILOGUE_DGELU ? DGELU : 0;
}

// The problem the descriptors describe, checked as cublasLtMatmul checks it: NOT_SUPPORTED for what
// the stand-in (and the project) does not use.
cublasStatus_t lt_problem(const LtDesc *d, const LtLayout *l[4]) {
  const LtLayout *a = l[0], *b = l[1], *c = l[2], *dd = l[3];
  if (d->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d->compute != CUBLAS_COMPUTE_32F && d->compute != CUBLAS_COMPUTE_32F_PEDANTIC &&
      d->compute != CUBLAS_COMPUTE_32F_FAST_TF32 && d->compute != CUBLAS_COMPUTE_32F_FAST_16F &&
      d->compute != CUBLAS_COMPUTE_32F_FAST_16BF)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (a->type != b->type || a->type == CUDA_R_64F || (a->type == CUDA_R_32F && dd->type != CUDA_R_32F) ||
      (dd->type != CUDA_R_32F && dd->type != a->type) || c->type != dd->type || c->rows != dd->rows ||
      c->cols != dd->cols)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  uint64_t m = d->ta == CUBLAS_OP_N ? a->rows : a->cols, k = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
  uint64_t kb = d->tb == CUBLAS_OP_N ? b->rows : b->cols, n = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
  if (k != kb || m != dd->rows || n != dd->cols) return CUBLAS_STATUS_INVALID_VALUE;
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < 4; i++)
    if (l[i]->ld < (int64_t)(l[i]->rows > 1 ? l[i]->rows : 1)) return CUBLAS_STATUS_INVALID_VALUE;
  if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && d->epilogue != CUBLASLT_EPILOGUE_BIAS &&
      d->epilogue != CUBLASLT_EPILOGUE_GELU_AUX && d->epilogue != CUBLASLT_EPILOGUE_GELU_AUX_BIAS &&
      d->epilogue != CUBLASLT_EPILOGUE_DGELU && d->epilogue != CUBLASLT_EPILOGUE_RELU &&
      d->epilogue != CUBLASLT_EPILOGUE_RELU_BIAS)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if ((d->epilogue & CUBLASLT_EPILOGUE_BIAS) && d->bias_type != -1 && d->bias_type != (int32_t)dd->type)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (lt_gelu(d)) {  // the gelu's input: laid out as D, rows a multiple of 8, of D's type
    if (d->aux_ld % 8 || d->aux_ld < (int64_t)dd->rows) return CUBLAS_STATUS_INVALID_VALUE;
    if (d->aux_type != -1 && d->aux_type != (int32_t)dd->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace gpusim

using namespace gpusim;

struct cublasLtContext {
  int device = 0;
};

// A cuBLAS or cuBLASLt handle made on the current device, and its end.
template <class T>
static cublasStatus_t create_handle(Handles<T> &live, T **h) {
  ApiLock lock;
  Device *d = current_device();
  if (!d) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  T *c = live.add(new T);
  c->device = d->index;
  *h = c;
  return CUBLAS_STATUS_SUCCESS;
}

template <class T>
static cublasStatus_t destroy_handle(Handles<T> &live, T *h) {
  ApiLock lock;
  if (!live.remove(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

// A cuBLASLt descriptor (the stand-in's T behind the library's opaque pointer) ended.
template <class T>
static cublasStatus_t destroy_descriptor(Handles<T> &live, void *opaque) {
  ApiLock lock;
  T *d = reinterpret_cast<T *>(opaque);
  if (!live.remove(d)) return CUBLAS_STATUS_INVALID_VALUE;
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
  return create_handle(handles, h);
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  return destroy_handle(handles, h);
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
  Gemm g = {ta,         tb,         m,          n,      k,
            lda,        ldb,        ldc,        batch,  sa,
            sb,         sc,         A,          B,      C,
            CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, false,  reduction(c->math, CUBLAS_COMPUTE_32F, m, n, k),
            0,          0,          nullptr,    nullptr};
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
  Gemm g = {
      ta, tb, m,       n,      k, lda, ldb, ldc, batch, sa,
      sb, sc, A,       B,      C, at,  bt,  ct,  f64,   at == CUDA_R_32F ? reduction(c->math, compute, m, n, k) : EXACT,
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

// cuBLASLt: matrix layouts and the matmul descriptor's and preference's attributes the project
// sets; the heuristic returns one algorithm, or none under GPUSIM_CUBLASLT=none (as cuBLASLt does
// for a problem no kernel of it supports).
static Handles<cublasLtContext> lt_handles;

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  return create_handle(lt_handles, h);
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  return destroy_handle(lt_handles, h);
}

size_t cublasLtGetVersion(void) {
  return CUBLAS_VERSION;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute, cudaDataType_t scale) {
  ApiLock lock;
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  LtDesc *d = lt_descs.add(new LtDesc);
  d->compute = compute, d->scale = scale;
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  return destroy_descriptor(lt_descs, desc);
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t bytes) {
  ApiLock lock;
  LtDesc *d = reinterpret_cast<LtDesc *>(desc);
  if (!lt_descs.has(d) || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  auto take = [&](void *field, size_t size) {
    if (bytes != size) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(field, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return take(&d->ta, sizeof d->ta);
    case CUBLASLT_MATMUL_DESC_TRANSB: return take(&d->tb, sizeof d->tb);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return take(&d->epilogue, sizeof d->epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return take(&d->bias, sizeof d->bias);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return take(&d->bias_type, sizeof d->bias_type);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return take(&d->aux, sizeof d->aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return take(&d->aux_ld, sizeof d->aux_ld);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: return take(&d->aux_type, sizeof d->aux_type);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;  // not modelled: the project sets no other
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  ApiLock lock;
  if (!layout || !type_size(type)) return CUBLAS_STATUS_INVALID_VALUE;
  LtLayout *l = lt_layouts.add(new LtLayout{type, rows, cols, ld});
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  return destroy_descriptor(lt_layouts, layout);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
  ApiLock lock;
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(lt_prefs.add(new LtPref));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  return destroy_descriptor(lt_prefs, pref);
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t bytes) {
  ApiLock lock;
  LtPref *p = reinterpret_cast<LtPref *>(pref);
  if (!lt_prefs.has(p) || !buf) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (bytes != sizeof p->max_workspace) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(&p->max_workspace, buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK) {
    if (bytes != sizeof p->reductions) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(&p->reductions, buf, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  int which = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
              : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
              : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
              : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES ? 3
                                                                   : -1;
  if (which < 0) return CUBLAS_STATUS_NOT_SUPPORTED;  // not modelled: the project sets no other
  if (bytes != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  memcpy(&p->align[which], buf, bytes);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t A,
                                              cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                                              cublasLtMatrixLayout_t D, cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned) {
  ApiLock lock;
  const LtDesc *d = reinterpret_cast<const LtDesc *>(desc);
  const LtLayout *l[4] = {reinterpret_cast<LtLayout *>(A), reinterpret_cast<LtLayout *>(B),
                          reinterpret_cast<LtLayout *>(C), reinterpret_cast<LtLayout *>(D)};
  const LtPref *p = reinterpret_cast<const LtPref *>(pref);
  if (!lt_handles.has(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!lt_descs.has(d) || !lt_prefs.has(p) || requested <= 0 || !results || !returned)
    return CUBLAS_STATUS_INVALID_VALUE;
  for (const LtLayout *x : l)
    if (!lt_layouts.has(x)) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  cublasStatus_t st = lt_problem(d, l);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  for (int i = 0; i < 4; i++) {
    size_t elem = type_size(l[i]->type);
    if (p->align[i] < elem || (p->align[i] & (p->align[i] - 1))) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (((d->epilogue & CUBLASLT_EPILOGUE_BIAS) && !d->bias) || (lt_gelu(d) && !d->aux))
    return CUBLAS_STATUS_INVALID_VALUE;
  const char *lt = getenv("GPUSIM_CUBLASLT");
  if (lt && !strcmp(lt, "none")) return CUBLAS_STATUS_NOT_SUPPORTED;
  LtAlgo algo = {LT_ALGO_MAGIC, lt_fingerprint(d, l), {}, 0};
  for (int i = 0; i < 4; i++) algo.align[i] = p->align[i];
  // the bias and the gelu's input are read 16 bytes at a time where they can be
  algo.align[4] = d->bias ? alignment_of(d->bias, 16) : 0;
  algo.align[5] = lt_gelu(d) ? alignment_of(d->aux, 16) : 0;
  // a long k is split, its partial sums kept in the workspace, when the preference allows a
  // workspace and a reduction scheme
  uint64_t k = d->ta == CUBLAS_OP_N ? l[0]->cols : l[0]->rows;
  algo.workspace = k >= 32 && p->max_workspace >= 65536 && (p->reductions & CUBLASLT_REDUCTION_SCHEME_MASK) ? 65536 : 0;
  memset(&results[0], 0, sizeof results[0]);
  memcpy(&results[0].algo, &algo, sizeof algo);
  results[0].workspaceSize = algo.workspace;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t *algo_in, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  ApiLock lock;
  const char *api = "cublasLtMatmul";
  const LtDesc *d = reinterpret_cast<const LtDesc *>(desc);
  const LtLayout *l[4] = {reinterpret_cast<LtLayout *>(Adesc), reinterpret_cast<LtLayout *>(Bdesc),
                          reinterpret_cast<LtLayout *>(Cdesc), reinterpret_cast<LtLayout *>(Ddesc)};
  if (!lt_handles.has(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!lt_descs.has(d) || !alpha || !beta) return CUBLAS_STATUS_INVALID_VALUE;
  for (const LtLayout *x : l)
    if (!lt_layouts.has(x)) return CUBLAS_STATUS_INVALID_VALUE;
  cublasStatus_t st = lt_problem(d, l);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (!algo_in) fatal("%s: no algorithm (the project always passes the heuristic's)", api);
  LtAlgo algo;
  memcpy(&algo, algo_in, sizeof algo);
  if (algo.magic != LT_ALGO_MAGIC) fatal("%s: the algorithm did not come from cublasLtMatmulAlgoGetHeuristic", api);
  if (algo.fingerprint != lt_fingerprint(d, l)) {
    warn("%s: the algorithm was chosen for other descriptors (types, shapes, transposes or epilogue)", api);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const void *ptr[4] = {A, B, C, D};
  static const char *const names[4] = {"A", "B", "C", "D"};
  for (int i = 0; i < 4; i++) {
    uint32_t have = alignment_of(ptr[i], (uint64_t)l[i]->ld * type_size(l[i]->type));
    if (have < algo.align[i]) {
      warn(
          "%s: matrix %s at %p (ld %lld) is %u-byte aligned, but its algorithm was chosen for %u bytes "
          "(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%s_BYTES)",
          api, names[i], ptr[i], (long long)l[i]->ld, have, algo.align[i], names[i]);
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  const bool bias = d->epilogue & CUBLASLT_EPILOGUE_BIAS;
  if (bias && (!d->bias || alignment_of(d->bias, 16) < algo.align[4])) {
    warn("%s: the bias (%p) is less aligned than when the algorithm was chosen (%u bytes)", api, d->bias,
         algo.align[4]);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int gelu = lt_gelu(d);
  if (gelu && (!d->aux || alignment_of(d->aux, 16) < algo.align[5])) {
    warn("%s: the gelu's input (%p) is less aligned than when the algorithm was chosen (%u bytes)", api, d->aux,
         algo.align[5]);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (algo.workspace && (workspace_bytes < algo.workspace || !workspace)) {
    warn("%s: the algorithm needs %llu bytes of workspace, given %zu", api, (unsigned long long)algo.workspace,
         workspace_bytes);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  cublasLtContext *c = h;
  Stream *s = stream_of(stream);
  if (!s) return CUBLAS_STATUS_EXECUTION_FAILED;
  for (int i = 0; i < 2; i++) {
    const void *p = i ? beta : alpha;
    if (in_device_region(p))
      fatal("%s: %s (%p) is device memory but the descriptor's pointer mode is host", api, i ? "beta" : "alpha", p);
  }
  Gemm g = {};
  g.ta = d->ta, g.tb = d->tb;
  g.m = (int)l[3]->rows, g.n = (int)l[3]->cols, g.k = (int)(d->ta == CUBLAS_OP_N ? l[0]->cols : l[0]->rows);
  g.lda = (int)l[0]->ld, g.ldb = (int)l[1]->ld, g.ldc = (int)l[3]->ld, g.batch = 1;
  g.a = A, g.b = B, g.c = D, g.at = l[0]->type, g.bt = l[1]->type, g.ct = l[3]->type;
  // no handle math mode in cuBLASLt: the compute type alone decides
  g.reduce = g.at == CUDA_R_32F && d->compute != CUBLAS_COMPUTE_32F_PEDANTIC
                 ? reduction(CUBLAS_DEFAULT_MATH, d->compute, g.m, g.n, g.k)
                 : EXACT;
  g.alpha = *(const float *)alpha, g.beta = *(const float *)beta;
  g.bias = bias ? d->bias : nullptr;
  g.gelu = gelu, g.aux = d->aux, g.aux_ld = (int)d->aux_ld;
  g.relu = d->epilogue == CUBLASLT_EPILOGUE_RELU || d->epilogue == CUBLASLT_EPILOGUE_RELU_BIAS;
  if (g.m == 0 || g.n == 0) return CUBLAS_STATUS_SUCCESS;
  int ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
  int br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
  std::unique_ptr<FnOp> op(new FnOp);
  const Allocation *used[4] = {
      check_matrix(api, "A", A, g.at, ar, ac, g.lda, 0, 1, c->device),
      check_matrix(api, "B", B, g.bt, br, bc, g.ldb, 0, 1, c->device),
      g.beta != 0 ? check_matrix(api, "C", C, g.ct, g.m, g.n, (int)l[2]->ld, 0, 1, c->device) : nullptr,
      check_matrix(api, "D", D, g.ct, g.m, g.n, g.ldc, 0, 1, c->device)};
  for (const Allocation *a : used)
    if (a) op->uses.push_back(a);
  size_t elem = type_size(g.ct);
  if (bias) {
    const Allocation *a = device_range(g.bias, (size_t)g.m * elem, c->device);
    if (!a)
      fatal("%s: the bias (%d values at %p, %s) does not lie inside one live allocation of device %d", api, g.m, g.bias,
            describe_address(g.bias).c_str(), c->device);
    op->uses.push_back(a);
    declare_access(op.get(), g.bias, (size_t)g.m * elem, false);
  }
  if (gelu) {
    const size_t bytes = extent(g.m, g.n, g.aux_ld) * elem;
    const Allocation *a = device_range(g.aux, bytes, c->device);
    if (!a)
      fatal("%s: the gelu's input (%d x %d, ld %d, at %p, %s) does not lie inside one live allocation of device %d",
            api, g.m, g.n, g.aux_ld, g.aux, describe_address(g.aux).c_str(), c->device);
    op->uses.push_back(a);
    declare_access(op.get(), g.aux, bytes, gelu == GELU_AUX);
  }
  if (algo.workspace) {
    const Allocation *a = device_range(workspace, algo.workspace, c->device);
    if (!a)
      fatal("%s: the workspace (%llu bytes at %p, %s) does not lie inside one live allocation of device %d", api,
            (unsigned long long)algo.workspace, workspace, describe_address(workspace).c_str(), c->device);
    op->uses.push_back(a);
    declare_access(op.get(), workspace, algo.workspace, true);
  }
  declare_access(op.get(), A, extent(ar, ac, g.lda) * type_size(g.at), false);
  declare_access(op.get(), B, extent(br, bc, g.ldb) * type_size(g.bt), false);
  const int ldc_in = (int)l[2]->ld;
  if (g.beta != 0) declare_access(op.get(), C, extent(g.m, g.n, ldc_in) * elem, false);
  declare_access(op.get(), D, extent(g.m, g.n, g.ldc) * elem, true);
  char what[160];
  snprintf(what, sizeof what, "%s (m %d, n %d, k %d%s%s)", api, g.m, g.n, g.k, bias ? ", bias" : "",
           gelu == GELU_AUX ? ", gelu"
           : gelu == DGELU  ? ", gelu's derivative"
           : g.relu         ? ", relu"
                            : "");
  op->what = what;
  op->fn = [g, C, ldc_in]() {
    if (g.beta != 0 && C != g.c)  // D starts as C, then takes the product as C would
      for (int j = 0; j < g.n; j++)
        for (int i = 0; i < g.m; i++) store(g.c, g.ct, (size_t)j * g.ldc + i, load(C, g.ct, (size_t)j * ldc_in + i));
    run_gemm(g);
  };
  // a capture refused it, or a fault broke the context (kernel_faults)
  if (enqueue(s, std::move(op)) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
