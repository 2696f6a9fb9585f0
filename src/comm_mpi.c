#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"

#define MPI_CHECK(call)                                                  \
  do {                                                                   \
    int rc_ = (call);                                                    \
    if (rc_ != MPI_SUCCESS) {                                            \
      char msg_[MPI_MAX_ERROR_STRING + 64];                              \
      int len_ = 0;                                                      \
      MPI_Error_string(rc_, msg_, &len_);                                \
      char what_[MPI_MAX_ERROR_STRING + 128];                            \
      snprintf(what_, sizeof what_, "%s failed: %s", #call, msg_);       \
      dt_abort(__FILE__, __LINE__, what_);                               \
    }                                                                    \
  } while (0)

int comm_init(dt_comm *c, int *argc, char ***argv) {
  memset(c, 0, sizeof *c);
  int provided = 0;
  MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  c->world = MPI_COMM_WORLD;
  MPI_CHECK(MPI_Comm_set_errhandler(c->world, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(c->world, &c->rank));
  MPI_CHECK(MPI_Comm_size(c->world, &c->size));
  MPI_CHECK(MPI_Comm_split_type(c->world, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &c->node));
  MPI_CHECK(MPI_Comm_rank(c->node, &c->local_rank));
  MPI_CHECK(MPI_Comm_size(c->node, &c->local_size));
  if (gethostname(c->host, sizeof c->host - 1)) snprintf(c->host, sizeof c->host, "unknown");
  return 0;
}

void comm_finalize(dt_comm *c) {
  if (c->node != MPI_COMM_NULL && c->node) MPI_Comm_free(&c->node);
  MPI_Finalize();
}

int comm_agree(dt_comm *c, const dt_status *st) {
  int *codes = dt_calloc((size_t)c->size, sizeof(int));
  int mine = st->code;
  MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, codes, 1, MPI_INT, c->world));
  int first = -1, failed = 0;
  for (int r = 0; r < c->size; r++)
    if (codes[r]) {
      if (first < 0) first = r;
      failed++;
    }
  int code = first >= 0 ? codes[first] : 0;
  if (first == c->rank) {
    if (failed == c->size || c->size == 1)
      fprintf(stderr, "ddp_train: error: %s\n", st->msg);
    else
      fprintf(stderr, "ddp_train: error: on rank %d (%d of %d ranks failed): %s\n", c->rank, failed, c->size,
              st->msg);
    fflush(stderr);
  }
  free(codes);
  return code;
}

int comm_check_same(dt_comm *c, uint64_t hash, const char *what, dt_status *st) {
  unsigned long long *all = dt_calloc((size_t)c->size, sizeof *all);
  unsigned long long mine = hash;
  MPI_CHECK(MPI_Allgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all, 1, MPI_UNSIGNED_LONG_LONG, c->world));
  char ranks[512] = "";
  size_t len = 0;
  int bad = 0;
  for (int r = 1; r < c->size; r++)
    if (all[r] != all[0]) {
      if (len < sizeof ranks - 16) len += (size_t)snprintf(ranks + len, sizeof ranks - len, "%s%d", bad ? ", " : "", r);
      bad++;
    }
  free(all);
  if (bad)
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s differs between ranks: rank(s) %s do not match rank 0; every rank must run the "
                   "identical config and --set options",
                   what, ranks);
  return 0;
}

void comm_bcast(dt_comm *c, void *buf, size_t bytes, int root) {
  char *p = buf;
  while (bytes) { /* MPI counts are int */
    int chunk = bytes > (1u << 30) ? (1 << 30) : (int)bytes;
    MPI_CHECK(MPI_Bcast(p, chunk, MPI_BYTE, root, c->world));
    p += chunk;
    bytes -= (size_t)chunk;
  }
}

void comm_allreduce_sum_f64(dt_comm *c, double *data, int n) {
  if (c->size == 1) return;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data, n, MPI_DOUBLE, MPI_SUM, c->world));
}

double comm_allreduce_max_f64(dt_comm *c, double v) {
  double out = v;
  if (c->size > 1) MPI_CHECK(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, c->world));
  return out;
}

void grad_sync_init(dt_grad_sync *g, dt_comm *c, float *grads, int64_t n, int64_t bucket_elems) {
  memset(g, 0, sizeof *g);
  g->comm = c;
  g->grads = grads;
  if (bucket_elems < 1) bucket_elems = 1;
  g->n_buckets = (int)((n + bucket_elems - 1) / bucket_elems);
  g->buckets = dt_calloc((size_t)(g->n_buckets ? g->n_buckets : 1), sizeof *g->buckets);
  for (int i = 0; i < g->n_buckets; i++) {
    g->buckets[i].end = n - (int64_t)i * bucket_elems;
    g->buckets[i].begin = g->buckets[i].end - bucket_elems > 0 ? g->buckets[i].end - bucket_elems : 0;
    g->buckets[i].req = MPI_REQUEST_NULL;
  }
}

void grad_sync_free(dt_grad_sync *g) {
  free(g->buckets);
  memset(g, 0, sizeof *g);
}

static void start_bucket(dt_grad_sync *g, dt_bucket *b) {
  int64_t count = b->end - b->begin;
  DT_ASSERT(count <= 0x7fffffff);
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, g->grads + b->begin, (int)count, MPI_FLOAT, MPI_SUM, g->comm->world, &b->req));
  b->started = 1;
}

void grad_sync_ready(dt_grad_sync *g, int64_t from) {
  if (g->comm->size == 1) return;
  while (g->next < g->n_buckets && g->buckets[g->next].begin >= from) start_bucket(g, &g->buckets[g->next++]);
  /* Open MPI progresses non-blocking collectives inside MPI calls: poke the ones in flight. */
  for (int i = 0; i < g->next; i++) {
    int done = 0;
    if (g->buckets[i].req != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(&g->buckets[i].req, &done, MPI_STATUS_IGNORE));
  }
}

void grad_sync_finish(dt_grad_sync *g) {
  g->wait_s = 0;
  if (g->comm->size == 1) return;
  double t0 = dt_now();
  while (g->next < g->n_buckets) start_bucket(g, &g->buckets[g->next++]);
  for (int i = 0; i < g->n_buckets; i++) {
    MPI_CHECK(MPI_Wait(&g->buckets[i].req, MPI_STATUS_IGNORE));
    g->buckets[i].started = 0;
  }
  g->next = 0;
  g->wait_s = dt_now() - t0;
}
