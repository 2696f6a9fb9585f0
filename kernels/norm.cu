// norm.cu: batchnorm over (B, C, S): statistics and their backward in double, per chunk of a channel;
// the statistics turned into mean and 1/std (and the running statistics updated) on the device, so
// a training step needs no host round trip. Layernorm over the rows of (N, D): one block per row,
// statistics in double, and dgamma, dbeta summed over chunks of rows in a fixed order (no atomics),
// as src/cpu/norm.c.
#include "common.cuh"
#include "half.h"
#include "kernels.h"

// Batchnorm's sums run over the b * sp positions of each channel in chunks (k_bn_chunks, bn_grid): block
// (channel, chunk) sums its chunk in double into partials (chunks, 2C), and the last block to finish adds
// each channel's chunks in order (bn_tail). One block per channel left all but C of an H100's 132 SMs idle
// (C = 32: about 0.13 TB/s measured, 4% of its bandwidth); the order of every sum is fixed by the shapes,
// so every run gives the same bits.
static __device__ __forceinline__ void bn_chunk(int64_t n, int64_t per, int64_t *r0, int64_t *r1) {
  *r0 = blockIdx.y * per;
  *r1 = *r0 + per < n ? *r0 + per : n;
}

// Channel ch's batch statistics in training from its sum s1 and sum of squares s2 over n values, and its running
// ones updated, as src/cpu/norm.c's cpu_bn_finalize (double precision, PyTorch's rules).
static __device__ __forceinline__ void bn_finalize_channel(int64_t ch, double n, double s1, double s2, float momentum,
                                                           float eps, float *mean, float *invstd, float *running_mean,
                                                           float *running_var) {
  double mu = n > 0 ? s1 / n : 0.0;
  double var = n > 0 ? s2 / n - mu * mu : 0.0;
  if (var < 0) var = 0;
  mean[ch] = (float)mu;
  invstd[ch] = (float)(1.0 / sqrt(var + eps));
  if (n > 0) {
    double unbiased = n > 1 ? var * n / (n - 1) : var;
    running_mean[ch] = (1 - momentum) * running_mean[ch] + momentum * (float)mu;
    running_var[ch] = (1 - momentum) * running_var[ch] + momentum * (float)unbiased;
  }
}

// Channel ch's two sums s1, s2 over the chunks: into sums (2C; count >= 0, the forward's, goes to sums[2C]),
// added to dbeta, dgamma (the backward's; NULL in the forward), and its statistics where mean is not NULL
// (kernels.h's k_bn_fin)
static __device__ __forceinline__ void bn_sums_channel(int64_t ch, int64_t c, double s1, double s2, double count,
                                                       double *sums, float *dgamma, float *dbeta, float momentum,
                                                       float eps, float *mean, float *invstd, float *running_mean,
                                                       float *running_var) {
  sums[ch] = s1, sums[c + ch] = s2;
  if (dbeta) dbeta[ch] += (float)s1, dgamma[ch] += (float)s2;
  if (ch == 0 && count >= 0) sums[2 * c] = count;
  if (mean) bn_finalize_channel(ch, count, s1, s2, momentum, eps, mean, invstd, running_mean, running_var);
}

// Whether this block is the last of `members` to take a ticket (every thread gets the answer). Each block
// fences its writes before taking one, and the last fences again before reading the others' (volatile loads,
// which no L1 serves), as the CUDA guide's last-block reduction; the last puts the ticket back to 0 for the
// next launch.
static __device__ bool bn_last_of(unsigned *ticket, unsigned members) {
  __shared__ unsigned last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(ticket, 1u) == members - 1;
    if (last) *ticket = 0;
  }
  __syncthreads();
  const bool mine = last;
  if (mine) __threadfence();
  return mine;
}

// Rows [0, count) of src (rows of 2C doubles: the first sums, then the second) added for the block's
// `width` channels from ch0: thread (lane, row) adds rows row, row + rows, ... in order, and the threads of
// row 0 (threadIdx.x < width) then add the rows' sums in row order, returning channel ch0 + lane's two. No
// barrier at its end: a second call's writes to red come after bn_last_of's.
static __device__ void bn_add_rows(const volatile double *src, int64_t count, int64_t c, int64_t ch0, int width,
                                   double *s1, double *s2) {
  __shared__ double red[2][kThreads];
  const int lane = threadIdx.x % width, row = threadIdx.x / width, rows = blockDim.x / width;
  const int64_t ch = ch0 + lane;
  double a = 0, b = 0;
  if (ch < c)
    for (int64_t k = row; k < count; k += rows) a += src[k * 2 * c + ch], b += src[k * 2 * c + c + ch];
  red[0][threadIdx.x] = a, red[1][threadIdx.x] = b;
  __syncthreads();
  if (row == 0)
    for (int r = 1; r < rows && r < count; r++) a += red[0][r * width + lane], b += red[1][r * width + lane];
  *s1 = a, *s2 = b;
}

