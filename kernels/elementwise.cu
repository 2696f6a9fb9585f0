// elementwise.cu: bias, activations, dropout, add, scale, sum of squares, input conversion.
#include <math.h>

#include "common.cuh"
#include "half.h"
#include "kernels.h"
#include "tanh_poly.h"  // the CPU backend's tanh, bit for bit

enum { ACT_RELU, ACT_GELU, ACT_TANH, ACT_SIGMOID, ACT_GELU_TANH };  // backend.h's DT_ACT_*

__global__ void bias_add_kernel(float *y, const float *bias, int64_t n, fast_div c, fast_div sp) {
  GRID_STRIDE(i, n) y[i] += bias[channel_of(i, c, sp)];
}

// y (m, n) = the bias (n) on every row: a GEMM with beta 1 then adds its product (one rounding)
__global__ void fill_rows_kernel(float *y, const float *bias, int64_t total, fast_div n) {
  GRID_STRIDE(i, total) y[i] = bias[(uint32_t)i - div_by((uint32_t)i, n) * n.d];
}

// One block per channel: db[c] += sum over (b, s) of dy.
__global__ void bias_grad_kernel(const float *dy, float *db, int64_t b, int64_t c, fast_div sp) {
  int64_t ch = blockIdx.x;
  double acc = 0;
  for (int64_t i = threadIdx.x; i < b * sp.d; i += blockDim.x) acc += dy[channel_offset(i, ch, c, sp)];
  acc = block_sum(acc);
  if (threadIdx.x == 0) db[ch] += (float)acc;
}

// The dense layers' dy (b, c) (s = 1), where one block per channel would read one float of every
// 32-byte sector: blocks of kBiasCols consecutive channels by kBiasLanes row lanes, so that a warp reads
// 4 rows of 8 floats, one sector each. Each lane sums rows lane, lane + kBiasLanes, ... in order, with
// four loads in flight (GPT-2's 768 channels are only 96 blocks: the loads in flight set the speed);
// the lanes' sums then add in a fixed tree: the same bits every run.
enum { kBiasThreads = 1024, kBiasCols = 8, kBiasLanes = kBiasThreads / kBiasCols };
// kMask: a fused relu's backward first, in the same pass (dy set to +0 in place where relu_y <= 0, as
// act_bwd_kernel's relu), the sums then taken of the masked values.
template <bool kMask>
static __device__ __forceinline__ void bias_grad_rows(const float *dy, float *masked, const float *relu_y, float *db,
                                                      int64_t b, int64_t c) {
  __shared__ double lane_sums[kBiasThreads];
  const int col = threadIdx.x % kBiasCols, lane = threadIdx.x / kBiasCols;
  const int64_t ch = (int64_t)blockIdx.x * kBiasCols + col;
  double acc = 0;
  if (ch < c) {
    int64_t r = lane;
    for (; r + 3 * kBiasLanes < b; r += 4 * kBiasLanes) {
      float v[4];
      UNROLL
      for (int k = 0; k < 4; k++) v[k] = dy[(r + k * kBiasLanes) * c + ch];
      if (kMask) {
        float y[4];
        UNROLL
        for (int k = 0; k < 4; k++) y[k] = relu_y[(r + k * kBiasLanes) * c + ch];
        UNROLL
        for (int k = 0; k < 4; k++) {
          v[k] = y[k] > 0 ? v[k] : 0.0f;
          masked[(r + k * kBiasLanes) * c + ch] = v[k];
        }
      }
      acc += v[0], acc += v[1], acc += v[2], acc += v[3];
    }
    for (; r < b; r += kBiasLanes) {
      float v = dy[r * c + ch];
      if (kMask) masked[r * c + ch] = v = relu_y[r * c + ch] > 0 ? v : 0.0f;
      acc += v;
    }
  }
  lane_sums[threadIdx.x] = acc;
  for (int half = kBiasLanes / 2; half > 0; half /= 2) {
    __syncthreads();
    if (lane < half) lane_sums[threadIdx.x] += lane_sums[threadIdx.x + half * kBiasCols];
  }
  if (lane == 0 && ch < c) db[ch] += (float)lane_sums[threadIdx.x];
}

