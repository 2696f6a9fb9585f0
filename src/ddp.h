/* ddp.h: data parallelism. The flat gradient buffer is summed over the ranks in buckets cut from
 * its end (backward finishes gradients from the end), each bucket started as soon as backward
 * reports it final, so that the sums overlap the rest of backward. The transport underneath is MPI
 * (comm.h: through host memory for device gradients) or a device collective library such as NCCL
 * (a dt_device_reduce, comm_nccl.h), which queues the sums on the device with no host wait, so that
 * a whole step can be captured. Before a bucket is sent its non-finite values are counted on the
 * device, so a NaN is blamed on the rank that produced it. The hooks also time each bucket for
 * metrics.jsonl (scripts/scaling.py reads them).
 * Owns: the buckets, the host staging copy, the hook state and timings. Borrows: the communicator,
 * the backend, the gradient buffer and the check counters (backend memory). */
#ifndef DT_DDP_H
#define DT_DDP_H

#include "backend.h"
#include "comm.h"

/* A bucket's part summed into one place: every rank (root -1), or under dist.zero 1 the rank whose
 * shard holds it. */
typedef struct {
  int64_t begin, end;
  int root;
  dt_comm_request req;
} dt_piece;

typedef struct {
  int64_t begin, end; /* [begin, end) of the gradient buffer */
  int first, n;       /* its pieces: pieces[first, first + n) */
  int started;
} dt_bucket;

typedef struct dt_ddp {
  dt_comm *comm;
  const dt_device_reduce *dev; /* NULL: MPI */
  dt_backend *be;
  float *grads;         /* (n) backend memory */
  float *staging;       /* (n) host copy for MPI when the backend's memory is not the host's; else NULL */
  double *grad_check;   /* (2) backend memory or NULL: sum of squares and non-finite count of the sent buckets */
  const int64_t *shard; /* dist.zero 1: (size + 1) rank r owns [shard[r], shard[r + 1]); NULL: all-reduce */
  int n_buckets, n_pieces;
  /* NULL, or called before buckets that read the gradients (to check or send them) start, with every
   * gradient at offset >= from final: the ones at those offsets that the model still holds elsewhere are
   * added in first (model_add_grads16, ctx the model) */
  void (*settle)(void *settle_ctx, int64_t from);
  void *settle_ctx;
  dt_bucket *buckets; /* buckets[0] is the last range of the buffer */
  dt_piece *pieces;   /* bucket by bucket, in the order they are sent */
  int next;           /* the first bucket not yet started */
  double wait_s;      /* seconds in ddp_finish this step */
  /* the last micro-batch's backward (host clock: meaningful where the backend runs its work as it is
   * called, the CPU's): when it began, seconds in the hooks since, of which in the bucket checks;
   * per bucket, seconds from its start until it was started and the MPI seconds before that */
  double t_backward, hook_s, check_s;
  double *ready_s, *ready_mpi_s; /* (n_buckets) */
} dt_ddp;

/* Buckets of bucket_elems floats over grads[0..n); check counts non-finite values into grad_check
 * (NULL: no check).
 * shard (borrowed, or NULL): dist.zero 1's slices, each rank's gradients summed into its own only. */
void ddp_init(dt_ddp *g, dt_comm *c, const dt_device_reduce *dev, dt_backend *be, float *grads, int64_t n,
              int64_t bucket_elems, double *grad_check, const int64_t *shard);
void ddp_free(dt_ddp *g);

/* The pass hooks (dt_pass.grads_ready and dt_pass.allreduce_sum, with ctx the dt_ddp): every
 * gradient at offset >= from is final; a sum of n doubles over the ranks (synchronised batchnorm's
 * statistics: queued on the device with NCCL, directly over MPI on the CPU, through host memory
 * otherwise). */
void ddp_ready(void *ctx, int64_t from);
void ddp_allreduce_sum(void *ctx, double *data, int n);

/* Around the backward of the step's last micro-batch: the hook timings start, and the buckets no
 * hook started are timed as ready when backward ended. */
void ddp_backward_begin(dt_ddp *g);
void ddp_backward_end(dt_ddp *g);

/* Starts what is left; sums over ranks in place (dist.zero 1: each rank's shard only; the rest of
 * its gradients are left as they were). Over MPI it waits for every bucket (under the deadline); on
 * the device it only makes the compute stream wait for them. */
void ddp_finish(dt_ddp *g);

/* dist.zero 1, after the update: every rank's shard of params (n values, backend memory) to every
 * rank (queued on the device with NCCL; over MPI waited for). */
void ddp_gather(dt_ddp *g, float *params);

/* The MPI seconds inside the last backward's hooks. */
static inline double ddp_backward_mpi_s(const dt_ddp *g) {
  return g->hook_s - g->check_s;
}

#endif