// The statistics kernels' end, where a kernel of its own added the chunks (a launch a batchnorm a pass fewer).
// Block (group, chunk) has written its chunk's partials (chunks, 2C) for the group's `width` channels from
// ch0; the chunks go in tiers of K_BN_TIER. The last block of a tier to finish adds the tier's chunks into
// tier sums (tiers, 2C), after the partials (with one tier: the totals); the last tier of the group adds the
// tiers and hands each channel's totals to bn_sums_channel. tickets: (groups, tiers + 1), zero between launches.
// Which block finishes last changes no bits: every sum's order is fixed by the shapes. The whole block calls it,
// as the kernel's last statement.
static __device__ void bn_tail(double *partials, int64_t chunks, int64_t c, int64_t ch0, int width, unsigned *tickets,
                               double count, double *sums, float *dgamma, float *dbeta, float momentum, float eps,
                               float *mean, float *invstd, float *running_mean, float *running_var) {
  const int64_t tiers = (chunks + K_BN_TIER - 1) / K_BN_TIER, tier = blockIdx.y / K_BN_TIER, first = tier * K_BN_TIER;
  const int64_t members = chunks - first < K_BN_TIER ? chunks - first : (int64_t)K_BN_TIER, ch = ch0 + threadIdx.x;
  unsigned *group = tickets + blockIdx.x * (tiers + 1);
  if (!bn_last_of(group + tier, (unsigned)members)) return;
  double s1, s2;
  bn_add_rows(partials + first * 2 * c, members, c, ch0, width, &s1, &s2);
  if (tiers > 1) {
    double *tier_sums = partials + chunks * 2 * c;
    if ((int)threadIdx.x < width && ch < c) tier_sums[tier * 2 * c + ch] = s1, tier_sums[tier * 2 * c + c + ch] = s2;
    if (!bn_last_of(group + tiers, (unsigned)tiers)) return;
    bn_add_rows(tier_sums, tiers, c, ch0, width, &s1, &s2);
  }
  if ((int)threadIdx.x < width && ch < c)
    bn_sums_channel(ch, c, s1, s2, count, sums, dgamma, dbeta, momentum, eps, mean, invstd, running_mean, running_var);
}

// bn_tail's arguments from count on, which the statistics kernels take as their last (pointers as arguments of
// their own, where the stand-in looks for what a kernel may touch)
#define BN_TAIL_PARAMS                                                                                                \
  unsigned *tickets, double count, double *sums, float *dgamma, float *dbeta, float momentum, float eps, float *mean, \
      float *invstd, float *running_mean, float *running_var
#define BN_TAIL_ARGS tickets, count, sums, dgamma, dbeta, momentum, eps, mean, invstd, running_mean, running_var

// partials (chunks, 2C): sum(c), sumsq(c) of the chunk; then bn_tail
__global__ void bn_stats_kernel(const float *x, int64_t b, int64_t c, fast_div sp, int64_t per, double *partials,
                                BN_TAIL_PARAMS) {
  int64_t ch = blockIdx.x, r0, r1;
  bn_chunk(b * sp.d, per, &r0, &r1);
  double s1 = 0, s2 = 0;
  for (int64_t i = r0 + threadIdx.x; i < r1; i += blockDim.x) {
    double v = x[channel_offset(i, ch, c, sp)];
    s1 += v;
    s2 += v * v;
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) partials[blockIdx.y * 2 * c + ch] = s1, partials[blockIdx.y * 2 * c + c + ch] = s2;
  bn_tail(partials, gridDim.y, c, ch, 1, BN_TAIL_ARGS);
}

// One thread per channel: the running statistics in evaluation, else bn_finalize_channel.
__global__ void bn_finalize_kernel(int64_t c, int training, float momentum, float eps, const double *sums, float *mean,
                                   float *invstd, float *running_mean, float *running_var) {
  GRID_STRIDE(ch, c) {
    if (!training) {
      mean[ch] = running_mean[ch];
      invstd[ch] = (float)(1.0 / sqrt((double)running_var[ch] + eps));
      continue;
    }
    bn_finalize_channel(ch, sums[2 * c], sums[ch], sums[c + ch], momentum, eps, mean, invstd, running_mean,
                        running_var);
  }
}

