/* sampler.h: which dataset rows each rank uses at each step (DistributedSampler done right).
 * global: one permutation of all N rows per epoch from (seed, epoch), identical on every rank;
 *   global step s covers perm[s*G, min((s+1)*G, N)) and rank r takes its slice (sizes differ by
 *   at most one when the final batch is partial).
 * contiguous: rank r owns rows [r*N/W, (r+1)*N/W) and shuffles them with (seed, epoch, rank);
 *   its per-step share of G is fixed, and every rank runs the same number of steps.
 * No row is dropped or repeated unless drop_last. Pure functions of the inputs: no I/O, no MPI. */
#ifndef DT_SAMPLER_H
#define DT_SAMPLER_H

#include <stdint.h>

typedef struct {
  int64_t n; /* rows in the dataset */
  int world, rank;
  int64_t global_batch; /* G */
  int contiguous, drop_last, shuffle;
  uint64_t seed;
  /* derived */
  int64_t steps;          /* per epoch, same on every rank */
  int64_t own_lo, own_hi; /* contiguous: this rank's rows */
  int64_t *perm;          /* owned: the current epoch's order (global: N; contiguous: own rows) */
  int64_t perm_epoch;
} dt_sampler;

/* share of G that rank r takes in contiguous mode / of a slice of len rows in global mode */
static inline int64_t split_lo(int64_t len, int world, int r) {
  return len * r / world;
}

void sampler_init(dt_sampler *s, int64_t n, int world, int rank, int64_t global_batch, int contiguous, int drop_last,
                  int shuffle, uint64_t seed);
void sampler_free(dt_sampler *s);

/* Rows of (epoch, step) for this rank into idx (capacity: sampler_max_local); returns the count.
 * *global_count receives the rows all ranks together use at this step. */
int64_t sampler_batch(dt_sampler *s, int64_t epoch, int64_t step, int64_t *idx, int64_t *global_count);
int64_t sampler_max_local(const dt_sampler *s);
/* Rows all ranks together use at step (no permutation needed). */
int64_t sampler_count(const dt_sampler *s, int64_t step);

/* Shuffles perm[0..n) in place with a stream derived from key (Fisher-Yates, unbiased). */
void sampler_shuffle(int64_t *perm, int64_t n, uint64_t key);

#endif
