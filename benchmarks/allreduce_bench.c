/* allreduce_bench: the time of a float-sum all-reduce over MPI_COMM_WORLD for message sizes from
 * 4 B to 64 MiB (powers of two), and a least-squares fit t(n) = alpha + beta * n per operation, written
 * as JSON for scripts/scaling.py (its `measured` link preset). Two operations are timed:
 *   allreduce   MPI_Allreduce (Open MPI's tuned component picks the algorithm by size and ranks)
 *   iallreduce  MPI_Iallreduce(MPI_IN_PLACE) then MPI_Wait: what the gradient buckets (src/ddp.c) do with
 *               each gradient bucket (Open MPI's libnbc: binomial reduce + broadcast for in-place)
 * A sample is `reps` back-to-back operations timed together, divided by reps; each rank's sample is
 * reduced to the slowest rank's; the figure per size is the median of the samples.
 *
 * The fits weight each size by 1/t^2 (least squares on the relative error), so small sizes set alpha
 * and large sizes set beta instead of the largest size deciding both. One line over every size is
 * reported (alpha_s, beta_s_per_byte), but MPI over shared memory changes protocol with the size
 * (eager copies below a few KiB, single-copy rendezvous above, another algorithm past a threshold)
 * and slows past the last-level cache, so no one line fits within tens of percent. The model uses
 * `segments`: the fewest consecutive size ranges (at least 3 sizes each, at most 6 ranges) whose
 * own alpha-beta lines are all within --tolerance (10%) of every size in them, the way NCCL keeps
 * an alpha and a beta per protocol.
 *
 * host_sleep_s: the median length of usleep(50) here. ddp_train's waits (comm_wait in
 * src/comm.c, wait_step in src/train_step.c) poll, then sleep 50 us between polls: scripts/scaling.py
 * charges the waits for it.
 *
 *   mpirun -np 2 build/allreduce_bench [--out FILE] [--max-bytes N] [--budget-s S] [--samples K]
 *                                      [--tolerance R] [--ops allreduce,iallreduce]
 *
 * Output: FILE (default: stdout) gets {"ranks", "nodes", "local_size", "host", "samples",
 * "host_sleep_s", "ops": {name: {"alpha_s", "beta_s_per_byte", "segments": [{"from_bytes",
 * "to_bytes", "alpha_s", "beta_s_per_byte", "max_rel_err"}, ...], "sizes": [{"bytes", "median_s"},
 * ...]}}}. Exit 1 on a bad argument or an unwritable file, 3 on an MPI failure. */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MPI_CHECK(call)                                                                              \
  do {                                                                                               \
    int rc_ = (call);                                                                                \
    if (rc_ != MPI_SUCCESS) {                                                                        \
      char msg_[MPI_MAX_ERROR_STRING];                                                               \
      int len_ = 0;                                                                                  \
      MPI_Error_string(rc_, msg_, &len_);                                                            \
      fprintf(stderr, "allreduce_bench: %s failed at %s:%d: %s\n", #call, __FILE__, __LINE__, msg_); \
      MPI_Abort(MPI_COMM_WORLD, 3);                                                                  \
    }                                                                                                \
  } while (0)

enum { OP_ALLREDUCE, OP_IALLREDUCE, N_OPS };
static const char *const op_names[N_OPS] = {"allreduce", "iallreduce"};
enum { MAX_SIZES = 64 };

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "allreduce_bench: out of memory allocating %zu bytes\n", bytes);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  return p;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void run_op(int op, float *buf, int count, int reps) {
  for (int r = 0; r < reps; r++) {
    if (op == OP_ALLREDUCE) {
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD));
    } else {
      MPI_Request req;
      MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req));
      MPI_CHECK(MPI_Wait(&req, MPI_STATUS_IGNORE));
    }
  }
}

/* Median seconds per operation of count floats: samples of reps operations each, the slowest
 * rank's time. reps is chosen (the same on every rank) so a sample lasts about budget_s / samples. */
static double time_op(int op, float *buf, int count, int samples, double budget_s) {
  MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  double t0 = MPI_Wtime();
  run_op(op, buf, count, 2); /* warm-up, and a first estimate */
  double est = (MPI_Wtime() - t0) / 2;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &est, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  int reps = (int)(budget_s / samples / (est > 1e-9 ? est : 1e-9));
  if (reps < 1) reps = 1;
  if (reps > 10000) reps = 10000;
  double *t = xmalloc((size_t)samples * sizeof(double));
  for (int s = 0; s < samples; s++) {
    MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
    double a = MPI_Wtime();
    run_op(op, buf, count, reps);
    t[s] = (MPI_Wtime() - a) / reps;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &t[s], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  }
  qsort(t, (size_t)samples, sizeof(double), cmp_double);
  double med = samples % 2 ? t[samples / 2] : 0.5 * (t[samples / 2 - 1] + t[samples / 2]);
  free(t);
  return med;
}