// z = (x - mean) * (invstd * gamma) + beta, with no fused multiply-add: src/cpu/norm.c's bn_z bit for
// bit, and the fused relu's backward recomputes exactly the z forward masked.
__device__ __forceinline__ float bn_z(float x, float mean, float invstd, float gamma, float beta) {
  return __fadd_rn(__fmul_rn(x - mean, __fmul_rn(invstd, gamma)), beta);
}

__global__ void bn_apply_kernel(int relu, const float *x, float *y, int64_t n, fast_div c, fast_div sp,
                                const float *mean, const float *invstd, const float *gamma, const float *beta) {
  GRID_STRIDE(i, n) {
    uint32_t ch = channel_of(i, c, sp);
    float z = bn_z(x[i], mean[ch], invstd[ch], gamma[ch], beta[ch]);
    y[i] = relu && z < 0 ? 0.0f : z;  // as the relu kernel: NaN passes
  }
}

// dy, or with the fused relu dy where z > 0 and 0 elsewhere (the relu kernel's backward)
__device__ __forceinline__ float bn_grad_at_z(int relu, float dy, float x, float mean, float invstd, float gamma,
                                              float beta) {
  return !relu || bn_z(x, mean, invstd, gamma, beta) > 0 ? dy : 0.0f;
}

// dx = gamma * invstd * (d - mean(dy) - xhat * mean(dy * xhat)), rounded in that order (no fused
// multiply-add, as src/cpu/norm.c)
__device__ __forceinline__ float bn_dx(float d, float xhat, float mdy, float mdyx, float gamma, float invstd) {
  return __fmul_rn(__fmul_rn(gamma, invstd), __fsub_rn(__fsub_rn(d, mdy), __fmul_rn(xhat, mdyx)));
}

// partials (chunks, 2C): sum_dy(c), sum_dy_xhat(c) of the chunk, then bn_tail; their sums are also the
// parameter gradients' shares. mean and invstd are read, and bn_tail's (the forward's) NULL.
__global__ void bn_bwd_stats_kernel(int relu, const float *x, const float *dy, int64_t b, int64_t c, fast_div sp,
                                    int64_t per, const float *bn_mean, const float *bn_invstd, const float *gamma,
                                    const float *beta, double *partials, BN_TAIL_PARAMS) {
  int64_t ch = blockIdx.x, r0, r1;
  bn_chunk(b * sp.d, per, &r0, &r1);
  double s1 = 0, s2 = 0;
  float m = bn_mean[ch], is = bn_invstd[ch], g = relu ? gamma[ch] : 0.0f, bt = relu ? beta[ch] : 0.0f;
  for (int64_t i = r0 + threadIdx.x; i < r1; i += blockDim.x) {
    int64_t j = channel_offset(i, ch, c, sp);
    float d = bn_grad_at_z(relu, dy[j], x[j], m, is, g, bt);
    s1 += d;
    s2 += (double)d * ((x[j] - m) * is);
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) partials[blockIdx.y * 2 * c + ch] = s1, partials[blockIdx.y * 2 * c + c + ch] = s2;
  bn_tail(partials, gridDim.y, c, ch, 1, BN_TAIL_ARGS);
}

__global__ void bn_bwd_apply_kernel(int relu, const float *x, const float *dy, float *dx, int64_t n, fast_div c,
                                    fast_div sp, const double *count, const float *mean, const float *invstd,
                                    const float *gamma, const float *beta, const double *sums) {
  double cnt = *count;
  GRID_STRIDE(i, n) {
    uint32_t ch = channel_of(i, c, sp);
    float is = invstd[ch], xhat = (x[i] - mean[ch]) * is;
    float mdy = (float)(sums[ch] / cnt), mdyx = (float)(sums[c.d + ch] / cnt);
    float d = bn_grad_at_z(relu, dy[i], x[i], mean[ch], is, gamma[ch], relu ? beta[ch] : 0.0f);
    dx[i] = bn_dx(d, xhat, mdy, mdyx, gamma[ch], is);
  }
}

// Batchnorm on a convolution's output as cuDNN wrote it under bf16 and fp16 (backend.h's x16): x and dx
// 16-bit (B, S, C), NHWC, the n = B * S positions in rows of C; y and dy FP32 (B, C, S). A block is 32
// channels by kRows16 rows of positions (thread: lane = channel, row = position), and moves 32 x 32 tiles
// through shared memory where the two layouts meet, so that every read and write runs along the
// contiguous dimension. The sums go in chunks of whole tiles of positions (k_bn16_chunks).
static const int kLanes16 = 32, kRows16 = kThreads / kLanes16;