__global__ void LAUNCH_BOUNDS(kBiasThreads, 1) bias_grad_rows_kernel(const float *dy, float *db, int64_t b, int64_t c) {
  bias_grad_rows<false>(dy, nullptr, nullptr, db, b, c);
}

__global__ void LAUNCH_BOUNDS(kBiasThreads, 1)
    relu_bias_grad_rows_kernel(float *dy, const float *relu_y, float *db, int64_t b, int64_t c) {
  bias_grad_rows<true>(dy, dy, relu_y, db, b, c);
}

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}
__device__ __forceinline__ float gelu_grad(float x) {
  return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.39894228040143268f * expf(-0.5f * x * x);
}

// PyTorch's gelu(approximate='tanh') and its exact derivative, as src/cpu/elementwise.c's gelu_tanh_f and
// gelu_tanh_grad
__device__ __forceinline__ float gelu_tanh(float x) {
  float inner = 0.79788456080286536f * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.0f + dt_tanhf(inner));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  float x2 = x * x, t = dt_tanhf(0.79788456080286536f * (x + 0.044715f * (x2 * x)));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * (0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x2));
}

__global__ void act_fwd_kernel(int kind, const float *x, float *y, int64_t n) {
  GRID_STRIDE(i, n) {
    float v = x[i];
    y[i] = kind == ACT_RELU        ? (v < 0 ? 0.0f : v)  // NaN passes, as in PyTorch
           : kind == ACT_GELU      ? gelu(v)
           : kind == ACT_TANH      ? dt_tanhf(v)
           : kind == ACT_GELU_TANH ? gelu_tanh(v)
                                   : 1.0f / (1.0f + expf(-v));
  }
}

// relu's selects dy (+0 where x <= 0, whatever dy is: no NaN or -0 from 0 * dy), as the CPU and the fused
// relus of batchnorm and residual sums
__global__ void act_bwd_kernel(int kind, const float *x, const float *y, const float *dy, float *dx, int64_t n) {
  GRID_STRIDE(i, n) {
    if (kind == ACT_RELU) {
      dx[i] = x[i] > 0 ? dy[i] : 0.0f;
      continue;
    }
    float g = kind == ACT_GELU        ? gelu_grad(x[i])
              : kind == ACT_TANH      ? 1.0f - y[i] * y[i]
              : kind == ACT_GELU_TANH ? gelu_tanh_grad(x[i])
                                      : y[i] * (1.0f - y[i]);
    dx[i] = g * dy[i];
  }
}

// The 16-bit GEMM's epilogues where cuBLASLt takes none (src/cuda/gemm.c), on (m, n) values in bfloat16 rows of
// ld (i runs over m n): pre += the bias rounded to bfloat16 (when given), its FP32 sum rounded into pre, and y
// (when given) the tanh gelu of that sum, rounded
__global__ void bias_gelu_bf16_rows_kernel(uint16_t *pre, const float *bias, uint16_t *y, int64_t total, fast_div n,
                                           int64_t ld) {
  GRID_STRIDE(i, total) {
    const uint32_t r = div_by((uint32_t)i, n), c = (uint32_t)i - r * n.d;
    const int64_t at = (int64_t)r * ld + c;
    float v = dt_from_bf16(pre[at]);
    if (bias) v += dt_from_bf16(dt_to_bf16(bias[c]));
    pre[at] = dt_to_bf16(v);
    if (y) y[at] = dt_to_bf16(gelu_tanh(v));
  }
}

// dx = the tanh gelu's derivative at aux times dx, in place, rounded (as act_bwd_kernel's gelu_tanh)
__global__ void dgelu_tanh_bf16_rows_kernel(const uint16_t *aux, uint16_t *dx, int64_t total, fast_div n, int64_t ld) {
  GRID_STRIDE(i, total) {
    const uint32_t r = div_by((uint32_t)i, n), c = (uint32_t)i - r * n.d;
    const int64_t at = (int64_t)r * ld + c;
    dx[at] = dt_to_bf16(gelu_tanh_grad(dt_from_bf16(aux[at])) * dt_from_bf16(dx[at]));
  }
}

