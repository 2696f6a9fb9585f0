// common.cuh: launch geometry, the launch form, and the hash shared with the CPU backend
// (backend.h's dt_hash64).
#pragma once
#include <stdint.h>

#include "half.h"  // dt_to_bf16, dt_from_bf16: rounding to nearest even, as the CPU's

// Kernels are launched as LAUNCH(kernel, grid, block, smem, stream)(args...) and declare dynamic
// shared memory with DYNAMIC_SHARED(T, name): nvcc gets the usual syntax; the CPU stand-in that
// `make test` runs them on (tests/gpusim) defines both before this file is read.
#ifndef LAUNCH
#define LAUNCH(kernel, grid, block, smem, stream) kernel<<<(grid), (block), (smem), (stream)>>>
#endif
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// Unrolls the loop that follows fully, so that register arrays indexed by its counter stay in registers
// (nvcc; GCC, which builds the stand-in, is left to its own choice).
#ifdef __CUDACC__
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif
// __launch_bounds__(threads, blocks) for nvcc: registers capped so that `blocks` blocks of `threads` fit an
// SM. A hint to the compiler; a launch of more threads than `threads` would fail on a GPU, so kernels that
// carry it are launched with exactly `threads` (the stand-in's GCC ignores it).
#ifdef __CUDACC__
#define LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#else
#define LAUNCH_BOUNDS(threads, blocks)
#endif

// Four floats in one 16-byte load. p must be 16-byte aligned, or a GPU stops the kernel with a misaligned
// address error. The stand-in's compiler splits the load into four of 4 bytes, which need no more than
// 4, so the stand-in checks the address here (GPUSIM_CHECK_ALIGNED, tests/gpusim/gpusim_device.h).
static __device__ __forceinline__ float4 load_float4(const float *p) {
#ifdef GPUSIM_CHECK_ALIGNED
  GPUSIM_CHECK_ALIGNED(p, 16);
#endif
  return *(const float4 *)p;
}

// Four bfloat16 values (8 bytes, p 8-byte aligned) as floats: load_float4's counterpart for 16-bit buffers.
static __device__ __forceinline__ float4 load4(const uint16_t *p) {
#ifdef GPUSIM_CHECK_ALIGNED
  GPUSIM_CHECK_ALIGNED(p, 8);
#endif
  const uint2 u = *(const uint2 *)p;
  return make_float4(dt_from_bf16((uint16_t)(u.x & 0xffffu)), dt_from_bf16((uint16_t)(u.x >> 16)),
                     dt_from_bf16((uint16_t)(u.y & 0xffffu)), dt_from_bf16((uint16_t)(u.y >> 16)));
}
static __device__ __forceinline__ float4 load4(const float *p) {
  return load_float4(p);
}

// Eight 16-bit values in one 16-byte load, as load_float4 (p 16-byte aligned); value i is the low (even i)
// or high half of word i / 2: half16_of reads it without aliasing the vector through another type.
static __device__ __forceinline__ uint4 load_half8(const uint16_t *p) {
#ifdef GPUSIM_CHECK_ALIGNED
  GPUSIM_CHECK_ALIGNED(p, 16);
#endif
  return *(const uint4 *)p;
}
static __device__ __forceinline__ uint16_t half16_of(uint4 v, int i) {
  const unsigned w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  return (uint16_t)(i & 1 ? w >> 16 : w & 0xffffu);
}

// Eight 16-bit values, o[0] lowest, in one 16-byte store (p 16-byte aligned, as load_half8's).
static __device__ __forceinline__ void store_half8(uint16_t *p, const unsigned o[8]) {
#ifdef GPUSIM_CHECK_ALIGNED
  GPUSIM_CHECK_ALIGNED(p, 16);
#endif
  *reinterpret_cast<uint4 *>(p) =
      make_uint4(o[0] | o[1] << 16, o[2] | o[3] << 16, o[4] | o[5] << 16, o[6] | o[7] << 16);
}

static const int kThreads = 256;
// Grid-stride kernels get at most this many blocks: two waves of 256-thread blocks on an H100
// (132 SMs x 8 resident blocks), so each thread handles several elements once tensors are large.
static const int64_t kMaxBlocks = 2048;

static inline unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// Threads for a kernel with one block per row of `len` values: a multiple of 32, 32 to 256.
static inline unsigned row_threads(int64_t len) {
  int64_t t = (len + 31) / 32 * 32;
  return (unsigned)(t < 32 ? 32 : t > kThreads ? kThreads : t);
}

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)blockDim.x * gridDim.x)

