/* tanh_poly.h: tanh in float as one polynomial code for the CPU backend and the CUDA kernels, so
 * both compute the same bits (GELU tanh, tanh): the odd series to x^13 below |x| = 0.3, else
 * (1 - e) / (1 + e) with e = exp(-2|x|) by Cody-Waite reduction (n ln 2 + r) and a degree-7
 * polynomial, scaled by 2^n through the exponent bits. Within 2 ulp of tanh over all floats in
 * [-12, 12] (test_ops: tanh_within_2_ulp). It has no branch and no library call, so GCC
 * vectorises the CPU's loops over it (libm's tanhf was 16% of a GPT step there). */
#pragma once

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define DT_HOST_DEVICE __host__ __device__
#else
#define DT_HOST_DEVICE
#endif

/* cond ? t : f by bit masks rather than a select: on selects GCC threads or sinks each side into a
 * branch of its own, and then does not vectorise (a float-to-int conversion cannot be speculated). */
static inline DT_HOST_DEVICE float dt_pick(int cond, float t, float f) {
  union {
    float f;
    int32_t i;
  } ut = {.f = t}, uf = {.f = f}, r;
  int32_t mask = -(int32_t)(cond != 0);
  r.i = (ut.i & mask) | (uf.i & ~mask);
  return r.f;
}

static inline DT_HOST_DEVICE float dt_tanhf(float x) {
  float a = fabsf(x);
  a = dt_pick(a < 9.0f, a, 9.0f); /* tanh(9) rounds to 1 - 6e-8; NaN to 9 as well */
  float s = a * a;
  float series =
      a + a * s *
              (-1.0f / 3 +
               s * (2.0f / 15 + s * (-17.0f / 315 + s * (62.0f / 2835 + s * (-1382.0f / 155925 + s * (21844.0f / 6081075))))));
  float y = -2.0f * a;                                    /* [-18, 0] */
  int32_t n = (int32_t)(y * 1.44269504088896341f - 0.5f); /* round(y / ln 2), y <= 0 */
  float r = (y - (float)n * 0.693145751953125f) - (float)n * 1.42860682030941723212e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r * (1.0f / 5040)))))));
  union {
    int32_t i;
    float f;
  } two_n = {.i = (n + 127) * (1 << 23)};
  float e = p * two_n.f, far = (1.0f - e) / (1.0f + e);
  return copysignf(dt_pick(a < 0.3f, series, far), x);
}
