// attention.cu: fused attention (backend.h's DT_OP_ATTENTION_*), flash-style: a block takes a tile of
// kTile query rows (forward, dq) or key rows (dk, dv) of one head and walks the other side's tiles
// through shared memory, so the (T, T) scores are never stored. Forward keeps each row's running
// maximum and sum (online softmax) and writes lse = max + log sum; backward computes the
// probabilities again from lse. dq is a kernel of its own (a block per query tile) rather than
// atomics from the key tiles: no atomics, the same bits on every run. Causal tiles above the
// diagonal are skipped. FP32 on CUDA cores, or the tile products on tensor cores under bf16 (the second
// half of this file); dropout masks are the dropout op's, element
// (h * T + i) * T + j of the probabilities. q, k, v, o are read and written where the layer keeps them
// (backend.h's dt_attention_geom: rows of a head strided by ld), so no permute runs around the kernels.
#include <math.h>

#include "common.cuh"
#include "kernels.h"

#ifdef __CUDACC__  // the stand-in's gpusim_device.h brings both
#include <cuda_bf16.h>
#include <mma.h>
#endif

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

// Stores v into a tile of float or bfloat16 (rounded to nearest even).
static __device__ __forceinline__ void put(float *p, float v) {
  *p = v;
}
// (unreferenced in the pre-8.0 pass, where the tensor-core kernels trap)
[[maybe_unused]] static __device__ __forceinline__ void put(__nv_bfloat16 *p, float v) {
  *p = __float2bfloat16_rn(v);
}

// Rows [row0, row0 + kTile) of a head (T rows of hd values, `stride` apart) into a (kTile, ld) tile of T
// (float, or bfloat16 rounded to nearest even) as columns [0, w): the hd values, then zeros; rows past
// T as zeros. Two tiles at once (tb NULL: one). Every load of both is issued before the first store,
// as float4 where the heads' rows are 16-byte aligned: a thread's loads are in flight together rather
// than each behind the last one's store, which left the kernels waiting on memory at every tile.
// w <= 16 COLS.
template <int COLS, class T>
static __device__ void load_tiles(T *ta, const float *ha, int64_t sa, T *tb, const float *hb, int64_t sb, int64_t row0,
                                  int64_t t, int hd, int w, int ld) {
  const bool vec = hd % 4 == 0 && w % 4 == 0 && sa % 4 == 0 && (uintptr_t)ha % 16 == 0 &&
                   (!tb || (sb % 4 == 0 && (uintptr_t)hb % 16 == 0));
  if (vec) {
    constexpr int N = kTile * 4 * COLS / kBlock;  // a thread's float4 of a tile, at most
    const int quads = w / 4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 va[N], vb[N];
    UNROLL
    for (int n = 0; n < N; n++) {
      const int e = (int)threadIdx.x + n * kBlock, r = e / quads, c = (e - r * quads) * 4;
      const bool in = e < kTile * quads && row0 + r < t && c < hd;
      va[n] = in ? load_float4(ha + (row0 + r) * sa + c) : zero;
      vb[n] = in && tb ? load_float4(hb + (row0 + r) * sb + c) : zero;
    }
    UNROLL
    for (int n = 0; n < N; n++) {
      const int e = (int)threadIdx.x + n * kBlock, r = e / quads, c = (e - r * quads) * 4;
      if (e >= kTile * quads) continue;
      T *pa = ta + r * ld + c;
      put(pa, va[n].x), put(pa + 1, va[n].y), put(pa + 2, va[n].z), put(pa + 3, va[n].w);
      if (!tb) continue;
      T *pb = tb + r * ld + c;
      put(pb, vb[n].x), put(pb + 1, vb[n].y), put(pb + 2, vb[n].z), put(pb + 3, vb[n].w);
    }
    return;
  }
  for (int e = threadIdx.x; e < kTile * w; e += kBlock) {
    const int r = e / w, c = e - r * w;
    const bool in = row0 + r < t && c < hd;
    put(ta + r * ld + c, in ? ha[(row0 + r) * sa + c] : 0.0f);
    if (tb) put(tb + r * ld + c, in ? hb[(row0 + r) * sb + c] : 0.0f);
  }
}

