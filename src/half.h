/* half.h: FP32 to and from the two 16-bit formats (bfloat16, IEEE half), rounded to nearest even as
 * __float2bfloat16_rn and __float2half_rn (which a GPU runs; elsewhere the same on the bit patterns). One
 * definition for the CUDA kernels (kernels/convert.cu, kernels/norm.cu) and the CPU backend's 16-bit
 * operands (src/cpu). */
#ifndef DT_HALF_H
#define DT_HALF_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DT_HD __host__ __device__ __forceinline__
#else
#define DT_HD static inline
#endif

DT_HD uint32_t dt_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

DT_HD float dt_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* On a GPU the conversion instructions (the same bits, but for a NaN's payload: one quiet NaN); the
 * stand-in and the CPU run the bit patterns below. */
DT_HD uint16_t dt_to_bf16(float f) {
#ifdef __CUDA_ARCH__
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t u = dt_float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
#endif
}

DT_HD float dt_from_bf16(uint16_t h) {
  return dt_bits_float((uint32_t)h << 16);
}

DT_HD uint16_t dt_to_half(float f) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half_rn(f));
#else
  uint32_t u = dt_float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: infinity */
  if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
    if (a <= 0x33000000u) return (uint16_t)sign;           /* at most 2^-25: ties to even zero */
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
    uint32_t r = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a - 0x38000000u; /* exponent rebiased from 127 to 15 */
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
#endif
}

DT_HD float dt_from_half(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24 */
    return sign ? -v : v;
  }
  if (e == 31) return dt_bits_float(sign | 0x7f800000u | (m << 13));
  return dt_bits_float(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

/* The 16-bit formats a tensor can be stored in (backend.h's x16, y16, dy16 fields): 0 is FP32. */
enum { DT_F16_NONE = 0, DT_F16_BF16 = 1, DT_F16_HALF = 2 };

DT_HD uint16_t dt_to_16(float f, int format) {
  return format == DT_F16_BF16 ? dt_to_bf16(f) : dt_to_half(f);
}

DT_HD float dt_from_16(uint16_t h, int format) {
  return format == DT_F16_BF16 ? dt_from_bf16(h) : dt_from_half(h);
}

/* The values a row of n takes in the 16-bit row layout (a GEMM's 16-bit operands, a classifier's logits):
 * rows of whole 16-byte pieces, as cuBLAS's aligned kernels read them. */
DT_HD int64_t dt_ld16(int64_t n) {
  return (n + 7) / 8 * 8;
}

/* One weight's 16-bit copy (backend.h's weights16 op): the FP32 (rows, cols, inner) at params + src becomes
 * (rows, inner, ld) at w16 + dst in `format`, the columns past cols left as they are. A dense weight (out, in):
 * inner 1, ld dt_ld16(in), the bfloat16 rows a GEMM reads as its B (gemm.b16); a convolution's (O, C, K, K):
 * inner K * K, ld C, the (O, K, K, C) filter cuDNN reads in NHWC (conv_fwd.w16). row0: the rows of the
 * entries before it in its table. grad: the layer's backward leaves the weight's gradient in the same layout at
 * dst of the model's grads16 (a convolution's filter gradient, as cuDNN computes it under bf16 and fp16), for the
 * grads16 op to add into the FP32 gradients at src. */
typedef struct {
  int64_t src, dst, rows, cols, inner, ld, row0;
  int format, grad;
} dt_weight16;

#endif
