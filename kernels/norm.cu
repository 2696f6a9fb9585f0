// norm.cu: batchnorm over (B, C, S): statistics and their backward in double, one block per channel;
// the statistics turned into mean and 1/std (and the running statistics updated) on the device, so
// a training step needs no host round trip.
#include "common.cuh"
#include "kernels.h"

// sums (2C + 1): sum(c), sumsq(c), then the count b * sp
__global__ void bn_stats_kernel(const float *x, int64_t b, int64_t c, fast_div sp, double *sums) {
  int64_t ch = blockIdx.x;
  double s1 = 0, s2 = 0;
  for (int64_t i = threadIdx.x; i < b * sp.d; i += blockDim.x) {
    double v = x[channel_offset(i, ch, c, sp)];
    s1 += v;
    s2 += v * v;
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) {
    sums[ch] = s1, sums[c + ch] = s2;
    if (ch == 0) sums[2 * c] = (double)(b * sp.d);
  }
}

// One thread per channel, as backend_cpu.c's op_bn_finalize (double precision, PyTorch's rules).
__global__ void bn_finalize_kernel(int64_t c, int training, float momentum, float eps, const double *sums, float *mean,
                                   float *invstd, float *running_mean, float *running_var) {
  GRID_STRIDE(ch, c) {
    if (!training) {
      mean[ch] = running_mean[ch];
      invstd[ch] = (float)(1.0 / sqrt((double)running_var[ch] + eps));
      continue;
    }
    double n = sums[2 * c];
    double mu = n > 0 ? sums[ch] / n : 0.0;
    double var = n > 0 ? sums[c + ch] / n - mu * mu : 0.0;
    if (var < 0) var = 0;
    mean[ch] = (float)mu;
    invstd[ch] = (float)(1.0 / sqrt(var + eps));
    if (n > 0) {
      double unbiased = n > 1 ? var * n / (n - 1) : var;
      running_mean[ch] = (1 - momentum) * running_mean[ch] + momentum * (float)mu;
      running_var[ch] = (1 - momentum) * running_var[ch] + momentum * (float)unbiased;
    }
  }
}

__global__ void bn_apply_kernel(const float *x, float *y, int64_t n, fast_div c, fast_div sp, const float *mean,
                                const float *invstd, const float *gamma, const float *beta) {
  GRID_STRIDE(i, n) {
    uint32_t ch = channel_of(i, c, sp);
    y[i] = (x[i] - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch];
  }
}

// sums (2C): sum_dy(c), sum_dy_xhat(c); the local sums are also the parameter gradients' shares
__global__ void bn_bwd_stats_kernel(const float *x, const float *dy, int64_t b, int64_t c, fast_div sp,
                                    const float *mean, const float *invstd, double *sums, float *dgamma, float *dbeta) {
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
  if (threadIdx.x == 0) {
    sums[ch] = s1, sums[c + ch] = s2;
    dbeta[ch] += (float)s1;
    dgamma[ch] += (float)s2;
  }
}

__global__ void bn_bwd_apply_kernel(const float *x, const float *dy, float *dx, int64_t n, fast_div c, fast_div sp,
                                    const double *count, const float *mean, const float *invstd, const float *gamma,
                                    const double *sums) {
  double cnt = *count;
  GRID_STRIDE(i, n) {
    uint32_t ch = channel_of(i, c, sp);
    float is = invstd[ch], xhat = (x[i] - mean[ch]) * is;
    float mdy = (float)(sums[ch] / cnt), mdyx = (float)(sums[c.d + ch] / cnt);
    dx[i] = gamma[ch] * is * (dy[i] - mdy - xhat * mdyx);
  }
}

extern "C" {

void k_bn_stats(cudaStream_t s, const float *x, int64_t b, int64_t c, int64_t sp, double *sums) {
  LAUNCH(bn_stats_kernel, (unsigned)c, kThreads, 0, s)(x, b, c, make_fast_div(sp), sums);
}

void k_bn_finalize(cudaStream_t s, int64_t c, int training, float momentum, float eps, const double *sums, float *mean,
                   float *invstd, float *running_mean, float *running_var) {
  LAUNCH(bn_finalize_kernel, blocks_for(c), kThreads, 0, s)
  (c, training, momentum, eps, sums, mean, invstd, running_mean, running_var);
}

void k_bn_apply(cudaStream_t s, const float *x, float *y, int64_t b, int64_t c, int64_t sp, const float *mean,
                const float *invstd, const float *gamma, const float *beta) {
  LAUNCH(bn_apply_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (x, y, b * c * sp, make_fast_div(c), make_fast_div(sp), mean, invstd, gamma, beta);
}

void k_bn_bwd_stats(cudaStream_t s, const float *x, const float *dy, int64_t b, int64_t c, int64_t sp,
                    const float *mean, const float *invstd, double *sums, float *dgamma, float *dbeta) {
  LAUNCH(bn_bwd_stats_kernel, (unsigned)c, kThreads, 0, s)
  (x, dy, b, c, make_fast_div(sp), mean, invstd, sums, dgamma, dbeta);
}

void k_bn_bwd_apply(cudaStream_t s, const float *x, const float *dy, float *dx, int64_t b, int64_t c, int64_t sp,
                    const double *count, const float *mean, const float *invstd, const float *gamma,
                    const double *sums) {
  LAUNCH(bn_bwd_apply_kernel, blocks_for(b * c * sp), kThreads, 0, s)
  (x, dy, dx, b * c * sp, make_fast_div(c), make_fast_div(sp), count, mean, invstd, gamma, sums);
}

}  // extern "C"
