// norm.cu: batchnorm over (B, C, S): statistics and their backward in double, one block per channel.
#include "common.cuh"
#include "kernels.h"

__global__ void bn_stats_kernel(const float *x, int64_t b, int64_t c, fast_div sp, double *sum, double *sumsq) {
  int64_t ch = blockIdx.x;
  double s1 = 0, s2 = 0;
  for (int64_t i = threadIdx.x; i < b * sp.d; i += blockDim.x) {
    double v = x[channel_offset(i, ch, c, sp)];
    s1 += v;
    s2 += v * v;
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) sum[ch] = s1, sumsq[ch] = s2;
}

__global__ void bn_apply_kernel(const float *x, float *y, int64_t n, fast_div c, fast_div sp, const float *mean,
                                const float *invstd, const float *gamma, const float *beta) {
  GRID_STRIDE(i, n) {
    uint32_t ch = channel_of(i, c, sp);
    y[i] = (x[i] - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch];
  }
}

__global__ void bn_bwd_stats_kernel(const float *x, const float *dy, int64_t b, int64_t c, fast_div sp,
                                    const float *mean, const float *invstd, double *sum_dy, double *sum_dy_xhat) {
  int64_t ch = blockIdx.x;
  double s1 = 0, s2 = 0;
  float m = mean[ch], is = invstd[ch];
  for (int64_t i = threadIdx.x; i < b * sp.d; i += blockDim.x) {
    int64_t j = channel_offset(i, ch, c, sp);
    s1 += dy[j];
    s2 += (double)dy[j] * ((x[j] - m) * is);
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) sum_dy[ch] = s1, sum_dy_xhat[ch] = s2;
}

__global__ void bn_bwd_apply_kernel(const float *x, const float *dy, float *dx, int64_t n, fast_div c, fast_div sp,
                                    double count, const float *mean, const float *invstd, const float *gamma,
                                    const double *sum_dy, const double *sum_dy_xhat) {
  GRID_STRIDE(i, n) {
    uint32_t ch = channel_of(i, c, sp);
    float is = invstd[ch], xhat = (x[i] - mean[ch]) * is;
    float mdy = (float)(sum_dy[ch] / count), mdyx = (float)(sum_dy_xhat[ch] / count);
    dx[i] = gamma[ch] * is * (dy[i] - mdy - xhat * mdyx);
  }
}

extern "C" {

void k_bn_stats(cudaStream_t s, const float *x, int64_t b, int64_t c, int64_t sp, double *sum, double *sumsq) {
  LAUNCH(bn_stats_kernel, (unsigned)c, kThreads, 0, s)(x, b, c, make_fast_div(sp), sum, sumsq);
}

void k_bn_apply(cudaStream_t s, const float *x, float *y, int64_t b, int64_t c, int64_t sp, const float *mean,
                const float *invstd, const float *gamma, const float *beta) {
  LAUNCH(bn_apply_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (x, y, b * c * sp, make_fast_div(c), make_fast_div(sp), mean, invstd, gamma, beta);
}

void k_bn_bwd_stats(cudaStream_t s, const float *x, const float *dy, int64_t b, int64_t c, int64_t sp,
                    const float *mean, const float *invstd, double *sum_dy, double *sum_dy_xhat) {
  LAUNCH(bn_bwd_stats_kernel, (unsigned)c, kThreads, 0, s)
  (x, dy, b, c, make_fast_div(sp), mean, invstd, sum_dy, sum_dy_xhat);
}

void k_bn_bwd_apply(cudaStream_t s, const float *x, const float *dy, float *dx, int64_t b, int64_t c, int64_t sp,
                    double count, const float *mean, const float *invstd, const float *gamma, const double *sum_dy,
                    const double *sum_dy_xhat) {
  LAUNCH(bn_bwd_apply_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (x, dy, dx, b * c * sp, make_fast_div(c), make_fast_div(sp), count, mean, invstd, gamma, sum_dy, sum_dy_xhat);
}

}  // extern "C"