// Thread (lane, row)'s double sums over the block's rows, in row order, into partials (chunks, 2C) at
// chunk blockIdx.y; red: the kernel's shared (2, kRows16, kLanes16).
static __device__ __forceinline__ void bn16_partials(double (*red)[kRows16][kLanes16], double s1, double s2, int64_t ch,
                                                     int64_t c, double *partials) {
  const int lane = threadIdx.x % kLanes16, row = threadIdx.x / kLanes16;
  red[0][row][lane] = s1, red[1][row][lane] = s2;
  __syncthreads();
  if (row == 0 && ch < c) {
    for (int r = 1; r < kRows16; r++) s1 += red[0][r][lane], s2 += red[1][r][lane];
    partials[blockIdx.y * 2 * c + ch] = s1, partials[blockIdx.y * 2 * c + c + ch] = s2;
  }
}

// partials (chunks, 2C) of a chunk, read along the channels, then bn_tail: sum(c) and sumsq(c) of x (dy NULL:
// forward), or sum_dy(c) and sum_dy_xhat(c) with dy 16-bit NHWC too (bn_apply's y16: a convolution read y)
__global__ void bn16_sums_kernel(int relu, const uint16_t *x, int format, const uint16_t *dy, int64_t n, int64_t c,
                                 int64_t per, const float *bn_mean, const float *bn_invstd, const float *gamma,
                                 const float *beta, double *partials, BN_TAIL_PARAMS) {
  __shared__ double red[2][kRows16][kLanes16];
  const int lane = threadIdx.x % kLanes16, row = threadIdx.x / kLanes16;
  const int64_t ch = (int64_t)blockIdx.x * kLanes16 + lane;
  int64_t r0, r1;
  bn_chunk(n, per, &r0, &r1);
  double s1 = 0, s2 = 0;
  if (ch < c && !dy) {
    for (int64_t p = r0 + row; p < r1; p += kRows16) {
      double v = dt_from_16(x[p * c + ch], format);
      s1 += v;
      s2 += v * v;
    }
  } else if (ch < c) {
    const float m = bn_mean[ch], is = bn_invstd[ch], g = relu ? gamma[ch] : 0.0f, bt = relu ? beta[ch] : 0.0f;
    for (int64_t p = r0 + row; p < r1; p += kRows16) {
      float xv = dt_from_16(x[p * c + ch], format);
      float d = bn_grad_at_z(relu, dt_from_16(dy[p * c + ch], format), xv, m, is, g, bt);
      s1 += d;
      s2 += (double)d * ((xv - m) * is);
    }
  }
  bn16_partials(red, s1, s2, ch, c, partials);
  bn_tail(partials, gridDim.y, c, (int64_t)blockIdx.x * kLanes16, kLanes16, BN_TAIL_ARGS);
}

// y (B, C, S) = z, or relu(z), of x (B, S, C): z computed as a tile is read (the lane's channel), written
// along the positions
__global__ void bn16_apply_kernel(int relu, const uint16_t *x, int format, void *y, int y16, int64_t n, int64_t c,
                                  fast_div sp, const float *mean, const float *invstd, const float *gamma,
                                  const float *beta) {
  __shared__ float tile[kLanes16][kLanes16 + 1];
  const int lane = threadIdx.x % kLanes16, row = threadIdx.x / kLanes16;
  const int64_t ch0 = (int64_t)blockIdx.x * kLanes16, ch = ch0 + lane;
  const float m = ch < c ? mean[ch] : 0.0f, is = ch < c ? invstd[ch] : 0.0f, g = ch < c ? gamma[ch] : 0.0f,
              bt = ch < c ? beta[ch] : 0.0f;
  for (int64_t q0 = (int64_t)blockIdx.y * kLanes16; q0 < n; q0 += (int64_t)gridDim.y * kLanes16) {
    if (y16) {  // y as x is: along the channels, no tile
      for (int r = row; r < kLanes16; r += kRows16)
        if (q0 + r < n && ch < c) {
          float z = bn_z(dt_from_16(x[(q0 + r) * c + ch], format), m, is, g, bt);
          ((uint16_t *)y)[(q0 + r) * c + ch] = dt_to_16(relu && z < 0 ? 0.0f : z, format);
        }
      continue;
    }
    __syncthreads();  // the last tile is written out
    for (int r = row; r < kLanes16; r += kRows16)
      if (q0 + r < n && ch < c) {
        float z = bn_z(dt_from_16(x[(q0 + r) * c + ch], format), m, is, g, bt);
        tile[r][lane] = relu && z < 0 ? 0.0f : z;  // as the relu kernel: NaN passes
      }
    __syncthreads();
    for (int r = row; r < kLanes16; r += kRows16)
      if (ch0 + r < c && q0 + lane < n) ((float *)y)[channel_offset(q0 + lane, ch0 + r, c, sp)] = tile[lane][r];
  }
}

