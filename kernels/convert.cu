// convert.cu: FP32 NCHW tensors to and from 16-bit (bfloat16 or IEEE half) NHWC, for cuDNN's
// convolutions under train.precision bf16 and fp16. Rounding is to nearest even (src/half.h).
#include "common.cuh"
#include "half.h"
#include "kernels.h"

// Where C > 1 and S > 1 each image is a transpose, (C, S) <-> (S, C): a block moves a 32 x 32 tile
// through shared memory (rows of 33 against bank conflicts), so that both sides are read and written
// along their contiguous dimension. Thread t is column t % 32 of tile rows t / 32, t / 32 + 8, ...
enum { kSide32 = 32, kTileRowsAtOnce = kThreads / kSide32 };

typedef float tile32[kSide32 + 1];

// For each of b images: source (rows, cols) -> destination (cols, rows), load(img, i, j) giving source
// element (i, j) and store(img, j, i, v) writing destination element (j, i); tile: the kernel's
// (32, 33) shared tile (declared there, where the stand-in places and checks shared memory). Grid
// (col tiles, row tiles, images) up to the grid's y and z limits, the rest taken in turn.
template <class Load, class Store>
static __device__ void transpose_tiles(tile32 *tile, int64_t b, int64_t rows, int64_t cols, Load load, Store store) {
  const int col = threadIdx.x % kSide32, row0 = threadIdx.x / kSide32;
  const int64_t j0 = (int64_t)blockIdx.x * kSide32;
  for (int64_t img = blockIdx.z; img < b; img += gridDim.z)
    for (int64_t i0 = (int64_t)blockIdx.y * kSide32; i0 < rows; i0 += (int64_t)gridDim.y * kSide32) {
      __syncthreads();  // the last tile is read
      for (int r = row0; r < kSide32; r += kTileRowsAtOnce)
        if (i0 + r < rows && j0 + col < cols) tile[r][col] = load(img, i0 + r, j0 + col);
      __syncthreads();
      for (int r = row0; r < kSide32; r += kTileRowsAtOnce)
        if (j0 + r < cols && i0 + col < rows) store(img, j0 + r, i0 + col, tile[col][r]);
    }
}

// x (B, C, S) FP32 -> y (B, S, C) 16-bit
__global__ void pack16_tiled_kernel(const float *x, uint16_t *y, int64_t b, int64_t c, int64_t s, int bf16) {
  __shared__ tile32 tile[kSide32];
  transpose_tiles(
      tile, b, c, s, [=](int64_t img, int64_t i, int64_t j) { return x[(img * c + i) * s + j]; },
      [=](int64_t img, int64_t j, int64_t i, float v) {
        y[(img * s + j) * c + i] = bf16 ? dt_to_bf16(v) : dt_to_half(v);
      });
}

// y (B, S, C) 16-bit -> x (B, C, S) FP32, added when accumulate
__global__ void unpack16_tiled_kernel(const uint16_t *y, float *x, int64_t b, int64_t c, int64_t s, int bf16,
                                      int accumulate) {
  __shared__ tile32 tile[kSide32];
  transpose_tiles(
      tile, b, s, c,
      [=](int64_t img, int64_t i, int64_t j) {
        uint16_t h = y[(img * s + i) * c + j];
        return bf16 ? dt_from_bf16(h) : dt_from_half(h);
      },
      [=](int64_t img, int64_t j, int64_t i, float v) {
        float *at = x + (img * c + j) * s + i;
        *at = accumulate ? *at + v : v;
      });
}

// C = 1 or S = 1 (the first layer's image, a 1 x 1 output): both layouts are the same, read and
// written in order. x (B, C, S) FP32 -> y (B, S, C) 16-bit; i runs over y
__global__ void pack16_kernel(const float *x, uint16_t *y, int64_t n, fast_div c_div, fast_div s_div, int bf16) {
  GRID_STRIDE(i, n) {
    uint32_t bs = div_by((uint32_t)i, c_div), c = (uint32_t)i - bs * c_div.d;
    uint32_t b = div_by(bs, s_div), sp = bs - b * s_div.d;
    float v = x[((int64_t)b * c_div.d + c) * s_div.d + sp];
    y[i] = bf16 ? dt_to_bf16(v) : dt_to_half(v);
  }
}

// y (B, S, C) 16-bit -> x (B, C, S) FP32, added when accumulate; i runs over x (C = 1 or S = 1)
__global__ void unpack16_kernel(const uint16_t *y, float *x, int64_t n, fast_div c_div, fast_div s_div, int bf16,
                                int accumulate) {
  GRID_STRIDE(i, n) {
    uint32_t bc = div_by((uint32_t)i, s_div), sp = (uint32_t)i - bc * s_div.d;
    uint32_t b = div_by(bc, c_div), c = bc - b * c_div.d;
    uint16_t h = y[((int64_t)b * s_div.d + sp) * c_div.d + c];
    float v = bf16 ? dt_from_bf16(h) : dt_from_half(h);
    x[i] = accumulate ? x[i] + v : v;
  }
}

