// cudnn.cc: the legacy cuDNN convolution API (the calls src/cuda/conv.c makes) on the stand-in.
// - Descriptors: 4-d tensors in NCHW, NHWC or explicit strides; 4-d filters in NCHW or NHWC;
//   2-d convolutions with padding, stride, dilation, both modes and a math type. A dimension that
//   is zero or negative is CUDNN_STATUS_BAD_PARAM, as in cuDNN.
// - Algorithm queries (the _v7 heuristics) return several algorithms, each with its status,
//   workspace size, determinism and math type; the Get*WorkspaceSize calls agree with them.
// - Running an algorithm checks shapes, that the workspace given is at least what it needs
//   (CUDNN_STATUS_BAD_PARAM otherwise) and that every buffer is device memory; alpha and beta are
//   host values. The math type decides the numerics: CUDNN_FMA_MATH is exact FP32, the default
//   and tensor-op math types read FP32 inputs as TF32 (as Ampere and Hopper do; FP32 below compute
//   capability 8.0, which has no TF32). The algorithms
//   cuDNN marks non-deterministic accumulate in an order that changes from call to call.
// - Data types: x, w and y all float (FLOAT_CONFIG), or all half or all bfloat16 with an FP32
//   compute type (PSEUDO_HALF_CONFIG, PSEUDO_BFLOAT16_CONFIG): read exactly, summed in FP32 under
//   every math type, alpha and beta applied in float, rounded to nearest even on store. Mixed types
//   are CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE; 16-bit data with a 16-bit compute type
//   (TRUE_HALF_CONFIG included) is CUDNN_STATUS_NOT_SUPPORTED. Heuristics and workspaces are those
//   of float data.
#include <cblas.h>
#include <cudnn.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "gpusim.h"

struct cudnnContext {
  cudaStream_t stream = nullptr;
  int device = 0;
};
struct cudnnTensorStruct {
  bool set = false;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  int n = 0, c = 0, h = 0, w = 0;
  int sn = 0, sc = 0, sh = 0, sw = 0;  // strides in elements
};
struct cudnnFilterStruct {
  bool set = false;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW;
  int k = 0, c = 0, h = 0, w = 0;
};
struct cudnnConvolutionStruct {
  bool set = false;
  int pad_h = 0, pad_w = 0, u = 1, v = 1, dil_h = 1, dil_w = 1;
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};

