// attention.cu: fused attention (backend.h's DT_OP_ATTENTION_*), flash-style: a block takes a tile of
// kTile query rows (forward, dq) or key rows (dk, dv) of one head and walks the other side's tiles
// through shared memory, so the (T, T) scores are never stored. Forward keeps each row's running
// maximum and sum (online softmax) and writes lse = max + log sum; backward computes the
// probabilities again from lse. dq is a kernel of its own (a block per query tile) rather than
// atomics from the key tiles: no atomics, the same bits on every run. Causal tiles above the
// diagonal are skipped. FP32 on CUDA cores; dropout masks are the dropout op's, element
// (h * T + i) * T + j of the probabilities. q, k, v, o are read and written where the layer keeps them
// (backend.h's dt_attention_geom: rows of a head strided by ld), so no permute runs around the kernels.
#include <math.h>

#include "common.cuh"
#include "kernels.h"

// Two blocks an SM for heads of up to 64 values (LAUNCH_BOUNDS: registers capped at 128, which ptxas
// meets without spilling; their shared memory, 66 and 100 KiB, fits twice), one for wider heads.
// A block is kSide x kSide threads; thread (tx, ty) owns rows ty + kSide a (a < kRows) of a tile and
// columns tx + kSide b: of the (kTile, kTile) scores (b < kRows) or of the head's hd values (b < COLS).
enum { kTile = DT_ATTENTION_TILE, kSide = 16, kRows = kTile / kSide, kBlock = kSide * kSide, kScoreLd = kTile + 1 };

static __device__ __forceinline__ int thread_x() {
  return (int)threadIdx.x % kSide;
}
static __device__ __forceinline__ int thread_y() {
  return (int)threadIdx.x / kSide;
}

// Rows [row0, row0 + kTile) of a head (T rows of hd values, `stride` apart) into a (kTile, ld) tile;
// rows past T as zeros.
static __device__ void load_tile(float *tile, const float *head, int64_t stride, int64_t row0, int64_t t, int hd,
                                 int ld) {
  for (int e = threadIdx.x; e < kTile * hd; e += kBlock) {
    int r = e / hd, c = e - r * hd;
    tile[r * ld + c] = row0 + r < t ? head[(row0 + r) * stride + c] : 0.0f;
  }
}

// s[a][b] = sum_d x[ty + kSide a][d] y[tx + kSide b][d]: the thread's part of x y^T, x and y (kTile, ld).
static __device__ void tile_xyt(const float *x, const float *y, int hd, int ld, float s[kRows][kRows]) {
  const int tx = thread_x(), ty = thread_y();
  UNROLL
  for (int a = 0; a < kRows; a++) {
    UNROLL
    for (int b = 0; b < kRows; b++) s[a][b] = 0.0f;
  }
  for (int d = 0; d < hd; d++) {
    float xa[kRows], yb[kRows];
    UNROLL
    for (int a = 0; a < kRows; a++) xa[a] = x[(ty + kSide * a) * ld + d];
    UNROLL
    for (int b = 0; b < kRows; b++) yb[b] = y[(tx + kSide * b) * ld + d];
    UNROLL
    for (int a = 0; a < kRows; a++) {
      UNROLL
      for (int b = 0; b < kRows; b++) s[a][b] += xa[a] * yb[b];
    }
  }
}

// acc[a][b] += sum_j p[r][j] y[j][tx + kSide b] for r = ty + kSide a (trans: p[j][r]): the thread's
// part of p y or p^T y, p (kTile, kScoreLd) and y (kTile, ld) with hd columns.
template <int COLS>
static __device__ void tile_py(const float *p, int trans, const float *y, int hd, int ld, float acc[kRows][COLS]) {
  const int tx = thread_x(), ty = thread_y();
  for (int j = 0; j < kTile; j++) {
    float pa[kRows];
    UNROLL
    for (int a = 0; a < kRows; a++) {
      int r = ty + kSide * a;
      pa[a] = trans ? p[j * kScoreLd + r] : p[r * kScoreLd + j];
    }
    UNROLL
    for (int b = 0; b < COLS; b++) {
      int c = tx + kSide * b;
      if (c < hd) {
        float yv = y[j * ld + c];
        UNROLL
        for (int a = 0; a < kRows; a++) acc[a][b] += pa[a] * yv;
      }
    }
  }
}