// dy's tile (32 channels from ch0, 32 positions from q0, FP32 (B, C, S)) into tile[channel][position],
// read along the positions; 0 past the channels and past `end`
static __device__ __forceinline__ void bn16_dy_tile(float (*tile)[kLanes16 + 1], const float *dy, int64_t q0,
                                                    int64_t end, int64_t ch0, int64_t c, fast_div sp) {
  const int lane = threadIdx.x % kLanes16, row = threadIdx.x / kLanes16;
  for (int r = row; r < kLanes16; r += kRows16)
    tile[r][lane] = ch0 + r < c && q0 + lane < end ? dy[channel_offset(q0 + lane, ch0 + r, c, sp)] : 0.0f;
}

// partials (chunks, 2C): sum_dy(c), sum_dy_xhat(c) of the chunk (whole tiles of positions), then bn_tail
__global__ void bn16_bwd_stats_kernel(int relu, const uint16_t *x, int format, const float *dy, int64_t n, int64_t c,
                                      fast_div sp, int64_t per, const float *bn_mean, const float *bn_invstd,
                                      const float *gamma, const float *beta, double *partials, BN_TAIL_PARAMS) {
  __shared__ float tile[kLanes16][kLanes16 + 1];
  __shared__ double red[2][kRows16][kLanes16];
  const int lane = threadIdx.x % kLanes16, row = threadIdx.x / kLanes16;
  const int64_t ch0 = (int64_t)blockIdx.x * kLanes16, ch = ch0 + lane;
  const float m = ch < c ? bn_mean[ch] : 0.0f, is = ch < c ? bn_invstd[ch] : 0.0f;
  const float g = relu && ch < c ? gamma[ch] : 0.0f, bt = relu && ch < c ? beta[ch] : 0.0f;
  int64_t r0, r1;
  bn_chunk(n, per, &r0, &r1);
  double s1 = 0, s2 = 0;
  for (int64_t q0 = r0; q0 < r1; q0 += kLanes16) {
    __syncthreads();  // the last tile is read
    bn16_dy_tile(tile, dy, q0, r1, ch0, c, sp);
    __syncthreads();
    for (int r = row; r < kLanes16; r += kRows16)
      if (q0 + r < r1 && ch < c) {
        float xv = dt_from_16(x[(q0 + r) * c + ch], format), d = bn_grad_at_z(relu, tile[lane][r], xv, m, is, g, bt);
        s1 += d;
        s2 += (double)d * ((xv - m) * is);
      }
  }
  bn16_partials(red, s1, s2, ch, c, partials);
  bn_tail(partials, gridDim.y, c, ch0, kLanes16, BN_TAIL_ARGS);
}

// dx (B, S, C) 16-bit from x (B, S, C) and dy (B, C, S), written along the channels
__global__ void bn16_bwd_apply_kernel(int relu, const uint16_t *x, int format, const void *dy, int dy16, uint16_t *dx,
                                      int64_t n, int64_t c, fast_div sp, const double *count, const float *mean,
                                      const float *invstd, const float *gamma, const float *beta, const double *sums) {
  __shared__ float tile[kLanes16][kLanes16 + 1];
  const int lane = threadIdx.x % kLanes16, row = threadIdx.x / kLanes16;
  const int64_t ch0 = (int64_t)blockIdx.x * kLanes16, ch = ch0 + lane;
  const double cnt = *count;
  const float m = ch < c ? mean[ch] : 0.0f, is = ch < c ? invstd[ch] : 0.0f, g = ch < c ? gamma[ch] : 0.0f;
  const float bt = relu && ch < c ? beta[ch] : 0.0f;
  const float mdy = ch < c ? (float)(sums[ch] / cnt) : 0.0f, mdyx = ch < c ? (float)(sums[c + ch] / cnt) : 0.0f;
  for (int64_t q0 = (int64_t)blockIdx.y * kLanes16; q0 < n; q0 += (int64_t)gridDim.y * kLanes16) {
    if (!dy16) {        // dy as x is (a convolution wrote it), read along the channels; else through the tile
      __syncthreads();  // the last tile is read
      bn16_dy_tile(tile, (const float *)dy, q0, n, ch0, c, sp);
      __syncthreads();
    }
    for (int r = row; r < kLanes16; r += kRows16)
      if (q0 + r < n && ch < c) {
        float xv = dt_from_16(x[(q0 + r) * c + ch], format), xhat = (xv - m) * is;
        float dyv = dy16 ? dt_from_16(((const uint16_t *)dy)[(q0 + r) * c + ch], format) : tile[lane][r];
        float d = bn_grad_at_z(relu, dyv, xv, m, is, g, bt);
        dx[(q0 + r) * c + ch] = dt_to_16(bn_dx(d, xhat, mdy, mdyx, g, is), format);
      }
  }
}

