// common.cuh: launch geometry, the launch form, and the hash shared with the CPU backend
// (backend.h's dt_hash64).
#pragma once
#include <stdint.h>

// Kernels are launched as LAUNCH(kernel, grid, block, smem, stream)(args...) and declare dynamic
// shared memory with DYNAMIC_SHARED(T, name): nvcc gets the usual syntax; the CPU stand-in that
// `make test` runs them on (tests/gpusim) defines both before this file is read.
#ifndef LAUNCH
#define LAUNCH(kernel, grid, block, smem, stream) kernel<<<(grid), (block), (smem), (stream)>>>
#endif
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

static const int kThreads = 256;

static inline unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

#define GRID_STRIDE(i, n) for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)blockDim.x * gridDim.x)

#include "hash.h"  // dt_hash_uniform: the same dropout masks as the CPU

// Sum of v over the lanes [0, lanes) of a warp; the result is valid in lane 0. Lanes that do not
// exist (a partial last warp) are neither named in the mask nor read.
static __device__ __forceinline__ double warp_sum(double v, int lanes) {
  unsigned mask = lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1u;
  int lane = threadIdx.x & 31;
  for (int o = 16; o > 0; o >>= 1) {
    double other = __shfl_down_sync(mask, v, o);
    if (lane + o < lanes) v += other;
  }
  return v;
}

// Block-wide sum of a double for any blockDim.x (1-D blocks); the result is valid in thread 0.
static __device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_sums[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int warps = (blockDim.x + 31) >> 5, in_warp = (int)blockDim.x - warp * 32;
  v = warp_sum(v, in_warp < 32 ? in_warp : 32);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_sum(lane < warps ? warp_sums[lane] : 0.0, (int)blockDim.x < 32 ? (int)blockDim.x : 32);
  __syncthreads();
  return v;
}
