/* ddp.c: gradient buckets, their backward hooks and timing, and their sums over the ranks (ddp.h). */
#include "ddp.h"

#include <stdlib.h>
#include <string.h>

/* Non-finite gradients in [begin, end), counted on the device before the range is sent (unless
 * grad_check is NULL: the trainer checks them otherwise). */
static void check_bucket(dt_ddp *g, int64_t begin, int64_t end) {
  if (!g->grad_check) return;
  dt_op op = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = end - begin, .x = g->grads + begin, .out = g->grad_check}};
  const double t0 = dt_now();
  backend_run(g->be, &op);
  g->check_s += dt_now() - t0;
}

void ddp_init(dt_ddp *g, dt_comm *c, const dt_device_reduce *dev, dt_backend *be, float *grads, int64_t n,
              int64_t bucket_elems, double *grad_check, const int64_t *shard) {
  memset(g, 0, sizeof *g);
  *g = (dt_ddp){.comm = c, .dev = dev, .be = be, .grads = grads, .grad_check = grad_check, .shard = shard};
  if (!dev && !be->host_memory && c->size > 1) g->staging = dt_malloc((size_t)(n ? n : 1) * sizeof(float));
  if (bucket_elems < 1) bucket_elems = 1;
  g->n_buckets = (int)((n + bucket_elems - 1) / bucket_elems);
  g->buckets = dt_calloc((size_t)(g->n_buckets ? g->n_buckets : 1), sizeof *g->buckets);
  /* a bucket is one piece, or under dist.zero one per shard it meets: at most buckets + ranks */
  g->pieces = dt_calloc((size_t)g->n_buckets + (size_t)c->size + 1, sizeof *g->pieces);
  for (int i = 0; i < g->n_buckets; i++) {
    dt_bucket *b = &g->buckets[i];
    b->end = n - (int64_t)i * bucket_elems;
    b->begin = b->end - bucket_elems > 0 ? b->end - bucket_elems : 0;
    b->first = g->n_pieces;
    if (!shard)
      g->pieces[g->n_pieces++] = (dt_piece){.begin = b->begin, .end = b->end, .root = -1, .req = DT_COMM_REQUEST_NULL};
    for (int r = shard ? c->size - 1 : -1; r >= 0; r--) { /* from the end, as the buckets go */
      const int64_t begin = shard[r] > b->begin ? shard[r] : b->begin,
                    end = shard[r + 1] < b->end ? shard[r + 1] : b->end;
      if (begin < end)
        g->pieces[g->n_pieces++] = (dt_piece){.begin = begin, .end = end, .root = r, .req = DT_COMM_REQUEST_NULL};
    }
    b->n = g->n_pieces - b->first;
  }
  g->ready_s = dt_calloc((size_t)g->n_buckets + 1, sizeof(double));
  g->ready_mpi_s = dt_calloc((size_t)g->n_buckets + 1, sizeof(double));
}

void ddp_free(dt_ddp *g) {
  free(g->buckets);
  free(g->pieces);
  free(g->staging);
  free(g->ready_s);
  free(g->ready_mpi_s);
  memset(g, 0, sizeof *g);
}

/* Whether starting a bucket reads its gradients: to check them, or to send them. */
static int buckets_read(const dt_ddp *g) {
  return g->grad_check || g->dev || g->comm->size > 1;
}

static void start_bucket(dt_ddp *g, dt_bucket *b) {
  check_bucket(g, b->begin, b->end);
  b->started = 1;
  if (!g->dev && g->comm->size == 1) return; /* nothing to sum: no MPI call, so the step can be captured */
  if (g->staging)                            /* device gradients go through host memory */
    g->be->to_host(g->be, g->staging + b->begin, g->grads + b->begin, (size_t)(b->end - b->begin) * sizeof(float));
  for (int i = b->first; i < b->first + b->n; i++) {
    dt_piece *p = &g->pieces[i];
    const int64_t count = p->end - p->begin;
    if (g->dev) {
      if (p->root < 0)
        g->dev->start(g->dev->ctx, g->grads + p->begin, count);
      else
        g->dev->reduce(g->dev->ctx, g->grads + p->begin, count, p->root);
    } else {
      float *buf = (g->staging ? g->staging : g->grads) + p->begin;
      if (p->root < 0)
        comm_isum_f32(g->comm, buf, count, &p->req);
      else
        comm_ireduce_f32(g->comm, buf, count, p->root, &p->req);
    }
  }
}

