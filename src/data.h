/* data.h: HDF5 datasets, checked at start-up, and a loader that prepares the next batch in a
 * background thread.
 * A split (train or val) is an x dataset (N, ...) of uint8/float32/float64 and a y dataset:
 * integer class labels (N,) for cross_entropy, float targets (N, K) or (N,) for mse.
 * A token model's split is x alone: integer tokens (N, T+1), a row's first T the input and its last
 * T the targets, or a flat stream (L,) cut into N = (L-1)/T such windows, each overlapping the
 * next by one token; every token is checked to be in [0, vocab) when the split is opened. The rows'
 * tokens are held in memory as the file stores them when it is uint8 or uint16 (as uint16), else as
 * int32; or, with data.cache none (auto: over 4 GiB), read from the file batch by batch, with only
 * each row's count of targets kept (for loss.ignore_index).
 * Each rank holds the rows it may use ([lo, hi)): all of them for global sharding, its own 1/W
 * for contiguous sharding, its 1/W slice of the validation set. Labels are always in memory; x
 * is in memory when cached, otherwise read row by row from the file per batch.
 * Owns: the HDF5 handles and the cached rows. */
#ifndef DT_DATA_H
#define DT_DATA_H

#include <hdf5.h>
#include <pthread.h>
#include <stdint.h>

#include "config.h"
#include "model.h"
#include "sampler.h"

enum { DT_X_U8, DT_X_F32, DT_X_F64 };
enum { DT_TOK_U16, DT_TOK_I32 };
enum { DT_CACHE_PROBE = -1 }; /* data_hdf5.c: the forked probe's open, which reads no more than it must */

typedef struct {
  char x_name[256], y_name[256];
  int64_t n, row_elems;
  int x_type;
  size_t x_elem;
  int64_t y_k;          /* targets per row (mse); 0 for class labels */
  int64_t lo, hi;       /* rows held by this rank */
  void *x;              /* rows [lo, hi) in the file's type; NULL: read per batch */
  int x_pending;        /* x is allocated but not read yet (dset_x stays open): data_fill reads it */
  int32_t *labels;      /* rows [lo, hi) (cross_entropy) */
  float *targets;       /* rows [lo, hi) x y_k (mse) */
  void *tokens;         /* token model, held: row r's T+1 tokens start at element (r - lo) * tok_stride, tok_type
                          each; NULL: read from dset_x per batch */
  int tok_type;         /* DT_TOK_U16 (the file's uint8 or uint16) or DT_TOK_I32 */
  int64_t tok_stride;   /* > 0 for a token split */
  int64_t tok_count;    /* the tokens rows [lo, hi) span */
  int tok_ignore;       /* the model has loss.ignore_index (row_targets is kept when the tokens are not) */
  int32_t *row_targets; /* tokens read per batch, with loss.ignore_index: each row's targets not ignored */
  hid_t dset_x;
} dt_split;

/* Token i of buf, whose tokens are of type (DT_TOK_*). */
static inline int32_t token_at(int type, const void *buf, int64_t i) {
  return type == DT_TOK_U16 ? (int32_t)((const uint16_t *)buf)[i] : ((const int32_t *)buf)[i];
}

/* Token i of a split's held tokens (counted from its first row's first token). */
static inline int32_t split_token(const dt_split *s, int64_t i) {
  return token_at(s->tok_type, s->tokens, i);
}

typedef struct {
  char path[1024];
  hid_t file;
  dt_split train, val;
  int has_val;
  int cached;
  int watched;  /* fd and size are set: every read checks that the file still has that size */
  int fd;       /* HDF5's descriptor of the file (borrowed) */
  int64_t size; /* bytes when opened */
} dt_data;

/* Opens and validates both splits; every failure is exit 2 naming file, dataset and index. Every read
 * after (data_fill, data_gather) checks that the file still has the size it had when opened: a file
 * truncated under the run reads as zeros in HDF5, and is exit 5 naming the file, dataset and rows.
 * The training rows held depend on sharding (see sampler.h). */
int data_open(dt_data *d, const dt_config *cfg, const dt_model *m, int world, int rank, dt_status *st);
void data_close(dt_data *d);
/* The host memory the rank's rows take once opened with data.cache `cache` (whatever cache d was
 * opened with: --dry-run's reads none): labels or targets, and x where the cache holds it; a token
 * model's (tokens) tokens where the cache holds them (as uint16 or int32), else its rows' target counts
 * with loss.ignore_index. 0 for data never opened. */
size_t data_held_bytes(const dt_data *d, int cache, int tokens);

/* Reads the training rows into the cache that data_open left pending (the training split's x of an
 * image or vector model cached in host memory), so that the first step need not wait for it: the
 * loader's thread calls it after the first batch, which it reads row by row. Nothing to do when
 * nothing is pending. Returns 0 or st (exit 2 naming the file, dataset and rows, as data_open's
 * reads; exit 5 when the file changed since). */
int data_fill(dt_data *d, dt_status *st);

/* Rows idx[0..n) (absolute row numbers within [lo, hi)) of split as float (n, row_elems), with
 * labels (n * labels per row: T for a token model) or targets (n, y_k). Returns 0 or st (exit 5 on
 * a read failure or a changed file, naming the file, dataset and row). */
int data_gather(dt_data *d, dt_split *s, const int64_t *idx, int64_t n, float *x, int32_t *labels, float *targets,
                dt_status *st);

/* One micro-batch on the host. */
typedef struct {
  float *x;        /* (count, row_elems); not filled by an indices-only loader */
  int32_t *labels; /* (count * labels per row), likewise */
  float *targets;  /* (count, y_k), likewise */
  int32_t *rows;   /* (count) the rows taken, numbered within the split's [lo, hi) */
  int64_t count, global_count;
  int64_t epoch, step; /* sampler position */
  int ready;
} dt_batch;

/* Training loader: produces (epoch, step) micro-batches in order from a start position, two ahead. */
typedef struct {
  dt_data *data;
  dt_sampler *sampler;
  int64_t *idx;
  dt_batch slots[2];
  int64_t next_fill, next_take; /* sequence numbers */
  int64_t start_epoch, start_step, end_epoch;
  int stop, threaded;
  int indices_only; /* batches carry only `rows` (data.cache device: the rows are gathered on the device) */
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  dt_status st;    /* first error seen by the thread */
  int64_t err_seq; /* the batch (sequence number) it stopped */
  int filling;     /* the thread has the training cache (data_fill) still to read */
  double wait_s;   /* time the consumer waited in loader_next since the last reset */
} dt_loader;

void loader_start(dt_loader *L, dt_data *d, dt_sampler *s, const dt_model *m, int64_t start_epoch, int64_t start_step,
                  int64_t end_epoch, int indices_only);
/* Next micro-batch in order; the previous one returned is released. NULL with st set on error.
 * ahead (a fetch to overlap work in flight): while the thread fills the training cache, a batch that
 * is not ready yet is not waited for: NULL with st untouched, and nothing released. */
dt_batch *loader_next(dt_loader *L, int ahead, dt_status *st);
/* Returns once the loader's thread has filled the training cache: HDF5 here is not thread-safe, so
 * the caller's own HDF5 calls (a checkpoint) wait for it. */
void loader_wait_filled(dt_loader *L);
void loader_stop(dt_loader *L);

#endif
