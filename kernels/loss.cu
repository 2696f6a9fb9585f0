// loss.cu: softmax cross-entropy (label smoothing) and mean squared error, one block per sample,
// fused with their gradient (cross-entropy in two passes over the logits: an online log-sum-exp,
// then the gradient), on FP32 logits or bfloat16 rows (the loss's logits16), and with distillation's
// term where a teacher's logits are given; per-sample losses and hits go to pairs, summed into
// out[0], out[1] (doubles) in a fixed order, so that the loss is the same on every run.
#include <math.h>

#include "common.cuh"
#include "half.h"
#include "kernels.h"

enum { LOSS_CE, LOSS_MSE };                     // backend.h's DT_LOSS_*
enum { DISTILL_NONE, DISTILL_KL, DISTILL_MSE };  // backend.h's DT_DISTILL_*

// A logit: FP32, or bfloat16 (the loss's logits16).
static __device__ __forceinline__ float logit_at(const float *z, int64_t j) {
  return z[j];
}
static __device__ __forceinline__ float logit_at(const uint16_t *z, int64_t j) {
  return dt_from_bf16(z[j]);
}

// Calls f(j, z[j]) for the row's elements this thread owns, j increasing: one at a time in FP32, eight
// (one 16-byte load; the row starts 16-byte aligned) at a time in bfloat16.
template <class F>
static __device__ __forceinline__ void each_logit(const float *z, int64_t k, F f) {
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) f(j, z[j]);
}
template <class F>
static __device__ __forceinline__ void each_logit(const uint16_t *z, int64_t k, F f) {
  for (int64_t j0 = 8 * (int64_t)threadIdx.x; j0 < k; j0 += 8 * (int64_t)blockDim.x) {
    const uint4 v = load_half8(z + j0);
    UNROLL
    for (int i = 0; i < 8; i++)
      if (j0 + i < k) f(j0 + i, dt_from_bf16(half16_of(v, i)));
  }
}

// d[j] = g(j, z[j]) for the same elements, rounded to nearest even in bfloat16 (eight to a 16-byte store
// where all eight lie inside the row).
template <class G>
static __device__ __forceinline__ void each_grad(const float *z, float *d, int64_t k, G g) {
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) d[j] = g(j, z[j]);
}
template <class G>
static __device__ __forceinline__ void each_grad(const uint16_t *z, uint16_t *d, int64_t k, G g) {
  for (int64_t j0 = 8 * (int64_t)threadIdx.x; j0 < k; j0 += 8 * (int64_t)blockDim.x) {
    const uint4 v = load_half8(z + j0);
    if (j0 + 8 <= k) {
      unsigned o[8];  // g in increasing j: it may add to a thread's sums
      UNROLL
      for (int i = 0; i < 8; i++) o[i] = dt_to_bf16(g(j0 + i, dt_from_bf16(half16_of(v, i))));
      store_half8(d + j0, o);
    } else {
      for (int i = 0; j0 + i < k; i++) d[j0 + i] = dt_to_bf16(g(j0 + i, dt_from_bf16(half16_of(v, i))));
    }
  }
}

// Row b's log-sum-exps at temperature temp of the student's logits z and the teacher's t, as
// max / temp + log(se) (cpu/loss.c's distill_row), valid in every thread on return.
template <typename T>
static __device__ void distill_row(const T *z, const float *t, int64_t k, double temp, double *r) {
  __shared__ double s_r[4];
  float zm = -INFINITY, tm = -INFINITY;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) zm = fmaxf(zm, logit_at(z, j)), tm = fmaxf(tm, t[j]);
  zm = block_max(zm);
  tm = block_max(tm);
  if (threadIdx.x == 0) s_r[0] = zm, s_r[2] = tm;
  __syncthreads();
  double ss = 0, st = 0;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    ss += exp(((double)logit_at(z, j) - s_r[0]) / temp);
    st += exp(((double)t[j] - s_r[2]) / temp);
  }
  ss = block_sum(ss);
  st = block_sum(st);
  if (threadIdx.x == 0) s_r[1] = log(ss), s_r[3] = log(st);
  __syncthreads();
  for (int i = 0; i < 4; i++) r[i] = s_r[i];
}

// Element j's distillation gradient (before alpha) into *grad; its part of the row's loss returned.
static __device__ double distill_element(int kind, const double *r, double z, double t, int64_t k, double temp,
                                  double *grad) {
  if (kind == DISTILL_MSE) {
    double d = z - t;
    *grad = 2.0 * d / (double)k;
    return d * d / (double)k;
  }
  double ls = (z - r[0]) / temp - r[1], lt = (t - r[2]) / temp - r[3];
  double pt = exp(lt);
  *grad = temp * (exp(ls) - pt);
  return temp * temp * pt * (lt - ls);
}

// A cross-entropy row's running state: the max m, its first index a (k while none), the sum s
// of exp(z - m) (float terms added in double, rescaled when m grows) and the sum z of the logits.
struct ce_row {
  float m;
  double s;
  int a;
  double z;
};

// Logit v at index j into st (indices arrive in increasing order). NaN never becomes the max but
// makes s NaN, as on the CPU; -inf adds nothing.
static __device__ __forceinline__ void ce_add(ce_row *st, float v, int j) {
  st->z += (double)v;
  if (v > st->m) {
    st->s = (st->s == 0.0 ? 0.0 : st->s * exp((double)st->m - (double)v)) + 1.0;
    st->m = v, st->a = j;
  } else if (v != -INFINITY) {
    st->s += (double)expf(v - st->m);
  }
}

