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

/* The same for the tensor-core kernels (train.precision bf16), whose tiles are bfloat16 of hd16 = hd
 * rounded up to 16 columns: (tile, hd16 + 8) tiles of rows and (hd16, tile + 8) transposed ones, the
 * backward's lse and delta, and 128 bytes to align the start. The forward takes the query and key tiles
 * and the value tile transposed; dk, dv the key, value, query and dout tiles and the last two
 * transposed; dq the query, dout, key and value tiles and the key tile transposed. At most 105 KiB (dk,
 * dv for heads of 128): wherever the FP32 kernels fit, these fit too (tests/test_gpu.c), so the pick
 * (dt_attention_fits) need not know the precision. */
static inline size_t dt_attention_shared_tc(int kernel, int64_t hd) {
  const size_t t = DT_ATTENTION_TILE, hd16 = ((size_t)hd + 15) / 16 * 16;
  const size_t rows = t * (hd16 + 8) * 2, cols = hd16 * (t + 8) * 2, stats = 2 * t * sizeof(float);
  return 128 + (kernel == DT_ATTENTION_FWD_KERNEL      ? 2 * rows + cols
                : kernel == DT_ATTENTION_BWD_KV_KERNEL ? 4 * rows + 2 * cols + stats
                                                       : 4 * rows + cols + stats);
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
  int io16;                  /* 0, or DT_F16_BF16 (CUDA under bf16): q, k, v, o and their gradients are bfloat16
                                values where they lie (the layer's projections written so), 2 bytes an element;
                                lse and delta stay FP32 */
} dt_attention_geom;

#endif