// The weights16 and grads16 ops: a warp per row of the table's entries (numbered across them from table[0].row0).
// Returns the warp's entry and its row r in it, NULL past the rows.
static __device__ const dt_weight16 *entry_of(const dt_weight16 *table, int n, int64_t rows, int64_t *r) {
  const int64_t row = (int64_t)blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return NULL;
  const int64_t at = table[0].row0 + row;
  int lo = 0, hi = n - 1; /* the last entry whose row0 <= at */
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].row0 <= at)
      lo = mid;
    else
      hi = mid - 1;
  }
  *r = at - table[lo].row0;
  return &table[lo];
}

// The lanes along the columns, and for a filter each lane's K * K values in turn: a dense row's reads and writes
// in order, a filter's writes in order, without a division.
__global__ void weights16_kernel(const float *params, uint16_t *w16, const dt_weight16 *table, int n, int64_t rows) {
  int64_t r;
  const dt_weight16 *e = entry_of(table, n, rows, &r);
  if (!e) return;
  const dt_weight16 t = *e;
  const float *x = params + t.src + r * t.cols * t.inner;
  uint16_t *y = w16 + t.dst + r * t.inner * t.ld;
  for (int64_t c = threadIdx.x % 32; c < t.cols; c += 32)
    for (int64_t s = 0; s < t.inner; s++) y[s * t.ld + c] = dt_to_16(x[c * t.inner + s], t.format);
}

// The inverse way, for the entries with grad (filters): grads(rows, cols, inner) += g16(rows, inner, ld) widened,
// the lanes along a row's FP32 values (its cols * inner), so that the wider side is read and written in order and
// a filter of few channels (a stem's 3) still fills the warp.
__global__ void grads16_kernel(float *grads, const uint16_t *g16, const dt_weight16 *table, int n, int64_t rows) {
  int64_t r;
  const dt_weight16 *e = entry_of(table, n, rows, &r);
  if (!e || !e->grad) return;
  const dt_weight16 t = *e;
  float *x = grads + t.src + r * t.cols * t.inner;
  const uint16_t *y = g16 + t.dst + r * t.inner * t.ld;
  for (int64_t i = threadIdx.x % 32; i < t.cols * t.inner; i += 32) {
    const int64_t c = i / t.inner, s = i - c * t.inner;
    x[i] += dt_from_16(y[s * t.ld + c], t.format);
  }
}

// x (rows, cols) FP32 -> y (rows, ld) bfloat16, the columns past cols left as they are; i runs over x
__global__ void pack_bf16_rows_kernel(const float *x, uint16_t *y, int64_t n, fast_div cols_div, int64_t ld) {
  GRID_STRIDE(i, n) {
    uint32_t r = div_by((uint32_t)i, cols_div), c = (uint32_t)i - r * cols_div.d;
    y[(int64_t)r * ld + c] = dt_to_bf16(x[i]);
  }
}

// Each column of x (rows, cols; rows of ldx values) summed in double, FP32 x copied to y (rows, ld) in bfloat16
// as it goes (a dense layer's bias gradient from its dy; bfloat16 x, a 16-bit dy, is only summed, y NULL): a
// block reads 32 columns of a chunk of rows (a warp one row of them), then adds its rows' sums per column in
// order into partials (chunks, cols): pack_bf16_rows_sums_kernel and bf16_rows_sums_kernel
template <class T>
static __device__ __forceinline__ void rows_sums(const T *x, int64_t ldx, uint16_t *y, int64_t rows, int64_t cols,
                                                 int64_t ld, int64_t per, double *partials) {
  __shared__ double red[kThreads / 32][32];
  const int lane = threadIdx.x % 32, row = threadIdx.x / 32;
  const int64_t col = (int64_t)blockIdx.x * 32 + lane, r0 = (int64_t)blockIdx.y * per,
                r1 = r0 + per < rows ? r0 + per : rows;
  double sum = 0;
  if (col < cols)
    for (int64_t r = r0 + row; r < r1; r += kThreads / 32) {
      const float v = value_of(x[r * ldx + col]);
      if (y) y[r * ld + col] = dt_to_bf16(v);
      sum += v;
    }
  red[row][lane] = sum;
  __syncthreads();
  if (row == 0 && col < cols) {
    for (int k = 1; k < kThreads / 32; k++) sum += red[k][lane];
    partials[(int64_t)blockIdx.y * cols + col] = sum;
  }
}

__global__ void pack_bf16_rows_sums_kernel(const float *x, uint16_t *y, int64_t rows, int64_t cols, int64_t ld,
                                           int64_t per, double *partials) {
  rows_sums(x, cols, y, rows, cols, ld, per, partials);
}

__global__ void bf16_rows_sums_kernel(const uint16_t *x, int64_t rows, int64_t cols, int64_t ld, int64_t per,
                                      double *partials) {
  rows_sums(x, ld, (uint16_t *)nullptr, rows, cols, 0, per, partials);
}