// FP32 tiles (kTile, hd + 1): one, or two at once.
template <int COLS>
static __device__ void load_tile(float *tile, const float *head, int64_t stride, int64_t row0, int64_t t, int hd) {
  load_tiles<COLS, float>(tile, head, stride, NULL, NULL, 0, row0, t, hd, hd, hd + 1);
}
template <int COLS>
static __device__ void load_tile_pair(float *ta, const float *ha, int64_t sa, float *tb, const float *hb, int64_t sb,
                                      int64_t row0, int64_t t, int hd) {
  load_tiles<COLS, float>(ta, ha, sa, tb, hb, sb, row0, t, hd, hd, hd + 1);
}

// One key tile j0 of the forward's online softmax, for the thread's rows of query tile i0: s (its
// unscaled scores) -> the probabilities times their dropout factors into sp (row stride ld); each
// row's running maximum m and sum l updated, and its part of the output acc rescaled to the new
// maximum.
template <int COLS, class T>
static __device__ __forceinline__ void attn_softmax_tile(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0,
                                                         int64_t j0, float s[kRows][kRows], float m[kRows],
                                                         float l[kRows], float acc[kRows][COLS], T *sp, int ld) {
  const int tx = thread_x(), ty = thread_y();
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
      put(sp + (ty + kSide * a) * ld + tx + kSide * b, e * attn_mask(g, seed, head, i, j));
    }
    l[a] = l[a] * corr + row_sum(sum);
    m[a] = m_new;
    UNROLL
    for (int b = 0; b < COLS; b++) acc[a][b] *= corr;
  }
}

// The forward's rows before any key tile: nothing seen (m = -inf, l = 0, acc = 0).
template <int COLS>
static __device__ __forceinline__ void attn_rows_start(float m[kRows], float l[kRows], float acc[kRows][COLS]) {
  zero_rows<COLS>(acc);
  UNROLL
  for (int a = 0; a < kRows; a++) m[a] = -INFINITY, l[a] = 0.0f;
}

// The forward's rows after the last key tile: lse = m + log l, o = acc / l.
template <int COLS>
static __device__ __forceinline__ void attn_rows_finish(const attn_geom &g, int64_t head, int64_t i0,
                                                        const float m[kRows], const float l[kRows],
                                                        const float acc[kRows][COLS], float *o, float *lse) {
  const int tx = thread_x(), ty = thread_y();
  float inv[kRows];
  UNROLL
  for (int a = 0; a < kRows; a++) {
    inv[a] = l[a] > 0 ? 1.0f / l[a] : 0.0f;
    int64_t i = i0 + ty + kSide * a;
    if (tx == 0 && i < g.t) lse[head * g.t + i] = m[a] + logf(l[a]);
  }
  store_rows<COLS>(o + head_offset(g, head, g.ld_o), g.ld_o, acc, inv, i0, g.t, g.hd);
}