__global__ void dropout_kernel(const float *x, float *y, int64_t n, float p, float keep, uint64_t layer_seed,
                               const uint64_t *step_seed) {
  uint64_t seed = dt_hash64(layer_seed ^ *step_seed);
  GRID_STRIDE(i, n) y[i] = dt_hash_uniform(seed, (uint64_t)i) >= p ? x[i] * keep : 0.0f;
}

__global__ void clip_kernel(float *x, int64_t n, float max_norm, const double *sumsq) {
  double norm = sqrt(*sumsq);
  if (!(norm > max_norm)) return;
  float alpha = (float)(max_norm / (norm + 1e-6));
  GRID_STRIDE(i, n) x[i] *= alpha;
}

// y = a + b, or relu(a + b) (the relu kernel's: NaN passes)
__global__ void add_kernel(const float *a, const float *b, float *y, int64_t n, int relu) {
  GRID_STRIDE(i, n) {
    float v = a[i] + b[i];
    y[i] = relu && v < 0 ? 0.0f : v;
  }
}

// 16-bit values in half.h's format: f(i, ...) on each of n, eight to a thread with 16-byte loads and a store
// where vec (every pointer 16-byte aligned), the rest one to a thread.
template <class F>
static __device__ __forceinline__ void each16(int64_t n, int vec, const uint16_t *a, const uint16_t *b, uint16_t *y,
                                              F f) {
  const int64_t eights = vec ? n / 8 : 0;
  GRID_STRIDE(g, eights) {
    const uint4 va = load_half8(a + 8 * g), vb = load_half8(b + 8 * g);
    unsigned o[8];
    UNROLL
    for (int j = 0; j < 8; j++) o[j] = f(half16_of(va, j), half16_of(vb, j));
    store_half8(y + 8 * g, o);
  }
  GRID_STRIDE(i, n - 8 * eights) {
    const int64_t at = 8 * eights + i;
    y[at] = (uint16_t)f(a[at], b[at]);
  }
}

// y = relu(a + b) (or a + b), each sum in FP32 rounded to nearest even: a residual's 16-bit sums
__global__ void add16_kernel(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n, int relu, int format,
                             int vec) {
  each16(n, vec, a, b, y, [=](uint16_t u, uint16_t v) -> unsigned {
    const float z = dt_from_16(u, format) + dt_from_16(v, format);
    return dt_to_16(relu && z < 0 ? 0.0f : z, format);
  });
}

// dx = dy where x > 0, else +0: the relu's backward on 16-bit values, dy's bits passed as they are
__global__ void relu_bwd16_kernel(const uint16_t *x, const uint16_t *dy, uint16_t *dx, int64_t n, int format, int vec) {
  each16(n, vec, x, dy, dx, [=](uint16_t u, uint16_t g) -> unsigned { return dt_from_16(u, format) > 0 ? g : 0u; });
}

// out(n, row) = src rows idx[i]; i runs over out
__global__ void gather_kernel(int type, const void *src, const int32_t *idx, void *out, int64_t n, fast_div row) {
  GRID_STRIDE(i, n) {
    uint32_t r = div_by((uint32_t)i, row), j = (uint32_t)i - r * row.d;
    int64_t from = (int64_t)idx[r] * row.d + j;
    if (type == 3) {
      ((int32_t *)out)[i] = ((const int32_t *)src)[from];
    } else {
      float v = type == 0   ? (float)((const uint8_t *)src)[from]
                : type == 1 ? ((const float *)src)[from]
                            : (float)((const double *)src)[from];
      ((float *)out)[i] = v;
    }
  }
}

__global__ void scale_kernel(float *x, float alpha, int64_t n) {
  GRID_STRIDE(i, n) x[i] *= alpha;
}

