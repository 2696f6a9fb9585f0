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
// times scale[a] (NULL: 1); T: float, or uint16_t for bfloat16 (rounded).
template <int COLS, class T>
static __device__ void store_rows(T *head, int64_t stride, const float acc[kRows][COLS], const float *scale,
                                  int64_t row0, int64_t t, int hd) {
  const int tx = thread_x(), ty = thread_y();
  UNROLL
  for (int a = 0; a < kRows; a++) {
    int64_t r = row0 + ty + kSide * a;
    if (r >= t) continue;
    UNROLL
    for (int b = 0; b < COLS; b++) {
      int c = tx + kSide * b;
      if (c < hd) store_value(&head[r * stride + c], scale ? acc[a][b] * scale[a] : acc[a][b]);
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

// A kernel's heads, one type so that a launch names it without a comma (f32x2, bf16x4, ...): COLS column
// groups of kSide (1, 2, 4 or 8: heads of up to kSide COLS values) of type T, float or uint16_t (bfloat16).
template <int C, class T>
struct heads_of {
  static constexpr int COLS = C;
  typedef T type;
};
template <class H>
using heads_t = typename H::type;
typedef heads_of<1, float> f32x1;
typedef heads_of<2, float> f32x2;
typedef heads_of<4, float> f32x4;
typedef heads_of<8, float> f32x8;
typedef heads_of<1, uint16_t> bf16x1;
typedef heads_of<2, uint16_t> bf16x2;
typedef heads_of<4, uint16_t> bf16x4;
typedef heads_of<8, uint16_t> bf16x8;

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

// Whether query i sees key j for every (i, j) of query tile i0 and key tile j0 (both within T, and the
// key tile wholly at or below the diagonal): the per-element test is then skipped, as it is for most
// tiles of a long sequence.
static __device__ __forceinline__ bool tile_all_visible(const attn_geom &g, int64_t i0, int64_t j0) {
  return i0 + kTile <= g.t && j0 + kTile <= g.t && (!g.causal || j0 + kTile - 1 <= i0);
}

// Rows [row0, row0 + kTile) of a head (T rows of hd values, `stride` apart) into a (kTile, hd + 1) FP32
// tile; rows past T as zeros. Two tiles at once (tb NULL: one). Every load of both is issued before the
// first store, as float4 where the heads' rows are 16-byte aligned: a thread's loads are in flight
// together rather than each behind the last one's store, which left the kernels waiting on memory at
// every tile. hd <= 16 COLS. T: the heads' type, float or uint16_t (bfloat16, widened; 4 values an 8-byte load).
template <int COLS, class T>
static __device__ void load_tiles(float *ta, const T *ha, int64_t sa, float *tb, const T *hb, int64_t sb, int64_t row0,
                                  int64_t t, int hd) {
  const int ld = hd + 1;
  constexpr unsigned kQuad = 4 * sizeof(T);  // the bytes of 4 values, the alignment of a vector load
  const bool vec =
      hd % 4 == 0 && sa % 4 == 0 && (uintptr_t)ha % kQuad == 0 && (!tb || (sb % 4 == 0 && (uintptr_t)hb % kQuad == 0));
  if (vec) {
    constexpr int N = kTile * 4 * COLS / kBlock;  // a thread's float4 of a tile, at most
    const int quads = hd / 4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 va[N], vb[N];
    UNROLL
    for (int n = 0; n < N; n++) {
      const int e = (int)threadIdx.x + n * kBlock, r = e / quads, c = (e - r * quads) * 4;
      const bool in = e < kTile * quads && row0 + r < t;
      va[n] = in ? load4(ha + (row0 + r) * sa + c) : zero;
      vb[n] = in && tb ? load4(hb + (row0 + r) * sb + c) : zero;
    }
    UNROLL
    for (int n = 0; n < N; n++) {
      const int e = (int)threadIdx.x + n * kBlock, r = e / quads, c = (e - r * quads) * 4;
      if (e >= kTile * quads) continue;
      float *pa = ta + r * ld + c;
      pa[0] = va[n].x, pa[1] = va[n].y, pa[2] = va[n].z, pa[3] = va[n].w;
      if (!tb) continue;
      float *pb = tb + r * ld + c;
      pb[0] = vb[n].x, pb[1] = vb[n].y, pb[2] = vb[n].z, pb[3] = vb[n].w;
    }
    return;
  }
  for (int e = threadIdx.x; e < kTile * hd; e += kBlock) {
    const int r = e / hd, c = e - r * hd;
    const bool in = row0 + r < t;
    ta[r * ld + c] = in ? value_of(ha[(row0 + r) * sa + c]) : 0.0f;
    if (tb) tb[r * ld + c] = in ? value_of(hb[(row0 + r) * sb + c]) : 0.0f;
  }
}

// FP32 tiles (kTile, hd + 1): one, or two at once.
template <int COLS, class T>
static __device__ void load_tile(float *tile, const T *head, int64_t stride, int64_t row0, int64_t t, int hd) {
  load_tiles<COLS, T>(tile, head, stride, NULL, NULL, 0, row0, t, hd);
}
template <int COLS, class T>
static __device__ void load_tile_pair(float *ta, const T *ha, int64_t sa, float *tb, const T *hb, int64_t sb,
                                      int64_t row0, int64_t t, int hd) {
  load_tiles<COLS, T>(ta, ha, sa, tb, hb, sb, row0, t, hd);
}

// One key tile j0 of the forward's online softmax, for the thread's rows of query tile i0: s (its
// unscaled scores) -> the probabilities times their dropout factors into sp (row stride ld); each
// row's running maximum m and sum l updated, and its part of the output acc rescaled to the new
// maximum.
template <int COLS>
static __device__ __forceinline__ void attn_softmax_tile(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0,
                                                         int64_t j0, float s[kRows][kRows], float m[kRows],
                                                         float l[kRows], float acc[kRows][COLS], float *sp, int ld) {
  const int tx = thread_x(), ty = thread_y();
  const bool all_visible = tile_all_visible(g, i0, j0);
  UNROLL
  for (int a = 0; a < kRows; a++) {
    const int64_t i = i0 + ty + kSide * a;
    float mx = -INFINITY;
    UNROLL
    for (int b = 0; b < kRows; b++) {
      int64_t j = j0 + tx + kSide * b;
      s[a][b] = all_visible || attn_visible(g, i, j) ? g.scale * s[a][b] : -INFINITY;
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
      sp[(ty + kSide * a) * ld + tx + kSide * b] = e * attn_mask(g, seed, head, i, j);
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
template <int COLS, class T>
static __device__ __forceinline__ void attn_rows_finish(const attn_geom &g, int64_t head, int64_t i0,
                                                        const float m[kRows], const float l[kRows],
                                                        const float acc[kRows][COLS], T *o, float *lse) {
  const int tx = thread_x(), ty = thread_y();
  float inv[kRows];
  UNROLL
  for (int a = 0; a < kRows; a++) {
    inv[a] = l[a] > 0 ? 1.0f / l[a] : 0.0f;
    int64_t i = i0 + ty + kSide * a;
    if (tx == 0 && i < g.t) lse[head * g.t + i] = m[a] + logf(l[a]);
  }
  store_rows<COLS, T>(o + head_offset(g, head, g.ld_o), g.ld_o, acc, inv, i0, g.t, g.hd);
}

// Forward: a block per (head, query tile): shared q, k, v tiles (kTile, hd + 1) and the probabilities
// (kTile, kScoreLd). T: q, k, v and o in FP32, or in bfloat16 (uint16_t) where the layer keeps them so.
template <class H>
__global__ void LAUNCH_BOUNDS(kBlock, H::COLS <= 4 ? 2 : 1)
    attn_fwd_kernel(const heads_t<H> *q, const heads_t<H> *k, const heads_t<H> *v, heads_t<H> *o, float *lse,
                    const uint64_t *step_seed, attn_geom g) {
  constexpr int COLS = H::COLS;
  typedef heads_t<H> T;
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1;
  float *sq = smem, *sk = sq + kTile * ld, *sv = sk + kTile * ld, *sp = sv + kTile * ld;
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile, in = head_offset(g, head, g.ld);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile<COLS, T>(sq, q + in, g.ld, i0, g.t, g.hd);
  float m[kRows], l[kRows], acc[kRows][COLS];
  attn_rows_start<COLS>(m, l, acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sp
    load_tile_pair<COLS, T>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
    __syncthreads();
    float s[kRows][kRows];
    tile_xyt(sq, sk, g.hd, ld, s);
    attn_softmax_tile<COLS>(g, seed, head, i0, j0, s, m, l, acc, sp, kScoreLd);
    __syncthreads();
    tile_py<COLS>(sp, 0, sv, g.hd, ld, acc);
  }
  attn_rows_finish<COLS, T>(g, head, i0, m, l, acc, o, lse);
}

// delta (B*H*T) = each row's dout . o. kDeltaLanes lanes a row, each adding every kDeltaLanes-th float4 of
// it (float where the rows are not 16-byte aligned): a row's lanes read 128 contiguous bytes at a time,
// where a thread a row read 32 rows 3 KiB apart at each step. The lanes' sums are added in a fixed order. T:
// float, or uint16_t (bfloat16 dout and o, 4 values an 8-byte load).
enum { kDeltaLanes = 8 };
template <class T>
__global__ void attn_delta_kernel(const T *dout, const T *o, float *delta, int64_t rows, attn_geom g) {
  constexpr unsigned kQuad = 4 * sizeof(T);
  const bool vec = g.hd % 4 == 0 && g.ld_o % 4 == 0 && (uintptr_t)dout % kQuad == 0 && (uintptr_t)o % kQuad == 0;
  const int lane = (int)threadIdx.x % 32, part = lane % kDeltaLanes, per_warp = 32 / kDeltaLanes;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32,
                warps = (int64_t)gridDim.x * blockDim.x / 32;
  // the bound is the same for the whole warp: every lane reaches the shuffles
  for (int64_t r0 = warp * per_warp; r0 < rows; r0 += warps * per_warp) {
    const int64_t r = r0 + lane / kDeltaLanes;
    float s = 0.0f;
    if (r < rows) {
      const int64_t at = head_offset(g, r / g.t, g.ld_o) + r % g.t * g.ld_o;
      if (vec) {
        for (int d = 4 * part; d < g.hd; d += 4 * kDeltaLanes) {
          const float4 x = load4(dout + at + d), y = load4(o + at + d);
          s += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
        }
      } else {
        for (int d = part; d < g.hd; d += kDeltaLanes) s += value_of(dout[at + d]) * value_of(o[at + d]);
      }
    }
    for (int m = kDeltaLanes / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    if (part == 0 && r < rows) delta[r] = s;
  }
}

// The backward's scores of one (query tile i0, key tile j0) pair, for the thread's elements (rows i
// = queries, columns j = keys): p = exp(scale q k^T - lse) times the dropout factor into sp (when
// not NULL), ds = scale p (mask dout v^T - delta) into sds. sl, sd: the query tile's lse and delta.
// From the thread's elements of the unscaled scores s = q k^T and of dp = dout v^T: p (times the dropout
// factor) into sp (when not NULL) and ds = scale p (mask dp - delta) into sds, both of row stride ld.
static __device__ __forceinline__ void attn_ds_tile(const attn_geom &g, uint64_t seed, int64_t head, int64_t i0,
                                                    int64_t j0, const float s[kRows][kRows],
                                                    const float dp[kRows][kRows], const float *sl, const float *sd,
                                                    float *sp, float *sds, int ld) {
  const int tx = thread_x(), ty = thread_y();
  const bool all_visible = tile_all_visible(g, i0, j0);
  UNROLL
  for (int a = 0; a < kRows; a++) {
    UNROLL
    for (int b = 0; b < kRows; b++) {
      const int r = ty + kSide * a, c = tx + kSide * b;
      const int64_t i = i0 + r, j = j0 + c;
      float p = 0.0f, mask = 0.0f;
      if (all_visible || attn_visible(g, i, j))
        p = expf(g.scale * s[a][b] - sl[r]), mask = attn_mask(g, seed, head, i, j);
      if (sp) sp[r * ld + c] = p * mask;
      sds[r * ld + c] = g.scale * p * (dp[a][b] * mask - sd[r]);
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
  for (int e = threadIdx.x; e < kTile; e += blockDim.x) {  // 256 threads (FP32) or 128 (tensor cores)
    bool in = row0 + e < t;
    sl[e] = in ? lse[head * t + row0 + e] : 0.0f;
    sd[e] = in ? delta[head * t + row0 + e] : 0.0f;
  }
}

// dk, dv: a block per (head, key tile), walking the query tiles that see it.
template <class H>
__global__ void LAUNCH_BOUNDS(kBlock, H::COLS <= 4 ? 2 : 1)
    attn_bwd_kv_kernel(const heads_t<H> *q, const heads_t<H> *k, const heads_t<H> *v, const heads_t<H> *dout,
                       const float *lse, const float *delta, heads_t<H> *dk, heads_t<H> *dv, const uint64_t *step_seed,
                       attn_geom g) {
  constexpr int COLS = H::COLS;
  typedef heads_t<H> T;
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1;
  float *sk = smem, *sv = sk + kTile * ld, *sq = sv + kTile * ld, *sdo = sq + kTile * ld, *sp = sdo + kTile * ld,
        *sds = sp + kTile * kScoreLd, *sl = sds + kTile * kScoreLd, *sd = sl + kTile;
  const int64_t head = blockIdx.x / g.tiles, j0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile_pair<COLS, T>(sk, k + in, g.ld, sv, v + in, g.ld, j0, g.t, g.hd);
  float dk_acc[kRows][COLS], dv_acc[kRows][COLS];
  zero_rows<COLS>(dk_acc);
  zero_rows<COLS>(dv_acc);
  for (int64_t i0 = g.causal ? j0 : 0; i0 < g.t; i0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sq, sdo, sp, sds
    load_tile<COLS, T>(sq, q + in, g.ld, i0, g.t, g.hd);  // one at a time: a pair's registers would spill
    load_tile<COLS, T>(sdo, dout + out, g.ld_o, i0, g.t, g.hd);
    load_row_stats(sl, sd, lse, delta, head, i0, g.t);
    __syncthreads();
    attn_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, sp, sds);
    __syncthreads();
    tile_py<COLS>(sp, 1, sdo, g.hd, ld, dv_acc);  // dv_j += sum_i p_ij dout_i
    tile_py<COLS>(sds, 1, sq, g.hd, ld, dk_acc);  // dk_j += sum_i ds_ij q_i
  }
  store_rows<COLS, T>(dk + in, g.ld, dk_acc, NULL, j0, g.t, g.hd);
  store_rows<COLS, T>(dv + in, g.ld, dv_acc, NULL, j0, g.t, g.hd);
}

// dq: a block per (head, query tile), walking the key tiles it sees.
template <class H>
__global__ void LAUNCH_BOUNDS(kBlock, H::COLS <= 4 ? 2 : 1)
    attn_bwd_q_kernel(const heads_t<H> *q, const heads_t<H> *k, const heads_t<H> *v, const heads_t<H> *dout,
                      const float *lse, const float *delta, heads_t<H> *dq, const uint64_t *step_seed, attn_geom g) {
  constexpr int COLS = H::COLS;
  typedef heads_t<H> T;
  DYNAMIC_SHARED(float, smem);
  const int ld = g.hd + 1;
  float *sq = smem, *sdo = sq + kTile * ld, *sk = sdo + kTile * ld, *sv = sk + kTile * ld, *sds = sv + kTile * ld,
        *sl = sds + kTile * kScoreLd, *sd = sl + kTile;
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  load_tile_pair<COLS, T>(sq, q + in, g.ld, sdo, dout + out, g.ld_o, i0, g.t, g.hd);
  load_row_stats(sl, sd, lse, delta, head, i0, g.t);
  float dq_acc[kRows][COLS];
  zero_rows<COLS>(dq_acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, sds
    load_tile<COLS, T>(sk, k + in, g.ld, j0, g.t, g.hd);  // one at a time: a pair's registers would spill
    load_tile<COLS, T>(sv, v + in, g.ld, j0, g.t, g.hd);
    __syncthreads();
    attn_scores_bwd(g, seed, head, i0, j0, sq, sdo, sk, sv, sl, sd, NULL, sds);
    __syncthreads();
    tile_py<COLS>(sds, 0, sk, g.hd, ld, dq_acc);  // dq_i += sum_j ds_ij k_j
  }
  store_rows<COLS, T>(dq + in, g.ld, dq_acc, NULL, i0, g.t, g.hd);
}

// ---- Tensor cores (train.precision bf16, compute capability 8.0 and later) --------------------------
// FlashAttention-2's division of the work: a block of kMmaWarps warps takes the same kTile rows as above
// (queries in the forward and dq, keys in dk and dv), 16 rows a warp, and its warps walk the other side's
// tiles together through shared memory. Each warp's products run on tensor cores (mma_16816_bf16:
// bfloat16 inputs, FP32 sums) and its scores never leave registers: the accumulators of a (16, 16) block
// of scores are, element for element, the A operand of the next product, so the probabilities and ds
// feed p v, p^T dout, ds^T q and ds k as they are. q, k, v, dout, the probabilities and ds are rounded to
// bfloat16, as cuBLAS rounds GEMM inputs under bf16; the softmax, lse, delta, dropout and the outputs'
// sums stay FP32.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define ATTN_TENSOR_CORES 1
#else
#define ATTN_TENSOR_CORES 0  // their bodies trap: the host asks first (k_attention_tensor_cores_built)
#endif

typedef __nv_bfloat16 bfloat;
// Warps and threads of a block; key (or query) columns of a tile in n-pieces of 8 and k-pieces of 16; the
// row stride of a transposed tile (attn_tiles_tc).
enum { kMmaWarps = kTile / 16, kMmaBlock = 32 * kMmaWarps, kPieces8 = kTile / 8, kPieces16 = kTile / 16 };
enum { kTld = kTile + 8 };
[[maybe_unused]] static constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// hd rounded up to whole 16-column pieces: the width of a tile of a head.
[[maybe_unused]] static __device__ __forceinline__ int width16(int hd) {
  return (hd + 15) / 16 * 16;
}

// Takes consecutive regions of the block's dynamic shared memory, from a 128-byte aligned start
// (every region's size is a multiple of 16 bytes).
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

#if ATTN_TENSOR_CORES  // bfloat16 arithmetic does not exist below sm_80
// d (16, 8) += a (16, 16) b (16, 8) on tensor cores, warp-wide: PTX's mma.sync m16n8k16 with bfloat16
// inputs and FP32 sums. With g = lane / 4 and c = lane % 4 a lane holds (each 32-bit register two
// bfloat16, the lower column, or row of b, in its low half):
//   a[0] = A[g][2c..2c+1], a[1] = A[g+8][2c..2c+1], a[2] = A[g][2c+8..2c+9], a[3] = A[g+8][2c+8..2c+9]
//   b[0] = B[2c..2c+1][g], b[1] = B[2c+8..2c+9][g];  d[0..1] = D[g][2c..2c+1], d[2..3] = D[g+8][2c..2c+1]
// The stand-in exchanges the lanes' registers in the same layout (tests/gpusim/gpusim_device.h).
static __device__ __forceinline__ void mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#ifdef GPUSIM_MMA_16816
  GPUSIM_MMA_16816(d, a, b);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Two bfloat16 (lo in the low half), rounded to nearest even.
static __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof u);
  return u;
}

// Two neighbouring bfloat16 of a shared tile in one 32-bit load (p 4-byte aligned), and four in one
// 64-bit store (p 8-byte aligned). nvcc gets the casts: through memcpy it would move bytes one at a time.
static __device__ __forceinline__ uint32_t load_pair(const bfloat *p) {
#ifdef __CUDACC__
  return *reinterpret_cast<const uint32_t *>(p);
#else
  GPUSIM_CHECK_ALIGNED(p, 4);
  uint32_t u;
  memcpy(&u, p, sizeof u);
  return u;
#endif
}
static __device__ __forceinline__ void store_quad(bfloat *p, uint32_t lo, uint32_t hi) {
#ifdef __CUDACC__
  *reinterpret_cast<uint2 *>(p) = make_uint2(lo, hi);
#else
  GPUSIM_CHECK_ALIGNED(p, 8);
  const uint32_t quad[2] = {lo, hi};
  memcpy(p, quad, sizeof quad);
#endif
}

// The A operand of rows [r0, r0 + 16) and columns [k0, k0 + 16) of a tile (row stride ld).
static __device__ __forceinline__ void frag_a(uint32_t a[4], const bfloat *tile, int ld, int r0, int k0) {
  const int lane = (int)threadIdx.x % 32;
  const bfloat *p = tile + (r0 + lane / 4) * ld + k0 + lane % 4 * 2;
  a[0] = load_pair(p), a[1] = load_pair(p + 8 * ld), a[2] = load_pair(p + 8), a[3] = load_pair(p + 8 * ld + 8);
}

// The B operand (16, 8) whose column n is row n0 + n of a tile (row stride ld), k from column k0: B = the
// tile's (8, 16) block transposed.
static __device__ __forceinline__ void frag_b(uint32_t b[2], const bfloat *tile, int ld, int n0, int k0) {
  const int lane = (int)threadIdx.x % 32;
  const bfloat *p = tile + (n0 + lane / 4) * ld + k0 + lane % 4 * 2;
  b[0] = load_pair(p), b[1] = load_pair(p + 8);
}

// The A operand of a (16, 16) block of a warp's scores from its accumulators s[2 kp], s[2 kp + 1] (the
// n-pieces of columns 16 kp to 16 kp + 15), rounded to bfloat16.
static __device__ __forceinline__ void scores_to_a(uint32_t a[4], const float s[kPieces8][4], int kp) {
  a[0] = pack_bf16x2(s[2 * kp][0], s[2 * kp][1]), a[1] = pack_bf16x2(s[2 * kp][2], s[2 * kp][3]);
  a[2] = pack_bf16x2(s[2 * kp + 1][0], s[2 * kp + 1][1]), a[3] = pack_bf16x2(s[2 * kp + 1][2], s[2 * kp + 1][3]);
}

// s[n] (n < kPieces8) += rows [16 warp, 16 warp + 16) of x times y^T, x and y (kTile, 16 nk) tiles of row
// stride ld (nk <= COLS): the warp's (16, kTile) block of x y^T.
template <int COLS>
static __device__ __forceinline__ void warp_xyt(const bfloat *x, const bfloat *y, int ld, int nk,
                                                float s[kPieces8][4]) {
  const int warp = (int)threadIdx.x / 32;
  UNROLL
  for (int kp = 0; kp < COLS; kp++) {
    if (kp >= nk) break;  // the same for every lane
    uint32_t a[4];
    frag_a(a, x, ld, 16 * warp, 16 * kp);
    UNROLL
    for (int n = 0; n < kPieces8; n++) {
      uint32_t b[2];
      frag_b(b, y, ld, 8 * n, 16 * kp);
      mma_16816_bf16(s[n], a, b);
    }
  }
}

// acc[n] (n < 2 nk) += p y for the warp's (16, kTile) block p (accumulators, rounded to bfloat16 here)
// and y given transposed: yt (16 nk, kTile) of row stride kTld.
template <int COLS>
static __device__ __forceinline__ void warp_py(const float p[kPieces8][4], const bfloat *yt, int nk,
                                               float acc[2 * COLS][4]) {
  UNROLL
  for (int kp = 0; kp < kPieces16; kp++) {
    uint32_t a[4];
    scores_to_a(a, p, kp);
    UNROLL
    for (int n = 0; n < 2 * COLS; n++) {
      if (n >= 2 * nk) break;
      uint32_t b[2];
      frag_b(b, yt, kTld, 8 * n, 16 * kp);
      mma_16816_bf16(acc[n], a, b);
    }
  }
}

template <int N>
static __device__ __forceinline__ void zero_pieces(float x[N][4]) {
  UNROLL
  for (int n = 0; n < N; n++) x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.0f;
}

// Rows [row0, row0 + kTile) of up to two heads (T rows of hd values, `stride` apart) as bfloat16 (rounded
// to nearest even; zeros past T and from column hd to w = width16(hd) <= 16 COLS): into rows (kTile, w + 8)
// tiles and transposed into cols (w, kTile + 8) tiles, each when not NULL. Every load of both heads is issued
// before the first store, as float4 where the heads' rows are 16-byte aligned: a warp reads 8 rows of 4
// float4 at a time (64 contiguous bytes a row), so that its transposed stores meet in pairs of banks at most.
template <int COLS, class T>
static __device__ void attn_tiles_tc(const T *ha, int64_t sa, bfloat *rows_a, bfloat *cols_a, const T *hb, int64_t sb,
                                     bfloat *rows_b, bfloat *cols_b, int64_t row0, int64_t t, int hd) {
  const int w = width16(hd), ld = w + 8, nk = w / 16;
  constexpr unsigned kQuad = 4 * sizeof(T);  // T: float, or uint16_t (bfloat16 heads: copied as they are)
  const bool vec =
      hd % 4 == 0 && sa % 4 == 0 && (uintptr_t)ha % kQuad == 0 && (!hb || (sb % 4 == 0 && (uintptr_t)hb % kQuad == 0));
  const int lane = (int)threadIdx.x % 32, warp = (int)threadIdx.x / 32;
  if (vec) {
    constexpr int N = kTile * 16 * COLS / 4 / kMmaBlock;  // a thread's (8 rows, 4 float4) pieces, at most
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 va[N], vb[N];
    UNROLL
    for (int n = 0; n < N; n++) {
      const int piece = warp + kMmaWarps * n, r = piece / nk * 8 + lane / 4, c = (piece % nk * 4 + lane % 4) * 4;
      const bool in = piece < 8 * nk && row0 + r < t && c < hd;
      va[n] = in ? load4(ha + (row0 + r) * sa + c) : zero;
      vb[n] = in && hb ? load4(hb + (row0 + r) * sb + c) : zero;
    }
    UNROLL
    for (int n = 0; n < N; n++) {
      const int piece = warp + kMmaWarps * n, r = piece / nk * 8 + lane / 4, c = (piece % nk * 4 + lane % 4) * 4;
      if (piece >= 8 * nk) break;
      const float4 x[2] = {va[n], vb[n]};
      bfloat *rows[2] = {rows_a, rows_b}, *cols[2] = {cols_a, cols_b};
      UNROLL
      for (int h = 0; h < 2; h++) {
        if (rows[h])  // 8-byte aligned: ld and c are multiples of 4
          store_quad(rows[h] + r * ld + c, pack_bf16x2(x[h].x, x[h].y), pack_bf16x2(x[h].z, x[h].w));
        if (cols[h]) {
          bfloat *p = cols[h] + c * kTld + r;
          p[0] = __float2bfloat16_rn(x[h].x), p[kTld] = __float2bfloat16_rn(x[h].y);
          p[2 * kTld] = __float2bfloat16_rn(x[h].z), p[3 * kTld] = __float2bfloat16_rn(x[h].w);
        }
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < kTile * w; e += kMmaBlock) {
    const int r = e / w, c = e - r * w;
    const bool in = row0 + r < t && c < hd;
    const bfloat xa = __float2bfloat16_rn(in ? value_of(ha[(row0 + r) * sa + c]) : 0.0f);
    const bfloat xb = __float2bfloat16_rn(in && hb ? value_of(hb[(row0 + r) * sb + c]) : 0.0f);
    if (rows_a) rows_a[r * ld + c] = xa;
    if (cols_a) cols_a[c * kTld + r] = xa;
    if (rows_b) rows_b[r * ld + c] = xb;
    if (cols_b) cols_b[c * kTld + r] = xb;
  }
}

// Stores a warp's (16, 16 COLS) block of results (rows row0 + 16 warp + ..., those below T; columns below
// hd) into a head (rows `stride` apart), row h (0: the lane's first, 1: its second) times scale[h].
template <int COLS, class T>
static __device__ void store_pieces(T *head, int64_t stride, const float acc[2 * COLS][4], const float scale[2],
                                    int64_t row0, int64_t t, int hd) {
  const int lane = (int)threadIdx.x % 32, warp = (int)threadIdx.x / 32;
  UNROLL
  for (int h = 0; h < 2; h++) {
    const int64_t r = row0 + 16 * warp + lane / 4 + 8 * h;
    if (r >= t) continue;
    UNROLL
    for (int n = 0; n < 2 * COLS; n++) {
      const int c = 8 * n + lane % 4 * 2;
      if (c < hd) store_value(&head[r * stride + c], acc[n][2 * h] * scale[h]);
      if (c + 1 < hd) store_value(&head[r * stride + c + 1], acc[n][2 * h + 1] * scale[h]);
    }
  }
}
#endif

// Forward: a block per (head, query tile). Shared: the query tile (kTile, w + 8) for w = width16(hd), read
// once into the warps' A operands, the key tile (the same shape) and the value tile transposed (w, kTile +
// 8).
template <class H>
__global__ void LAUNCH_BOUNDS(kMmaBlock, H::COLS <= 4 ? 3 : 2)
    attn_fwd_tc_kernel(const heads_t<H> *q, const heads_t<H> *k, const heads_t<H> *v, heads_t<H> *o, float *lse,
                       const uint64_t *step_seed, attn_geom g) {
  constexpr int COLS = H::COLS;
  typedef heads_t<H> T;
#if ATTN_TENSOR_CORES
  const int w = width16(g.hd), ld = w + 8, nk = w / 16;
  DYNAMIC_SHARED(float, smem);
  shared_regions sh(smem);
  bfloat *sq = sh.take<bfloat>(kTile * ld), *sk = sh.take<bfloat>(kTile * ld), *svt = sh.take<bfloat>(w * kTld);
  const int lane = (int)threadIdx.x % 32, warp = (int)threadIdx.x / 32;
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile, in = head_offset(g, head, g.ld);
  const int64_t row[2] = {i0 + 16 * warp + lane / 4, i0 + 16 * warp + lane / 4 + 8};
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  attn_tiles_tc<COLS, T>(q + in, g.ld, sq, NULL, NULL, 0, NULL, NULL, i0, g.t, g.hd);
  __syncthreads();
  uint32_t qa[COLS][4];
  UNROLL
  for (int kp = 0; kp < COLS; kp++)
    if (kp < nk) frag_a(qa[kp], sq, ld, 16 * warp, 16 * kp);
  const float scale2 = g.scale * kLog2e;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[2 * COLS][4];  // m in base 2: scale2 q k^T
  zero_pieces<2 * COLS>(acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, svt
    attn_tiles_tc<COLS, T>(k + in, g.ld, sk, NULL, NULL, 0, NULL, NULL, j0, g.t, g.hd);
    attn_tiles_tc<COLS, T>(v + in, g.ld, NULL, svt, NULL, 0, NULL, NULL, j0, g.t, g.hd);
    __syncthreads();
    float s[kPieces8][4];
    zero_pieces<kPieces8>(s);
    UNROLL
    for (int kp = 0; kp < COLS; kp++) {
      if (kp >= nk) break;  // the same for every lane
      UNROLL
      for (int n = 0; n < kPieces8; n++) {
        uint32_t b[2];
        frag_b(b, sk, ld, 8 * n, 16 * kp);
        mma_16816_bf16(s[n], qa[kp], b);
      }
    }
    // online softmax of the lane's two rows, in base 2 (one multiply-add and exp2 an element); a row's
    // values are spread over the 4 lanes of a quad
    const bool all_visible = tile_all_visible(g, i0, j0);
    UNROLL
    for (int h = 0; h < 2; h++) {
      // f(key j, score x) for each of the lane's 16 scores of row h
      auto each = [&](auto &&f) {
        UNROLL
        for (int n = 0; n < kPieces8; n++) {
          UNROLL
          for (int e = 0; e < 2; e++) f(j0 + 8 * n + lane % 4 * 2 + e, s[n][2 * h + e]);
        }
      };
      float mx = -INFINITY;
      each([&](int64_t j, float &x) {
        x = all_visible || attn_visible(g, row[h], j) ? scale2 * x : -INFINITY;
        mx = fmaxf(mx, x);
      });
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      // a row with nothing visible yet (only rows past T) keeps m = -inf: its exponentials are 0
      const float corr = m_new == -INFINITY ? 1.0f : exp2f(m[h] - m_new);
      float sum = 0.0f;
      each([&](int64_t j, float &x) {
        const float ex = x == -INFINITY ? 0.0f : exp2f(x - m_new);
        sum += ex;
        x = ex * attn_mask(g, seed, head, row[h], j);
      });
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l[h] = l[h] * corr + sum;
      m[h] = m_new;
      UNROLL
      for (int n = 0; n < 2 * COLS; n++) acc[n][2 * h] *= corr, acc[n][2 * h + 1] *= corr;
    }
    warp_py<COLS>(s, svt, nk, acc);
  }
  float inv[2];
  UNROLL
  for (int h = 0; h < 2; h++) {
    inv[h] = l[h] > 0 ? 1.0f / l[h] : 0.0f;
    if (lane % 4 == 0 && row[h] < g.t) lse[head * g.t + row[h]] = m[h] * kLn2 + logf(l[h]);
  }
  store_pieces<COLS, T>(o + head_offset(g, head, g.ld_o), g.ld_o, acc, inv, i0, g.t, g.hd);
#else
  __trap();
#endif
}

// The backward's scores of a warp's (16, kTile) block in place: from s = q k^T (unscaled) and dp = dout
// v^T, p = exp(scale s - lse) times its dropout factor into s, and ds = scale p (mask dp - delta) into dp.
// The block's rows start at row0 and its columns at col0: queries and keys, or keys and queries
// (KEYS_ARE_ROWS, the transposed scores of dk and dv). sl, sd: the query tile's lse and delta.
template <int KEYS_ARE_ROWS>
static __device__ __forceinline__ void attn_ds_pieces(const attn_geom &g, uint64_t seed, int64_t head, int64_t row0,
                                                      int64_t col0, const float *sl, const float *sd,
                                                      float s[kPieces8][4], float dp[kPieces8][4]) {
  const int lane = (int)threadIdx.x % 32, warp = (int)threadIdx.x / 32;
  const bool all_visible = KEYS_ARE_ROWS ? tile_all_visible(g, col0, row0) : tile_all_visible(g, row0, col0);
  const float scale2 = g.scale * kLog2e;  // p = exp(scale s - lse) = exp2(scale2 s - lse log2 e)
  UNROLL
  for (int h = 0; h < 2; h++) {
    UNROLL
    for (int n = 0; n < kPieces8; n++) {
      UNROLL
      for (int e = 0; e < 2; e++) {
        const int r = 16 * warp + lane / 4 + 8 * h, c = 8 * n + lane % 4 * 2 + e, x = 2 * h + e;
        const int iq = KEYS_ARE_ROWS ? c : r;  // the query's place in its tile
        const int64_t i = KEYS_ARE_ROWS ? col0 + c : row0 + r, j = KEYS_ARE_ROWS ? row0 + r : col0 + c;
        float p = 0.0f, mask = 0.0f;
        if (all_visible || attn_visible(g, i, j))
          p = exp2f(scale2 * s[n][x] - sl[iq] * kLog2e), mask = attn_mask(g, seed, head, i, j);
        s[n][x] = p * mask;
        dp[n][x] = g.scale * p * (dp[n][x] * mask - sd[iq]);
      }
    }
  }
}

#if ATTN_TENSOR_CORES
// The warp's (16, kTile) block of the backward's scores: s = x y^T and dp = xd yd^T (q, dout against k, v;
// or k, v against q, dout when KEYS_ARE_ROWS), then p and ds from them (attn_ds_pieces).
template <int COLS, int KEYS_ARE_ROWS>
static __device__ __forceinline__ void warp_scores_bwd(const attn_geom &g, uint64_t seed, int64_t head, int64_t row0,
                                                       int64_t col0, const bfloat *x, const bfloat *y, const bfloat *xd,
                                                       const bfloat *yd, int ld, int nk, const float *sl,
                                                       const float *sd, float p[kPieces8][4], float ds[kPieces8][4]) {
  zero_pieces<kPieces8>(p);
  zero_pieces<kPieces8>(ds);
  warp_xyt<COLS>(x, y, ld, nk, p);
  warp_xyt<COLS>(xd, yd, ld, nk, ds);
  attn_ds_pieces<KEYS_ARE_ROWS>(g, seed, head, row0, col0, sl, sd, p, ds);
}
#endif

// dk, dv: a block per (head, key tile), walking the query tiles that see it. Shared: the key and value
// tiles (the warps' A operands of s^T = k q^T and dp^T = v dout^T), the query and dout tiles as rows (B
// operands of those) and transposed (of dk += ds^T q and dv += p^T dout), the query tile's lse and delta.
template <class H>
__global__ void LAUNCH_BOUNDS(kMmaBlock, H::COLS <= 4 ? 2 : 1)
    attn_bwd_kv_tc_kernel(const heads_t<H> *q, const heads_t<H> *k, const heads_t<H> *v, const heads_t<H> *dout,
                          const float *lse, const float *delta, heads_t<H> *dk, heads_t<H> *dv,
                          const uint64_t *step_seed, attn_geom g) {
  constexpr int COLS = H::COLS;
  typedef heads_t<H> T;
#if ATTN_TENSOR_CORES
  const int w = width16(g.hd), ld = w + 8, nk = w / 16;
  DYNAMIC_SHARED(float, smem);
  shared_regions sh(smem);
  bfloat *sk = sh.take<bfloat>(kTile * ld), *sv = sh.take<bfloat>(kTile * ld), *sq = sh.take<bfloat>(kTile * ld),
         *sdo = sh.take<bfloat>(kTile * ld), *sqt = sh.take<bfloat>(w * kTld), *sdot = sh.take<bfloat>(w * kTld);
  float *sl = sh.take<float>(kTile), *sd = sh.take<float>(kTile);
  const int64_t head = blockIdx.x / g.tiles, j0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  attn_tiles_tc<COLS, T>(k + in, g.ld, sk, NULL, v + in, g.ld, sv, NULL, j0, g.t, g.hd);
  float dk_acc[2 * COLS][4], dv_acc[2 * COLS][4];
  zero_pieces<2 * COLS>(dk_acc);
  zero_pieces<2 * COLS>(dv_acc);
  for (int64_t i0 = g.causal ? j0 : 0; i0 < g.t; i0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sq, sdo, sqt, sdot, sl, sd
    attn_tiles_tc<COLS, T>(q + in, g.ld, sq, sqt, dout + out, g.ld_o, sdo, sdot, i0, g.t, g.hd);
    load_row_stats(sl, sd, lse, delta, head, i0, g.t);
    __syncthreads();
    float pt[kPieces8][4], dst[kPieces8][4];  // p^T, ds^T
    warp_scores_bwd<COLS, 1>(g, seed, head, j0, i0, sk, sq, sv, sdo, ld, nk, sl, sd, pt, dst);
    warp_py<COLS>(pt, sdot, nk, dv_acc);  // dv_j += sum_i p_ij dout_i
    warp_py<COLS>(dst, sqt, nk, dk_acc);  // dk_j += sum_i ds_ij q_i
  }
  const float one[2] = {1.0f, 1.0f};
  store_pieces<COLS, T>(dk + in, g.ld, dk_acc, one, j0, g.t, g.hd);
  store_pieces<COLS, T>(dv + in, g.ld, dv_acc, one, j0, g.t, g.hd);
#else
  __trap();
#endif
}

// dq: a block per (head, query tile), walking the key tiles it sees. Shared: the query and dout tiles
// (read as they are used: A operands of s = q k^T and dp = dout v^T), the key and value tiles as rows (B
// operands of those) and the key tile transposed (of dq += ds k), the query tile's lse and delta.
template <class H>
__global__ void LAUNCH_BOUNDS(kMmaBlock, H::COLS <= 4 ? 3 : 1)
    attn_bwd_q_tc_kernel(const heads_t<H> *q, const heads_t<H> *k, const heads_t<H> *v, const heads_t<H> *dout,
                         const float *lse, const float *delta, heads_t<H> *dq, const uint64_t *step_seed, attn_geom g) {
  constexpr int COLS = H::COLS;
  typedef heads_t<H> T;
#if ATTN_TENSOR_CORES
  const int w = width16(g.hd), ld = w + 8, nk = w / 16;
  DYNAMIC_SHARED(float, smem);
  shared_regions sh(smem);
  bfloat *sq = sh.take<bfloat>(kTile * ld), *sdo = sh.take<bfloat>(kTile * ld), *sk = sh.take<bfloat>(kTile * ld),
         *sv = sh.take<bfloat>(kTile * ld), *skt = sh.take<bfloat>(w * kTld);
  float *sl = sh.take<float>(kTile), *sd = sh.take<float>(kTile);
  const int64_t head = blockIdx.x / g.tiles, i0 = (blockIdx.x % g.tiles) * kTile;
  const int64_t in = head_offset(g, head, g.ld), out = head_offset(g, head, g.ld_o);
  const uint64_t seed = g.p > 0 ? dt_hash64(g.layer_seed ^ *step_seed) : 0;
  attn_tiles_tc<COLS, T>(q + in, g.ld, sq, NULL, dout + out, g.ld_o, sdo, NULL, i0, g.t, g.hd);
  load_row_stats(sl, sd, lse, delta, head, i0, g.t);
  float dq_acc[2 * COLS][4];
  zero_pieces<2 * COLS>(dq_acc);
  const int64_t end = g.causal && i0 + kTile < g.t ? i0 + kTile : g.t;
  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the last tile's readers are done with sk, sv, skt
    attn_tiles_tc<COLS, T>(k + in, g.ld, sk, skt, v + in, g.ld, sv, NULL, j0, g.t, g.hd);
    __syncthreads();
    float p[kPieces8][4], ds[kPieces8][4];
    warp_scores_bwd<COLS, 0>(g, seed, head, i0, j0, sq, sk, sdo, sv, ld, nk, sl, sd, p, ds);
    warp_py<COLS>(ds, skt, nk, dq_acc);  // dq_i += sum_j ds_ij k_j
  }
  const float one[2] = {1.0f, 1.0f};
  store_pieces<COLS, T>(dq + in, g.ld, dq_acc, one, i0, g.t, g.hd);
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

// Launches kernel<TY x COLS> (TY: f32 or bf16, the heads' type) with COLS the column groups hd needs (1, 2, 4
// or 8), opting in to the shared memory it takes (attention_geom.h's dt_attention_shared); on the opt-in's
// error, returns it from the function it is used in.
#define ATTN_LAUNCH(kernel, TY, hd, smem, grid, threads, stream, ...)                                             \
  do {                                                                                                            \
    int cols_ = (int)(((hd) + kSide - 1) / kSide);                                                                \
    cudaError_t err_;                                                                                             \
    if (cols_ <= 1) {                                                                                             \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<TY##x1>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                              \
        return err_;                                                                                              \
      LAUNCH(kernel<TY##x1>, grid, threads, smem, stream)(__VA_ARGS__);                                           \
    } else if (cols_ <= 2) {                                                                                      \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<TY##x2>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                              \
        return err_;                                                                                              \
      LAUNCH(kernel<TY##x2>, grid, threads, smem, stream)(__VA_ARGS__);                                           \
    } else if (cols_ <= 4) {                                                                                      \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<TY##x4>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                              \
        return err_;                                                                                              \
      LAUNCH(kernel<TY##x4>, grid, threads, smem, stream)(__VA_ARGS__);                                           \
    } else {                                                                                                      \
      if ((err_ = cudaFuncSetAttribute((const void *)kernel<TY##x8>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                       (int)(smem))) != cudaSuccess)                                              \
        return err_;                                                                                              \
      LAUNCH(kernel<TY##x8>, grid, threads, smem, stream)(__VA_ARGS__);                                           \
    }                                                                                                             \
  } while (0)

// The forward's kernel on heads of TY (f32 or bf16: T float or uint16_t), the backward's three.
#define ATTN_FWD(TY, T)                                                                                             \
  do {                                                                                                              \
    const T *q_ = (const T *)q, *k_ = (const T *)k, *v_ = (const T *)v;                                             \
    T *o_ = (T *)o;                                                                                                 \
    if (tensor_cores)                                                                                               \
      ATTN_LAUNCH(attn_fwd_tc_kernel, TY, a->hd, dt_attention_shared_tc(DT_ATTENTION_FWD_KERNEL, a->hd), grid,      \
                  kMmaBlock, s, q_, k_, v_, o_, lse, a->step_seed, g);                                              \
    else                                                                                                            \
      ATTN_LAUNCH(attn_fwd_kernel, TY, a->hd, dt_attention_shared(DT_ATTENTION_FWD_KERNEL, a->hd), grid, kBlock, s, \
                  q_, k_, v_, o_, lse, a->step_seed, g);                                                            \
  } while (0)
#define ATTN_BWD(TY, T)                                                                                                \
  do {                                                                                                                 \
    const T *q_ = (const T *)q, *k_ = (const T *)k, *v_ = (const T *)v, *o_ = (const T *)o;                            \
    const T *dout_ = (const T *)dout;                                                                                  \
    T *dq_ = (T *)dq, *dk_ = (T *)dk, *dv_ = (T *)dv;                                                                  \
    LAUNCH(attn_delta_kernel<T>, blocks_for(heads * a->t * kDeltaLanes), kThreads, 0, s)                               \
    (dout_, o_, delta, heads * a->t, g);                                                                               \
    if (tensor_cores) {                                                                                                \
      ATTN_LAUNCH(attn_bwd_kv_tc_kernel, TY, a->hd, dt_attention_shared_tc(DT_ATTENTION_BWD_KV_KERNEL, a->hd), grid,   \
                  kMmaBlock, s, q_, k_, v_, dout_, lse, delta, dk_, dv_, a->step_seed, g);                             \
      ATTN_LAUNCH(attn_bwd_q_tc_kernel, TY, a->hd, dt_attention_shared_tc(DT_ATTENTION_BWD_Q_KERNEL, a->hd), grid,     \
                  kMmaBlock, s, q_, k_, v_, dout_, lse, delta, dq_, a->step_seed, g);                                  \
    } else {                                                                                                           \
      ATTN_LAUNCH(attn_bwd_kv_kernel, TY, a->hd, dt_attention_shared(DT_ATTENTION_BWD_KV_KERNEL, a->hd), grid, kBlock, \
                  s, q_, k_, v_, dout_, lse, delta, dk_, dv_, a->step_seed, g);                                        \
      ATTN_LAUNCH(attn_bwd_q_kernel, TY, a->hd, dt_attention_shared(DT_ATTENTION_BWD_Q_KERNEL, a->hd), grid, kBlock,   \
                  s, q_, k_, v_, dout_, lse, delta, dq_, a->step_seed, g);                                             \
    }                                                                                                                  \
  } while (0)

extern "C" {

cudaError_t k_attention_tensor_cores_built(int *built) {
  cudaFuncAttributes fa;
  cudaError_t err = cudaFuncGetAttributes(&fa, (const void *)attn_fwd_tc_kernel<f32x1>);
  *built = err == cudaSuccess && fa.ptxVersion >= 80;
  return err;
}

cudaError_t k_attention_fwd(cudaStream_t s, const dt_attention_geom *a, int tensor_cores, const void *q, const void *k,
                            const void *v, void *o, float *lse) {
  const int64_t heads = a->b * a->h;
  if (!heads || !a->t) return cudaSuccess;
  attn_geom g = make_geom(a);
  unsigned grid = (unsigned)(heads * g.tiles);
  if (a->io16)
    ATTN_FWD(bf16, uint16_t);
  else
    ATTN_FWD(f32, float);
  return cudaSuccess;
}

cudaError_t k_attention_bwd(cudaStream_t s, const dt_attention_geom *a, int tensor_cores, const void *q, const void *k,
                            const void *v, const void *o, const float *lse, const void *dout, float *delta, void *dq,
                            void *dk, void *dv) {
  const int64_t heads = a->b * a->h;
  if (!heads || !a->t) return cudaSuccess;
  attn_geom g = make_geom(a);
  unsigned grid = (unsigned)(heads * g.tiles);
  if (a->io16)
    ATTN_BWD(bf16, uint16_t);
  else
    ATTN_BWD(f32, float);
  return cudaSuccess;
}

}  // extern "C"