// Forward: a block per (head, query tile): shared q, k, v tiles (kTile, hd + 1) and the probabilities
// (kTile, kScoreLd).
template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_fwd_kernel(const float *q, const float *k, const float *v, float *o, float *lse, const uint64_t *step_seed,
                    attn_geom g) {
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1;
  float *sq = smem, *sk = sq + kTile * ld, *sv = sk + kTile * ld, *sp = sv + kTile * ld;
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile, in = head_offset(g, head, g.ld);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile<COLS>(sq, q + in, g.ld, i0, g.t, g.hd);
  float m[kRows], l[kRows], acc[kRows][COLS];
  attn_rows_start<COLS>(m, l, acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sp
    load_tile_pair<COLS>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
    __syncthreads();
    float s[kRows][kRows];
    tile_xyt(sq, sk, g.hd, ld, s);
    attn_softmax_tile<COLS>(g, seed, head, i0, j0, s, m, l, acc, sp, kScoreLd);
    __syncthreads();
    tile_py<COLS>(sp, 0, sv, g.hd, ld, acc);
  }
  attn_rows_finish<COLS>(g, head, i0, m, l, acc, o, lse);
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
// From the thread's elements of the unscaled scores s = q k^T and of dp = dout v^T: p (times the dropout
// factor) into sp (when not NULL) and ds = scale p (mask dp - delta) into sds, both of row stride ld.
template <class T>
static __device__ __forceinline__ void attn_ds_tile(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0,
                                                    int64_t j0, const float s[kRows][kRows],
                                                    const float dp[kRows][kRows], const float *sl, const float *sd,
                                                    T *sp, T *sds, int ld) {
  const int tx = thread_x(), ty = thread_y();
  UNROLL
  for (int a = 0; a < kRows; a++) {
    UNROLL
    for (int b = 0; b < kRows; b++) {
      const int r = ty + kSide * a, c = tx + kSide * b;
      const int64_t i = i0 + r, j = j0 + c;
      float p = 0.0f, mask = 0.0f;
      if (attn_visible(g, i, j)) p = expf(g.scale * s[a][b] - sl[r]), mask = attn_mask(g, seed, head, i, j);
      if (sp) put(sp + r * ld + c, p * mask);
      put(sds + r * ld + c, g.scale * p * (dp[a][b] * mask - sd[r]));
    }
  }
}

static __device__ void attn_scores_bwd(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0, int64_t j0,
                                       const float *sq, const float *sdo, const float *sk, const float *sv,
                                       const float *sl, const float *sd, float *sp, float *sds) {
  const int ld = g.hd + 1;
  float s[kRows][kRows], dp[kRows][kRows];
  tile_xyt(sq, sk, g.hd, ld, s);
  tile_xyt(sdo, sv, g.hd, ld, dp);
  attn_ds_tile(g, seed, head, i0, j0, s, dp, sl, sd, sp, sds, kScoreLd);
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
  load_tile_pair<COLS>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
  float dk_acc[kRows][COLS], dv_acc[kRows][COLS];
  zero_rows<COLS>(dk_acc);
  zero_rows<COLS>(dv_acc);
  for (int64_t i0 = g.causal ? j0 : 0; i0 < g.t; i0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sq, sdo, sp, sds
    load_tile<COLS>(sq, q + in, g.ld, i0, g.t, g.hd);  // one at a time: a pair's registers would spill
    load_tile<COLS>(sdo, dout + out, g.ld_o, i0, g.t, g.hd);
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
  load_tile_pair<COLS>(sq, q + in, g.ld, sdo, dout + out, g.ld_o, i0, g.t, g.hd);
  load_row_stats(sl, sd, lse, delta, head, i0, g.t);
  float dq_acc[kRows][COLS];
  zero_rows<COLS>(dq_acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sds
    load_tile<COLS>(sk, k + in, g.ld, j0, g.t, g.hd);  // one at a time: a pair's registers would spill
    load_tile<COLS>(sv, v + in, g.ld, j0, g.t, g.hd);
    __syncthreads();
    attn_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, NULL, sds);
    __syncthreads();
    tile_py<COLS>(sds, 0, sk, g.hd, ld, dq_acc);  // dq_i += sum_j ds_ij k_j
  }
  store_rows<COLS>(dq + in, g.ld, dq_acc, NULL, i0, g.t, g.hd);
}

// ---- Tensor cores (train.precision bf16, compute capability 8.0 and later) --------------------------
// The same blocks, tiles, loops and thread ownership as above, with the tile products on tensor cores
// through WMMA (16x16x16 pieces, bfloat16 inputs, FP32 sums): q, k, v, dout, the probabilities and ds
// are rounded to bfloat16 in shared memory, as cuBLAS rounds GEMM inputs under bf16, and the softmax,
// lse, delta, dropout and the outputs' sums stay FP32. The block's 8 warps share each product's
// pieces. Scores come back through an FP32 tile that threads read as above; the forward's p v is
// staged there too (its rows need rescaling), while the backward keeps dq, dk and dv in fragments
// across the loop and stages them once at the end.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define ATTN_TENSOR_CORES 1
#else
#define ATTN_TENSOR_CORES 0  // their bodies trap: the host asks first (k_attention_tensor_cores_built)
#endif

typedef __nv_bfloat16 bfloat;
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc_frag;
enum { kWarps = kBlock / 32, kSld = kTile + 4, kPld = kTile + 8 };  // row strides of score and p tiles

[[maybe_unused]] static __device__ __forceinline__ int width16(int hd) {
  return (hd + 15) / 16 * 16;
}

// Takes consecutive regions of the block's dynamic shared memory, from a 128-byte aligned start
// (WMMA needs 256-bit aligned tiles; every region's size is a multiple of 32 bytes).
struct shared_regions {
  char *at;
  // offset from base, not a pointer made from an integer: the compiler keeps knowing it is shared memory
  __device__ explicit shared_regions(void *base) : at((char *)base + ((0u - (unsigned)(uintptr_t)base) & 127u)) {}
  template <class T>
  __device__ T *take(int64_t n) {
    T *p = (T *)at;
    at += n * (int64_t)sizeof(T);
    return p;
  }
};

#if ATTN_TENSOR_CORES  // bfloat16 fragments do not exist below sm_80
// Rows [row0, row0 + kTile) of a head into a (kTile, width16(hd) + 8) bfloat16 tile; columns hd to
// width16(hd) and rows past T as zeros (load_tiles): one, or two at once.
template <int COLS>
static __device__ void load_tile16(bfloat *tile, const float *head, int64_t stride, int64_t row0, int64_t t, int hd) {
  load_tiles<COLS, bfloat>(tile, head, stride, NULL, NULL, 0, row0, t, hd, width16(hd), width16(hd) + 8);
}
template <int COLS>
static __device__ void load_tile16_pair(bfloat *ta, const float *ha, int64_t sa, bfloat *tb, const float *hb,
                                        int64_t sb, int64_t row0, int64_t t, int hd) {
  load_tiles<COLS, bfloat>(ta, ha, sa, tb, hb, sb, row0, t, hd, width16(hd), width16(hd) + 8);
}

// out (kTile, kTile), row stride kSld, = x y^T for (kTile, width16(hd)) tiles x, y.
static __device__ void tc_xyt(const bfloat *x, const bfloat *y, int hd, float *out) {
  using namespace nvcuda;
  const int w = width16(hd), ld = w + 8;
  for (int f = (int)threadIdx.x / 32; f < 16; f += kWarps) {
    const int fr = f / 4, fc = f % 4;
    acc_frag acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < w; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bfloat, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bfloat, wmma::col_major> b;  // y^T: y's rows are its columns
      wmma::load_matrix_sync(a, x + fr * 16 * ld + kk, ld);
      wmma::load_matrix_sync(b, y + fc * 16 * ld + kk, ld);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(out + fr * 16 * kSld + fc * 16, acc, kSld, wmma::mem_row_major);
  }
}

// The warp's pieces of a (kTile, width16(hd)) result: piece f = warp + kWarps r (r < FR), at row f / (w / 16)
// and column f % (w / 16) of pieces; pieces past the result's 4 w / 16 are none of the warp's.
template <int FR>
static __device__ void tc_zero(acc_frag acc[FR]) {
  UNROLL
  for (int r = 0; r < FR; r++) nvcuda::wmma::fill_fragment(acc[r], 0.0f);
}

// acc += p y (TRANS: p^T y) on the warp's pieces, p (kTile, kTile) bfloat16 of row stride kPld, y a
// (kTile, width16(hd)) tile.
template <int TRANS, int FR>
static __device__ void tc_py(const bfloat *p, const bfloat *y, int hd, acc_frag acc[FR]) {
  using namespace nvcuda;
  const int w = width16(hd), ld = w + 8, nc = w / 16;
  UNROLL
  for (int r = 0; r < FR; r++) {
    const int f = (int)threadIdx.x / 32 + kWarps * r;
    if (f >= 4 * nc) continue;  // the same for every lane of the warp
    const int fr = f / nc, fc = f % nc;
    for (int kk = 0; kk < kTile; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bfloat, wmma::row_major> b;
      wmma::load_matrix_sync(b, y + kk * ld + fc * 16, ld);
      if (TRANS) {  // p^T's piece (fr, kk) is p's (kk, fr) read column-major
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bfloat, wmma::col_major> a;
        wmma::load_matrix_sync(a, p + kk * kPld + fr * 16, kPld);
        wmma::mma_sync(acc[r], a, b, acc[r]);
      } else {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bfloat, wmma::row_major> a;
        wmma::load_matrix_sync(a, p + fr * 16 * kPld + kk, kPld);
        wmma::mma_sync(acc[r], a, b, acc[r]);
      }
    }
  }
}

// The warp's pieces into out (kTile, width16(hd)) FP32 of row stride width16(hd) + 4.
template <int FR>
static __device__ void tc_stage(const acc_frag acc[FR], int hd, float *out) {
  const int w = width16(hd), nc = w / 16;
  UNROLL
  for (int r = 0; r < FR; r++) {
    const int f = (int)threadIdx.x / 32 + kWarps * r;
    if (f < 4 * nc)
      nvcuda::wmma::store_matrix_sync(out + f / nc * 16 * (w + 4) + f % nc * 16, acc[r], w + 4,
                                      nvcuda::wmma::mem_row_major);
  }
}

// A staged (kTile, width16(hd) + 4) tile's rows below T into a head (rows `stride` apart).
static __device__ void store_staged(float *head, int64_t stride, const float *staged, int64_t row0, int64_t t, int hd) {
  const int ld = width16(hd) + 4;
  for (int e = threadIdx.x; e < kTile * hd; e += kBlock) {
    int r = e / hd, c = e - r * hd;
    if (row0 + r < t) head[(row0 + r) * stride + c] = staged[r * ld + c];
  }
}

// The thread's elements of a (kTile, kTile) FP32 tile of row stride kSld.
static __device__ __forceinline__ void read_scores(const float *tile, float s[kRows][kRows]) {
  const int tx = thread_x(), ty = thread_y();
  UNROLL
  for (int a = 0; a < kRows; a++) {
    UNROLL
    for (int b = 0; b < kRows; b++) s[a][b] = tile[(ty + kSide * a) * kSld + tx + kSide * b];
  }
}

// attn_scores_bwd on tensor cores: q k^T into ss and dout v^T into sdp (both (kTile, kTile), FP32), then
// p (when sp is not NULL) and ds as bfloat16 of row stride kPld. Ends without a barrier: the caller
// syncs before reading sp or sds.
static __device__ __forceinline__ void tc_scores_bwd(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0, int64_t j0,
                                     const bfloat *sq, const bfloat *sdo, const bfloat *sk, const bfloat *sv,
                                     const float *sl, const float *sd, float *ss, float *sdp, bfloat *sp, bfloat *sds) {
  tc_xyt(sq, sk, g.hd, ss);
  tc_xyt(sdo, sv, g.hd, sdp);
  __syncthreads();
  float s[kRows][kRows], dp[kRows][kRows];
  read_scores(ss, s);
  read_scores(sdp, dp);
  attn_ds_tile(g, seed, head, i0, j0, s, dp, sl, sd, sp, sds, kPld);
}

#endif

template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_fwd_tc_kernel(const float *q, const float *k, const float *v, float *o, float *lse, const uint64_t *step_seed,
                       attn_geom g) {
#if ATTN_TENSOR_CORES
  constexpr int FR = (COLS + 1) / 2;  // pieces of a (kTile, 16 COLS) result per warp
  DYNAMIC_SHARED(float, smem);
  shared_regions sh(smem);
  const int w = width16(g.hd), tx = thread_x(), ty = thread_y();
  bfloat *sq = sh.take<bfloat>(kTile * (w + 8)), *sk = sh.take<bfloat>(kTile * (w + 8)),
         *sv = sh.take<bfloat>(kTile * (w + 8));
  float *ss = sh.take<float>(kTile * (kSld > w + 4 ? kSld : w + 4));  // the scores, then p v staged
  bfloat *sp = sh.take<bfloat>(kTile * kPld);
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile, in = head_offset(g, head, g.ld);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile16<COLS>(sq, q + in, g.ld, i0, g.t, g.hd);
  float m[kRows], l[kRows], acc[kRows][COLS];
  attn_rows_start<COLS>(m, l, acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, ss
    load_tile16_pair<COLS>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
    __syncthreads();
    tc_xyt(sq, sk, g.hd, ss);
    __syncthreads();
    float s[kRows][kRows];
    read_scores(ss, s);
    attn_softmax_tile<COLS>(g, seed, head, i0, j0, s, m, l, acc, sp, kPld);
    __syncthreads();  // sp written, ss read
    acc_frag pv[FR];
    tc_zero<FR>(pv);
    tc_py<0, FR>(sp, sv, g.hd, pv);
    tc_stage<FR>(pv, g.hd, ss);
    __syncthreads();
    UNROLL
    for (int a = 0; a < kRows; a++) {
      UNROLL
      for (int b = 0; b < COLS; b++) {
        int c = tx + kSide * b;
        if (c < g.hd) acc[a][b] += ss[(ty + kSide * a) * (w + 4) + c];
      }
    }
  }
  attn_rows_finish<COLS>(g, head, i0, m, l, acc, o, lse);
#else
  __trap();
#endif
}

template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_bwd_kv_tc_kernel(const float *q, const float *k, const float *v, const float *dout, const float *lse,
                          const float *delta, float *dk, float *dv, const uint64_t *step_seed, attn_geom g) {
#if ATTN_TENSOR_CORES
  constexpr int FR = (COLS + 1) / 2;
  DYNAMIC_SHARED(float, smem);
  shared_regions sh(smem);
  const int w = width16(g.hd);
  bfloat *sk = sh.take<bfloat>(kTile * (w + 8)), *sv = sh.take<bfloat>(kTile * (w + 8)),
         *sq = sh.take<bfloat>(kTile * (w + 8)), *sdo = sh.take<bfloat>(kTile * (w + 8));
  float *ss = sh.take<float>(kTile * kSld), *sdp = sh.take<float>(kTile * kSld);  // ss..sdp stage dk, dv
  bfloat *sp = sh.take<bfloat>(kTile * kPld), *sds = sh.take<bfloat>(kTile * kPld);
  float *sl = sh.take<float>(kTile), *sd = sh.take<float>(kTile);
  const int64_t head = blockIdx.x / g.tiles, j0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile16_pair<COLS>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
  acc_frag dk_f[FR], dv_f[FR];
  tc_zero<FR>(dk_f);
  tc_zero<FR>(dv_f);
  for (int64_t i0 = g.causal ? j0 : 0; i0 < g.t; i0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sq, sdo, sp, sds
    load_tile16_pair<COLS>(sq, q + in, g.ld, sdo, dout + out, g.ld_o, i0, g.t, g.hd);
    load_row_stats(sl, sd, lse, delta, head, i0, g.t);
    __syncthreads();
    tc_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, ss, sdp, sp, sds);
    __syncthreads();
    tc_py<1, FR>(sp, sdo, g.hd, dv_f);  // dv_j += sum_i p_ij dout_i
    tc_py<1, FR>(sds, sq, g.hd, dk_f);  // dk_j += sum_i ds_ij q_i
  }
  // ss and sdp were last read before the loop's last barrier
  tc_stage<FR>(dk_f, g.hd, ss);
  __syncthreads();
  store_staged(dk + in, g.ld, ss, j0, g.t, g.hd);
  __syncthreads();
  tc_stage<FR>(dv_f, g.hd, ss);
  __syncthreads();
  store_staged(dv + in, g.ld, ss, j0, g.t, g.hd);
#else
  __trap();
#endif
}

