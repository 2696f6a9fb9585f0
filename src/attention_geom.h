/* attention_geom.h: the fused attention ops' geometry (backend.h's DT_OP_ATTENTION_*), shared by
 * the C backends and the CUDA kernels (kernels/attention.cu), so plain C that C++ reads too. */
#ifndef DT_ATTENTION_GEOM_H
#define DT_ATTENTION_GEOM_H

#include <stdint.h>

/* The widest head the CUDA attention kernels take (model.attention fused): wider ones use the
 * materialised path. */
enum { DT_ATTENTION_MAX_HD = 128 };

/* The fused attention ops' geometry: B samples of T positions, H heads of hd values. Element
 * (b, t, h, e) of q, k, v (and dq, dk, dv) is at [(b T + t) ld_qkv + h hd + e] and of o (and dout)
 * at [(b T + t) ld_o + h hd + e]: the attention layer's (B, T, 3, H, hd) projections and its
 * (B, T, H, hd) merged heads as they lie, without permutes. */
typedef struct {
  int64_t b, h, t, hd, ld_qkv, ld_o;
  int causal;                /* position i sees j <= i */
  float scale, p;            /* scores scaled by scale; dropout p on the probabilities (0: none) */
  uint64_t seed;             /* as dropout_fwd's: probability (b H + h, i, j) gets the mask of element
                                ((b H + h) T + i) T + j, as the materialised (B*H, T, T) buffer's */
  const uint64_t *step_seed; /* (1), read when p > 0 */
} dt_attention_geom;

#endif
