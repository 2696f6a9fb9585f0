#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"

#define MPI_CHECK(call)                                            \
  do {                                                             \
    int rc_ = (call);                                              \
    if (rc_ != MPI_SUCCESS) {                                      \
      char msg_[MPI_MAX_ERROR_STRING + 64];                        \
      int len_ = 0;                                                \
      MPI_Error_string(rc_, msg_, &len_);                          \
      char what_[MPI_MAX_ERROR_STRING + 128];                      \
      snprintf(what_, sizeof what_, "%s failed: %s", #call, msg_); \
      dt_abort(__FILE__, __LINE__, what_);                         \
    }                                                              \
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
  c->timeout_s = 600;
  c->step = -1;
  c->send_req = MPI_REQUEST_NULL;
  if (c->rank == 0) {
    c->arrived_seq = dt_calloc((size_t)c->size, sizeof(int64_t));
    c->arrive_req = dt_calloc((size_t)c->size, sizeof(MPI_Request));
    for (int r = 0; r < c->size; r++) c->arrive_req[r] = MPI_REQUEST_NULL;
  }
  return 0;
}

enum { TAG_ARRIVE = 7001, TAG_FAILED = 7002 };

void comm_announce_failure(dt_comm *c) {
  for (int r = 0; r < c->size; r++) {
    if (r == c->rank) continue;
    MPI_Request req; /* c->rank outlives the send; nobody needs to wait for it */
    MPI_CHECK(MPI_Isend(&c->rank, 1, MPI_INT, r, TAG_FAILED, c->world, &req));
    MPI_CHECK(MPI_Request_free(&req));
  }
}

int comm_failed_peer(dt_comm *c) {
  int flag = 0, who = -1;
  MPI_Status st;
  MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, TAG_FAILED, c->world, &flag, &st));
  if (flag) MPI_CHECK(MPI_Recv(&who, 1, MPI_INT, st.MPI_SOURCE, TAG_FAILED, c->world, MPI_STATUS_IGNORE));
  return who;
}

void comm_finalize(dt_comm *c) {
  /* receive the failure announcements that arrived after their receiver stopped listening */
  while (comm_failed_peer(c) >= 0) continue;
  if (c->node != MPI_COMM_NULL && c->node) MPI_Comm_free(&c->node);
  free(c->arrived_seq);
  free(c->arrive_req);
  MPI_Finalize();
}

static void missing_ranks(const dt_comm *c, char *buf, size_t cap, int *count) {
  size_t len = 0;
  *count = 0;
  buf[0] = 0;
  for (int r = 1; r < c->size; r++) {
    if (c->arrived_seq[r] >= c->seq) continue;
    if (len < cap - 16) len += (size_t)snprintf(buf + len, cap - len, "%s%d", *count ? ", " : "", r);
    (*count)++;
  }
}

static void where_text(const dt_comm *c, char *buf, size_t cap) {
  if (c->step >= 0)
    snprintf(buf, cap, "at step %lld", (long long)c->step);
  else
    snprintf(buf, cap, "during start-up");
}