template <int COLS>
__global__ void LAUNCH_BOUNDS(kBlock, COLS <= 4 ? 2 : 1)
    attn_bwd_q_tc_kernel(const float *q, const float *k, const float *v, const float *dout, const float *lse,
                         const float *delta, float *dq, const uint64_t *step_seed, attn_geom g) {
#if ATTN_TENSOR_CORES
  constexpr int FR = (COLS + 1) / 2;
  DYNAMIC_SHARED(float, smem);
  shared_regions sh(smem);
  const int w = width16(g.hd);
  bfloat *sq = sh.take<bfloat>(kTile * (w + 8)), *sdo = sh.take<bfloat>(kTile * (w + 8)),
         *sk = sh.take<bfloat>(kTile * (w + 8)), *sv = sh.take<bfloat>(kTile * (w + 8));
  float *ss = sh.take<float>(kTile * kSld), *sdp = sh.take<float>(kTile * kSld);  // ss..sdp stage dq
  bfloat *sds = sh.take<bfloat>(kTile * kPld);
  float *sl = sh.take<float>(kTile), *sd = sh.take<float>(kTile);
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile16_pair<COLS>(sq, q + in, g.ld, sdo, dout + out, g.ld_o, i0, g.t, g.hd);
  load_row_stats(sl, sd, lse, delta, head, i0, g.t);
  acc_frag dq_f[FR];
  tc_zero<FR>(dq_f);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sds
    load_tile16_pair<COLS>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
    __syncthreads();
    tc_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, ss, sdp, NULL, sds);
    __syncthreads();
    tc_py<0, FR>(sds, sk, g.hd, dq_f);  // dq_i += sum_j ds_ij k_j
  }
  tc_stage<FR>(dq_f, g.hd, ss);  // ss and sdp were last read before the loop's last barrier
  __syncthreads();
  store_staged(dq + in, g.ld, ss, i0, g.t, g.hd);