// out[0], out[1] += the sums of pairs[2i] and pairs[2i + 1] over i < n, in an order fixed by n
// alone (one block): the deterministic second pass of k_sumsq and k_loss.
__global__ void sum_pairs_kernel(const double *pairs, int64_t n, double *out) {
  double a = 0, b = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) a += pairs[2 * i], b += pairs[2 * i + 1];
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) out[0] += a, out[1] += b;
}

__global__ void sumsq_kernel(const float *x, int64_t n, double *pairs) {
  double acc = 0, bad = 0;
  GRID_STRIDE(i, n) {
    float v = x[i];
    if (isfinite(v))
      acc += (double)v * v;
    else
      bad += 1;
  }
  acc = block_sum(acc);
  bad = block_sum(bad);
  if (threadIdx.x == 0) pairs[2 * blockIdx.x] = acc, pairs[2 * blockIdx.x + 1] = bad;
}

// A raw value of channel ch normalised: (raw * scale - mean) / std, as the CPU's
static __device__ __forceinline__ float input_value(float raw, uint32_t ch, float scale, const float *mean,
                                                    const float *std) {
  float m = mean ? mean[ch] : 0.0f, inv = std ? 1.0f / std[ch] : 1.0f;
  return (raw * scale - m) * inv;
}

__global__ void input_kernel(const float *raw, float *x, int64_t n, fast_div c, fast_div sp, float scale,
                             const float *mean, const float *std) {
  GRID_STRIDE(i, n) x[i] = input_value(raw[i], channel_of(i, c, sp), scale, mean, std);
}

// x (B, S, C) 16-bit in `format`, element i = (b * S + s) * C + ch, from raw (B, C, S): the first convolution's
// NHWC operand, written along the channels
__global__ void input16_kernel(const float *raw, uint16_t *x, int format, int64_t n, fast_div c, fast_div sp,
                               float scale, const float *mean, const float *std) {
  GRID_STRIDE(i, n) {
    const uint32_t pos = div_by((uint32_t)i, c), ch = (uint32_t)i - pos * c.d, b = div_by(pos, sp);
    const int64_t from = ((int64_t)b * c.d + ch) * sp.d + (pos - b * sp.d);
    x[i] = dt_to_16(input_value(raw[from], ch, scale, mean, std), format);
  }
}