template <int COLS>
static __device__ __forceinline__ void zero_rows(float acc[kRows][COLS]) {
  UNROLL
  for (int a = 0; a < kRows; a++) {
    UNROLL
    for (int b = 0; b < COLS; b++) acc[a][b] = 0.0f;
  }
}

// Writes the thread's rows of acc (rows row0 + ty + kSide a below T) into a head (rows `stride` apart),
// times scale[a] (NULL: 1).
template <int COLS>
static __device__ void store_rows(float *head, int64_t stride, const float acc[kRows][COLS], const float *scale,
                                  int64_t row0, int64_t t, int hd) {
  const int tx = thread_x(), ty = thread_y();
  UNROLL
  for (int a = 0; a < kRows; a++) {
    int64_t r = row0 + ty + kSide * a;
    if (r >= t) continue;
    UNROLL
    for (int b = 0; b < COLS; b++) {
      int c = tx + kSide * b;
      if (c < hd) head[r * stride + c] = scale ? acc[a][b] * scale[a] : acc[a][b];
    }
  }
}

// Max and sum over the kSide threads of a row (lanes tx of a half warp; every lane takes part).
static __device__ __forceinline__ float row_max(float v) {
  for (int o = kSide / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
static __device__ __forceinline__ float row_sum(float v) {
  for (int o = kSide / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

typedef struct {
  int64_t t, tiles;     // positions, tiles of kTile along them
  int64_t h, ld, ld_o;  // heads; the row strides of q, k, v (dq, dk, dv) and of o (dout)
  int hd, causal;
  float scale, p, keep;  // dropout: keep = 1 / (1 - p)
  uint64_t layer_seed;
} attn_geom;

// Where head `head` (b H + h) starts in a buffer of row stride ld.
static __device__ __forceinline__ int64_t head_offset(const attn_geom &g, int64_t head, int64_t ld) {
  return head / g.h * g.t * ld + head % g.h * g.hd;
}

// The dropout factor of probability (head, i, j): keep or 0 (1 without dropout).
static __device__ __forceinline__ float attn_mask(const attn_geom &g, uint64_t seed, int64_t head, int64_t i,
                                                  int64_t j) {
  if (g.p <= 0) return 1.0f;
  return dt_hash_uniform(seed, (uint64_t)((head * g.t + i) * g.t + j)) >= g.p ? g.keep : 0.0f;
}

static __device__ __forceinline__ bool attn_visible(const attn_geom &g, int64_t i, int64_t j) {
  return i < g.t && j < g.t && !(g.causal && j > i);
}

// Forward: a block per (head, query tile): shared q, k, v tiles (kTile, hd + 1) and the probabilities
// (kTile, kScoreLd).
template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_fwd_kernel(const float *q, const float *k, const float *v, float *o, float *lse, const uint64_t *step_seed,
                    attn_geom g) {
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1, tx = thread_x(), ty = thread_y();
  float *sq = smem, *sk = sq + kTile * ld, *sv = sk + kTile * ld, *sp = sv + kTile * ld;
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile, in = head_offset(g, head, g.ld);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile(sq, q + in, g.ld, i0, g.t, g.hd, ld);
  float m[kRows], l[kRows], acc[kRows][COLS];
  zero_rows<COLS>(acc);
  UNROLL
  for (int a = 0; a < kRows; a++) m[a] = -INFINITY, l[a] = 0.0f;
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sp
    load_tile(sk, k + in, g.ld, j0, g.t, g.hd, ld);
    load_tile(sv, v + in, g.ld, j0, g.t, g.hd, ld);
    __syncthreads();
    float s[kRows][kRows];
    tile_xyt(sq, sk, g.hd, ld, s);
    UNROLL
    for (int a = 0; a < kRows; a++) {
      const int64_t i = i0 + ty + kSide * a;
      float mx = -INFINITY;
      UNROLL
      for (int b = 0; b < kRows; b++) {
        int64_t j = j0 + tx + kSide * b;
        s[a][b] = attn_visible(g, i, j) ? g.scale * s[a][b] : -INFINITY;
        mx = fmaxf(mx, s[a][b]);
      }
      const float m_new = fmaxf(m[a], row_max(mx));
      // a row with nothing visible yet (only rows past T) keeps m = -inf: its exponentials are 0
      const float corr = m_new == -INFINITY ? 1.0f : expf(m[a] - m_new);
      float sum = 0.0f;
      UNROLL
      for (int b = 0; b < kRows; b++) {
        int64_t j = j0 + tx + kSide * b;
        float e = s[a][b] == -INFINITY ? 0.0f : expf(s[a][b] - m_new);
        sum += e;
        sp[(ty + kSide * a) * kScoreLd + tx + kSide * b] = e * attn_mask(g, seed, head, i, j);
      }
      l[a] = l[a] * corr + row_sum(sum);
      m[a] = m_new;
      UNROLL
      for (int b = 0; b < COLS; b++) acc[a][b] *= corr;
    }
    __syncthreads();
    tile_py<COLS>(sp, 0, sv, g.hd, ld, acc);
  }
  float inv[kRows];
  UNROLL
  for (int a = 0; a < kRows; a++) {
    inv[a] = l[a] > 0 ? 1.0f / l[a] : 0.0f;
    int64_t i = i0 + ty + kSide * a;
    if (tx == 0 && i < g.t) lse[head * g.t + i] = m[a] + logf(l[a]);
  }
  store_rows<COLS>(o + head_offset(g, head, g.ld_o), g.ld_o, acc, inv, i0, g.t, g.hd);
}

// delta (B*H*T) = each row's dout . o; a thread per row.
__global__ void attn_delta_kernel(const float *dout, const float *o, float *delta, int64_t rows, attn_geom g) {
  GRID_STRIDE(r, rows) {
    const int64_t at = head_offset(g, r / g.t, g.ld_o) + r % g.t * g.ld_o;
    float s = 0.0f;
    for (int d = 0; d < g.hd; d++) s += dout[at + d] * o[at + d];
    delta[r] = s;
  }
}

// The backward's scores of one (query tile i0, key tile j0) pair, for the thread's elements (rows i
// = queries, columns j = keys): p = exp(scale q k^T - lse) times the dropout factor into sp (when
// not NULL), ds = scale p (mask dout v^T - delta) into sds. sl, sd: the query tile's lse and delta.
static __device__ void attn_scores_bwd(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0, int64_t j0,
                                       const float *sq, const float *sdo, const float *sk, const float *sv,
                                       const float *sl, const float *sd, float *sp, float *sds) {
  const int ld = g.hd + 1, tx = thread_x(), ty = thread_y();
  float s[kRows][kRows], dp[kRows][kRows];
  tile_xyt(sq, sk, g.hd, ld, s);
  tile_xyt(sdo, sv, g.hd, ld, dp);
  UNROLL
  for (int a = 0; a < kRows; a++) {
    UNROLL
    for (int b = 0; b < kRows; b++) {
      const int r = ty + kSide * a, c = tx + kSide * b;
      const int64_t i = i0 + r, j = j0 + c;
      float p = 0.0f, mask = 0.0f;
      if (attn_visible(g, i, j)) p = expf(g.scale * s[a][b] - sl[r]), mask = attn_mask(g, seed, head, i, j);
      if (sp) sp[r * kScoreLd + c] = p * mask;
      sds[r * kScoreLd + c] = g.scale * p * (dp[a][b] * mask - sd[r]);
    }
  }
}

// Rows [row0, row0 + kTile) of lse and delta into sl, sd (0 past T).
static __device__ void load_row_stats(float *sl, float *sd, const float *lse, const float *delta, int64_t head,
                                      int64_t row0, int64_t t) {
  for (int e = threadIdx.x; e < kTile; e += kBlock) {
    bool in = row0 + e < t;
    sl[e] = in ? lse[head * t + row0 + e] : 0.0f;
    sd[e] = in ? delta[head * t + row0 + e] : 0.0f;
  }
}

// dk, dv: a block per (head, key tile), walking the query tiles that see it.
template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_bwd_kv_kernel(const float *q, const float *k, const float *v, const float *dout, const float *lse,
                       const float *delta, float *dk, float *dv, const uint64_t *step_seed, attn_geom g) {
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1;
  float *sk = smem, *sv = sk + kTile * ld, *sq = sv + kTile * ld, *sdo = sq + kTile * ld, *sp = sdo + kTile * ld,
        *sds = sp + kTile * kScoreLd, *sl = sds + kTile * kScoreLd, *sd = sl + kTile;
  const int64_t head = blockIdx.x / g.tiles, j0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile(sk, k + in, g.ld, j0, g.t, g.hd, ld);
  load_tile(sv, v + in, g.ld, j0, g.t, g.hd, ld);
  float dk_acc[kRows][COLS], dv_acc[kRows][COLS];
  zero_rows<COLS>(dk_acc);
  zero_rows<COLS>(dv_acc);
  for (int64_t i0 = g.causal ? j0 : 0; i0 < g.t; i0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sq, sdo, sp, sds
    load_tile(sq, q + in, g.ld, i0, g.t, g.hd, ld);
    load_tile(sdo, dout + out, g.ld_o, i0, g.t, g.hd, ld);
    load_row_stats(sl, sd, lse, delta, head, i0, g.t);
    __syncthreads();
    attn_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, sp, sds);
    __syncthreads();
    tile_py<COLS>(sp, 1, sdo, g.hd, ld, dv_acc);  // dv_j += sum_i p_ij dout_i
    tile_py<COLS>(sds, 1, sq, g.hd, ld, dk_acc);  // dk_j += sum_i ds_ij q_i
  }
  store_rows<COLS>(dk + in, g.ld, dk_acc, NULL, j0, g.t, g.hd);
  store_rows<COLS>(dv + in, g.ld, dv_acc, NULL, j0, g.t, g.hd);
}

// dq: a block per (head, query tile), walking the key tiles it sees.
template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_bwd_q_kernel(const float *q, const float *k, const float *v, const float *dout, const float *lse,
                      const float *delta, float *dq, const uint64_t *step_seed, attn_geom g) {
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1;
  float *sq = smem, *sdo = sq + kTile * ld, *sk = sdo + kTile * ld, *sv = sk + kTile * ld, *sds = sv + kTile * ld,
        *sl = sds + kTile * kScoreLd, *sd = sl + kTile;
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile(sq, q + in, g.ld, i0, g.t, g.hd, ld);
  load_tile(sdo, dout + out, g.ld_o, i0, g.t, g.hd, ld);
  load_row_stats(sl, sd, lse, delta, head, i0, g.t);
  float dq_acc[kRows][COLS];
  zero_rows<COLS>(dq_acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sds
    load_tile(sk, k + in, g.ld, j0, g.t, g.hd, ld);
    load_tile(sv, v + in, g.ld, j0, g.t, g.hd, ld);
    __syncthreads();
    attn_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, NULL, sds);
    __syncthreads();
    tile_py<COLS>(sds, 0, sk, g.hd, ld, dq_acc);  // dq_i += sum_j ds_ij k_j
  }
  store_rows<COLS>(dq + in, g.ld, dq_acc, NULL, i0, g.t, g.hd);
}

static attn_geom make_geom(const dt_attention_geom *a) {
  attn_geom g;
  g.t = a->t, g.tiles = (a->t + kTile - 1) / kTile, g.h = a->h, g.ld = a->ld_qkv, g.ld_o = a->ld_o;
  g.hd = (int)a->hd, g.causal = a->causal, g.scale = a->scale, g.p = a->p;
  g.keep = a->p > 0 ? 1.0f / (1.0f - a->p) : 1.0f, g.layer_seed = a->seed;
  return g;
}

// Launches kernel<COLS> with COLS the column groups hd needs (1, 2, 4 or 8), opting in to the shared
// memory it takes (attention_geom.h's dt_attention_shared); on the opt-in's error, returns it from the
// function it is used in.
#define ATTN_LAUNCH(kernel, hd, smem, grid, stream, ...)                                                     \
  do {                                                                                                       \
    int cols_ = (int)(((hd) + kSide - 1) / kSide);                                                           \
    cudaError_t err_;                                                                                        \
    if (cols_ <= 1) {                                                                                        \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                         \
        return err_;                                                                                         \
      LAUNCH(kernel<1>, grid, kBlock, smem, stream)(__VA_ARGS__);                                            \
    } else if (cols_ <= 2) {                                                                                 \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                         \
        return err_;                                                                                         \
      LAUNCH(kernel<2>, grid, kBlock, smem, stream)(__VA_ARGS__);                                            \
    } else if (cols_ <= 4) {                                                                                 \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                         \
        return err_;                                                                                         \
      LAUNCH(kernel<4>, grid, kBlock, smem, stream)(__VA_ARGS__);                                            \
    } else {                                                                                                 \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                         \
        return err_;                                                                                         \
      LAUNCH(kernel<8>, grid, kBlock, smem, stream)(__VA_ARGS__);                                            \
    }                                                                                                        \
  } while (0)

extern "C" {

cudaError_t k_attention_fwd(cudaStream_t s, const dt_attention_geom *a, const float *q, const float *k, const float *v,
                            float *o, float *lse) {
  const int64_t heads = a->b * a->h;
  if (!heads || !a->t) return cudaSuccess;
  attn_geom g = make_geom(a);
  unsigned grid = (unsigned)(heads * g.tiles);
  ATTN_LAUNCH(attn_fwd_kernel, a->hd, dt_attention_shared(DT_ATTENTION_FWD_KERNEL, a->hd), grid, s, q, k, v, o, lse,
              a->step_seed, g);
  return cudaSuccess;
}

cudaError_t k_attention_bwd(cudaStream_t s, const dt_attention_geom *a, const float *q, const float *k, const float *v,
                            const float *o, const float *lse, const float *dout, float *delta, float *dq, float *dk,
                            float *dv) {
  const int64_t heads = a->b * a->h;
  if (!heads || !a->t) return cudaSuccess;
  attn_geom g = make_geom(a);
  unsigned grid = (unsigned)(heads * g.tiles);
  LAUNCH(attn_delta_kernel, blocks_for(heads * a->t), kThreads, 0, s)(dout, o, delta, heads * a->t, g);
  ATTN_LAUNCH(attn_bwd_kv_kernel, a->hd, dt_attention_shared(DT_ATTENTION_BWD_KV_KERNEL, a->hd), grid, s, q, k, v, dout,
              lse, delta, dk, dv, a->step_seed, g);
  ATTN_LAUNCH(attn_bwd_q_kernel, a->hd, dt_attention_shared(DT_ATTENTION_BWD_Q_KERNEL, a->hd), grid, s, q, k, v, dout,
              lse, delta, dq, a->step_seed, g);
  return cudaSuccess;
}

}  // extern "C"