#include "hash.h"  // dt_hash_uniform: the same dropout masks as the CPU

// A value of a buffer that is FP32, or bfloat16 (uint16_t: a bf16 build's 16-bit activations), as FP32; and one
// stored so (rounded to nearest even): kernels templated on their buffers' types.
static __device__ __forceinline__ float value_of(float v) {
  return v;
}
static __device__ __forceinline__ float value_of(uint16_t v) {
  return dt_from_bf16(v);
}
static __device__ __forceinline__ void store_value(float *p, float v) {
  *p = v;
}
static __device__ __forceinline__ void store_value(uint16_t *p, float v) {
  *p = dt_to_bf16(v);
}

// Division by a divisor fixed at launch, without a divide instruction (64-bit division is
// emulated on GPUs): q = umulhi(n, mul) >> shift for 0 <= n < 2^31 (Granlund-Montgomery, as in
// CUTLASS's FastDivmod). Launchers build it on the host; element counts stay below 2^31.
typedef struct {
  uint32_t d, mul, shift;
} fast_div;

static inline fast_div make_fast_div(int64_t d) {
  fast_div f = {(uint32_t)d, 0, 0};
  if (d > 1) {
    uint32_t log2_ceil = 0;
    while ((1ull << log2_ceil) < (uint64_t)d) log2_ceil++;
    uint32_t p = 31 + log2_ceil;
    f.mul = (uint32_t)(((1ull << p) + (uint64_t)d - 1) / (uint64_t)d);
    f.shift = p - 32;
  }
  return f;
}

static __device__ __forceinline__ uint32_t div_by(uint32_t n, fast_div f) {
  return f.d == 1 ? n : __umulhi(n, f.mul) >> f.shift;
}

// The lane shuffles warp_reduce needs, one per type it reduces (a struct's, field by field, beside
// the struct).
static __device__ __forceinline__ double shfl_down(unsigned mask, double v, int o) {
  return __shfl_down_sync(mask, v, o);
}
static __device__ __forceinline__ float shfl_down(unsigned mask, float v, int o) {
  return __shfl_down_sync(mask, v, o);
}

// op over the lanes [0, lanes) of a warp, lane l taking in lane l + o for o = 16, 8, ..., 1; the
// result is valid in lane 0. Lanes that do not exist (a partial last warp) or lie past `lanes` are
// neither named in the mask nor read.
template <typename T, typename Op>
static __device__ __forceinline__ T warp_reduce(T v, int lanes, Op op) {
  const unsigned mask = lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1u;
  const int lane = threadIdx.x & 31;
  if (lane < lanes)
    for (int o = 16; o > 0; o >>= 1) {
      T other = shfl_down(mask, v, o);
      if (lane + o < lanes) v = op(v, other);
    }
  return v;
}

// op over the block for any blockDim.x (1-D blocks): within each warp, then warp 0 over the warps'
// results, the same order on every run; the result is valid in thread 0. Every thread must call it.
template <typename T, typename Op>
static __device__ __forceinline__ T block_reduce(T v, Op op) {
  __shared__ T warp_results[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5, in_warp = (int)blockDim.x - warp * 32;
  v = warp_reduce(v, in_warp < 32 ? in_warp : 32, op);
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0 && lane < warps) v = warp_reduce(warp_results[lane], warps, op);
  __syncthreads();  // the next call writes warp_results again
  return v;
}

static __device__ __forceinline__ double block_sum(double v) {
  return block_reduce(v, [](double a, double b) { return a + b; });
}

static __device__ __forceinline__ float block_max(float v) {
  return block_reduce(v, [](float a, float b) { return fmaxf(a, b); });
}

// Channel of element i of a (B, C, S) tensor.
static __device__ __forceinline__ uint32_t channel_of(int64_t i, fast_div c, fast_div sp) {
  uint32_t plane = div_by((uint32_t)i, sp);
  return plane - div_by(plane, c) * c.d;
}

// Offset of element i of channel ch's (B, S) slice in a (B, C, S) tensor.
static __device__ __forceinline__ int64_t channel_offset(int64_t i, int64_t ch, int64_t c, fast_div sp) {
  uint32_t bi = div_by((uint32_t)i, sp);
  return ((int64_t)bi * c + ch) * sp.d + (i - (int64_t)bi * sp.d);
}
