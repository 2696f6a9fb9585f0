#include "sampler.h"

#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "common.h"

void sampler_shuffle(int64_t *perm, int64_t n, uint64_t key) {
  for (int64_t i = n - 1; i > 0; i--) {
    uint64_t r = dt_hash64(key ^ dt_hash64((uint64_t)i));
    int64_t j = (int64_t)(((unsigned __int128)r * (uint64_t)(i + 1)) >> 64);
    int64_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
}

static int64_t own_rows(const dt_sampler *s, int r) {
  return split_lo(s->n, s->world, r + 1) - split_lo(s->n, s->world, r);
}
static int64_t share(const dt_sampler *s, int r) {
  return split_lo(s->global_batch, s->world, r + 1) - split_lo(s->global_batch, s->world, r);
}

void sampler_init(dt_sampler *s, int64_t n, int world, int rank, int64_t global_batch, int contiguous, int drop_last,
                  int shuffle, uint64_t seed) {
  memset(s, 0, sizeof *s);
  s->n = n;
  s->world = world;
  s->rank = rank;
  s->global_batch = global_batch;
  s->contiguous = contiguous;
  s->drop_last = drop_last;
  s->shuffle = shuffle;
  s->seed = seed;
  s->perm_epoch = -1;
  DT_ASSERT(global_batch >= 1 && world >= 1);
  if (!contiguous) {
    s->own_lo = 0;
    s->own_hi = n;
    s->steps = drop_last ? n / global_batch : (n + global_batch - 1) / global_batch;
  } else {
    s->own_lo = split_lo(n, world, rank);
    s->own_hi = split_lo(n, world, rank + 1);
    int64_t steps = drop_last ? INT64_MAX : 0;
    for (int r = 0; r < world; r++) {
      int64_t b = share(s, r), rows = own_rows(s, r);
      if (b == 0) continue; /* fewer rows per batch than ranks: this rank never gets any */
      int64_t k = drop_last ? rows / b : (rows + b - 1) / b;
      steps = drop_last ? (k < steps ? k : steps) : (k > steps ? k : steps);
    }
    s->steps = steps == INT64_MAX ? 0 : steps;
  }
  s->perm = dt_malloc((size_t)(s->own_hi - s->own_lo + 1) * sizeof(int64_t));
}

void sampler_free(dt_sampler *s) {
  free(s->perm);
  s->perm = NULL;
}

int64_t sampler_max_local(const dt_sampler *s) {
  /* global: a share of a global batch of at most G rows, the largest rounded up */
  return s->contiguous ? share(s, s->rank) : (s->global_batch + s->world - 1) / s->world;
}

static void ensure_perm(dt_sampler *s, int64_t epoch) {
  if (s->perm_epoch == epoch) return;
  int64_t m = s->own_hi - s->own_lo;
  for (int64_t i = 0; i < m; i++) s->perm[i] = s->own_lo + i;
  uint64_t key = dt_hash64(s->seed * 0x100000001b3ULL ^ dt_hash64((uint64_t)epoch + 0x5151));
  if (s->contiguous) key = dt_hash64(key ^ (uint64_t)(s->rank + 1));
  if (s->shuffle) sampler_shuffle(s->perm, m, key);
  s->perm_epoch = epoch;
}

int64_t sampler_batch(dt_sampler *s, int64_t epoch, int64_t step, int64_t *idx, int64_t *global_count) {
  DT_ASSERT(step >= 0 && step < s->steps);
  ensure_perm(s, epoch);
  if (!s->contiguous) {
    int64_t start = step * s->global_batch;
    int64_t len = s->n - start < s->global_batch ? s->n - start : s->global_batch;
    int64_t lo = split_lo(len, s->world, s->rank), hi = split_lo(len, s->world, s->rank + 1);
    for (int64_t i = lo; i < hi; i++) idx[i - lo] = s->perm[start + i];
    *global_count = len;
    return hi - lo;
  }
  int64_t total = 0, mine = 0;
  for (int r = 0; r < s->world; r++) {
    int64_t b = share(s, r), rows = own_rows(s, r);
    int64_t lo = step * b, hi = lo + b < rows ? lo + b : rows;
    int64_t cnt = hi > lo ? hi - lo : 0;
    total += cnt;
    if (r == s->rank) {
      for (int64_t i = 0; i < cnt; i++) idx[i] = s->perm[lo + i];
      mine = cnt;
    }
  }
  *global_count = total;
  return mine;
}

int64_t sampler_count(const dt_sampler *s, int64_t step) {
  if (!s->contiguous) {
    int64_t start = step * s->global_batch;
    return s->n - start < s->global_batch ? s->n - start : s->global_batch;
  }
  int64_t total = 0;
  for (int r = 0; r < s->world; r++) {
    int64_t b = share(s, r), rows = own_rows(s, r);
    int64_t lo = step * b, hi = lo + b < rows ? lo + b : rows;
    total += hi > lo ? hi - lo : 0;
  }
  return total;
}
