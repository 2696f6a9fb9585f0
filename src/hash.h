/* hash.h: the counter-based hash behind every random stream (initialisation, data order,
 * dropout masks). One definition for the CPU and the CUDA kernels, so masks are identical. */
#ifndef DT_HASH_H
#define DT_HASH_H

#include <stdint.h>

#ifdef __CUDACC__
#define DT_HD __host__ __device__ __forceinline__
#else
#define DT_HD static inline
#endif

DT_HD uint64_t dt_hash64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/* A uniform float in [0, 1) from (seed, i). */
DT_HD float dt_hash_uniform(uint64_t seed, uint64_t i) {
  return (float)(dt_hash64(seed ^ dt_hash64(i)) >> 40) * (1.0f / 16777216.0f);
}

#endif