// One block per row: mean and biased variance in double (two passes over the row), then y with
// xhat in double, as the CPU's. Y: float, or uint16_t for bfloat16 rows of ldy values (rounded once).
template <class Y>
__global__ void ln_fwd_kernel(const float *x, const float *gamma, const float *beta, Y *y, float *mean, float *rstd,
                              int64_t d, int64_t ldy, float eps) {
  const float *xr = x + blockIdx.x * d;
  Y *yr = y + blockIdx.x * ldy;
  __shared__ double s_mu, s_rs;
  double s = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) s += xr[j];
  s = block_sum(s);
  if (threadIdx.x == 0) s_mu = s / (double)d;
  __syncthreads();
  double mu = s_mu, v = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) v += ((double)xr[j] - mu) * ((double)xr[j] - mu);
  v = block_sum(v);
  if (threadIdx.x == 0) {
    s_rs = 1.0 / sqrt(v / (double)d + (double)eps);
    mean[blockIdx.x] = (float)mu;
    rstd[blockIdx.x] = (float)s_rs;
  }
  __syncthreads();
  double rs = s_rs;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    store_value(&yr[j], (float)(((double)xr[j] - mu) * rs) * gamma[j] + beta[j]);
}

// One block per row: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, plus add (NULL, or a
// residual's gradient through its shortcut; the value rounded first, as the add kernel's sum, no FMA). DY: float,
// or uint16_t for bfloat16 rows of lddy values.
template <class DY>
__global__ void ln_bwd_dx_kernel(const float *x, const DY *dy, const float *gamma, const float *mean, const float *rstd,
                                 float *dx, const float *add, int64_t d, int64_t lddy) {
  const int64_t off = blockIdx.x * d, dy_off = blockIdx.x * lddy;
  const float m = mean[blockIdx.x], rs = rstd[blockIdx.x];
  __shared__ float s_ma, s_mb;
  double a = 0, b = 0;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float g = value_of(dy[dy_off + j]) * gamma[j], xh = (x[off + j] - m) * rs;
    a += g;
    b += (double)g * xh;
  }
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) s_ma = (float)(a / (double)d), s_mb = (float)(b / (double)d);
  __syncthreads();
  float ma = s_ma, mb = s_mb;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float g = value_of(dy[dy_off + j]) * gamma[j], xh = (x[off + j] - m) * rs, v = rs * (g - ma - xh * mb);
    dx[off + j] = add ? __fadd_rn(v, add[off + j]) : v;
  }
}

// dgamma, dbeta partial sums: thread (column j, chunk blockIdx.y) sums its chunk of rows in
// increasing order, in double, into partials (chunks, 2, D).
template <class DY>
__global__ void ln_bwd_partials_kernel(const float *x, const DY *dy, const float *mean, const float *rstd, int64_t n,
                                       int64_t d, int64_t lddy, int64_t per, double *partials) {
  int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= d) return;
  int64_t r0 = blockIdx.y * per, r1 = r0 + per < n ? r0 + per : n;
  double sg = 0, sb = 0;
  for (int64_t r = r0; r < r1; r++) {
    float g = value_of(dy[r * lddy + j]);
    sg += (double)g * ((x[r * d + j] - mean[r]) * rstd[r]);
    sb += g;
  }
  partials[blockIdx.y * 2 * d + j] = sg;
  partials[blockIdx.y * 2 * d + d + j] = sb;
}

// The chunks' sums in chunk order, added into dgamma, dbeta.
__global__ void ln_bwd_params_kernel(const double *partials, int64_t chunks, int64_t d, float *dgamma, float *dbeta) {
  GRID_STRIDE(j, d) {
    double sg = 0, sb = 0;
    for (int64_t c = 0; c < chunks; c++) sg += partials[c * 2 * d + j], sb += partials[c * 2 * d + d + j];
    dgamma[j] += (float)sg;
    dbeta[j] += (float)sb;
  }
}

