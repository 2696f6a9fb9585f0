// optim.cu: SGD and AdamW over the flat parameter buffer, PyTorch's update rules (as src/cpu/optim.c),
// and the weights' exponential moving average.
#include <math.h>

#include "common.cuh"
#include "kernels.h"

// The thread's count of non-finite gradient values, added to *nonfinite (a whole number: any order of
// the additions gives the same sum).
static __device__ __forceinline__ void add_nonfinite(double *nonfinite, int count) {
  if (count) atomicAdd(nonfinite, (double)count);
}

// The weight decay of value i: wd, or that of its run (runs in order, the first at 0), found from *r, the run
// of the thread's value before (a thread's values come in increasing order: each run is passed once).
static __device__ __forceinline__ float decay_of(int64_t i, float wd, const dt_decay_run *runs, int n_runs, int *r) {
  if (!runs) return wd;
  while (*r + 1 < n_runs && runs[*r + 1].start <= i) ++*r;
  return runs[*r].weight_decay;
}

__global__ void sgd_kernel(float *p, const float *g, float *mom, int64_t n, const float *hyper, const double *skip,
                           double *nonfinite, float momentum, float weight_decay, const dt_decay_run *runs, int n_runs,
                           int nesterov) {
  if (skip && *skip > 0) return;
  float lr = hyper[0];
  int first = hyper[1] != 0.0f, bad = 0, run = 0;
  GRID_STRIDE(i, n) {
    // p read once: the store to mom would make the compiler read it again
    float wd = decay_of(i, weight_decay, runs, n_runs, &run), gi = g[i], pi = p[i], d = gi + wd * pi;
    bad += !isfinite(gi);
    if (momentum > 0) {
      float buf = first ? d : momentum * mom[i] + d;
      mom[i] = buf;
      d = nesterov ? d + momentum * buf : buf;
    }
    p[i] = pi - lr * d;
  }
  if (nonfinite) add_nonfinite(nonfinite, bad);
}

__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, const float *hyper,
                             const double *skip, double *nonfinite, float b1, float b2, float eps, float weight_decay,
                             const dt_decay_run *runs, int n_runs) {
  if (skip && *skip > 0) return;
  float lr = hyper[0], step_size = hyper[1], bc2_sqrt = hyper[2];
  int bad = 0, run = 0;
  GRID_STRIDE(i, n) {  // each value read and written once: the compiler cannot know that p, m, v do not alias
    float wd = decay_of(i, weight_decay, runs, n_runs, &run);
    float gi = g[i], pi = __fmul_rn(p[i], 1.0f - lr * wd);  // rounded, as when it was stored: no FMA with the update
    bad += !isfinite(gi);
    float mi = b1 * m[i] + (1.0f - b1) * gi;
    float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
  }
  if (nonfinite) add_nonfinite(nonfinite, bad);
}

__global__ void unscale_kernel(float *x, int64_t n, const float *scaler) {
  float inv = 1.0f / scaler[0];  // as GradScaler: multiplied by the reciprocal
  GRID_STRIDE(i, n) x[i] *= inv;
}

// one thread: the scale and the count of good steps, by GradScaler's rules
__global__ void scaler_update_kernel(float *sc, const double *overflow, int64_t interval, float growth, float backoff) {
  if (*overflow > 0) {
    sc[0] *= backoff;
    sc[1] = 0;
  } else if (sc[1] + 1 >= (float)interval) {
    float grown = sc[0] * growth;
    if (isfinite(grown)) sc[0] = grown;  // as PyTorch: a scale that would overflow stays
    sc[1] = 0;
  } else {
    sc[1] += 1;
  }
}

__global__ void ema_kernel(float *ema, const float *x, int64_t n, float decay, float rest) {
  GRID_STRIDE(i, n) ema[i] = decay * ema[i] + rest * x[i];
}

extern "C" {

void k_sgd(cudaStream_t s, float *p, const float *g, float *mom, int64_t n, const float *hyper, const double *skip,
           double *nonfinite, float momentum, float wd, const dt_decay_run *runs, int n_runs, int nesterov) {
  LAUNCH(sgd_kernel, blocks_for(n), kThreads, 0, s)
  (p, g, mom, n, hyper, skip, nonfinite, momentum, wd, runs, n_runs, nesterov);
}

void k_adamw(cudaStream_t s, float *p, const float *g, float *m, float *v, int64_t n, const float *hyper,
             const double *skip, double *nonfinite, float b1, float b2, float eps, float wd, const dt_decay_run *runs,
             int n_runs) {
  LAUNCH(adamw_kernel, blocks_for(n), kThreads, 0, s)
  (p, g, m, v, n, hyper, skip, nonfinite, b1, b2, eps, wd, runs, n_runs);
}

void k_unscale(cudaStream_t s, float *x, int64_t n, const float *scaler) {
  LAUNCH(unscale_kernel, blocks_for(n), kThreads, 0, s)(x, n, scaler);
}

void k_scaler_update(cudaStream_t s, float *scaler, const double *overflow, int64_t growth_interval, float growth,
                     float backoff) {
  LAUNCH(scaler_update_kernel, 1, 1, 0, s)(scaler, overflow, growth_interval, growth, backoff);
}

void k_ema(cudaStream_t s, float *ema, const float *x, int64_t n, float decay) {
  LAUNCH(ema_kernel, blocks_for(n), kThreads, 0, s)(ema, x, n, decay, 1.0f - decay);
}

}  // extern "C"