#else
  __trap();
#endif
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

cudaError_t k_attention_tensor_cores_built(int *built) {
  cudaFuncAttributes fa;
  cudaError_t err = cudaFuncGetAttributes(&fa, (const void *)attn_fwd_tc_kernel<1>);
  *built = err == cudaSuccess && fa.ptxVersion >= 80;
  return err;
}

cudaError_t k_attention_fwd(cudaStream_t s, const dt_attention_geom *a, int tensor_cores, const float *q,
                            const float *k, const float *v, float *o, float *lse) {
  const int64_t heads = a->b * a->h;
  if (!heads || !a->t) return cudaSuccess;
  attn_geom g = make_geom(a);
  unsigned grid = (unsigned)(heads * g.tiles);
  if (tensor_cores)
    ATTN_LAUNCH(attn_fwd_tc_kernel, a->hd, dt_attention_shared_tc(DT_ATTENTION_FWD_KERNEL, a->hd), grid, s, q, k, v, o,
                lse, a->step_seed, g);
  else
    ATTN_LAUNCH(attn_fwd_kernel, a->hd, dt_attention_shared(DT_ATTENTION_FWD_KERNEL, a->hd), grid, s, q, k, v, o, lse,
                a->step_seed, g);
  return cudaSuccess;
}

cudaError_t k_attention_bwd(cudaStream_t s, const dt_attention_geom *a, int tensor_cores, const float *q,
                            const float *k, const float *v, const float *o, const float *lse, const float *dout,
                            float *delta, float *dq, float *dk, float *dv) {
  const int64_t heads = a->b * a->h;
  if (!heads || !a->t) return cudaSuccess;
  attn_geom g = make_geom(a);
  unsigned grid = (unsigned)(heads * g.tiles);
  LAUNCH(attn_delta_kernel, blocks_for(heads * a->t), kThreads, 0, s)(dout, o, delta, heads * a->t, g);
  if (tensor_cores) {
    ATTN_LAUNCH(attn_bwd_kv_tc_kernel, a->hd, dt_attention_shared_tc(DT_ATTENTION_BWD_KV_KERNEL, a->hd), grid, s, q, k,
                v, dout, lse, delta, dk, dv, a->step_seed, g);
    ATTN_LAUNCH(attn_bwd_q_tc_kernel, a->hd, dt_attention_shared_tc(DT_ATTENTION_BWD_Q_KERNEL, a->hd), grid, s, q, k, v,
                dout, lse, delta, dq, a->step_seed, g);
    return cudaSuccess;
  }
  ATTN_LAUNCH(attn_bwd_kv_kernel, a->hd, dt_attention_shared(DT_ATTENTION_BWD_KV_KERNEL, a->hd), grid, s, q, k, v, dout,
              lse, delta, dk, dv, a->step_seed, g);
  ATTN_LAUNCH(attn_bwd_q_kernel, a->hd, dt_attention_shared(DT_ATTENTION_BWD_Q_KERNEL, a->hd), grid, s, q, k, v, dout,
              lse, delta, dq, a->step_seed, g);
  return cudaSuccess;
}

}  // extern "C"
