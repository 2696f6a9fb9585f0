// pool.cu: max and average pooling, NCHW (max pooling also 16-bit NHWC), no padding (floor), as
// src/cpu/pool.c.
#include <math.h>

#include "common.cuh"
#include "half.h"
#include "kernels.h"

enum { POOL_MAX, POOL_AVG };  // backend.h's DT_POOL_*

__global__ void pool_fwd_kernel(int kind, const float *x, float *y, int32_t *argmax, int64_t n, int64_t h, int64_t w,
                                int64_t k, int64_t stride, fast_div ho, fast_div wo) {
  GRID_STRIDE(i, n) {
    uint32_t row = div_by((uint32_t)i, wo), plane = div_by(row, ho);
    int64_t ow = i - (int64_t)row * wo.d, oh = row - plane * ho.d;
    const float *xp = x + plane * h * w;
    float best = -INFINITY, acc = 0;
    int32_t where = (int32_t)(oh * stride * w + ow * stride);  // a window of -inf: its first, as the CPU
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

// 16-bit NHWC max pooling (the op's nhwc16): one thread per output value (b, oh, ow, c), c fastest, so a
// warp reads 32 channels of a pixel at once. The same choice as pool_fwd_kernel (the first maximum in
// row-major order, a NaN over numbers); y takes that input's bits.
__global__ void pool16_fwd_kernel(const uint16_t *x, uint16_t *y, int32_t *argmax, int64_t n, int64_t h, int64_t w,
                                  int k, int stride, fast_div c, fast_div wo, fast_div ho, int bf16) {
  GRID_STRIDE(i, n) {
    uint32_t pix = div_by((uint32_t)i, c), row = div_by(pix, wo), img = div_by(row, ho);
    const int64_t ch = i - (int64_t)pix * c.d, ow = pix - row * wo.d, oh = row - img * ho.d;
    const uint16_t *xp = x + (int64_t)img * h * w * c.d + ch;
    float best = -INFINITY;
    int32_t where = (int32_t)(oh * stride * w + ow * stride);  // a window of -inf: its first
    for (int a = 0; a < k; a++)
      for (int b = 0; b < k; b++) {
        const int32_t idx = (int32_t)((oh * stride + a) * w + ow * stride + b);
        const float v = bf16 ? dt_from_bf16(xp[(int64_t)idx * c.d]) : dt_from_half(xp[(int64_t)idx * c.d]);
        if (v > best || (isnan(v) && !isnan(best))) best = v, where = idx;
      }
    y[i] = xp[(int64_t)where * c.d];
    argmax[i] = where;
  }
}

// Its backward: one thread per input value (b, iy, ix, c), as pool_bwd_kernel (disjoint windows by
// multiplies), the sum in FP32 rounded once to nearest even.
__global__ void pool16_bwd_kernel(const uint16_t *dy, const int32_t *argmax, uint16_t *dx, int64_t n, fast_div c,
                                  fast_div w, fast_div h, int k, int stride, int ho, int wo, fast_div window,
                                  int bf16) {
  GRID_STRIDE(i, n) {
    uint32_t pix = div_by((uint32_t)i, c), row = div_by(pix, w), img = div_by(row, h);
    const int64_t ch = i - (int64_t)pix * c.d;
    const int ix = (int)(pix - row * w.d), iy = (int)(row - img * h.d), at = iy * (int)w.d + ix;
    const int64_t plane = (int64_t)img * ho * wo;
    float g = 0;
    if (k == stride) {
      const int oh = (int)div_by((uint32_t)iy, window), ow = (int)div_by((uint32_t)ix, window);
      if (oh < ho && ow < wo) {  // else past the last whole window: no gradient
        const int64_t o = (plane + oh * wo + ow) * c.d + ch;
        if (argmax[o] == at) g = bf16 ? dt_from_bf16(dy[o]) : dt_from_half(dy[o]);
      }
    } else {
      int oh0 = iy >= k ? (iy - k) / stride + 1 : 0, ow0 = ix >= k ? (ix - k) / stride + 1 : 0;
      int oh1 = iy / stride, ow1 = ix / stride;
      if (oh1 >= ho) oh1 = ho - 1;
      if (ow1 >= wo) ow1 = wo - 1;
      for (int oh = oh0; oh <= oh1; oh++)
        for (int ow = ow0; ow <= ow1; ow++) {
          const int64_t o = (plane + oh * wo + ow) * c.d + ch;
          if (argmax[o] == at) g += bf16 ? dt_from_bf16(dy[o]) : dt_from_half(dy[o]);
        }
    }
    dx[i] = bf16 ? dt_to_bf16(g) : dt_to_half(g);
  }
}

// Global average pooling of 16-bit NHWC values: one thread per (b, c), c fastest (a warp reads 32 channels
// of a pixel at once), the sum over s in order divided once, as the CPU's.
__global__ void gap16_fwd_kernel(const uint16_t *x, int format, float *y, int64_t n, int64_t sp, fast_div c) {
  GRID_STRIDE(i, n) {
    const uint32_t img = div_by((uint32_t)i, c);
    const uint16_t *xp = x + (int64_t)img * sp * c.d + (i - (int64_t)img * c.d);
    float sum = 0.0f;
    for (int64_t s = 0; s < sp; s++) sum += dt_from_16(xp[s * c.d], format);
    y[i] = sum / (float)sp;
  }
}

// Its backward: one thread per dx value (b, s, c)
__global__ void gap16_bwd_kernel(const float *dy, uint16_t *dx, int format, int64_t n, int64_t sp, fast_div c,
                                 fast_div plane) {
  GRID_STRIDE(i, n) {
    const uint32_t img = div_by((uint32_t)i, plane), ch = (uint32_t)i - div_by((uint32_t)i, c) * c.d;
    dx[i] = dt_to_16(dy[(int64_t)img * c.d + ch] / (float)sp, format);
  }
}

extern "C" {

void k_gap16_fwd(cudaStream_t s, const uint16_t *x, int format, float *y, int64_t b, int64_t sp, int64_t c) {
  if (b * c == 0) return;
  LAUNCH(gap16_fwd_kernel, blocks_for(b * c), kThreads, 0, s)(x, format, y, b * c, sp, make_fast_div(c));
}

void k_gap16_bwd(cudaStream_t s, const float *dy, uint16_t *dx, int format, int64_t b, int64_t sp, int64_t c) {
  if (b * sp * c == 0) return;
  LAUNCH(gap16_bwd_kernel, blocks_for(b * sp * c), kThreads, 0, s)
  (dy, dx, format, b * sp * c, sp, make_fast_div(c), make_fast_div(sp * c));
}

void k_pool16_fwd(cudaStream_t s, const uint16_t *x, uint16_t *y, int32_t *argmax, int64_t b, int64_t c, int64_t h,
                  int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo, int bf16) {
  int64_t n = b * ho * wo * c;
  if (!n) return;
  LAUNCH(pool16_fwd_kernel, blocks_for(n), kThreads, 0, s)
  (x, y, argmax, n, h, w, (int)k, (int)stride, make_fast_div(c), make_fast_div(wo), make_fast_div(ho), bf16);
}

void k_pool16_bwd(cudaStream_t s, const uint16_t *dy, const int32_t *argmax, uint16_t *dx, int64_t b, int64_t c,
                  int64_t h, int64_t w, int64_t k, int64_t stride, int64_t ho, int64_t wo, int bf16) {
  int64_t n = b * h * w * c;
  if (!n) return;
  LAUNCH(pool16_bwd_kernel, blocks_for(n), kThreads, 0, s)
  (dy, argmax, dx, n, make_fast_div(c), make_fast_div(w), make_fast_div(h), (int)k, (int)stride, (int)ho, (int)wo,
   make_fast_div(k), bf16);
}

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