extern "C" {

void k_bias_add(cudaStream_t s, float *y, const float *bias, int64_t b, int64_t c, int64_t sp) {
  LAUNCH(bias_add_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (y, bias, b * c * sp, make_fast_div(c), make_fast_div(sp));
}

void k_fill_rows(cudaStream_t s, float *y, const float *bias, int64_t m, int64_t n) {
  LAUNCH(fill_rows_kernel, blocks_for(m * n), kThreads, 0, s)(y, bias, m * n, make_fast_div(n));
}

void k_bias_grad(cudaStream_t s, const float *dy, float *db, int64_t b, int64_t c, int64_t sp) {
  if (sp == 1)
    LAUNCH(bias_grad_rows_kernel, (unsigned)((c + kBiasCols - 1) / kBiasCols), kBiasThreads, 0, s)(dy, db, b, c);
  else
    LAUNCH(bias_grad_kernel, (unsigned)c, kThreads, 0, s)(dy, db, b, c, make_fast_div(sp));
}

void k_relu_bias_grad(cudaStream_t s, float *dy, const float *relu_y, float *db, int64_t b, int64_t c) {
  LAUNCH(relu_bias_grad_rows_kernel, (unsigned)((c + kBiasCols - 1) / kBiasCols), kBiasThreads, 0, s)
  (dy, relu_y, db, b, c);
}

void k_bias_gelu_bf16_rows(cudaStream_t s, uint16_t *pre, const float *bias, uint16_t *y, int64_t m, int64_t n,
                           int64_t ld) {
  if (!m || !n) return;
  LAUNCH(bias_gelu_bf16_rows_kernel, blocks_for(m * n), kThreads, 0, s)(pre, bias, y, m * n, make_fast_div(n), ld);
}

void k_dgelu_tanh_bf16_rows(cudaStream_t s, const uint16_t *aux, uint16_t *dx, int64_t m, int64_t n, int64_t ld) {
  if (!m || !n) return;
  LAUNCH(dgelu_tanh_bf16_rows_kernel, blocks_for(m * n), kThreads, 0, s)(aux, dx, m * n, make_fast_div(n), ld);
}

void k_act_fwd(cudaStream_t s, int kind, const float *x, float *y, int64_t n) {
  LAUNCH(act_fwd_kernel, blocks_for(n), kThreads, 0, s)(kind, x, y, n);
}

void k_act_bwd(cudaStream_t s, int kind, const float *x, const float *y, const float *dy, float *dx, int64_t n) {
  LAUNCH(act_bwd_kernel, blocks_for(n), kThreads, 0, s)(kind, x, y, dy, dx, n);
}

void k_dropout(cudaStream_t s, const float *x, float *y, int64_t n, float p, uint64_t seed, const uint64_t *step_seed) {
  LAUNCH(dropout_kernel, blocks_for(n), kThreads, 0, s)(x, y, n, p, 1.0f / (1.0f - p), seed, step_seed);
}

void k_clip(cudaStream_t s, float *x, int64_t n, float max_norm, const double *sumsq) {
  LAUNCH(clip_kernel, blocks_for(n), kThreads, 0, s)(x, n, max_norm, sumsq);
}

void k_add(cudaStream_t s, const float *a, const float *b, float *y, int64_t n, int relu) {
  LAUNCH(add_kernel, blocks_for(n), kThreads, 0, s)(a, b, y, n, relu);
}

static int aligned16(const void *a, const void *b, const void *c) {
  return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15) == 0;
}

void k_add16(cudaStream_t s, const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n, int relu, int format) {
  const int vec = aligned16(a, b, y);
  LAUNCH(add16_kernel, blocks_for(vec ? n / 8 + 8 : n), kThreads, 0, s)(a, b, y, n, relu, format, vec);
}

void k_relu_bwd16(cudaStream_t s, const uint16_t *x, const uint16_t *dy, uint16_t *dx, int64_t n, int format) {
  const int vec = aligned16(x, dy, dx);
  LAUNCH(relu_bwd16_kernel, blocks_for(vec ? n / 8 + 8 : n), kThreads, 0, s)(x, dy, dx, n, format, vec);
}

void k_gather(cudaStream_t s, int type, const void *src, const int32_t *idx, void *out, int64_t n, int64_t row) {
  int64_t total = n * row;
  if (!total) return;
  LAUNCH(gather_kernel, blocks_for(total), kThreads, 0, s)(type, src, idx, out, total, make_fast_div(row));
}

void k_scale(cudaStream_t s, float *x, float alpha, int64_t n) {
  LAUNCH(scale_kernel, blocks_for(n), kThreads, 0, s)(x, alpha, n);
}

void k_sumsq(cudaStream_t s, const float *x, int64_t n, double *out, double *pairs) {
  unsigned blocks = blocks_for(n);
  if (blocks > K_SUM_BLOCKS) blocks = K_SUM_BLOCKS;
  LAUNCH(sumsq_kernel, blocks, kThreads, 0, s)(x, n, pairs);
  k_sum_pairs(s, pairs, blocks, out);
}

void k_sum_pairs(cudaStream_t s, const double *pairs, int64_t n, double *out) {
  LAUNCH(sum_pairs_kernel, 1, kThreads, 0, s)(pairs, n, out);
}

void k_input(cudaStream_t s, const float *raw, float *x, int x16, int64_t b, int64_t c, int64_t sp, float scale,
             const float *mean, const float *std) {
  if (x16) {
    LAUNCH(input16_kernel, blocks_for(b * c * sp), kThreads, 0, s)
    (raw, (uint16_t *)x, x16, b * c * sp, make_fast_div(c), make_fast_div(sp), scale, mean, std);
  } else {
    LAUNCH(input_kernel, blocks_for(b * c * sp), kThreads, 0, s)
    (raw, x, b * c * sp, make_fast_div(c), make_fast_div(sp), scale, mean, std);
  }
}

}  // extern "C"