namespace gpusim {
namespace {

enum Dir { FWD, BWD_DATA, BWD_FILTER };

Handles<cudnnContext> handles;
Handles<cudnnTensorStruct> tensors;
Handles<cudnnFilterStruct> filters;
Handles<cudnnConvolutionStruct> convolutions;

bool ok(const cudnnTensorStruct *t) {
  return tensors.has(t) && t->set;
}
bool ok(const cudnnFilterStruct *f) {
  return filters.has(f) && f->set;
}
bool ok(const cudnnConvolutionStruct *c) {
  return convolutions.has(c) && c->set;
}
cudnnContext *handle_of(cudnnHandle_t h) {
  return handles.has(h) ? h : nullptr;
}

bool is16(cudnnDataType_t t) {
  return t == CUDNN_DATA_HALF || t == CUDNN_DATA_BFLOAT16;
}
size_t element_bytes(cudnnDataType_t t) {
  return is16(t) ? 2 : sizeof(float);
}

// The configurations supported: FLOAT_CONFIG, and PSEUDO_HALF_CONFIG and PSEUDO_BFLOAT16_CONFIG
// (16-bit data, FP32 compute). TRUE_HALF_CONFIG (half arithmetic) is not modelled.
cudnnStatus_t configuration(const cudnnTensorStruct *x, const cudnnFilterStruct *f, const cudnnConvolutionStruct *cv,
                            const cudnnTensorStruct *y) {
  cudnnDataType_t t = x->type;
  if (f->type != t || y->type != t || (t != CUDNN_DATA_FLOAT && !is16(t))) return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
  if (is16(t) && cv->compute != CUDNN_DATA_FLOAT) return CUDNN_STATUS_NOT_SUPPORTED;
  return CUDNN_STATUS_SUCCESS;
}

// The convolution's shapes, checked for consistency: x (N,C,H,W), w (K,C,R,S), y (N,K,P,Q).
struct Geom {
  int n, c, h, w, k, r, s, p, q;
  cudnnDataType_t type;  // of x, w and y alike
};

cudnnStatus_t geometry(const cudnnTensorStruct *x, const cudnnFilterStruct *f, const cudnnConvolutionStruct *cv,
                       const cudnnTensorStruct *y, Geom *g) {
  if (!ok(x) || !ok(f) || !ok(cv) || !ok(y)) return CUDNN_STATUS_BAD_PARAM;
  if (cudnnStatus_t st = configuration(x, f, cv, y)) return st;
  if (x->c != f->c || y->c != f->k || y->n != x->n) return CUDNN_STATUS_BAD_PARAM;
  int er = (f->h - 1) * cv->dil_h + 1, es = (f->w - 1) * cv->dil_w + 1;
  int p = (x->h + 2 * cv->pad_h - er) / cv->u + 1, q = (x->w + 2 * cv->pad_w - es) / cv->v + 1;
  if (x->h + 2 * cv->pad_h < er || x->w + 2 * cv->pad_w < es || y->h != p || y->w != q) return CUDNN_STATUS_BAD_PARAM;
  *g = Geom{x->n, x->c, x->h, x->w, f->k, f->h, f->w, p, q, x->type};
  return CUDNN_STATUS_SUCCESS;
}

bool tf32(const cudnnConvolutionStruct *cv) {
  // FP32 data on tensor cores reads TF32, from compute capability 8.0 (Ampere) on
  return cv->math != CUDNN_FMA_MATH && config().cc_major >= 8;
}

// Whether tensor-core kernels exist for the shape: 16-bit data needs channel counts that are
// multiples of 8 (a first layer of 1 or 3 channels has none) and compute capability 7.0, FP32
// data (as TF32) needs 8.0.
bool tensor_cores(const Geom &g) {
  if (is16(g.type)) return config().cc_major >= 7 && g.c % 8 == 0 && g.k % 8 == 0;
  return config().cc_major >= 8;
}

// The kernels a math type selects, as cuDNN reports them per algorithm: CUDNN_FMA_MATH selects
// FMA kernels; the tensor-op math types select tensor-core kernels where the shape has them and
// the default kernels where it does not ("permitted, not enforced"); CUDNN_DEFAULT_MATH selects
// the default kernels.
cudnnMathType_t kernels_for(cudnnMathType_t math, const Geom &g) {
  if (math == CUDNN_FMA_MATH) return CUDNN_FMA_MATH;
  if (math != CUDNN_DEFAULT_MATH && tensor_cores(g)) return CUDNN_TENSOR_OP_MATH;
  return CUDNN_DEFAULT_MATH;
}

// One algorithm's description for a shape and its kernels' math type: supported or not, its
// workspace (sized as for FP32 data; the default and FMA kernels on 16-bit data also widen the
// operands to FP32 in it), its determinism.
struct Algo {
  int id;
  cudnnStatus_t status;
  size_t memory;
  cudnnDeterminism_t determinism;
  cudnnMathType_t math;
};

size_t pow2_at_least(size_t x) {
  size_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

Algo describe(Dir dir, int id, const Geom &g, const cudnnConvolutionStruct *cv, cudnnMathType_t math) {
  size_t f = sizeof(float), crs = (size_t)g.c * g.r * g.s, pq = (size_t)g.p * g.q;
  bool unit = cv->u == 1 && cv->v == 1 && cv->dil_h == 1 && cv->dil_w == 1;
  bool is3x3 = g.r == 3 && g.s == 3;
  size_t fft_tile = pow2_at_least((size_t)(g.h + 2 * cv->pad_h)) * pow2_at_least((size_t)(g.w + 2 * cv->pad_w));
  size_t fft = 2 * f * fft_tile * ((size_t)g.n * g.c + (size_t)g.k * g.c + (size_t)g.n * g.k);
  size_t wino = f * 16 * ((size_t)g.n * g.c + (size_t)g.k * g.c + (size_t)g.n * g.k) * ((pq + 3) / 4);
  Algo a = {id, CUDNN_STATUS_SUCCESS, 0, CUDNN_DETERMINISTIC, math};
  auto unsupported = [&]() { a.status = CUDNN_STATUS_NOT_SUPPORTED; };
  if (dir == FWD) {
    switch (id) {
      case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM: break;
      case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM: a.memory = f * 2 * crs + 256; break;
      case CUDNN_CONVOLUTION_FWD_ALGO_GEMM: a.memory = f * crs * pq; break;
      case CUDNN_CONVOLUTION_FWD_ALGO_DIRECT: unsupported(); break;
      case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
        a.memory = fft;
        if (!unit || g.h > 256 || g.w > 256) unsupported();
        break;
      case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
        a.memory = fft / 4 + 4096;
        if (!unit) unsupported();
        break;
      case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
        a.memory = 4096;
        if (!unit || !is3x3) unsupported();
        break;
      case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
        a.memory = wino;
        if (!unit || !is3x3) unsupported();
        break;
    }
  } else if (dir == BWD_DATA) {
    switch (id) {
      case CUDNN_CONVOLUTION_BWD_DATA_ALGO_0: a.determinism = CUDNN_NON_DETERMINISTIC; break;
      case CUDNN_CONVOLUTION_BWD_DATA_ALGO_1: a.memory = f * crs * pq; break;
      case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT:
        a.memory = fft;
        if (!unit || g.h > 256 || g.w > 256) unsupported();
        break;
      case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING:
        a.memory = fft / 4 + 4096;
        if (!unit) unsupported();
        break;
      case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD:
        a.memory = 4096;
        if (!unit || !is3x3) unsupported();
        break;
      case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED:
        a.memory = wino;
        if (!unit || !is3x3) unsupported();
        break;
    }
  } else {
    switch (id) {
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0: a.determinism = CUDNN_NON_DETERMINISTIC; break;
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1: a.memory = f * crs * pq; break;
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT:
        a.memory = fft;
        if (!unit || g.h > 256 || g.w > 256) unsupported();
        break;
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3:
        a.memory = f * (size_t)g.k * crs;
        a.determinism = CUDNN_NON_DETERMINISTIC;
        break;
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD: unsupported(); break;
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED:
        a.memory = wino;
        if (!unit || !is3x3) unsupported();
        break;
      case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING:
        a.memory = fft / 4 + 4096;
        if (!unit) unsupported();
        break;
    }
    // tensor-core filter gradients of 16-bit data split the reduction and add with atomics
    if (math == CUDNN_TENSOR_OP_MATH && is16(g.type) && id == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1)
      a.determinism = CUDNN_NON_DETERMINISTIC;
  }
  if (is16(g.type) && math != CUDNN_TENSOR_OP_MATH)
    a.memory += f * ((size_t)g.n * g.c * g.h * g.w + (size_t)g.k * crs + (size_t)g.n * g.k * pq);
  return a;
}

int algo_count(Dir dir) {
  if (dir == FWD) return CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  if (dir == BWD_DATA) return CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  return CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
}

// The heuristics' ranking: supported algorithms first, "fastest" first, each with the math type
// of its kernels: where the descriptor permits tensor ops and the shape has tensor-core kernels,
// each algorithm is listed twice, its tensor-core kernels (ranked first) and its default ones. As
// in cuDNN, the order depends on the shape: small channel counts favour the implicit GEMMs and the
// non-deterministic atomics-based backward algorithms; 3x3 unit-stride layers favour Winograd.
std::vector<Algo> ranked(Dir dir, const Geom &g, const cudnnConvolutionStruct *cv) {
  std::vector<Algo> all;
  const cudnnMathType_t mine = kernels_for(cv->math, g);
  for (int id = 0; id < algo_count(dir); id++) {
    all.push_back(describe(dir, id, g, cv, mine));
    if (mine == CUDNN_TENSOR_OP_MATH) all.push_back(describe(dir, id, g, cv, CUDNN_DEFAULT_MATH));
  }
  auto score = [&](const Algo &a) {
    if (a.status != CUDNN_STATUS_SUCCESS) return 1e30;
    double s = (double)a.memory / 1e6;                       // workspace traffic
    if (a.determinism == CUDNN_NON_DETERMINISTIC) s -= 1.0;  // atomics are quick
    if (g.r == 3 && g.s == 3 && a.memory > 4096 && g.c >= 64) s -= 2.0;
    if (a.math == CUDNN_TENSOR_OP_MATH) s -= 4.0;  // tensor cores are quicker still
    return s + 0.01 * a.id;
  };
  std::stable_sort(all.begin(), all.end(), [&](const Algo &a, const Algo &b) { return score(a) < score(b); });
  return all;
}

template <class Perf>
cudnnStatus_t heuristics(Dir dir, const Geom &g, const cudnnConvolutionStruct *cv, int requested, int *returned,
                         Perf *perf) {
  if (requested < 1 || !returned || !perf) return CUDNN_STATUS_BAD_PARAM;
  std::vector<Algo> r = ranked(dir, g, cv);
  int n = std::min(requested, (int)r.size());
  for (int i = 0; i < n; i++) {
    memset(&perf[i], 0, sizeof perf[i]);
    perf[i].algo = (decltype(perf[i].algo))r[(size_t)i].id;
    perf[i].status = r[(size_t)i].status;
    perf[i].time = -1.0f;  // heuristics do not time anything
    perf[i].memory = r[(size_t)i].memory;
    perf[i].determinism = r[(size_t)i].determinism;
    perf[i].mathType = r[(size_t)i].math;
  }
  *returned = n;
  return CUDNN_STATUS_SUCCESS;
}

// For the kernels the descriptor's math type selects now (cudnnSetConvolutionMathType first).
cudnnStatus_t workspace(Dir dir, const Geom &g, const cudnnConvolutionStruct *cv, int algo, size_t *bytes) {
  if (algo < 0 || algo >= algo_count(dir) || !bytes) return CUDNN_STATUS_BAD_PARAM;
  Algo a = describe(dir, algo, g, cv, kernels_for(cv->math, g));
  if (a.status != CUDNN_STATUS_SUCCESS) return a.status;
  *bytes = a.memory;
  return CUDNN_STATUS_SUCCESS;
}

size_t tensor_extent(const cudnnTensorStruct *t) {
  return (size_t)(t->n - 1) * t->sn + (size_t)(t->c - 1) * t->sc + (size_t)(t->h - 1) * t->sh +
         (size_t)(t->w - 1) * t->sw + 1;
}

const Allocation *check_buffer(const char *api, const char *name, const void *p, size_t bytes, int dev) {
  const Allocation *a = device_range(p, bytes, dev);
  if (!a)
    fatal("%s: %s (%zu bytes at %p, %s) is not inside one live allocation of device %d", api, name, bytes, p,
          describe_address(p).c_str(), dev);
  return a;
}

// Everything a queued convolution needs, copied at call time.
struct Conv {
  Dir dir;
  Geom g;
  cudnnTensorStruct x, y;  // y: the output side (dy for the backward passes)
  cudnnFilterStruct f;
  cudnnConvolutionStruct cv;
  const void *xp, *yp, *wp;  // inputs, of the data type of x
  void *out;                 // y, dx or dw
  float alpha, beta;
  bool deterministic;
  uint64_t seed;
};

// Filter element (k, c, r, s) with the layout's offset; the convolution mode flips r and s.
size_t filter_index(const Conv &cv, int k, int c, int r, int s) {
  const cudnnFilterStruct &f = cv.f;
  if (cv.cv.mode == CUDNN_CONVOLUTION) r = f.h - 1 - r, s = f.w - 1 - s;
  if (f.format == CUDNN_TENSOR_NHWC) return (((size_t)k * f.h + r) * f.w + s) * f.c + c;
  return (((size_t)k * f.c + c) * f.h + r) * f.w + s;
}

// Scratch reused between calls (queued work runs one op at a time).
struct Scratch {
  std::vector<float> W, col, Y, dx, acc;
};

// The convolution on FP32 buffers (16-bit data arrives widened, see run_conv).
void conv_f32(const Conv &cv) {
  static Scratch sc;
  const Geom &g = cv.g;
  const int crs = g.c * g.r * g.s, pq = g.p * g.q;
  const bool round = cv.x.type == CUDNN_DATA_FLOAT && tf32(&cv.cv);  // 16-bit inputs are exact in TF32
  const float *xp = static_cast<const float *>(cv.xp), *yp = static_cast<const float *>(cv.yp),
              *wp = static_cast<const float *>(cv.wp);
  float *out = static_cast<float *>(cv.out);
  auto rd = [&](float v) { return round ? to_tf32(v) : v; };
  const cudnnTensorStruct &x = cv.x, &y = cv.y;
  const int u = cv.cv.u, v = cv.cv.v, ph = cv.cv.pad_h, pw = cv.cv.pad_w, dh = cv.cv.dil_h, dw = cv.cv.dil_w;
  std::vector<float> &W = sc.W, &col = sc.col, &Y = sc.Y;
  W.resize((size_t)g.k * crs);
  col.resize((size_t)crs * pq);
  Y.resize((size_t)g.k * pq);
  // W as (K, CRS)
  if (cv.dir != BWD_FILTER)
    for (int k = 0; k < g.k; k++)
      for (int c = 0; c < g.c; c++)
        for (int r = 0; r < g.r; r++)
          for (int s = 0; s < g.s; s++)
            W[(size_t)k * crs + (c * g.r + r) * g.s + s] = rd(wp[filter_index(cv, k, c, r, s)]);
  // col(CRS, PQ) of image n: x at (p*u - pad + r*dil, q*v - pad + s*dil), 0 outside
  const bool unit_w = v == 1 && x.sw == 1 && !round;  // rows copy as they are
  auto im2col = [&](int n) {
    const float *xn = xp + (size_t)n * x.sn;
    float *row = col.data();
    for (int c = 0; c < g.c; c++)
      for (int r = 0; r < g.r; r++)
        for (int s = 0; s < g.s; s++) {
          int iw0 = s * dw - pw;
          // the q range whose input column is inside the image
          int q0 = iw0 >= 0 ? 0 : (-iw0 + v - 1) / v, q1 = (g.w - iw0 + v - 1) / v;
          if (q1 > g.q) q1 = g.q;
          if (q0 > q1) q0 = q1;
          for (int p = 0; p < g.p; p++, row += g.q) {
            int ih = p * u - ph + r * dh;
            if (ih < 0 || ih >= g.h) {
              memset(row, 0, (size_t)g.q * sizeof(float));
              continue;
            }
            const float *xr = xn + (size_t)c * x.sc + (size_t)ih * x.sh;
            for (int q = 0; q < q0; q++) row[q] = 0.0f;
            if (unit_w)
              memcpy(row + q0, xr + iw0 + q0, (size_t)(q1 - q0) * sizeof(float));
            else
              for (int q = q0; q < q1; q++) row[q] = rd(xr[(size_t)(iw0 + q * v) * x.sw]);
            for (int q = q1; q < g.q; q++) row[q] = 0.0f;
          }
        }
  };
  // dY (K, PQ) of image n, gathered from its strides
  auto gather_y = [&](int n) {
    float *o = Y.data();
    for (int k = 0; k < g.k; k++)
      for (int p = 0; p < g.p; p++, o += g.q) {
        const float *yr = yp + (size_t)n * y.sn + (size_t)k * y.sc + (size_t)p * y.sh;
        if (y.sw == 1 && !round)
          memcpy(o, yr, (size_t)g.q * sizeof(float));
        else
          for (int q = 0; q < g.q; q++) o[q] = rd(yr[(size_t)q * y.sw]);
      }
  };
  Rng rng(cv.seed);
  const float alpha = cv.alpha, beta = cv.beta;
  if (cv.dir == FWD) {
    for (int n = 0; n < g.n; n++) {
      im2col(n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g.k, pq, crs, 1.0f, W.data(), crs, col.data(), pq, 0.0f,
                  Y.data(), pq);
      const float *in = Y.data();
      for (int k = 0; k < g.k; k++)
        for (int p = 0; p < g.p; p++) {
          float *o = out + (size_t)n * y.sn + (size_t)k * y.sc + (size_t)p * y.sh;
          for (int q = 0; q < g.q; q++, in++) {
            float val = alpha * *in;
            o[(size_t)q * y.sw] = beta != 0 ? val + beta * o[(size_t)q * y.sw] : val;  // beta 0: y is not read
          }
        }
    }
  } else if (cv.dir == BWD_DATA) {
    std::vector<float> &dx = sc.dx;
    dx.resize((size_t)g.c * g.h * g.w);
    std::vector<int> offs((size_t)g.r * g.s);
    for (int i = 0; i < g.r * g.s; i++) offs[(size_t)i] = i;
    for (int n = 0; n < g.n; n++) {
      gather_y(n);
      // dcol(CRS, PQ) = W^T dY
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, crs, pq, g.k, 1.0f, W.data(), crs, Y.data(), pq, 0.0f,
                  col.data(), pq);
      std::fill(dx.begin(), dx.end(), 0.0f);
      if (!cv.deterministic) std::shuffle(offs.begin(), offs.end(), rng);  // atomics land in any order
      for (int c = 0; c < g.c; c++)
        for (int o : offs) {
          int r = o / g.s, s = o % g.s;
          const float *row = &col[(size_t)((c * g.r + r) * g.s + s) * pq];
          for (int p = 0; p < g.p; p++, row += g.q) {
            int ih = p * u - ph + r * dh;
            if (ih < 0 || ih >= g.h) continue;
            float *d = &dx[((size_t)c * g.h + ih) * g.w];
            for (int q = 0, iw = s * dw - pw; q < g.q; q++, iw += v)
              if (iw >= 0 && iw < g.w) d[iw] += row[q];
          }
        }
      const float *in = dx.data();
      for (int c = 0; c < g.c; c++)
        for (int ih = 0; ih < g.h; ih++) {
          float *o = out + (size_t)n * x.sn + (size_t)c * x.sc + (size_t)ih * x.sh;
          for (int iw = 0; iw < g.w; iw++, in++) {
            float val = alpha * *in;
            o[(size_t)iw * x.sw] = beta != 0 ? val + beta * o[(size_t)iw * x.sw] : val;
          }
        }
    }
  } else {
    // dW(K, CRS) = sum over images of dY(K, PQ) col(CRS, PQ)^T, images summed in a fixed order
    // (deterministic algorithms) or in a different order on every call (the others)
    std::vector<int> order((size_t)g.n);
    for (int n = 0; n < g.n; n++) order[(size_t)n] = n;
    if (!cv.deterministic) std::shuffle(order.begin(), order.end(), rng);
    std::vector<float> &acc = sc.acc;
    acc.assign((size_t)g.k * crs, 0.0f);
    for (int n : order) {
      im2col(n);
      gather_y(n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g.k, crs, pq, 1.0f, Y.data(), pq, col.data(), pq, 1.0f,
                  acc.data(), crs);
    }
    for (int k = 0; k < g.k; k++)
      for (int c = 0; c < g.c; c++)
        for (int r = 0; r < g.r; r++)
          for (int s = 0; s < g.s; s++) {
            float *o = &out[filter_index(cv, k, c, r, s)];
            float val = alpha * acc[(size_t)k * crs + (c * g.r + r) * g.s + s];
            *o = beta != 0 ? val + beta * *o : val;
          }
  }
}

// Calls fn(offset) for each element of t.
template <class Fn>
void each_element(const cudnnTensorStruct &t, Fn fn) {
  for (int n = 0; n < t.n; n++)
    for (int c = 0; c < t.c; c++)
      for (int h = 0; h < t.h; h++)
        for (int w = 0; w < t.w; w++) fn((size_t)n * t.sn + (size_t)c * t.sc + (size_t)h * t.sh + (size_t)w * t.sw);
}

// A filter as a packed tensor of its data type (both filter layouts are packed).
cudnnTensorStruct as_tensor(const cudnnFilterStruct &f) {
  cudnnTensorStruct t;
  t.set = true;
  t.type = f.type;
  t.n = f.k, t.c = f.c, t.h = f.h, t.w = f.w;
  t.sn = f.c * f.h * f.w, t.sc = f.h * f.w, t.sh = f.w, t.sw = 1;
  return t;
}

// t's 16-bit elements at p, read exactly as floats at the same offsets of v (zeros between them).
void widen(const cudnnTensorStruct &t, const void *p, std::vector<float> &v) {
  const uint16_t *s = static_cast<const uint16_t *>(p);
  const bool half = t.type == CUDNN_DATA_HALF;
  v.assign(tensor_extent(&t), 0.0f);
  each_element(t, [&](size_t i) { v[i] = half ? half_to_float(s[i]) : bf16_to_float(s[i]); });
}

// v's elements rounded to t's 16-bit type (to nearest even), stored at p; the gaps are not touched.
void narrow(const cudnnTensorStruct &t, const std::vector<float> &v, void *p) {
  uint16_t *d = static_cast<uint16_t *>(p);
  const bool half = t.type == CUDNN_DATA_HALF;
  each_element(t, [&](size_t i) { d[i] = half ? float_to_half(v[i]) : float_to_bf16(v[i]); });
}

// The convolution: FP32 data as it is; 16-bit data read exactly, computed in FP32 (no TF32, the
// inputs have fewer bits already), alpha and beta applied in float, the result rounded on store.
void run_conv(const Conv &cv) {
  if (cv.x.type == CUDNN_DATA_FLOAT) return conv_f32(cv);
  static std::vector<float> X, Y, W, O;
  const cudnnTensorStruct f = as_tensor(cv.f);
  const cudnnTensorStruct &out = cv.dir == FWD ? cv.y : cv.dir == BWD_DATA ? cv.x : f;
  Conv c = cv;
  if (cv.xp) widen(cv.x, cv.xp, X), c.xp = X.data();
  if (cv.yp) widen(cv.y, cv.yp, Y), c.yp = Y.data();
  if (cv.wp) widen(f, cv.wp, W), c.wp = W.data();
  if (cv.beta != 0)
    widen(out, cv.out, O);
  else
    O.assign(tensor_extent(&out), 0.0f);  // beta 0: the output is not read
  c.out = O.data();
  conv_f32(c);
  narrow(out, O, cv.out);
}

float host_scalar(const char *api, const char *name, const void *p) {
  if (!p) fatal("%s: %s is NULL", api, name);
  if (in_device_region(p))
    fatal("%s: %s (%p) is device memory; cuDNN's alpha and beta are host pointers", api, name, p);
  return *static_cast<const float *>(p);
}

cudnnStatus_t submit(cudnnContext *h, const char *api, Conv cv, int algo, void *ws, size_t ws_bytes, const void *alpha,
                     const void *beta) {
  if (algo < 0 || algo >= algo_count(cv.dir)) return CUDNN_STATUS_BAD_PARAM;
  Algo a = describe(cv.dir, algo, cv.g, &cv.cv, kernels_for(cv.cv.math, cv.g));
  if (a.status != CUDNN_STATUS_SUCCESS) return a.status;
  if (ws_bytes < a.memory) return CUDNN_STATUS_BAD_PARAM;  // the workspace is smaller than the algorithm needs
  Stream *s = stream_of(h->stream);
  if (!s) return CUDNN_STATUS_EXECUTION_FAILED;
  cv.alpha = host_scalar(api, "alpha", alpha);
  cv.beta = host_scalar(api, "beta", beta);
  cv.deterministic = a.determinism == CUDNN_DETERMINISTIC;
  cv.seed = next_seed();
  std::unique_ptr<FnOp> op(new FnOp);
  int dev = h->device;
  size_t fbytes = (size_t)cv.f.k * cv.f.c * cv.f.h * cv.f.w * element_bytes(cv.f.type);
  const Allocation *x = check_buffer(api, cv.dir == BWD_DATA ? "dx" : "x", cv.dir == BWD_DATA ? cv.out : cv.xp,
                                     tensor_extent(&cv.x) * element_bytes(cv.x.type), dev);
  const Allocation *y = check_buffer(api, cv.dir == FWD ? "y" : "dy", cv.dir == FWD ? cv.out : cv.yp,
                                     tensor_extent(&cv.y) * element_bytes(cv.y.type), dev);
  const Allocation *w =
      check_buffer(api, cv.dir == BWD_FILTER ? "dw" : "w", cv.dir == BWD_FILTER ? cv.out : cv.wp, fbytes, dev);
  op->uses = {x, y, w};
  if (a.memory) op->uses.push_back(check_buffer(api, "workSpace", ws, a.memory, dev));
  // the bytes it reads and writes (hazard.cc): the output is read too when beta is not 0
  const size_t xbytes = tensor_extent(&cv.x) * element_bytes(cv.x.type),
               ybytes = tensor_extent(&cv.y) * element_bytes(cv.y.type),
               obytes = cv.dir == FWD        ? ybytes
                        : cv.dir == BWD_DATA ? xbytes
                                             : fbytes;
  if (cv.xp) declare_access(op.get(), cv.xp, xbytes, false);
  if (cv.yp) declare_access(op.get(), cv.yp, ybytes, false);
  if (cv.wp) declare_access(op.get(), cv.wp, fbytes, false);
  if (cv.beta != 0) declare_access(op.get(), cv.out, obytes, false);
  declare_access(op.get(), cv.out, obytes, true);
  declare_access(op.get(), ws, a.memory, false);
  declare_access(op.get(), ws, a.memory, true);
  char what[160];
  snprintf(what, sizeof what, "%s (algorithm %d)", api, algo);
  op->what = what;
  op->fn = [cv, again = false]() mutable {  // a graph runs it again: a non-deterministic order changes
    if (again) cv.seed = next_seed();
    again = true;
    run_conv(cv);
  };
  // a capture refused it, or a fault broke the context (kernel_faults)
  if (enqueue(s, std::move(op)) != cudaSuccess) return CUDNN_STATUS_EXECUTION_FAILED;
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace
}  // namespace gpusim

using namespace gpusim;

extern "C" {

size_t cudnnGetVersion(void) {
  return CUDNN_VERSION;
}

const char *cudnnGetErrorString(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE: return "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
    default: return "CUDNN_STATUS_UNKNOWN";
  }
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *h) {
  ApiLock lock;
  Device *d = current_device();
  if (!d) return CUDNN_STATUS_NOT_INITIALIZED;
  cudnnContext *c = handles.add(new cudnnContext);
  c->device = d->index;
  *h = c;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t h) {
  ApiLock lock;
  if (!handles.remove(h)) return CUDNN_STATUS_BAD_PARAM;
  delete h;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) {
  ApiLock lock;
  if (!handle_of(h) || !stream_of(s)) return CUDNN_STATUS_BAD_PARAM;
  h->stream = s;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetStream(cudnnHandle_t h, cudaStream_t *s) {
  ApiLock lock;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  *s = h->stream;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *t) {
  ApiLock lock;
  *t = tensors.add(new cudnnTensorStruct);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t t) {
  ApiLock lock;
  if (!tensors.remove(t)) return CUDNN_STATUS_BAD_PARAM;
  delete t;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetTensor4dDescriptorEx(cudnnTensorDescriptor_t t, cudnnDataType_t type, int n, int c, int h, int w,
                                           int sn, int sc, int sh, int sw) {
  ApiLock lock;
  if (!tensors.has(t)) return CUDNN_STATUS_BAD_PARAM;
  if (n <= 0 || c <= 0 || h <= 0 || w <= 0 || sn <= 0 || sc <= 0 || sh <= 0 || sw <= 0) return CUDNN_STATUS_BAD_PARAM;
  if (type != CUDNN_DATA_FLOAT && type != CUDNN_DATA_DOUBLE && type != CUDNN_DATA_HALF && type != CUDNN_DATA_BFLOAT16)
    return CUDNN_STATUS_BAD_PARAM;
  *t = cudnnTensorStruct();
  t->set = true;
  t->type = type;
  t->n = n, t->c = c, t->h = h, t->w = w;
  t->sn = sn, t->sc = sc, t->sh = sh, t->sw = sw;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t t, cudnnTensorFormat_t format, cudnnDataType_t type,
                                         int n, int c, int h, int w) {
  if (n <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
  if (format == CUDNN_TENSOR_NCHW) return cudnnSetTensor4dDescriptorEx(t, type, n, c, h, w, c * h * w, h * w, w, 1);
  if (format == CUDNN_TENSOR_NHWC) return cudnnSetTensor4dDescriptorEx(t, type, n, c, h, w, h * w * c, 1, w * c, c);
  return CUDNN_STATUS_BAD_PARAM;
}

cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t *f) {
  ApiLock lock;
  *f = filters.add(new cudnnFilterStruct);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t f) {
  ApiLock lock;
  if (!filters.remove(f)) return CUDNN_STATUS_BAD_PARAM;
  delete f;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t f, cudnnDataType_t type, cudnnTensorFormat_t format,
                                         int k, int c, int h, int w) {
  ApiLock lock;
  if (!filters.has(f)) return CUDNN_STATUS_BAD_PARAM;
  if (k <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
  if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC) return CUDNN_STATUS_BAD_PARAM;
  *f = cudnnFilterStruct();
  f->set = true;
  f->type = type;
  f->format = format;
  f->k = k, f->c = c, f->h = h, f->w = w;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t *c) {
  ApiLock lock;
  *c = convolutions.add(new cudnnConvolutionStruct);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t c) {
  ApiLock lock;
  if (!convolutions.remove(c)) return CUDNN_STATUS_BAD_PARAM;
  delete c;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t cv, int pad_h, int pad_w, int u, int v,
                                              int dil_h, int dil_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t compute) {
  ApiLock lock;
  if (!convolutions.has(cv)) return CUDNN_STATUS_BAD_PARAM;
  if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dil_h <= 0 || dil_w <= 0) return CUDNN_STATUS_BAD_PARAM;
  if (mode != CUDNN_CONVOLUTION && mode != CUDNN_CROSS_CORRELATION) return CUDNN_STATUS_BAD_PARAM;
  cudnnMathType_t math = cv->math;
  *cv = cudnnConvolutionStruct();
  cv->set = true;
  cv->pad_h = pad_h, cv->pad_w = pad_w, cv->u = u, cv->v = v, cv->dil_h = dil_h, cv->dil_w = dil_w;
  cv->mode = mode;
  cv->compute = compute;
  cv->math = math;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t cv, cudnnMathType_t math) {
  ApiLock lock;
  if (!convolutions.has(cv)) return CUDNN_STATUS_BAD_PARAM;
  if (math != CUDNN_DEFAULT_MATH && math != CUDNN_TENSOR_OP_MATH && math != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION &&
      math != CUDNN_FMA_MATH)
    return CUDNN_STATUS_BAD_PARAM;
  cv->math = math;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionMathType(cudnnConvolutionDescriptor_t cv, cudnnMathType_t *math) {
  ApiLock lock;
  if (!convolutions.has(cv)) return CUDNN_STATUS_BAD_PARAM;
  *math = cv->math;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolution2dForwardOutputDim(const cudnnConvolutionDescriptor_t cv,
                                                    const cudnnTensorDescriptor_t x, const cudnnFilterDescriptor_t f,
                                                    int *n, int *c, int *h, int *w) {
  ApiLock lock;
  if (!ok(cv) || !ok(x) || !ok(f) || x->c != f->c) return CUDNN_STATUS_BAD_PARAM;
  int er = (f->h - 1) * cv->dil_h + 1, es = (f->w - 1) * cv->dil_w + 1;
  if (x->h + 2 * cv->pad_h < er || x->w + 2 * cv->pad_w < es) return CUDNN_STATUS_BAD_PARAM;
  *n = x->n;
  *c = f->k;
  *h = (x->h + 2 * cv->pad_h - er) / cv->u + 1;
  *w = (x->w + 2 * cv->pad_w - es) / cv->v + 1;
  return CUDNN_STATUS_SUCCESS;
}

// Heuristics list an algorithm once per kind of kernel (tensor-core and default): twice the count.
cudnnStatus_t cudnnGetConvolutionForwardAlgorithmMaxCount(cudnnHandle_t h, int *count) {
  ApiLock lock;
  if (!handle_of(h) || !count) return CUDNN_STATUS_BAD_PARAM;
  *count = 2 * CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnnHandle_t h, int *count) {
  ApiLock lock;
  if (!handle_of(h) || !count) return CUDNN_STATUS_BAD_PARAM;
  *count = 2 * CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnnHandle_t h, int *count) {
  ApiLock lock;
  if (!handle_of(h) || !count) return CUDNN_STATUS_BAD_PARAM;
  *count = 2 * CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, const cudnnTensorDescriptor_t x,
                                                     const cudnnFilterDescriptor_t f,
                                                     const cudnnConvolutionDescriptor_t cv,
                                                     const cudnnTensorDescriptor_t y, const int requested,
                                                     int *returned, cudnnConvolutionFwdAlgoPerf_t *perf) {
  ApiLock lock;
  Geom g;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  cudnnStatus_t st = geometry(x, f, cv, y, &g);
  return st ? st : heuristics(FWD, g, cv, requested, returned, perf);
}

cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t h, const cudnnFilterDescriptor_t f,
                                                          const cudnnTensorDescriptor_t dy,
                                                          const cudnnConvolutionDescriptor_t cv,
                                                          const cudnnTensorDescriptor_t dx, const int requested,
                                                          int *returned, cudnnConvolutionBwdDataAlgoPerf_t *perf) {
  ApiLock lock;
  Geom g;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  cudnnStatus_t st = geometry(dx, f, cv, dy, &g);
  return st ? st : heuristics(BWD_DATA, g, cv, requested, returned, perf);
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t h, const cudnnTensorDescriptor_t x,
                                                            const cudnnTensorDescriptor_t dy,
                                                            const cudnnConvolutionDescriptor_t cv,
                                                            const cudnnFilterDescriptor_t dw, const int requested,
                                                            int *returned, cudnnConvolutionBwdFilterAlgoPerf_t *perf) {
  ApiLock lock;
  Geom g;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  cudnnStatus_t st = geometry(x, dw, cv, dy, &g);
  return st ? st : heuristics(BWD_FILTER, g, cv, requested, returned, perf);
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t h, const cudnnTensorDescriptor_t x,
                                                      const cudnnFilterDescriptor_t f,
                                                      const cudnnConvolutionDescriptor_t cv,
                                                      const cudnnTensorDescriptor_t y, cudnnConvolutionFwdAlgo_t algo,
                                                      size_t *bytes) {
  ApiLock lock;
  Geom g;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  cudnnStatus_t st = geometry(x, f, cv, y, &g);
  return st ? st : workspace(FWD, g, cv, algo, bytes);
}

cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(cudnnHandle_t h, const cudnnFilterDescriptor_t f,
                                                           const cudnnTensorDescriptor_t dy,
                                                           const cudnnConvolutionDescriptor_t cv,
                                                           const cudnnTensorDescriptor_t dx,
                                                           cudnnConvolutionBwdDataAlgo_t algo, size_t *bytes) {
  ApiLock lock;
  Geom g;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  cudnnStatus_t st = geometry(dx, f, cv, dy, &g);
  return st ? st : workspace(BWD_DATA, g, cv, algo, bytes);
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(cudnnHandle_t h, const cudnnTensorDescriptor_t x,
                                                             const cudnnTensorDescriptor_t dy,
                                                             const cudnnConvolutionDescriptor_t cv,
                                                             const cudnnFilterDescriptor_t dw,
                                                             cudnnConvolutionBwdFilterAlgo_t algo, size_t *bytes) {
  ApiLock lock;
  Geom g;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  cudnnStatus_t st = geometry(x, dw, cv, dy, &g);
  return st ? st : workspace(BWD_FILTER, g, cv, algo, bytes);
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha, const cudnnTensorDescriptor_t xd,
                                      const void *x, const cudnnFilterDescriptor_t wd, const void *w,
                                      const cudnnConvolutionDescriptor_t cv, cudnnConvolutionFwdAlgo_t algo, void *ws,
                                      size_t ws_bytes, const void *beta, const cudnnTensorDescriptor_t yd, void *y) {
  ApiLock lock;
  Conv c;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  if (cudnnStatus_t st = geometry(xd, wd, cv, yd, &c.g)) return st;
  c.dir = FWD;
  c.x = *xd, c.y = *yd, c.f = *wd, c.cv = *cv;
  c.xp = x, c.wp = w, c.yp = nullptr;
  c.out = y;
  return submit(h, "cudnnConvolutionForward", c, algo, ws, ws_bytes, alpha, beta);
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void *alpha, const cudnnFilterDescriptor_t wd,
                                           const void *w, const cudnnTensorDescriptor_t dyd, const void *dy,
                                           const cudnnConvolutionDescriptor_t cv, cudnnConvolutionBwdDataAlgo_t algo,
                                           void *ws, size_t ws_bytes, const void *beta,
                                           const cudnnTensorDescriptor_t dxd, void *dx) {
  ApiLock lock;
  Conv c;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  if (cudnnStatus_t st = geometry(dxd, wd, cv, dyd, &c.g)) return st;
  c.dir = BWD_DATA;
  c.x = *dxd, c.y = *dyd, c.f = *wd, c.cv = *cv;
  c.xp = nullptr, c.wp = w, c.yp = dy;
  c.out = dx;
  return submit(h, "cudnnConvolutionBackwardData", c, algo, ws, ws_bytes, alpha, beta);
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void *alpha, const cudnnTensorDescriptor_t xd,
                                             const void *x, const cudnnTensorDescriptor_t dyd, const void *dy,
                                             const cudnnConvolutionDescriptor_t cv,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void *ws, size_t ws_bytes,
                                             const void *beta, const cudnnFilterDescriptor_t dwd, void *dw) {
  ApiLock lock;
  Conv c;
  if (!handle_of(h)) return CUDNN_STATUS_BAD_PARAM;
  if (cudnnStatus_t st = geometry(xd, dwd, cv, dyd, &c.g)) return st;
  c.dir = BWD_FILTER;
  c.x = *xd, c.y = *dyd, c.f = *dwd, c.cv = *cv;
  c.xp = x, c.wp = nullptr, c.yp = dy;
  c.out = dw;
  return submit(h, "cudnnConvolutionBackwardFilter", c, algo, ws, ws_bytes, alpha, beta);
}

}  // extern "C"