extern "C" {

// chunks of at most k_bn_chunks(n) with none empty: per positions each (n = 0: one empty chunk)
static dim3 bn_grid(int64_t n, int64_t c, int64_t *per) {
  int64_t chunks = k_bn_chunks(n);
  *per = n > 0 ? (n + chunks - 1) / chunks : 1;
  return dim3((unsigned)c, (unsigned)(n > 0 ? (n + *per - 1) / *per : 1));
}

void k_bn_stats(cudaStream_t s, const float *x, int64_t b, int64_t c, int64_t sp, double *sums, double *partials,
                unsigned *tickets, k_bn_fin fin) {
  int64_t per;
  dim3 grid = bn_grid(b * sp, c, &per);
  LAUNCH(bn_stats_kernel, grid, kThreads, 0, s)
  (x, b, c, make_fast_div(sp), per, partials, tickets, (double)(b * sp), sums, (float *)NULL, (float *)NULL,
   fin.momentum, fin.eps, fin.mean, fin.invstd, fin.running_mean, fin.running_var);
}

void k_bn_finalize(cudaStream_t s, int64_t c, int training, float momentum, float eps, const double *sums, float *mean,
                   float *invstd, float *running_mean, float *running_var) {
  LAUNCH(bn_finalize_kernel, blocks_for(c), kThreads, 0, s)
  (c, training, momentum, eps, sums, mean, invstd, running_mean, running_var);
}

void k_bn_apply(cudaStream_t s, int relu, const float *x, float *y, int64_t b, int64_t c, int64_t sp, const float *mean,
                const float *invstd, const float *gamma, const float *beta) {
  LAUNCH(bn_apply_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (relu, x, y, b * c * sp, make_fast_div(c), make_fast_div(sp), mean, invstd, gamma, beta);
}

void k_bn_bwd_stats(cudaStream_t s, int relu, const float *x, const float *dy, int64_t b, int64_t c, int64_t sp,
                    const float *mean, const float *invstd, const float *gamma, const float *beta, double *sums,
                    float *dgamma, float *dbeta, double *partials, unsigned *tickets) {
  int64_t per;
  dim3 grid = bn_grid(b * sp, c, &per);
  LAUNCH(bn_bwd_stats_kernel, grid, kThreads, 0, s)
  (relu, x, dy, b, c, make_fast_div(sp), per, mean, invstd, gamma, beta, partials, tickets, -1.0, sums, dgamma, dbeta,
   0.0f, 0.0f, (float *)NULL, (float *)NULL, (float *)NULL, (float *)NULL);
}

void k_bn_bwd_apply(cudaStream_t s, int relu, const float *x, const float *dy, float *dx, int64_t b, int64_t c,
                    int64_t sp, const double *count, const float *mean, const float *invstd, const float *gamma,
                    const float *beta, const double *sums) {
  LAUNCH(bn_bwd_apply_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (relu, x, dy, dx, b * c * sp, make_fast_div(c), make_fast_div(sp), count, mean, invstd, gamma, beta, sums);
}

// The 16-bit kernels' grid: channel groups of 32 by chunks of whole 32-position tiles (stats, at most
// k_bn16_chunks(n, c)), or by tiles up to the grid's y limit (apply)
static dim3 bn16_grid(int64_t n, int64_t c, int64_t *per) {
  const int64_t groups = (c + kLanes16 - 1) / kLanes16, chunks = k_bn16_chunks(n, c);
  *per = n > 0 ? ((n + chunks - 1) / chunks + kLanes16 - 1) / kLanes16 * kLanes16 : kLanes16;
  return dim3((unsigned)groups, (unsigned)(n > 0 ? (n + *per - 1) / *per : 1));
}
static dim3 bn16_tiles(int64_t n, int64_t c) {
  const int64_t tiles = (n + kLanes16 - 1) / kLanes16;
  return dim3((unsigned)((c + kLanes16 - 1) / kLanes16), (unsigned)(tiles < 1 ? 1 : tiles < 65535 ? tiles : 65535));
}

void k_bn16_stats(cudaStream_t s, const uint16_t *x, int format, int64_t b, int64_t c, int64_t sp, double *sums,
                  double *partials, unsigned *tickets, k_bn_fin fin) {
  int64_t per;
  dim3 grid = bn16_grid(b * sp, c, &per);
  LAUNCH(bn16_sums_kernel, grid, kThreads, 0, s)
  (0, x, format, (const uint16_t *)NULL, b * sp, c, per, (const float *)NULL, (const float *)NULL, (const float *)NULL,
   (const float *)NULL, partials, tickets, (double)(b * sp), sums, (float *)NULL, (float *)NULL, fin.momentum, fin.eps,
   fin.mean, fin.invstd, fin.running_mean, fin.running_var);
}

void k_bn16_apply(cudaStream_t s, int relu, const uint16_t *x, int format, void *y, int y16, int64_t b, int64_t c,
                  int64_t sp, const float *mean, const float *invstd, const float *gamma, const float *beta) {
  if (b * sp == 0) return;
  LAUNCH(bn16_apply_kernel, bn16_tiles(b * sp, c), kThreads, 0, s)
  (relu, x, format, y, y16, b * sp, c, make_fast_div(sp), mean, invstd, gamma, beta);
}

void k_bn16_bwd_stats(cudaStream_t s, int relu, const uint16_t *x, int format, const void *dy, int dy16, int64_t b,
                      int64_t c, int64_t sp, const float *mean, const float *invstd, const float *gamma,
                      const float *beta, double *sums, float *dgamma, float *dbeta, double *partials,
                      unsigned *tickets) {
  int64_t per;
  dim3 grid = bn16_grid(b * sp, c, &per);
  if (dy16) {
    LAUNCH(bn16_sums_kernel, grid, kThreads, 0, s)
    (relu, x, format, (const uint16_t *)dy, b * sp, c, per, mean, invstd, gamma, beta, partials, tickets, -1.0, sums,
     dgamma, dbeta, 0.0f, 0.0f, (float *)NULL, (float *)NULL, (float *)NULL, (float *)NULL);
  } else {
    LAUNCH(bn16_bwd_stats_kernel, grid, kThreads, 0, s)
    (relu, x, format, (const float *)dy, b * sp, c, make_fast_div(sp), per, mean, invstd, gamma, beta, partials,
     tickets, -1.0, sums, dgamma, dbeta, 0.0f, 0.0f, (float *)NULL, (float *)NULL, (float *)NULL, (float *)NULL);
  }
}

void k_bn16_bwd_apply(cudaStream_t s, int relu, const uint16_t *x, int format, const void *dy, int dy16, uint16_t *dx,
                      int64_t b, int64_t c, int64_t sp, const double *count, const float *mean, const float *invstd,
                      const float *gamma, const float *beta, const double *sums) {
  if (b * sp == 0) return;
  LAUNCH(bn16_bwd_apply_kernel, bn16_tiles(b * sp, c), kThreads, 0, s)
  (relu, x, format, dy, dy16, dx, b * sp, c, make_fast_div(sp), count, mean, invstd, gamma, beta, sums);
}

void k_ln_fwd(cudaStream_t s, const float *x, const float *gamma, const float *beta, void *y, int y16, float *mean,
              float *rstd, int64_t n, int64_t d, float eps) {
  if (!n) return;
  if (y16) {
    LAUNCH(ln_fwd_kernel<uint16_t>, (unsigned)n, row_threads(d), 0, s)
    (x, gamma, beta, (uint16_t *)y, mean, rstd, d, dt_ld16(d), eps);
  } else {
    LAUNCH(ln_fwd_kernel<float>, (unsigned)n, row_threads(d), 0, s)(x, gamma, beta, (float *)y, mean, rstd, d, d, eps);
  }
}

void k_ln_bwd(cudaStream_t s, const float *x, const void *dy, int dy16, const float *gamma, const float *mean,
              const float *rstd, float *dx, const float *dx_add, float *dgamma, float *dbeta, int64_t n, int64_t d,
              double *partials) {
  if (!n || !d) return;
  const int64_t COLS = 128, most = K_LN_CHUNKS, lddy = dy16 ? dt_ld16(d) : d;
  int64_t chunks = n < most ? n : most, per = (n + chunks - 1) / chunks;
  chunks = (n + per - 1) / per;  // no empty chunk
  dim3 grid((unsigned)((d + COLS - 1) / COLS), (unsigned)chunks);
  const unsigned threads = row_threads(d < COLS ? d : COLS);
  if (dy16) {
    const uint16_t *dy_16 = (const uint16_t *)dy;
    if (dx) LAUNCH(ln_bwd_dx_kernel<uint16_t>, (unsigned)n, row_threads(d), 0, s)
    (x, dy_16, gamma, mean, rstd, dx, dx_add, d, lddy);
    LAUNCH(ln_bwd_partials_kernel<uint16_t>, grid, threads, 0, s)(x, dy_16, mean, rstd, n, d, lddy, per, partials);
  } else {
    const float *dy_32 = (const float *)dy;
    if (dx) LAUNCH(ln_bwd_dx_kernel<float>, (unsigned)n, row_threads(d), 0, s)
    (x, dy_32, gamma, mean, rstd, dx, dx_add, d, lddy);
    LAUNCH(ln_bwd_partials_kernel<float>, grid, threads, 0, s)(x, dy_32, mean, rstd, n, d, lddy, per, partials);
  }
  LAUNCH(ln_bwd_params_kernel, blocks_for(d), kThreads, 0, s)(partials, chunks, d, dgamma, dbeta);
}

}  // extern "C"
