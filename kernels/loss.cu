// loss.cu: softmax cross-entropy (label smoothing) and mean squared error, one block per sample,
// fused with their gradient; per-sample losses and hits go to pairs, summed into out[0], out[1]
// (doubles) in a fixed order, so that the loss is the same on every run.
#include <math.h>

#include "common.cuh"
#include "kernels.h"

enum { LOSS_CE, LOSS_MSE };  // backend.h's DT_LOSS_*

__global__ void loss_kernel(int kind, const float *logits, const int32_t *labels, const float *targets, float *dz,
                            int64_t k, float ls, int32_t ignore, double weight, const double *weight_dev,
                            const float *grad_scale, double *pairs) {
  int64_t b = blockIdx.x;
  if (weight_dev) weight = weight_dev[0];
  if (grad_scale) weight *= (double)grad_scale[0];
  const float *z = logits + b * k;
  float *d = dz + b * k;
  __shared__ float s_max;
  __shared__ int s_arg;
  if (kind == LOSS_CE && labels[b] == ignore) {  // padding: no loss, hit or gradient
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) d[j] = 0.0f;
    if (threadIdx.x == 0) pairs[2 * b] = 0.0, pairs[2 * b + 1] = 0.0;
  } else if (kind == LOSS_CE) {
    // the max over the block, then its first index (the CPU's argmax): k may be a vocabulary
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) mx = fmaxf(mx, z[j]);
    mx = block_max(mx);
    if (threadIdx.x == 0) s_max = mx, s_arg = (int)k;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
      if (z[j] == s_max) {
        atomicMin(&s_arg, (int)j);  // the smallest such index, whatever the order
        break;
      }
    __syncthreads();
    double se = 0;
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) se += exp((double)(z[j] - s_max));
    se = block_sum(se);
    __shared__ double s_lse;
    if (threadIdx.x == 0) s_lse = s_max + log(se);
    __syncthreads();
    int32_t y = labels[b];
    double off = (double)ls / (double)k, loss = 0;
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      double t = off + (j == y ? 1.0 - ls : 0.0), lp = (double)z[j] - s_lse;
      loss -= t * lp;
      d[j] = (float)((exp(lp) - t) * weight);
    }
    loss = block_sum(loss);
    if (threadIdx.x == 0) pairs[2 * b] = loss, pairs[2 * b + 1] = s_arg == y ? 1.0 : 0.0;
  } else {
    const float *t = targets + b * k;
    double loss = 0;
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      double diff = (double)z[j] - t[j];
      loss += diff * diff;
      d[j] = (float)(2.0 * diff / (double)k * weight);
    }
    loss = block_sum(loss);
    if (threadIdx.x == 0) pairs[2 * b] = loss / (double)k, pairs[2 * b + 1] = 0.0;
  }
}

extern "C" void k_loss(cudaStream_t s, int kind, const float *logits, const int32_t *labels, const float *targets,
                       float *dlogits, int64_t b, int64_t k, float label_smoothing, int32_t ignore_index, double weight,
                       const double *weight_dev, const float *grad_scale, double *out, double *pairs) {
  if (b > 0) LAUNCH(loss_kernel, (unsigned)b, 128, 0, s)
  (kind, logits, labels, targets, dlogits, k, label_smoothing, ignore_index, weight, weight_dev, grad_scale, pairs);
  k_sum_pairs(s, pairs, b, out);  // zeros when b is 0
}