// db(cols) += the chunks' sums of each column, added in order (one thread a column)
__global__ void col_sums_kernel(const double *partials, int64_t chunks, int64_t cols, float *db) {
  GRID_STRIDE(col, cols) {
    double sum = 0;
    for (int64_t k = 0; k < chunks; k++) sum += partials[k * cols + col];
    db[col] += (float)sum;
  }
}

extern "C" {

int64_t k_pack_bf16_rows_chunks(int64_t rows, int64_t cols) {
  const int64_t groups = (cols + 31) / 32, most = K_PACK_SUMS_BLOCKS / groups,
                chunks = (rows + K_PACK_SUMS_ROWS_MIN - 1) / K_PACK_SUMS_ROWS_MIN;
  return chunks < 1 || most < 1 ? 1 : chunks > most ? most : chunks;
}

// The grid of rows_sums_kernel: 32 columns by a chunk of `per` rows a block.
static dim3 sums_grid(int64_t rows, int64_t cols, int64_t *per) {
  const int64_t chunks = k_pack_bf16_rows_chunks(rows, cols);
  *per = rows > 0 ? (rows + chunks - 1) / chunks : 1;
  return dim3((unsigned)((cols + 31) / 32), (unsigned)(rows > 0 ? (rows + *per - 1) / *per : 1));
}

void k_pack_bf16_rows_sums(cudaStream_t s, const float *x, uint16_t *y, int64_t rows, int64_t cols, int64_t ld,
                           float *db, double *partials) {
  if (!cols) return;
  int64_t per;
  const dim3 grid = sums_grid(rows, cols, &per);
  LAUNCH(pack_bf16_rows_sums_kernel, grid, kThreads, 0, s)(x, y, rows, cols, ld, per, partials);
  LAUNCH(col_sums_kernel, blocks_for(cols), kThreads, 0, s)(partials, grid.y, cols, db);
}

void k_bf16_rows_sums(cudaStream_t s, const uint16_t *x, int64_t rows, int64_t cols, int64_t ld, float *db,
                      double *partials) {
  if (!cols) return;
  int64_t per;
  const dim3 grid = sums_grid(rows, cols, &per);
  LAUNCH(bf16_rows_sums_kernel, grid, kThreads, 0, s)(x, rows, cols, ld, per, partials);
  LAUNCH(col_sums_kernel, blocks_for(cols), kThreads, 0, s)(partials, grid.y, cols, db);
}

// transpose_tiles' grid for b images of (rows, cols): row tiles and images up to the grid's y and z
// limits (cols: C or S of a tensor under 2^31 values, under the x limit as tiles).
static dim3 tile_grid(int64_t b, int64_t rows, int64_t cols) {
  int64_t row_tiles = (rows + kSide32 - 1) / kSide32;
  return dim3((unsigned)((cols + kSide32 - 1) / kSide32), (unsigned)(row_tiles < 65535 ? row_tiles : 65535),
              (unsigned)(b < 65535 ? b : 65535));
}

void k_pack16(cudaStream_t s, const float *x, uint16_t *y, int64_t b, int64_t c, int64_t sp, int bf16) {
  int64_t n = b * c * sp;
  if (!n) return;
  if (c > 1 && sp > 1)
    LAUNCH(pack16_tiled_kernel, tile_grid(b, c, sp), kThreads, 0, s)(x, y, b, c, sp, bf16);
  else
    LAUNCH(pack16_kernel, blocks_for(n), kThreads, 0, s)(x, y, n, make_fast_div(c), make_fast_div(sp), bf16);
}

void k_pack_bf16_rows(cudaStream_t s, const float *x, uint16_t *y, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t n = rows * cols;
  if (!n) return;
  LAUNCH(pack_bf16_rows_kernel, blocks_for(n), kThreads, 0, s)(x, y, n, make_fast_div(cols), ld);
}

void k_weights16(cudaStream_t s, const float *params, uint16_t *w16, const dt_weight16 *table, int n, int64_t rows) {
  if (!rows) return;
  const int64_t warps = kThreads / 32;
  LAUNCH(weights16_kernel, (rows + warps - 1) / warps, kThreads, 0, s)(params, w16, table, n, rows);
}

void k_grads16(cudaStream_t s, float *grads, const uint16_t *g16, const dt_weight16 *table, int n, int64_t rows) {
  if (!rows) return;
  const int64_t warps = kThreads / 32;
  LAUNCH(grads16_kernel, (rows + warps - 1) / warps, kThreads, 0, s)(grads, g16, table, n, rows);
}

void k_unpack16(cudaStream_t s, const uint16_t *y, float *x, int64_t b, int64_t c, int64_t sp, int bf16,
                int accumulate) {
  int64_t n = b * c * sp;
  if (!n) return;
  if (c > 1 && sp > 1)
    LAUNCH(unpack16_tiled_kernel, tile_grid(b, sp, c), kThreads, 0, s)(y, x, b, c, sp, bf16, accumulate);
  else
    LAUNCH(unpack16_kernel, blocks_for(n), kThreads, 0, s)
  (y, x, n, make_fast_div(c), make_fast_div(sp), bf16, accumulate);
}

}  // extern "C"
