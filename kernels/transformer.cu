// transformer.cu: token and position embeddings, (causal) softmax and permute, as the ops of the
// same names in src/cpu/transformer.c (layernorm is in norm.cu). Every sum that must be repeatable
// is taken in an order fixed by the shapes alone: no atomics, and the embedding gradient adds rows
// in the CPU's order (n = 0, 1, ...), so both backends give the same bits there.
#include <math.h>

#include "common.cuh"
#include "kernels.h"

// y(N, D) = wte(tok[n]) + wpe(n % T); one thread per element.
__global__ void embed_fwd_kernel(const float *tokens, const float *wte, const float *wpe, float *y, int64_t total,
                                 fast_div t, fast_div d) {
  GRID_STRIDE(i, total) {
    uint32_t r = div_by((uint32_t)i, d), j = (uint32_t)i - r * d.d;
    float e = wte[(int64_t)tokens[r] * d.d + j];
    if (wpe) {
      uint32_t pos = r - div_by(r, t) * t.d;
      e = e + wpe[(int64_t)pos * d.d + j];
    }
    y[i] = e;
  }
}

// dwte: thread (column j, token range blockIdx.y) goes through the rows in increasing order and
// adds those whose token is in its range. A warp shares its range and each row's token, so its
// lanes take the same branch; each element is added to in the CPU's order.
__global__ void embed_bwd_wte_kernel(const float *tokens, const float *dy, float *dwte, int64_t n, int64_t d,
                                     int64_t vocab, int64_t per) {
  int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= d) return;
  int64_t v0 = blockIdx.y * per, v1 = v0 + per < vocab ? v0 + per : vocab;
  for (int64_t r = 0; r < n; r++) {
    int64_t v = (int64_t)tokens[r];
    if (v >= v0 && v < v1) dwte[v * d + j] += dy[r * d + j];
  }
}

// dwpe(t, j) += dy(r, j) for r = t, t + T, ... in increasing order; one thread per (t, j).
__global__ void embed_bwd_wpe_kernel(const float *dy, float *dwpe, int64_t n, int64_t total, int64_t t, fast_div d) {
  GRID_STRIDE(i, total) {
    uint32_t pos = div_by((uint32_t)i, d), j = (uint32_t)i - pos * d.d;
    float acc = dwpe[i];
    for (int64_t r = pos; r < n; r += t) acc += dy[r * d.d + j];
    dwpe[i] = acc;
  }
}

// One block per row; columns [0, valid) take part (all t, or j <= r % t when causal), the rest are 0.
__global__ void softmax_fwd_kernel(const float *x, float *y, int64_t t, int causal, float scale) {
  const int64_t r = blockIdx.x, valid = causal ? r % t + 1 : t;
  const float *xr = x + r * t;
  float *yr = y + r * t;
  __shared__ float s_max, s_inv;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, scale * xr[j]);
  mx = block_max(mx);
  if (threadIdx.x == 0) s_max = mx;
  __syncthreads();
  mx = s_max;
  double s = 0;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(scale * xr[j] - mx);
  s = block_sum(s);
  if (threadIdx.x == 0) s_inv = (float)(1.0 / s);
  __syncthreads();
  float inv = s_inv;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) yr[j] = j < valid ? expf(scale * xr[j] - mx) * inv : 0.0f;
}

__global__ void softmax_bwd_kernel(const float *y, const float *dy, float *dx, int64_t t, int causal, float scale) {
  const int64_t r = blockIdx.x, valid = causal ? r % t + 1 : t, off = r * t;
  __shared__ float s_dot;
  double s = 0;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += (double)dy[off + j] * y[off + j];
  s = block_sum(s);
  if (threadIdx.x == 0) s_dot = (float)s;
  __syncthreads();
  float dot = s_dot;
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x)
    dx[off + j] = j < valid ? scale * y[off + j] * (dy[off + j] - dot) : 0.0f;
}

// y's dims (5, leading ones of size 1) and, for each, the stride of x's dim it comes from.
typedef struct {
  fast_div ydim[5];
  int64_t xstride[5];
} permute_geom;

__global__ void permute_kernel(const float *x, float *y, int64_t total, permute_geom g) {
  GRID_STRIDE(i, total) {
    uint32_t rest = (uint32_t)i;
    int64_t from = 0;
    for (int k = 4; k >= 0; k--) {
      uint32_t q = div_by(rest, g.ydim[k]);
      from += (int64_t)(rest - q * g.ydim[k].d) * g.xstride[k];
      rest = q;
    }
    y[i] = x[from];
  }
}

extern "C" {

void k_embed_fwd(cudaStream_t s, const float *tokens, const float *wte, const float *wpe, float *y, int64_t n,
                 int64_t t, int64_t d) {
  if (!n || !d) return;
  LAUNCH(embed_fwd_kernel, blocks_for(n * d), kThreads, 0, s)
  (tokens, wte, wpe, y, n * d, make_fast_div(wpe ? t : 1), make_fast_div(d));
}

void k_embed_bwd(cudaStream_t s, const float *tokens, const float *dy, float *dwte, float *dwpe, int64_t n, int64_t t,
                 int64_t d, int64_t vocab) {
  if (!n || !d) return;
  const int64_t RANGES = 32, COLS = 128;  // token ranges, columns per block
  int64_t ranges = vocab < RANGES ? (vocab > 0 ? vocab : 1) : RANGES, per = (vocab + ranges - 1) / ranges;
  dim3 grid((unsigned)((d + COLS - 1) / COLS), (unsigned)ranges);
  LAUNCH(embed_bwd_wte_kernel, grid, row_threads(d < COLS ? d : COLS), 0, s)(tokens, dy, dwte, n, d, vocab, per);
  if (!dwpe) return;
  int64_t positions = t < n ? t : n;
  LAUNCH(embed_bwd_wpe_kernel, blocks_for(positions * d), kThreads, 0, s)
  (dy, dwpe, n, positions * d, t, make_fast_div(d));
}

void k_softmax_fwd(cudaStream_t s, const float *x, float *y, int64_t rows, int64_t t, int causal, float scale) {
  if (!rows || !t) return;
  LAUNCH(softmax_fwd_kernel, (unsigned)rows, row_threads(t), 0, s)(x, y, t, causal, scale);
}

void k_softmax_bwd(cudaStream_t s, const float *y, const float *dy, float *dx, int64_t rows, int64_t t, int causal,
                   float scale) {
  if (!rows || !t) return;
  LAUNCH(softmax_bwd_kernel, (unsigned)rows, row_threads(t), 0, s)(y, dy, dx, t, causal, scale);
}

void k_permute(cudaStream_t s, const float *x, float *y, int ndim, const int64_t *dims, const int *perm) {
  int64_t stride[5], total = 1, step = 1;
  for (int i = ndim - 1; i >= 0; i--) stride[i] = step, step *= dims[i];
  permute_geom g;
  for (int i = 0, pad = 5 - ndim; i < 5; i++) {
    int64_t n = i < pad ? 1 : dims[perm[i - pad]];
    g.ydim[i] = make_fast_div(n);
    g.xstride[i] = i < pad ? 0 : stride[perm[i - pad]];
    total *= n;
  }
  if (!total) return;
  LAUNCH(permute_kernel, blocks_for(total), kThreads, 0, s)(x, y, total, g);
}

}  // extern "C"