void comm_wait(dt_comm *c, MPI_Request *reqs, int n, const char *what) {
  if (c->size == 1) {
    MPI_CHECK(MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE));
    return;
  }
  c->seq++;
  if (c->rank != 0) {
    if (c->send_req != MPI_REQUEST_NULL) MPI_CHECK(MPI_Wait(&c->send_req, MPI_STATUS_IGNORE));
    c->send_seq = c->seq;
    MPI_CHECK(MPI_Isend(&c->send_seq, 1, MPI_INT64_T, 0, TAG_ARRIVE, c->world, &c->send_req));
  } else {
    for (int r = 1; r < c->size; r++)
      MPI_CHECK(MPI_Irecv(&c->arrived_seq[r], 1, MPI_INT64_T, r, TAG_ARRIVE, c->world, &c->arrive_req[r]));
  }
  double t0 = dt_now(), warn_at = c->timeout_s / 2, hook_at = 1.0;
  int warned = 0, spins = 0, hooked = 0;
  for (;;) {
    int done = 0;
    MPI_CHECK(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
    if (c->rank == 0)
      for (int r = 1; r < c->size; r++) {
        int got = 0;
        if (c->arrive_req[r] != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(&c->arrive_req[r], &got, MPI_STATUS_IGNORE));
      }
    if (done) break;
    double waited = dt_now() - t0;
    const int hook_due = c->wait_hook && waited >= hook_at, warn_due = !warned && waited > warn_at;
    /* rank 0 knows who is missing: it reports first; the others give it a second */
    const int late = waited > c->timeout_s + (c->rank == 0 ? 0 : 1);
    if (hook_due || warn_due || late) { /* the texts are made only when something is said */
      char at[64], missing[512] = "";
      int n_missing = 0;
      where_text(c, at, sizeof at);
      if (c->rank == 0) missing_ranks(c, missing, sizeof missing, &n_missing);
      if (hook_due) {
        c->wait_hook(c->wait_ctx, what, c->step, waited, missing);
        hooked = 1;
        hook_at = waited + 0.5;
      }
      if (warn_due) {
        warned = 1;
        if (c->rank == 0 && n_missing)
          fprintf(stderr,
                  "ddp_train: warning: %s %s: waiting %.0f s for rank(s) %s (deadline dist.timeout_s = %.0f s)\n", what,
                  at, waited, missing, c->timeout_s);
        fflush(stderr);
      }
      if (late) {
        if (c->rank == 0 && n_missing)
          fprintf(stderr,
                  "ddp_train: error: %s %s did not complete within dist.timeout_s = %.0f s: rank(s) %s never "
                  "arrived (%d of %d); aborting the job\n",
                  what, at, c->timeout_s, missing, n_missing, c->size);
        else
          fprintf(stderr,
                  "ddp_train: error: rank %d: %s %s did not complete within dist.timeout_s = %.0f s; aborting "
                  "the job\n",
                  c->rank, what, at, c->timeout_s);
        fflush(stderr);
        comm_abort(c, DT_EXIT_PEER);
      }
    }
    if (++spins > 100) usleep(spins > 1000 ? 1000 : 50);
  }
  /* every rank sent its arrival before joining, so these complete */
  if (c->rank == 0) MPI_CHECK(MPI_Waitall(c->size - 1, c->arrive_req + 1, MPI_STATUSES_IGNORE));
  if (hooked) c->wait_hook(c->wait_ctx, NULL, c->step, 0, "");
}

/* The lowest failing rank prints its message once, naming itself when not every rank failed. */
static void print_failure(const dt_comm *c, int first, int failed, const dt_status *st) {
  if (first != c->rank) return;
  if (failed == c->size || c->size == 1)
    fprintf(stderr, "ddp_train: error: %s\n", st->msg);
  else
    fprintf(stderr, "ddp_train: error: on rank %d (%d of %d ranks failed): %s\n", c->rank, failed, c->size, st->msg);
  fflush(stderr);
}

int comm_agree(dt_comm *c, const dt_status *st) {
  int *codes = dt_calloc((size_t)c->size, sizeof(int));
  int mine = st->code;
  MPI_Request req;
  MPI_CHECK(MPI_Iallgather(&mine, 1, MPI_INT, codes, 1, MPI_INT, c->world, &req));
  comm_wait(c, &req, 1, "status agreement");
  int first = -1, failed = 0;
  for (int r = 0; r < c->size; r++)
    if (codes[r]) {
      if (first < 0) first = r;
      failed++;
    }
  int code = first >= 0 ? codes[first] : 0;
  print_failure(c, first, failed, st);
  free(codes);
  return code;
}

int comm_check_same(dt_comm *c, uint64_t hash, const char *what, dt_status *st) {
  unsigned long long *all = dt_calloc((size_t)c->size, sizeof *all);
  unsigned long long mine = hash;
  MPI_Request req;
  MPI_CHECK(MPI_Iallgather(&mine, 1, MPI_UNSIGNED_LONG_LONG, all, 1, MPI_UNSIGNED_LONG_LONG, c->world, &req));
  comm_wait(c, &req, 1, "config check");
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
    MPI_Request req;
    MPI_CHECK(MPI_Ibcast(p, chunk, MPI_BYTE, root, c->world, &req));
    comm_wait(c, &req, 1, "broadcast");
    p += chunk;
    bytes -= (size_t)chunk;
  }
}

void comm_gather_text(dt_comm *c, const char *text, size_t cap, char *all) {
  char *mine = dt_calloc(cap, 1);
  dt_strlcpy(mine, text, cap);
  MPI_Request req;
  MPI_CHECK(MPI_Igather(mine, (int)cap, MPI_CHAR, all, (int)cap, MPI_CHAR, 0, c->world, &req));
  comm_wait(c, &req, 1, "gather");
  free(mine);
}

void comm_allgather_text(dt_comm *c, const char *text, size_t cap, char *all) {
  char *mine = dt_calloc(cap, 1);
  dt_strlcpy(mine, text, cap);
  MPI_Request req;
  MPI_CHECK(MPI_Iallgather(mine, (int)cap, MPI_CHAR, all, (int)cap, MPI_CHAR, c->world, &req));
  comm_wait(c, &req, 1, "all-gather");
  free(mine);
}