/* Weighted least squares of t = alpha + beta * n over n[0..k) with weights 1/t^2; beta is kept at
 * least 0 (a flat range fits a constant). Returns the largest relative error of the line. */
static double fit(const double *n, const double *t, int k, double *alpha, double *beta) {
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (int i = 0; i < k; i++) {
    double w = 1.0 / (t[i] * t[i]);
    sw += w, sx += w * n[i], sy += w * t[i], sxx += w * n[i] * n[i], sxy += w * n[i] * t[i];
  }
  double det = sw * sxx - sx * sx;
  *beta = det > 0 ? (sw * sxy - sx * sy) / det : 0;
  if (*beta < 0) *beta = 0;
  *alpha = (sy - *beta * sx) / sw;
  double worst = 0;
  for (int i = 0; i < k; i++) {
    double e = fabs(*alpha + *beta * n[i] - t[i]) / t[i];
    if (e > worst) worst = e;
  }
  return worst;
}

/* The fewest consecutive ranges of n[0..k) (each of at least MIN_SEG sizes, at most MAX_SEGMENTS)
 * whose own lines all fit within tol, the largest error minimised among those (dynamic programming
 * over the range starts); the best MAX_SEGMENTS ranges when none fits. lo gets each range's first
 * index; returns their count. */
enum { MIN_SEG = 3, MAX_SEGMENTS = 6 };
static int segment(const double *n, const double *t, int k, double tol, int *lo) {
  if (k < 2 * MIN_SEG) {
    lo[0] = 0;
    return 1;
  }
  double(*cost)[MAX_SIZES + 1] = calloc(MAX_SIZES, sizeof *cost); /* cost[i][j]: worst error of [i, j) */
  double best[MAX_SEGMENTS + 1][MAX_SIZES + 1];
  int from[MAX_SEGMENTS + 1][MAX_SIZES + 1];
  if (!cost) {
    fprintf(stderr, "allreduce_bench: out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  for (int i = 0; i < k; i++)
    for (int j = i + MIN_SEG; j <= k; j++) {
      double a, b;
      cost[i][j] = fit(n + i, t + i, j - i, &a, &b);
    }
  int segs = MAX_SEGMENTS;
  for (int g = 1; g <= MAX_SEGMENTS; g++) {
    for (int j = 0; j <= k; j++) {
      best[g][j] = INFINITY;
      from[g][j] = -1;
      if (g == 1) {
        if (j >= MIN_SEG) best[g][j] = cost[0][j], from[g][j] = 0;
        continue;
      }
      for (int i = MIN_SEG * (g - 1); i + MIN_SEG <= j; i++) {
        double c = fmax(best[g - 1][i], cost[i][j]);
        if (c < best[g][j]) best[g][j] = c, from[g][j] = i;
      }
    }
    if (best[g][k] <= tol) {
      segs = g;
      break;
    }
  }
  while (segs > 1 && !isfinite(best[segs][k])) segs--; /* too few sizes for that many */
  for (int g = segs, j = k; g >= 1; g--) {
    lo[g - 1] = from[g][j];
    j = from[g][j];
  }
  free(cost);
  return segs;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double host_sleep_s(void) {
  double t[101];
  for (int i = 0; i < 101; i++) {
    double a = now_s();
    usleep(50);
    t[i] = now_s() - a;
  }
  qsort(t, 101, sizeof(double), cmp_double);
  return t[50];
}

static void usage(void) {
  fprintf(stderr,
          "usage: allreduce_bench [--out FILE] [--max-bytes N] [--budget-s S] [--samples K] [--tolerance R]\n"
          "                       [--ops allreduce,iallreduce]\n");
}

int main(int argc, char **argv) {
  MPI_CHECK(MPI_Init(&argc, &argv));
  int rank, size, local_size;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_size(node, &local_size));
  int node_leader = 0, nodes = 0, node_rank;
  MPI_CHECK(MPI_Comm_rank(node, &node_rank));
  node_leader = node_rank == 0;
  MPI_CHECK(MPI_Allreduce(&node_leader, &nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  MPI_CHECK(MPI_Comm_free(&node));

  const char *out = NULL;
  long long max_bytes = 64ll << 20;
  double budget_s = 0.25; /* per size and operation */
  int samples = 15;
  double tol = 0.1; /* a segment's line within 10% of each of its sizes */
  int use[N_OPS] = {1, 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    char *end = NULL;
    if (!strcmp(a, "--out") && v) {
      out = v, i++;
    } else if (!strcmp(a, "--max-bytes") && v) {
      max_bytes = strtoll(v, &end, 10), i++;
      if (*end || max_bytes < 4 || max_bytes > (1ll << 32)) goto bad;
    } else if (!strcmp(a, "--budget-s") && v) {
      budget_s = strtod(v, &end), i++;
      if (*end || !(budget_s > 0)) goto bad;
    } else if (!strcmp(a, "--tolerance") && v) {
      tol = strtod(v, &end), i++;
      if (*end || !(tol > 0)) goto bad;
    } else if (!strcmp(a, "--ops") && v) { /* a comma-separated subset of op_names */
      i++;
      for (int op = 0; op < N_OPS; op++) use[op] = 0;
      for (const char *p = v; *p;) {
        size_t len = strcspn(p, ",");
        int found = 0;
        for (int op = 0; op < N_OPS; op++)
          if (strlen(op_names[op]) == len && !strncmp(p, op_names[op], len)) use[op] = found = 1;
        if (!found) goto bad;
        p += len + (p[len] == ',');
      }
    } else if (!strcmp(a, "--samples") && v) {
      samples = (int)strtol(v, &end, 10), i++;
      if (*end || samples < 1 || samples > 1000) goto bad;
    } else {
      goto bad;
    }
    continue;
  bad:
    if (rank == 0) usage();
    MPI_Finalize();
    return 1;
  }

  double bytes[MAX_SIZES], med[N_OPS][MAX_SIZES];
  int k = 0;
  for (long long b = 4; b <= max_bytes && k < MAX_SIZES; b *= 2) bytes[k++] = (double)b;
  float *buf = xmalloc((size_t)bytes[k - 1]);
  for (size_t i = 0; i < (size_t)bytes[k - 1] / sizeof(float); i++) buf[i] = 0.0f; /* sums stay 0: no overflow */
  for (int op = 0; op < N_OPS; op++)
    for (int i = 0; i < k && use[op]; i++) {
      med[op][i] = time_op(op, buf, (int)(bytes[i] / sizeof(float)), samples, budget_s);
      if (rank == 0) fprintf(stderr, "%-10s %10.0f B  %12.3f us\n", op_names[op], bytes[i], med[op][i] * 1e6);
    }
  free(buf);
  double sleep_s = host_sleep_s();

  if (rank == 0) {
    FILE *f = out ? fopen(out, "w") : stdout;
    if (!f) {
      perror(out);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    char host[MPI_MAX_PROCESSOR_NAME] = "";
    int hl = 0;
    MPI_CHECK(MPI_Get_processor_name(host, &hl));
    fprintf(f,
            "{\"ranks\": %d, \"nodes\": %d, \"local_size\": %d, \"host\": \"%s\", \"samples\": %d, "
            "\"host_sleep_s\": %.6e, \"ops\": {",
            size, nodes, local_size, host, samples, sleep_s);
    for (int op = 0, first = 1; op < N_OPS; op++) {
      if (!use[op]) continue;
      double alpha, beta;
      fit(bytes, med[op], k, &alpha, &beta);
      fprintf(f, "%s\"%s\": {\"alpha_s\": %.6e, \"beta_s_per_byte\": %.6e, \"segments\": [", first ? "" : ", ",
              op_names[op], alpha, beta);
      first = 0;
      int lo[MAX_SEGMENTS], n_seg = segment(bytes, med[op], k, tol, lo);
      for (int g = 0; g < n_seg; g++) {
        int hi = g + 1 < n_seg ? lo[g + 1] : k;
        double a, b, err = fit(bytes + lo[g], med[op] + lo[g], hi - lo[g], &a, &b);
        fprintf(f,
                "%s{\"from_bytes\": %.0f, \"to_bytes\": %.0f, \"alpha_s\": %.6e, \"beta_s_per_byte\": %.6e, "
                "\"max_rel_err\": %.4f}",
                g ? ", " : "", bytes[lo[g]], bytes[hi - 1], a, b, err);
      }
      fprintf(f, "], \"sizes\": [");
      for (int i = 0; i < k; i++)
        fprintf(f, "%s{\"bytes\": %.0f, \"median_s\": %.6e}", i ? ", " : "", bytes[i], med[op][i]);
      fprintf(f, "]}");
    }
    fprintf(f, "}}\n");
    if (f != stdout && fclose(f)) {
      perror(out);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  MPI_CHECK(MPI_Finalize());
  return 0;
}
