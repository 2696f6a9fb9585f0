/* ddp.c: gradient buckets, their backward hooks and timing, and their sums over the ranks (ddp.h). */
#include "ddp.h"

#include <stdlib.h>
#include <string.h>

/* Non-finite gradients in [begin, end), counted on the device before the range is sent. */
static void check_bucket(dt_ddp *g, int64_t begin, int64_t end) {
  dt_op op = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = end - begin, .x = g->grads + begin, .out = g->grad_check}};
  const double t0 = dt_now();
  backend_run(g->be, &op);
  g->check_s += dt_now() - t0;
}

void ddp_init(dt_ddp *g, dt_comm *c, const dt_device_reduce *dev, dt_backend *be, float *grads, int64_t n,
              int64_t bucket_elems, double *grad_check) {
  memset(g, 0, sizeof *g);
  *g = (dt_ddp){.comm = c, .dev = dev, .be = be, .grads = grads, .grad_check = grad_check};
  if (!dev && !be->host_memory && c->size > 1) g->staging = dt_malloc((size_t)(n ? n : 1) * sizeof(float));
  if (bucket_elems < 1) bucket_elems = 1;
  g->n_buckets = (int)((n + bucket_elems - 1) / bucket_elems);
  g->buckets = dt_calloc((size_t)(g->n_buckets ? g->n_buckets : 1), sizeof *g->buckets);
  for (int i = 0; i < g->n_buckets; i++) {
    g->buckets[i].end = n - (int64_t)i * bucket_elems;
    g->buckets[i].begin = g->buckets[i].end - bucket_elems > 0 ? g->buckets[i].end - bucket_elems : 0;
    g->buckets[i].req = DT_COMM_REQUEST_NULL;
  }
  g->ready_s = dt_calloc((size_t)g->n_buckets + 1, sizeof(double));
  g->ready_mpi_s = dt_calloc((size_t)g->n_buckets + 1, sizeof(double));
}

void ddp_free(dt_ddp *g) {
  free(g->buckets);
  free(g->staging);
  free(g->ready_s);
  free(g->ready_mpi_s);
  memset(g, 0, sizeof *g);
}

static void start_bucket(dt_ddp *g, dt_bucket *b) {
  int64_t count = b->end - b->begin;
  check_bucket(g, b->begin, b->end);
  b->started = 1;
  if (!g->dev && g->comm->size == 1) return; /* nothing to sum: no MPI call, so the step can be captured */
  if (g->dev) {
    g->dev->start(g->dev->ctx, g->grads + b->begin, count);
    return;
  }
  float *buf = g->grads + b->begin;
  if (g->staging) { /* device gradients go through host memory */
    g->be->to_host(g->be, g->staging + b->begin, buf, (size_t)count * sizeof(float));
    buf = g->staging + b->begin;
  }
  comm_isum_f32(g->comm, buf, count, &b->req);
}

void ddp_ready(void *ctx, int64_t from) {
  dt_ddp *g = ctx;
  const int before = g->next;
  const double t0 = dt_now(), mpi_s = ddp_backward_mpi_s(g);
  while (g->next < g->n_buckets && g->buckets[g->next].begin >= from) start_bucket(g, &g->buckets[g->next++]);
  if (!g->dev) /* Open MPI progresses non-blocking collectives inside MPI calls: poke the ones in flight */
    for (int i = 0; i < g->next; i++) comm_progress(&g->buckets[i].req);
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
    dt_comm_request *reqs = dt_malloc((size_t)(g->n_buckets ? g->n_buckets : 1) * sizeof *reqs);
    for (int i = 0; i < g->n_buckets; i++) reqs[i] = g->buckets[i].req;
    comm_wait(g->comm, reqs, g->n_buckets, "gradient allreduce");
    if (g->staging && g->n_buckets)
      g->be->to_device(g->be, g->grads, g->staging, (size_t)g->buckets[0].end * sizeof(float));
    for (int i = 0; i < g->n_buckets; i++) g->buckets[i].req = DT_COMM_REQUEST_NULL;
    free(reqs);
  }
  for (int i = 0; i < g->n_buckets; i++) g->buckets[i].started = 0;
  g->next = 0;
  g->wait_s = dt_now() - t0;
}
