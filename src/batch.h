/* batch.h: a micro-batch in backend memory, shared by training (train.c) and inference (infer.c):
 * its input rows, labels or targets and dropout seed, uploaded from a host batch; with
 * data.cache device, the rank's training rows held in backend memory once and each batch gathered
 * there from its row numbers (the only thing that travels). And the count of the targets a batch's
 * loss averages over when model.loss ignore_index leaves some out.
 * Owns: the backend buffers of a dt_dev_batch and of a dt_dev_cache. Borrows: the model, the data. */
#ifndef DT_BATCH_H
#define DT_BATCH_H

#include "data.h"
#include "model.h"

/* One micro-batch on the device, backend memory for `cap` rows. */
typedef struct {
  float *raw;      /* (cap, input) */
  int32_t *labels; /* (cap * labels per row) */
  float *targets;  /* (cap, outputs): mse targets */
  uint64_t *seed;  /* (1) the dropout seed */
  int32_t *rows;   /* (cap) data.cache device: the rows to gather, within the rank's cached rows */
} dt_dev_batch;

void batch_alloc(dt_dev_batch *db, const dt_model *m, int64_t cap);
void batch_free(dt_dev_batch *db, dt_backend *be);
/* Queues the copy of host batch b (x; labels for cross_entropy, else targets) and its seed; with a
 * device cache (cached) only its row numbers. ahead: on the backend's copy queue (upload_ahead),
 * overlapping queued work that must not use db. */
void batch_upload(dt_dev_batch *db, const dt_model *m, const dt_batch *b, int cached, uint64_t seed, int ahead);

/* data.cache device: the rank's training rows as stored, and their labels or targets. */
typedef struct {
  void *x, *y; /* backend memory; NULL when off */
} dt_dev_cache;

/* Copies the split's rows (already in host memory) into backend memory. */
void cache_fill(dt_dev_cache *c, dt_backend *be, const dt_split *s);
void cache_free(dt_dev_cache *c, dt_backend *be);
/* Queues the gather of db's rows (rows of them) from the cache into db (part of a captured step). */
void cache_gather(const dt_dev_cache *c, dt_backend *be, const dt_split *s, const dt_dev_batch *db, int64_t rows);

/* The targets of split rows idx[0..n) that ignore_index leaves in (a token model's). */
double count_targets(const dt_split *s, const int64_t *idx, int64_t n, int64_t ignore);

#endif
