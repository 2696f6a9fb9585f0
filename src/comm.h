/* comm.h: everything that talks to MPI after start-up.
 * - comm_agree: every rank brings its status; if any failed, the lowest failing rank prints its
 *   message once (naming itself when not every rank failed) and all return that code together.
 * - grad_sync: gradient averaging in buckets over the flat gradient buffer. Buckets are cut from
 *   the end of the buffer (backward finishes gradients from the end), and each bucket's
 *   MPI_Iallreduce starts as soon as backward reports it complete.
 * Owns: the node communicator and the bucket requests. Borrows: the gradient buffer. */
#ifndef DT_COMM_H
#define DT_COMM_H

#include <mpi.h>
#include <stdint.h>

#include "common.h"

typedef struct {
  int rank, size;             /* in MPI_COMM_WORLD */
  int local_rank, local_size; /* on this node (MPI_COMM_TYPE_SHARED) */
  MPI_Comm world, node;
  char host[256];
} dt_comm;

int comm_init(dt_comm *c, int *argc, char ***argv);
void comm_finalize(dt_comm *c);

/* Collective: returns the agreed exit code (0: all ok). Prints the message once. */
int comm_agree(dt_comm *c, const dt_status *st);

/* Collective: exit-2 status naming the ranks whose hash differs from rank 0's. */
int comm_check_same(dt_comm *c, uint64_t hash, const char *what, dt_status *st);

void comm_bcast(dt_comm *c, void *buf, size_t bytes, int root);
void comm_allreduce_sum_f64(dt_comm *c, double *data, int n);
double comm_allreduce_max_f64(dt_comm *c, double v);

typedef struct {
  int64_t begin, end;
  MPI_Request req;
  int started;
} dt_bucket;

typedef struct {
  dt_comm *comm;
  float *grads; /* borrowed, host memory */
  int n_buckets;
  dt_bucket *buckets; /* buckets[0] is the last range of the buffer */
  int next;           /* first bucket not yet started */
  double wait_s;      /* time spent waiting in grad_sync_finish this step */
} dt_grad_sync;

void grad_sync_init(dt_grad_sync *g, dt_comm *c, float *grads, int64_t n, int64_t bucket_elems);
void grad_sync_free(dt_grad_sync *g);
/* Backward hook: every gradient at offset >= from is final. Starts the buckets it completes. */
void grad_sync_ready(dt_grad_sync *g, int64_t from);
/* Starts what is left and waits for every bucket; sums over ranks in place. */
void grad_sync_finish(dt_grad_sync *g);

#endif
