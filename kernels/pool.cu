// pool.cu: max and average pooling, NCHW, no padding (floor), as src/cpu/pool.c.
#include <math.h>

#include "common.cuh"
#include "kernels.h"

enum { POOL_MAX, POOL_AVG };  // backend.h's DT_POOL_*

__global__ void pool_fwd_kernel(int kind, const float *x, float *y, int32_t *argmax, int64_t n, int64_t h, int64_t w,
                                int64_t k, int64_t stride, fast_div ho, fast_div wo) {
  GRID_STRIDE(i, n) {
    uint32_t row = div_by((uint32_t)i, wo), plane = div_by(row, ho);
    int64_t ow = i - (int64_t)row * wo.d, oh = row - plane * ho.d;
    const float *xp = x + plane * h * w;
    float best = -INFINITY, acc = 0;
    int32_t where = 0;
    for (int64_t a = 0; a < k; a++)
      for (int64_t b = 0; b < k; b++) {
        int64_t idx = (oh * stride + a) * w + ow * stride + b;
        float v = xp[idx];
        acc += v;
        if (v > best || (isnan(v) && !isnan(best))) best = v, where = (int32_t)idx;
      }
    if (kind == POOL_MAX) {
      y[i] = best;
      argmax[i] = where;
    } else {
      y[i] = acc / (float)(k * k);
    }
  }
}

// One thread per input element gathers from the windows that cover it: no atomics. Disjoint windows
// (k == stride, the usual 2x2 pool) take the one window that covers the element, if any, by multiplies
// (window = fast_div by k): the general walk's integer divisions by the stride made the kernel
// instruction-bound (53 us a launch on an H100 where its bytes take 13).
__global__ void pool_bwd_kernel(int kind, const float *dy, const int32_t *argmax, float *dx, int64_t n, fast_div h,
                                fast_div w, int k, int stride, int ho, int wo, fast_div window) {
  GRID_STRIDE(i, n) {
    uint32_t row = div_by((uint32_t)i, w), plane = div_by(row, h);
    int ix = (int)(i - (int64_t)row * w.d), iy = (int)(row - plane * h.d);
    if (k == stride) {
      const int oh = (int)div_by((uint32_t)iy, window), ow = (int)div_by((uint32_t)ix, window);
      float g = 0;
      if (oh < ho && ow < wo) {  // else past the last whole window: no gradient
        const int64_t o = (int64_t)plane * ho * wo + oh * wo + ow;
        if (kind != POOL_MAX)
          g = dy[o] / (float)(k * k);
        else if (argmax[o] == (int32_t)(iy * (int)w.d + ix))
          g = dy[o];
      }
      dx[i] = g;
      continue;
    }
    // window sizes and strides are small: 32-bit arithmetic
    int oh0 = iy >= k ? (iy - k) / stride + 1 : 0, ow0 = ix >= k ? (ix - k) / stride + 1 : 0;
    int oh1 = iy / stride, ow1 = ix / stride;
    if (oh1 >= ho) oh1 = ho - 1;
    if (ow1 >= wo) ow1 = wo - 1;
    float g = 0;
    for (int oh = oh0; oh <= oh1; oh++)
      for (int ow = ow0; ow <= ow1; ow++) {
        if (iy < oh * stride || iy >= oh * stride + k || ix < ow * stride || ix >= ow * stride + k) continue;
        int64_t o = (int64_t)plane * ho * wo + oh * wo + ow;
        if (kind == POOL_MAX) {
          if (argmax[o] == (int32_t)(iy * (int)w.d + ix)) g += dy[o];
        } else {
          g += dy[o] / (float)(k * k);
        }
      }
    dx[i] = g;
  }
}

extern "C" {

void k_pool_fwd(cudaStream_t s, int kind, const float *x, float *y, int32_t *argmax, int64_t b, int64_t c, int64_t h,
                int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo) {
  int64_t n = b * c * ho * wo;
  LAUNCH(pool_fwd_kernel, blocks_for(n), kThreads, 0, s)
  (kind, x, y, argmax, n, h, w, k, stride, make_fast_div(ho), make_fast_div(wo));
}

void k_pool_bwd(cudaStream_t s, int kind, const float *dy, const int32_t *argmax, float *dx, int64_t b, int64_t c,
                int64_t h, int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo) {
  int64_t n = b * c * h * w;
  LAUNCH(pool_bwd_kernel, blocks_for(n), kThreads, 0, s)
  (kind, dy, argmax, dx, n, make_fast_div(h), make_fast_div(w), (int)k, (int)stride, (int)ho, (int)wo,
   make_fast_div(k));
}

}  // extern "C"
