/* attention_geom.h: the fused attention ops' geometry (backend.h's DT_OP_ATTENTION_*), shared by
 * the C backends and the CUDA kernels (kernels/attention.cu), so plain C that C++ reads too. */
#ifndef DT_ATTENTION_GEOM_H
#define DT_ATTENTION_GEOM_H

#include <stddef.h>
#include <stdint.h>

/* The widest head the CUDA attention kernels take (model.attention fused): wider ones use the
 * materialised path. A kernel block holds DT_ATTENTION_TILE rows of a head. */
enum { DT_ATTENTION_MAX_HD = 128, DT_ATTENTION_TILE = 64 };
enum { DT_ATTENTION_FWD_KERNEL, DT_ATTENTION_BWD_KV_KERNEL, DT_ATTENTION_BWD_Q_KERNEL };

/* Shared memory bytes a block of each CUDA attention kernel takes for heads of hd values: (tile, hd + 1)
 * tiles of q, k, v (and dout), (tile, tile + 1) score tiles, and the backward's lse and delta. */
static inline size_t dt_attention_shared(int kernel, int64_t hd) {
  const size_t t = DT_ATTENTION_TILE, row = (size_t)hd + 1, scores = t * (t + 1);
  size_t floats = kernel == DT_ATTENTION_FWD_KERNEL      ? 3 * t * row + scores
                  : kernel == DT_ATTENTION_BWD_KV_KERNEL ? 4 * t * row + 2 * scores + 2 * t
                                                         : 4 * t * row + scores + 2 * t;
  return floats * sizeof(float);
}

/* The same for the tensor-core kernels (train.precision bf16): (tile, hd16 + 8) bfloat16 tiles of q, k,
 * v (and dout) with hd16 = hd rounded up to 16; (tile, tile + 4) FP32 score tiles, which also stage
 * (tile, hd16 + 4) outputs; (tile, tile + 8) bfloat16 probability tiles; lse and delta; and 128 bytes
 * to align the start. At most 89 KiB for heads of up to 64 values and 121 KiB for wider ones: wherever
 * the FP32 kernels fit a GPU of compute capability 8.0 or later (99 KiB a block or more), these fit
 * too (tests/test_gpu.c), so the pick (dt_attention_fits) need not know the precision. */
static inline size_t dt_attention_shared_tc(int kernel, int64_t hd) {
  const size_t t = DT_ATTENTION_TILE, hd16 = ((size_t)hd + 15) / 16 * 16, tile = t * (hd16 + 8) * 2;
  const size_t scores = t * (t + 4) * 4, staged = t * (hd16 + 4) * 4, probs = t * (t + 8) * 2;
  return 128 + (kernel == DT_ATTENTION_FWD_KERNEL      ? 3 * tile + (scores > staged ? scores : staged) + probs
                : kernel == DT_ATTENTION_BWD_KV_KERNEL ? 4 * tile + 2 * scores + 2 * probs + 2 * t * 4
                                                       : 4 * tile + 2 * scores + probs + 2 * t * 4);
}

/* Whether a GPU whose blocks may opt in to `shared` bytes runs the kernels for heads of hd values. */
static inline int dt_attention_fits(int64_t hd, size_t shared) {
  return hd >= 1 && hd <= DT_ATTENTION_MAX_HD && dt_attention_shared(DT_ATTENTION_BWD_KV_KERNEL, hd) <= shared;
}

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