void ddp_ready(void *ctx, int64_t from) {
  dt_ddp *g = ctx;
  const int before = g->next;
  const double t0 = dt_now(), mpi_s = ddp_backward_mpi_s(g);
  if (g->settle && buckets_read(g) && g->next < g->n_buckets && g->buckets[g->next].begin >= from)
    g->settle(g->settle_ctx, from);
  while (g->next < g->n_buckets && g->buckets[g->next].begin >= from) start_bucket(g, &g->buckets[g->next++]);
  if (!g->dev) /* Open MPI progresses non-blocking collectives inside MPI calls: poke the ones in flight */
    for (int i = 0; i < (g->next ? g->buckets[g->next - 1].first + g->buckets[g->next - 1].n : 0); i++)
      comm_progress(&g->pieces[i].req);
  for (int i = before; i < g->next; i++) {
    g->ready_s[i] = t0 - g->t_backward;
    g->ready_mpi_s[i] = mpi_s;
  }
  g->hook_s += dt_now() - t0;
}

void ddp_allreduce_sum(void *ctx, double *data, int n) {
  dt_ddp *g = ctx;
  if (g->comm->size == 1) return; /* a sum over one rank: nothing to do, and nothing to wait for */
  if (g->dev) {
    g->dev->sum_f64(g->dev->ctx, data, n);
  } else if (g->be->host_memory) {
    comm_allreduce_sum_f64(g->comm, data, n, "batchnorm statistics allreduce");
  } else {
    double *host = dt_malloc((size_t)n * sizeof(double));
    g->be->to_host(g->be, host, data, (size_t)n * sizeof(double));
    comm_allreduce_sum_f64(g->comm, host, n, "batchnorm statistics allreduce");
    g->be->to_device(g->be, data, host, (size_t)n * sizeof(double));
    free(host);
  }
}

void ddp_backward_begin(dt_ddp *g) {
  g->t_backward = dt_now();
  g->hook_s = g->check_s = 0;
}

void ddp_backward_end(dt_ddp *g) {
  const double t = dt_now() - g->t_backward;
  for (int i = g->next; i < g->n_buckets; i++) g->ready_s[i] = t, g->ready_mpi_s[i] = ddp_backward_mpi_s(g);
}

void ddp_finish(dt_ddp *g) {
  g->wait_s = 0;
  double t0 = dt_now();
  while (g->next < g->n_buckets) start_bucket(g, &g->buckets[g->next++]);
  if (g->dev) {
    g->dev->join(g->dev->ctx);
  } else {
    dt_comm_request *reqs = dt_malloc((size_t)(g->n_pieces ? g->n_pieces : 1) * sizeof *reqs);
    for (int i = 0; i < g->n_pieces; i++) reqs[i] = g->pieces[i].req;
    comm_wait(g->comm, reqs, g->n_pieces, g->shard ? "gradient reduce" : "gradient allreduce");
    if (g->staging && g->n_buckets) { /* the sums back: all of them, or this rank's shard */
      const int64_t lo = g->shard ? g->shard[g->comm->rank] : 0,
                    hi = g->shard ? g->shard[g->comm->rank + 1] : g->buckets[0].end;
      if (hi > lo) g->be->to_device(g->be, g->grads + lo, g->staging + lo, (size_t)(hi - lo) * sizeof(float));
    }
    for (int i = 0; i < g->n_pieces; i++) g->pieces[i].req = DT_COMM_REQUEST_NULL;
    free(reqs);
  }
  for (int i = 0; i < g->n_buckets; i++) g->buckets[i].started = 0;
  g->next = 0;
  g->wait_s = dt_now() - t0;
}

void ddp_gather(dt_ddp *g, float *params) {
  DT_ASSERT(g->shard);
  const dt_comm *c = g->comm;
  if (c->size == 1) return;
  if (g->dev) {
    g->dev->gather(g->dev->ctx, params, g->shard);
  } else if (g->be->host_memory) {
    comm_allgather_slices_f32(g->comm, params, g->shard, "parameter allgather");
  } else { /* through host memory: this rank's shard up, everyone's down */
    const int64_t lo = g->shard[c->rank], hi = g->shard[c->rank + 1], n = g->shard[c->size];
    if (hi > lo) g->be->to_host(g->be, g->staging + lo, params + lo, (size_t)(hi - lo) * sizeof(float));
    comm_allgather_slices_f32(g->comm, g->staging, g->shard, "parameter allgather");
    g->be->to_device(g->be, params, g->staging, (size_t)n * sizeof(float));
  }
}