void comm_gather_f64(dt_comm *c, const double *mine, int n, double *all) {
  MPI_Request req;
  MPI_CHECK(MPI_Igather(mine, n, MPI_DOUBLE, all, n, MPI_DOUBLE, 0, c->world, &req));
  comm_wait(c, &req, 1, "gather");
}

void comm_gather_rows(dt_comm *c, const float *mine, int64_t n_mine, int64_t width, float *all) {
  int *counts = dt_calloc((size_t)c->size, sizeof(int)), *displs = dt_calloc((size_t)c->size, sizeof(int));
  DT_ASSERT(n_mine * width <= 2147483647); /* callers keep the whole under MPI's int counts */
  int count = (int)(n_mine * width);
  MPI_Request req;
  MPI_CHECK(MPI_Igather(&count, 1, MPI_INT, counts, 1, MPI_INT, 0, c->world, &req));
  comm_wait(c, &req, 1, "gather of row counts");
  for (int r = 1; r < c->size; r++) displs[r] = displs[r - 1] + counts[r - 1];
  MPI_CHECK(MPI_Igatherv(mine, count, MPI_FLOAT, all, counts, displs, MPI_FLOAT, 0, c->world, &req));
  comm_wait(c, &req, 1, "gather of rows");
  free(counts);
  free(displs);
}

void comm_allgather_f64(dt_comm *c, double mine, double *all, const char *what) {
  MPI_Request req;
  MPI_CHECK(MPI_Iallgather(&mine, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, c->world, &req));
  comm_wait(c, &req, 1, what);
}

void comm_allreduce_sum_f64(dt_comm *c, double *data, int n, const char *what) {
  if (c->size == 1) return;
  MPI_Request req;
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data, n, MPI_DOUBLE, MPI_SUM, c->world, &req));
  comm_wait(c, &req, 1, what);
}

int comm_min_i32(dt_comm *c, int mine, const char *what) {
  if (c->size == 1) return mine;
  int32_t v = mine;
  MPI_Request req;
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, &v, 1, MPI_INT32_T, MPI_MIN, c->world, &req));
  comm_wait(c, &req, 1, what);
  return v;
}

int comm_step_agree(dt_comm *c, const dt_step_report *mine, const dt_status *st, dt_step_report *out) {
  dt_step_report *all = dt_calloc((size_t)c->size, sizeof *all);
  MPI_Request req;
  MPI_CHECK(MPI_Iallgather(mine, (int)sizeof *mine, MPI_BYTE, all, (int)sizeof *mine, MPI_BYTE, c->world, &req));
  comm_wait(c, &req, 1, "step agreement");
  memset(out, 0, sizeof *out);
  int first = -1, failed = 0;
  for (int r = 0; r < c->size; r++) {
    out->loss_sum += all[r].loss_sum;
    out->correct += all[r].correct;
    if (all[r].stop && !out->stop) out->stop = all[r].stop;
    if (all[r].checkpoint) out->checkpoint = 1;
    if (all[r].code) {
      if (first < 0) first = r;
      failed++;
    }
  }
  int code = first >= 0 ? all[first].code : 0;
  out->code = code;
  print_failure(c, first, failed, st);
  free(all);
  return code;
}

void comm_isum_f32(dt_comm *c, float *buf, int64_t count, dt_comm_request *req) {
  DT_ASSERT(count <= 0x7fffffff);
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, c->world, req));
}

void comm_ireduce_f32(dt_comm *c, float *buf, int64_t count, int root, dt_comm_request *req) {
  DT_ASSERT(count <= 0x7fffffff && root >= 0 && root < c->size);
  if (c->rank == root)
    MPI_CHECK(MPI_Ireduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, root, c->world, req));
  else
    MPI_CHECK(MPI_Ireduce(buf, NULL, (int)count, MPI_FLOAT, MPI_SUM, root, c->world, req));
}

void comm_allgather_slices_f32(dt_comm *c, float *buf, const int64_t *lo, const char *what) {
  DT_ASSERT(lo[c->size] <= 0x7fffffff);
  if (c->size == 1) return;
  int *counts = dt_malloc((size_t)c->size * sizeof(int)), *displs = dt_malloc((size_t)c->size * sizeof(int));
  for (int r = 0; r < c->size; r++) counts[r] = (int)(lo[r + 1] - lo[r]), displs[r] = (int)lo[r];
  MPI_Request req;
  MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs, MPI_FLOAT, c->world, &req));
  comm_wait(c, &req, 1, what);
  free(counts);
  free(displs);
}

void comm_progress(dt_comm_request *req) {
  int done = 0;
  if (*req != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
}

void comm_abort(dt_comm *c, int code) {
  MPI_Abort(c->world, code);
  abort(); /* MPI_Abort does not return; if it did, the job still ends */
}