// Two rows' states as one: the larger max (the smaller index on a tie), the sums rescaled to it.
static __device__ __forceinline__ ce_row ce_merge(ce_row x, ce_row y) {
  if (y.m > x.m || (y.m == x.m && y.a < x.a)) {
    ce_row t = x;
    x = y, y = t;
  }
  x.s += y.s == 0.0 ? 0.0 : y.s * exp((double)y.m - (double)x.m);
  x.z += y.z;
  return x;
}

// warp_reduce's shuffle of a ce_row
static __device__ __forceinline__ ce_row shfl_down(unsigned mask, ce_row v, int o) {
  return {__shfl_down_sync(mask, v.m, o), __shfl_down_sync(mask, v.s, o), __shfl_down_sync(mask, v.a, o),
          __shfl_down_sync(mask, v.z, o)};
}

// Rows of ld values (k in FP32, dt_ld16(k) in bfloat16), one block each.
template <typename T>
__global__ void loss_kernel(int kind, const T *logits, int64_t ld, const int32_t *labels, const float *targets, T *dz,
                            int64_t k, float ls, int32_t ignore, double weight, const double *weight_dev,
                            const float *grad_scale, int distill, double alpha, double temp, const float *teacher,
                            double *pairs) {
  int64_t b = blockIdx.x;
  if (weight_dev) weight = weight_dev[0];
  if (grad_scale) weight *= (double)grad_scale[0];
  const double keep = 1.0 - alpha;
  const T *z = logits + b * ld;
  const float *tz = distill ? teacher + b * k : NULL;
  T *d = dz + b * ld;
  if (kind == LOSS_CE && labels[b] == ignore) {  // padding: no loss, hit or gradient
    each_grad(z, d, k, [](int64_t, float) { return 0.0f; });
    if (threadIdx.x == 0) pairs[2 * b] = 0.0, pairs[2 * b + 1] = 0.0;
    return;
  }
  double r[4] = {0, 0, 0, 0};
  if (distill == DISTILL_KL) distill_row(z, tz, k, temp, r);
  double own = 0, dist = 0, hit = 0;
  if (kind == LOSS_CE) {
    // one read for the max, its first index, the sum of exp(z - max) and the sum of z; one more
    // to write the gradient: the loss is -(off (sum z - k lse) + (1 - ls)(z[y] - lse))
    ce_row st = {-INFINITY, 0.0, (int)k, 0.0};
    each_logit(z, k, [&](int64_t j, float v) { ce_add(&st, v, (int)j); });
    st = block_reduce(st, [](ce_row x, ce_row y) { return ce_merge(x, y); });
    __shared__ double s_lse;
    __shared__ int s_arg;
    if (threadIdx.x == 0) s_lse = (double)st.m + log(st.s), s_arg = st.a == (int)k ? 0 : st.a;
    __syncthreads();
    const double lse = s_lse;
    int32_t y = labels[b];
    double off = (double)ls / (double)k;
    each_grad(z, d, k, [&](int64_t j, float zj) {
      // the label's in double: p near 1 - ls would cancel a float's digits (the others need no more)
      double lp = (double)zj - lse, p = j == y ? exp(lp) : (double)expf((float)lp);
      double g = p - (off + (j == y ? 1.0 - ls : 0.0));
      if (distill) {
        double dg;
        dist += distill_element(distill, r, zj, tz[j], k, temp, &dg);
        g = keep * g + alpha * dg;
      }
      return (float)(g * weight);
    });
    if (threadIdx.x == 0) own = -(off * (st.z - (double)k * lse) + (1.0 - ls) * ((double)logit_at(z, y) - lse));
    hit = s_arg == y ? 1.0 : 0.0;
  } else {
    const float *t = targets + b * k;
    each_grad(z, d, k, [&](int64_t j, float zj) {
      double diff = (double)zj - t[j];
      own += diff * diff;
      double g = 2.0 * diff / (double)k;
      if (distill) {
        double dg;
        dist += distill_element(distill, r, zj, tz[j], k, temp, &dg);
        g = keep * g + alpha * dg;
      }
      return (float)(g * weight);
    });
  }
  if (kind == LOSS_MSE) own = block_sum(own);  // cross-entropy's is thread 0's already
  if (distill) dist = block_sum(dist);
  if (threadIdx.x == 0) {
    if (kind == LOSS_MSE) own /= (double)k;
    pairs[2 * b] = distill ? keep * own + alpha * dist : own, pairs[2 * b + 1] = hit;
  }
}

extern "C" void k_loss(cudaStream_t s, int kind, const void *logits, int logits16, const int32_t *labels,
                       const float *targets, void *dlogits, int64_t b, int64_t k, float label_smoothing,
                       int32_t ignore_index, double weight, const double *weight_dev, const float *grad_scale,
                       int distill, float alpha, float temperature, const float *teacher, double *out, double *pairs) {
  if (b > 0 && logits16) {  // rows of 16-byte pieces (the caller checks their alignment)
    LAUNCH(loss_kernel<uint16_t>, (unsigned)b, 128, 0, s)
    (kind, (const uint16_t *)logits, dt_ld16(k), labels, targets, (uint16_t *)dlogits, k, label_smoothing, ignore_index,
     weight, weight_dev, grad_scale, distill, (double)alpha, (double)temperature, teacher, pairs);
  } else if (b > 0) {
    LAUNCH(loss_kernel<float>, (unsigned)b, 128, 0, s)
    (kind, (const float *)logits, k, labels, targets, (float *)dlogits, k, label_smoothing, ignore_index, weight,
     weight_dev, grad_scale, distill, (double)alpha, (double)temperature, teacher, pairs);
  }
  k_sum_pairs(s, pairs, b, out);  // zeros when b is 0
}
