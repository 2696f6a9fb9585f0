#include "train.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu.h"
#include "layers.h"
#include "log.h"
#include "ema.h"
#include "optim.h"
#include "signals.h"

typedef struct {
  dt_comm *comm;
  dt_grad_sync *gs;
  const dt_device_reduce *dev; /* NULL: sums through MPI */
  dt_backend *be;
  float *grads;
  double *grad_check; /* (2) backend memory: sum of squares and non-finite count of the sent buckets */
  /* the last micro-batch's backward, for metrics.jsonl (host clock: meaningful where the backend
   * runs its work as it is called, the CPU's) */
  double t_backward;   /* dt_now() when it began */
  double hook_s;       /* seconds in grad_sync_ready since: the buckets' checks and MPI calls */
  double check_s;      /* of which in the checks (ctx_check): compute */
  double *ready_s;     /* (n_buckets) seconds from t_backward until bucket i was started */
  double *ready_mpi_s; /* (n_buckets) seconds of MPI calls (hook_s - check_s) before that */
} pass_ctx;

enum { STATS = 6 };
enum { max_logged_buckets = 1024 }; /* metrics.jsonl lists each bucket's timing up to this many */
/* fp16 loss scaling, PyTorch GradScaler's defaults */
static const double scale_init = 65536.0, scale_growth = 2.0, scale_backoff = 0.5;
static const int64_t scale_interval = 2000;

/* Synchronised batchnorm's sums (backend memory): queued on the device with NCCL, directly over
 * MPI on the CPU, through host memory otherwise. */
static void ctx_allreduce(void *ctx, double *data, int n) {
  pass_ctx *c = ctx;
  if (c->comm->size == 1) return; /* a sum over one rank: nothing to do, and nothing to wait for */
  if (c->dev) {
    c->dev->sum_f64(c->dev->ctx, data, n);
  } else if (c->be->host_memory) {
    comm_allreduce_sum_f64(c->comm, data, n, "batchnorm statistics allreduce");
  } else {
    double *host = dt_malloc((size_t)n * sizeof(double));
    c->be->to_host(c->be, host, data, (size_t)n * sizeof(double));
    comm_allreduce_sum_f64(c->comm, host, n, "batchnorm statistics allreduce");
    c->be->to_device(c->be, data, host, (size_t)n * sizeof(double));
    free(host);
  }
}

static void ctx_ready(void *ctx, int64_t from) {
  pass_ctx *c = ctx;
  const int before = c->gs->next;
  const double t0 = dt_now(), mpi_s = c->hook_s - c->check_s;
  grad_sync_ready(c->gs, from);
  for (int i = before; i < c->gs->next; i++) {
    c->ready_s[i] = t0 - c->t_backward;
    c->ready_mpi_s[i] = mpi_s;
  }
  c->hook_s += dt_now() - t0;
}

/* Non-finite gradients in [begin, end), counted before the range is sent. */
static void ctx_check(void *ctx, int64_t begin, int64_t end) {
  pass_ctx *c = ctx;
  dt_op op = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = end - begin, .x = c->grads + begin, .out = c->grad_check}};
  const double t0 = dt_now();
  backend_run(c->be, &op);
  c->check_s += dt_now() - t0;
}

/* One micro-batch on the device: the loader's rows, their labels or targets, and the dropout
 * seed. Backend memory for `cap` rows; filled by upload (queued). */
typedef struct {
  float *raw;      /* (cap, input) */
  int32_t *labels; /* (cap * labels per row) */
  float *targets;  /* (cap, outputs) */
  uint64_t *seed;  /* (1) */
  int32_t *rows;   /* (cap) data.cache device: the rows to gather, within the rank's cached rows */
} dev_batch;

static void dev_batch_alloc(dev_batch *db, const dt_model *m, int64_t cap) {
  dt_backend *be = m->be;
  db->raw = be->alloc(be, (size_t)(cap * shape_size(m->input)) * sizeof(float));
  db->labels = (int32_t *)be->alloc(be, (size_t)(cap * m->n_labels) * sizeof(int32_t));
  db->targets = be->alloc(be, (size_t)(cap * (m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1)) * sizeof(float));
  db->seed = (uint64_t *)be->alloc(be, sizeof(uint64_t));
  db->rows = (int32_t *)be->alloc(be, (size_t)cap * sizeof(int32_t));
}

static void dev_batch_free(dev_batch *db, dt_backend *be) {
  be->free(be, db->raw);
  be->free(be, db->labels);
  be->free(be, db->targets);
  be->free(be, db->seed);
  be->free(be, db->rows);
}

/* Queues the copy of a host batch (x; labels for cross_entropy, else targets) and its seed; with
 * data.cache device only its row numbers, gathered on the device by queue_gather. */
static void dev_batch_upload(dev_batch *db, const dt_model *m, const dt_batch *b, int device_cache, uint64_t seed,
                             int ahead) {
  dt_backend *be = m->be;
  void (*copy)(dt_backend *, void *, const void *, size_t) = ahead ? be->upload_ahead : be->upload;
  const int64_t rows = b->count;
  copy(be, db->seed, &seed, sizeof seed);
  if (device_cache) {
    copy(be, db->rows, b->rows, (size_t)rows * sizeof(int32_t));
    return;
  }
  copy(be, db->raw, b->x, (size_t)(rows * shape_size(m->input)) * sizeof(float));
  if (m->loss.kind == DT_LOSS_CROSS_ENTROPY)
    copy(be, db->labels, b->labels, (size_t)(rows * m->n_labels) * sizeof(int32_t));
  else
    copy(be, db->targets, b->targets, (size_t)(rows * m->n_outputs) * sizeof(float));
}

/* The targets of split rows idx[0..n) that ignore_index leaves in (a token model's). */
static double count_targets(const dt_split *s, const int64_t *idx, int64_t n, int64_t ignore) {
  double c = 0;
  for (int64_t i = 0; i < n; i++) {
    const int32_t *w = s->tokens + (idx[i] - s->lo) * s->tok_stride;
    for (int64_t j = 1; j <= s->row_elems; j++) c += w[j] != ignore;
  }
  return c;
}

/* Forward over this rank's validation rows with params and bufs (backend memory: the model's or
 * the EMA's); sums[0..1] get loss and hits (read once at the end); logits (rows, K) and labels are
 * kept when given (host). */
static void eval_rows(dt_model *m, const float *params, const float *bufs, dt_data *d, double *sums, float *logits,
                      int32_t *all_labels, dt_status *st) {
  dt_split *s = &d->val;
  dt_backend *be = m->be;
  int64_t rows = s->hi - s->lo, cap = m->max_batch;
  float *x = dt_malloc((size_t)(cap * shape_size(m->input)) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)(cap * m->n_labels) * sizeof(int32_t));
  float *targets = dt_malloc((size_t)(cap * (m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1)) * sizeof(float));
  int64_t *idx = dt_malloc((size_t)cap * sizeof(int64_t));
  dev_batch db;
  dev_batch_alloc(&db, m, cap);
  double *dev_sums = (double *)be->alloc(be, 2 * sizeof(double));
  dt_pass pass = {.be = be,
                  .training = 0,
                  .global_targets = 1,
                  .params = (float *)params,
                  .grads = m->grads,
                  .bufs = (float *)bufs};
  for (int64_t i = 0; i < rows && !st->code; i += cap) {
    int64_t n = rows - i < cap ? rows - i : cap;
    for (int64_t k = 0; k < n; k++) idx[k] = s->lo + i + k;
    if (data_gather(d, s, idx, n, x, labels, targets, st)) break;
    dt_batch hb = {.x = x, .labels = labels, .targets = targets, .count = n};
    dev_batch_upload(&db, m, &hb, 0, 0, 0);
    model_input(m, db.raw, n);
    pass.batch = n;
    model_forward(m, &pass);
    model_loss(m, &pass, db.labels, db.targets, dev_sums);
    if (logits) be->to_host(be, logits + i * m->n_outputs, model_logits(m), (size_t)(n * m->n_outputs) * sizeof(float));
    if (all_labels && s->y_k == 0)
      memcpy(all_labels + i * m->n_labels, labels, (size_t)(n * m->n_labels) * sizeof(int32_t));
  }
  double host[2];
  be->to_host(be, host, dev_sums, sizeof host);
  sums[0] += host[0];
  sums[1] += host[1];
  be->free(be, dev_sums);
  dev_batch_free(&db, be);
  free(x);
  free(labels);
  free(targets);
  free(idx);
}

void train_evaluate(const dt_config *cfg, dt_model *m, const float *params, const float *bufs, dt_data *d,
                    dt_comm *comm, double *loss, double *acc, dt_status *st) {
  (void)cfg;
  int64_t rows = d->val.hi - d->val.lo;
  double sums[3] = {0, 0, (double)(rows * m->n_labels)}; /* per target: a token model's are T per row */
  if (m->loss.ignore_index_set) {
    int64_t *idx = dt_malloc((size_t)(rows + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < rows; i++) idx[i] = d->val.lo + i;
    sums[2] = count_targets(&d->val, idx, rows, m->loss.ignore_index);
    free(idx);
  }
  eval_rows(m, params ? params : m->params, bufs ? bufs : m->bufs, d, sums, NULL, NULL, st);
  comm_allreduce_sum_f64(comm, sums, 3, "validation allreduce");
  *loss = sums[2] > 0 ? sums[0] / sums[2] : 0;
  *acc = m->loss.kind == DT_LOSS_CROSS_ENTROPY && sums[2] > 0 ? sums[1] / sums[2] : -1;
}

/* Collective at log steps: every rank's mean compute time per step into all (W). Returns the
 * slowest rank and fills min/max/median; prints a straggler line when W > 1. */
static void straggler_line(dt_comm *comm, dt_log *lg, double compute_ms, double *all, double *min_ms, double *max_ms,
                           int *slow) {
  int W = comm->size;
  double *sorted = dt_malloc((size_t)W * sizeof(double));
  comm_allgather_f64(comm, compute_ms, all, "straggler report");
  int lo = 0, hi = 0;
  for (int r = 0; r < W; r++) {
    if (all[r] < all[lo]) lo = r;
    if (all[r] > all[hi]) hi = r;
    sorted[r] = all[r];
  }
  for (int i = 1; i < W; i++) /* insertion sort: W values once per log line */
    for (int j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
      double t = sorted[j];
      sorted[j] = sorted[j - 1];
      sorted[j - 1] = t;
    }
  double median = W % 2 ? sorted[W / 2] : 0.5 * (sorted[W / 2 - 1] + sorted[W / 2]);
  *min_ms = all[lo];
  *max_ms = all[hi];
  *slow = median > 0 && all[hi] > 1.1 * median ? hi : -1;
  if (W > 1) {
    if (*slow >= 0)
      log_line(lg, "straggler: rank %d computes %.1f ms/step, %.0f%% over the median %.1f (fastest: rank %d, %.1f)", hi,
               all[hi], 100.0 * (all[hi] / median - 1.0), median, lo, all[lo]);
    else
      log_line(lg, "ranks: compute %.1f to %.1f ms/step (slowest rank %d, fastest rank %d)", all[lo], all[hi], hi, lo);
  }
  free(sorted);
}

int train_predict(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const char *path) {
  (void)cfg;
  dt_status st = {0};
  if (!d->has_val)
    dt_fail(&st, DT_EXIT_INPUT, "--predict: there is no validation split (data.val.x is empty)");
  else if ((double)d->val.n * (double)m->n_outputs > 2147483647.0) /* MPI's counts are ints */
    dt_fail(&st, DT_EXIT_INPUT,
            "--predict: %lld validation rows of %lld logits%s are more than 2^31 values; use fewer rows (data.val.x)",
            (long long)d->val.n, (long long)m->n_outputs, m->tokens ? " (T x vocab)" : "");
  int code = comm_agree(comm, &st);
  if (code) return code;
  int64_t rows = d->val.hi - d->val.lo, k = m->n_outputs, n = d->val.n, per = m->n_labels;
  float *logits = dt_malloc((size_t)(rows * k + 1) * sizeof(float));
  float *labels_f = dt_malloc((size_t)(rows * per + 1) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)(rows * per + 1) * sizeof(int32_t));
  double sums[2] = {0, 0};
  eval_rows(m, m->params, m->bufs, d, sums, logits, labels, &st);
  if ((code = comm_agree(comm, &st))) goto out;
  for (int64_t i = 0; i < rows * per; i++) labels_f[i] = (float)labels[i]; /* exact for class indices */
  float *all = comm->rank == 0 ? dt_malloc((size_t)(n * k + 1) * sizeof(float)) : NULL;
  float *all_labels = comm->rank == 0 ? dt_malloc((size_t)(n * per + 1) * sizeof(float)) : NULL;
  comm_gather_rows(comm, logits, rows, k, all);
  comm_gather_rows(comm, labels_f, rows, per, all_labels);
  if (comm->rank == 0) {
    int32_t *li = dt_malloc((size_t)(n * per + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < n * per; i++) li[i] = (int32_t)all_labels[i];
    /* a token model's targets are its data, shifted: only class labels are written */
    const int32_t *written = m->loss.kind == DT_LOSS_CROSS_ENTROPY && per == 1 ? li : NULL;
    if (!ckpt_write_predictions(path, all, written, n, k, &st))
      printf("wrote the logits of %lld validation rows to %s\n", (long long)n, path);
    free(li);
  }
  free(all);
  free(all_labels);
  code = comm_agree(comm, &st);
out:
  free(logits);
  free(labels_f);
  free(labels);
  return code;
}

static int cmp_desc(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x < y) - (x > y);
}

/* Draws a token from logits (V) at temperature among the top_k; u uniform in [0, 1). */
static int32_t sample_token(const float *logits, int64_t v, double temperature, int64_t top_k, double u,
                            float *scratch) {
  int64_t best = 0;
  for (int64_t i = 1; i < v; i++)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return (int32_t)best;
  float floor_logit = -INFINITY; /* logits below the k-th largest are left out */
  if (top_k > 0 && top_k < v) {
    memcpy(scratch, logits, (size_t)v * sizeof(float));
    qsort(scratch, (size_t)v, sizeof(float), cmp_desc);
    floor_logit = scratch[top_k - 1];
  }
  double total = 0;
  for (int64_t i = 0; i < v; i++)
    total += logits[i] >= floor_logit ? exp((logits[i] - logits[best]) / temperature) : 0.0;
  double target = u * total, run = 0;
  for (int64_t i = 0; i < v; i++) {
    if (logits[i] < floor_logit) continue;
    run += exp((logits[i] - logits[best]) / temperature);
    if (run > target) return (int32_t)i;
  }
  return (int32_t)best;
}

int train_sample(const dt_config *cfg, dt_model *m, dt_comm *comm, int64_t n, const char *prompt, double temperature,
                 int64_t top_k) {
  dt_status st = {0};
  const int64_t t = m->tokens, v = m->n_classes;
  const int bytes = v == 256;
  int64_t len = 0, cap = (int64_t)strlen(prompt) + n + 2;
  int32_t *ctx = dt_malloc((size_t)cap * sizeof(int32_t));
  int causal = 1; /* the context is padded after the prompt: only causal attention leaves that unseen */
  for (int i = 0; i < m->n_all; i++)
    if (m->all[i]->ops == &dt_layer_attention && !m->all[i]->args.causal) causal = 0;
  if (!t) {
    dt_fail(&st, DT_EXIT_INPUT, "--sample: the model is not a token model (its first layer is not an embedding)");
  } else if (!causal) {
    dt_fail(&st, DT_EXIT_INPUT,
            "--sample: the model has attention with causal: false, which sees the tokens after "
            "each position; sampling needs causal attention");
  } else if (bytes) {
    for (const unsigned char *p = (const unsigned char *)prompt; *p; p++) ctx[len++] = *p;
  } else {
    for (const char *p = prompt; *p && !st.code;) {
      char *end;
      long id = strtol(p, &end, 10);
      if (end == p) {
        if (*p == ' ' || *p == ',') {
          p++;
          continue;
        }
        dt_fail(&st, DT_EXIT_INPUT, "--prompt: with vocab %lld the prompt is token ids separated by spaces; got '%s'",
                (long long)v, prompt);
      } else if (id < 0 || id >= v) {
        dt_fail(&st, DT_EXIT_INPUT, "--prompt: token %ld is outside [0, %lld)", id, (long long)v);
      } else {
        ctx[len++] = (int32_t)id;
      }
      p = end == p ? p : end;
    }
  }
  int code = comm_agree(comm, &st);
  if (code) {
    free(ctx);
    return code;
  }
  if (len == 0) ctx[len++] = bytes ? '\n' : 0; /* an empty prompt starts a new line */
  dt_backend *be = m->be;
  float *x = dt_calloc((size_t)t, sizeof(float)), *logits = dt_malloc((size_t)v * sizeof(float));
  float *scratch = dt_malloc((size_t)v * sizeof(float));
  float *raw = be->alloc(be, (size_t)t * sizeof(float));
  dt_pass pass = {.be = be,
                  .batch = 1,
                  .training = 0,
                  .global_targets = 1,
                  .params = m->params,
                  .grads = m->grads,
                  .bufs = m->bufs};
  if (comm->rank == 0 && bytes) fwrite(prompt, 1, strlen(prompt), stdout);
  for (int64_t i = 0; i < n; i++) {
    /* the last T tokens, left-aligned: causal attention keeps the zero padding after them unseen */
    int64_t start = len > t ? len - t : 0, w = len - start;
    for (int64_t j = 0; j < t; j++) x[j] = j < w ? (float)ctx[start + j] : 0.0f;
    be->to_device(be, raw, x, (size_t)t * sizeof(float));
    model_input(m, raw, 1);
    model_forward(m, &pass);
    be->to_host(be, logits, model_logits(m) + (w - 1) * v, (size_t)v * sizeof(float));
    int32_t tok =
        sample_token(logits, v, temperature, top_k, dt_hash_uniform((uint64_t)cfg->v.seed, (uint64_t)i), scratch);
    ctx[len++] = tok;
    if (comm->rank == 0) {
      if (bytes)
        fputc(tok, stdout);
      else
        printf("%s%d", i ? " " : "", tok);
      fflush(stdout);
    }
  }
  if (comm->rank == 0) printf("\n");
  be->free(be, raw);
  free(x);
  free(logits);
  free(scratch);
  free(ctx);
  return comm_agree(comm, &st);
}

/* Collective at log steps on GPU runs: every rank's NVML reading, gathered by rank 0 into all
 * (W x DT_MON_GPU_FIELDS, for the monitor) and written into the metrics line as
 * "gpu": [{rank, mem_used_mib, mem_peak_mib, util_pct, power_w, temp_c}, ...]. */
static void gpu_metrics(dt_comm *comm, int gpu, double *peak, double *all, char *json, size_t cap) {
  dt_gpu_reading r;
  gpu_read(gpu, peak, &r);
  const double mine[DT_MON_GPU_FIELDS] = {[DT_MON_GPU_VALID] = r.valid,
                                          [DT_MON_GPU_INDEX] = gpu,
                                          [DT_MON_GPU_MEM_USED] = r.mem_used_mib,
                                          [DT_MON_GPU_MEM_PEAK] = r.mem_peak_mib,
                                          [DT_MON_GPU_UTIL] = r.util_pct,
                                          [DT_MON_GPU_POWER] = r.power_w,
                                          [DT_MON_GPU_TEMP] = r.temp_c};
  comm_gather_f64(comm, mine, DT_MON_GPU_FIELDS, all);
  json[0] = 0;
  if (comm->rank == 0) {
    size_t len = (size_t)snprintf(json, cap, ", \"gpu\": [");
    int any = 0;
    for (int k = 0; k < comm->size && len < cap; k++) {
      const double *x = all + (size_t)k * DT_MON_GPU_FIELDS;
      if (!x[DT_MON_GPU_VALID]) continue;
      len += (size_t)snprintf(json + len, cap - len,
                              "%s{\"rank\": %d, \"mem_used_mib\": %.0f, \"mem_peak_mib\": %.0f, \"util_pct\": %.0f, "
                              "\"power_w\": %.0f, \"temp_c\": %.0f}",
                              any++ ? ", " : "", k, x[DT_MON_GPU_MEM_USED], x[DT_MON_GPU_MEM_PEAK], x[DT_MON_GPU_UTIL],
                              x[DT_MON_GPU_POWER], x[DT_MON_GPU_TEMP]);
    }
    if (len < cap) snprintf(json + len, cap - len, "]");
    if (!any) json[0] = 0;
  }
}

static int lower_is_better(int metric) {
  return metric == DT_METRIC_VAL_LOSS || metric == DT_METRIC_EMA_VAL_LOSS;
}

static int improved(int metric, double value, double best) {
  return lower_is_better(metric) ? value < best : value > best;
}

static const char *metric_name(int metric) {
  static const char *const names[] = {"none", "val_loss", "val_acc", "ema_val_loss", "ema_val_acc"};
  return names[metric];
}

/* Everything a checkpoint needs, copied to the host (d's arrays are the trainer's scratch; the
 * EMA's only when there is one). */
static void snapshot(const dt_model *m, const dt_optim *o, const dt_ema *ema, const dt_train_state *ts,
                     dt_ckpt_data *d) {
  dt_backend *be = m->be;
  size_t pb = (size_t)m->n_params * sizeof(float), bb = (size_t)m->n_bufs * sizeof(float);
  be->to_host(be, d->params, m->params, pb);
  be->to_host(be, d->bufs, m->bufs, bb);
  if (ema->params) {
    be->to_host(be, d->ema_params, ema->params, pb);
    be->to_host(be, d->ema_bufs, ema->bufs, bb);
  }
  for (int k = 0; k < DT_OPTIM_MAX_STATES; k++) {
    d->opt[k] = k < o->n_states ? d->params + (k + 1) * m->n_params : NULL; /* the scratch has room after params */
    if (d->opt[k]) be->to_host(be, d->opt[k], o->states[k], pb);
  }
  d->ts = *ts;
  d->ts.optim_step = o->step;
}

/* Rank 0 writes a step checkpoint (or best.h5); all ranks agree on the outcome. */
static int save_checkpoint(const dt_config *cfg, const dt_model *m, const dt_optim *o, const dt_ema *ema,
                           const dt_train_state *ts, dt_comm *comm, dt_ckpt_data *scratch, int best, dt_log *lg) {
  dt_status st = {0};
  if (comm->rank == 0) {
    const dt_config_values *v = &cfg->v;
    snapshot(m, o, ema, ts, scratch);
    char path[1200];
    if (!log_mkdirs(v->ckpt_dir, &st)) {
      if (best) {
        snprintf(path, sizeof path, "%s/best.h5", v->ckpt_dir);
        if (!ckpt_write(path, m, scratch, cfg, &st)) log_line(lg, "saved %s (best so far)", path);
      } else if (!ckpt_save_step(v->ckpt_dir, v->ckpt_keep, m, scratch, cfg, path, sizeof path, &st)) {
        log_line(lg, "saved %s", path);
      }
    }
  }
  return comm_agree(comm, &st);
}

/* The loop's state: what train_run's steps share. Borrows the config, model, data, comm and
 * options; owns the sampler, optimizer, gradient sync, loader, log and checkpoint scratch. */
typedef struct {
  const dt_config *cfg;
  const dt_config_values *v;
  dt_model *m;
  dt_data *d;
  dt_comm *comm;
  const dt_train_opts *opts;
  dt_backend *be;
  dt_sampler smp;
  dt_optim opt;
  dt_ema ema; /* params NULL: train.ema is off */
  dt_grad_sync gs;
  pass_ctx ctx;
  dt_loader L;
  dt_log lg;
  dt_ckpt_data scratch; /* rank 0 with checkpoints: host copies for writing */
  dev_batch in[2];      /* micro-batches alternate between the two */
  int64_t micro_count;  /* micro-batches uploaded so far: in[micro_count % 2] is next */
  dev_batch *ahead;     /* the next step's batch, already uploaded (upload_ahead), or NULL */
  int64_t ahead_rows;
  dt_status ahead_st; /* why taking it failed: reported by the step that needed it */
  /* train.cuda_graph: a step of one micro-batch, captured once per input buffer and replayed */
  int graphs;                        /* steps may be captured */
  void *graph[2];                    /* the captured step reading in[i], or NULL */
  int64_t graph_gen[2];              /* be->generation when it was captured */
  int64_t graph_rows[2], warm_rows;  /* this rank's rows in that step, and in the last step run */
  double graph_count[2], warm_count; /* the global batch of each */
  int64_t captures, replays;
  /* this step's results, summed on the device and read once: loss, hits, the sum of squares and
   * the non-finite count of the gradient buckets this rank sent, and (fp16) the same of the summed
   * gradients after unscaling: a non-finite one skips the step */
  double *stats, *stats_host;  /* (STATS): backend memory, and host memory it is downloaded to */
  float *scaler, *scaler_host; /* train.precision fp16: (2) the loss scale and good steps; else NULL */
  int inject;                  /* this step's injected fault: DT_FAULT_NAN, DT_FAULT_OVERFLOW or none */
  double *clip_sq;             /* (2) backend memory: train.clip_grad_norm's sum of squares */
  /* data.cache device: the rank's training rows (as stored) and labels or targets, backend memory */
  void *cache_x;
  void *cache_y;
  dt_train_state ts;
  int64_t accum, opt_per_epoch, total; /* micro-batches per step, steps per epoch, steps in all */
  /* this optimizer step */
  int64_t epoch, os, micro0, k; /* epoch, step within it, its first micro-batch, micro-batches */
  double count;                 /* rows in its global batch */
  double targets;               /* targets in it the loss averages over: rows x labels per row, less ignore_index's */
  dt_sampler target_smp;        /* ignore_index: the sampler's twin for counting them (the loader's is its thread's) */
  double *loss_weight;          /* ignore_index: (1) backend memory, 1 / targets, uploaded each step */
  int64_t *target_idx;          /* (local rows cap) scratch for counting them */
  double lr;
  dt_step_report all; /* the ranks' summed report */
  /* the log window */
  double t_start, t_window, win_data, win_comm, win_loss;
  int64_t win_samples, win_steps, run_samples;
  /* its step timing (metrics.jsonl, CPU backend), summed: forward and loss, backward, the update
   * after the gradient wait, the step agreement, MPI calls inside the last backward; per bucket
   * (n_buckets) the time from that backward's start until it was started, and the MPI time before */
  double win_forward, win_backward, win_update, win_agree, win_backward_mpi;
  double *win_ready, *win_ready_mpi;
  char *bucket_json; /* (bucket_json_cap) the "buckets" member text */
  size_t bucket_json_cap;
  double gpu_peak_mib;
  int stop, stop_signal;
  int ckpt_asked; /* some rank asked for a checkpoint at this step (POST /checkpoint) */
  /* for the monitor: the state after the last step (rank 0 publishes it), every rank's compute
   * time and (GPU runs) NVML reading at the last log step */
  dt_monitor_snapshot snap;
  double *rank_compute_ms; /* (W) */
  double *gpu_all;         /* rank 0 on GPU runs: (W x DT_MON_GPU_FIELDS), else NULL */
  int64_t steps_run;
} dt_trainer;

/* Sampler, log, optimizer, gradient sync, resume state and loader. Returns the agreed code. */
static int trainer_start(dt_trainer *T, const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm,
                         const dt_train_opts *opts) {
  memset(T, 0, sizeof *T);
  const dt_config_values *v = &cfg->v;
  *T = (dt_trainer){.cfg = cfg, .v = v, .m = m, .d = d, .comm = comm, .opts = opts, .be = m->be};
  dt_status st = {0};
  const int W = comm->size, leader = comm->rank == 0;
  const int64_t G = config_global_batch(v, W);
  sampler_init(&T->smp, d->train.n, W, comm->rank, G, v->sharding == DT_SHARD_CONTIGUOUS, v->drop_last, v->shuffle,
               (uint64_t)v->seed);
  if (m->loss.ignore_index_set) {
    sampler_init(&T->target_smp, d->train.n, W, comm->rank, G, v->sharding == DT_SHARD_CONTIGUOUS, v->drop_last,
                 v->shuffle, (uint64_t)v->seed);
    T->target_idx = dt_malloc((size_t)(sampler_max_local(&T->target_smp) + 1) * sizeof(int64_t));
    T->loss_weight = (double *)T->be->alloc(T->be, sizeof(double));
  }
  if (v->sharding == DT_SHARD_CONTIGUOUS && G < W)
    dt_fail(&st, DT_EXIT_INPUT,
            "data.sharding contiguous: the global batch (%lld) must be at least the number of "
            "ranks (%d), or some ranks' rows would never be used",
            (long long)G, W);
  if (T->smp.steps == 0)
    dt_fail(&st, DT_EXIT_INPUT,
            "%s: the global batch (%lld) is larger than the %lld training rows and data.drop_last "
            "is true: no step to run",
            d->path, (long long)G, (long long)d->train.n);
  const char *no_graph = !T->be->capture_begin ? "it runs on the CPU backend (CUDA graphs need --device cuda)"
                         : v->grad_accum > 1   ? "train.grad_accum is above 1 (a captured step has one micro-batch)"
                         : !opts->dev && W > 1 ? "its gradients are summed over MPI through host memory (a captured "
                                                 "step needs NCCL, or a single rank)"
                                               : NULL;
  if (v->cuda_graph == DT_GRAPH_ON && no_graph)
    dt_fail(&st, DT_EXIT_INPUT,
            "train.cuda_graph is on, but this run cannot capture its step: %s; set it to auto or off", no_graph);
  T->graphs = v->cuda_graph != DT_GRAPH_OFF && !no_graph;
  T->warm_rows = -1;
  log_open(&T->lg, leader, v->log_dir, v->progress, opts->resume != NULL, &st);
  int code = comm_agree(comm, &st);
  if (code) {
    sampler_free(&T->smp);
    if (T->target_idx) sampler_free(&T->target_smp), free(T->target_idx), T->be->free(T->be, T->loss_weight);
    log_close(&T->lg);
    return code;
  }
  T->accum = v->grad_accum;
  T->opt_per_epoch = (T->smp.steps + T->accum - 1) / T->accum;
  T->total = T->opt_per_epoch * v->epochs;
  if (v->max_steps && v->max_steps < T->total) T->total = v->max_steps;

  dt_backend *be = T->be;
  optim_init(&T->opt, v, be, m->n_params, T->total);
  if (v->no_decay) { /* optim.no_decay: weight decay only on the other tensors */
    int64_t *off = dt_malloc((size_t)m->n_tensors * sizeof(int64_t)),
            *len = dt_malloc((size_t)m->n_tensors * sizeof(int64_t));
    int *decay = dt_malloc((size_t)m->n_tensors * sizeof(int));
    optim_set_runs(&T->opt, model_decay_runs(m, v->no_decay, off, len, decay), off, len, decay);
    free(off);
    free(len);
    free(decay);
  }
  T->stats = (double *)be->alloc(be, STATS * sizeof(double));
  T->stats_host = be->alloc_host(be, STATS * sizeof(double));
  if (v->precision == DT_PREC_FP16) {
    T->scaler = be->alloc(be, 2 * sizeof(float));
    T->scaler_host = be->alloc_host(be, 2 * sizeof(float));
    T->opt.skip = T->stats + 5;
  }
  T->clip_sq = (double *)be->alloc(be, 2 * sizeof(double));
  for (int i = 0; i < 2; i++) dev_batch_alloc(&T->in[i], m, m->max_batch);
  if (v->cache == DT_CACHE_DEVICE) { /* one copy, then only row numbers travel */
    const dt_split *s = &d->train;
    size_t xb = (size_t)(s->hi - s->lo) * (size_t)s->row_elems * s->x_elem;
    size_t yb = (size_t)(s->hi - s->lo) * (s->labels ? sizeof(int32_t) : (size_t)s->y_k * sizeof(float));
    T->cache_x = be->alloc(be, xb ? xb : 1);
    T->cache_y = be->alloc(be, yb ? yb : 1);
    be->to_device(be, T->cache_x, s->x, xb);
    be->to_device(be, T->cache_y, s->labels ? (const void *)s->labels : (const void *)s->targets, yb);
  }
  T->ctx =
      (pass_ctx){.comm = comm, .gs = &T->gs, .dev = opts->dev, .be = be, .grads = m->grads, .grad_check = T->stats + 2};
  grad_sync_init(&T->gs, comm, opts->dev, be, m->grads, m->n_params,
                 (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float)), ctx_check, &T->ctx);
  const size_t nb = (size_t)T->gs.n_buckets + 1;
  T->ctx.ready_s = dt_calloc(nb, sizeof(double));
  T->ctx.ready_mpi_s = dt_calloc(nb, sizeof(double));
  T->win_ready = dt_calloc(nb, sizeof(double));
  T->win_ready_mpi = dt_calloc(nb, sizeof(double));
  if (T->gs.n_buckets <= max_logged_buckets) { /* more: "buckets" is null */
    T->bucket_json_cap = nb * 96 + 32;
    T->bucket_json = dt_malloc(T->bucket_json_cap);
  }
  T->ts = (dt_train_state){.global_batch = G * T->accum,
                           .world_size = W,
                           .seed = (uint64_t)v->seed,
                           .optim = v->optim,
                           .best_metric = lower_is_better(v->early_metric) ? INFINITY : -INFINITY,
                           .best_val_acc = -1};
  if (opts->resume) {
    T->ts = opts->resume->ts;
    T->ts.world_size = W;
    if (!T->scaler) T->ts.loss_scale = T->ts.scale_growth = 0;
    size_t pb = (size_t)m->n_params * sizeof(float);
    for (int k = 0; k < T->opt.n_states; k++)
      if (opts->resume->opt[k]) be->to_device(be, T->opt.states[k], opts->resume->opt[k], pb);
    T->opt.step = T->ts.optim_step;
  }
  if (T->scaler) { /* a run that did not scale starts from GradScaler's initial scale */
    if (!(T->ts.loss_scale > 0)) T->ts.loss_scale = scale_init, T->ts.scale_growth = 0;
    float s[2] = {(float)T->ts.loss_scale, (float)T->ts.scale_growth};
    be->to_device(be, T->scaler, s, sizeof s);
  }
  if (v->ema_decay > 0) {
    ema_init(&T->ema, be, v->ema_decay, m->params, m->n_params, m->bufs, m->n_bufs);
    if (opts->resume && opts->resume->has_ema) {
      be->to_device(be, T->ema.params, opts->resume->ema_params, (size_t)m->n_params * sizeof(float));
      be->to_device(be, T->ema.bufs, opts->resume->ema_bufs, (size_t)m->n_bufs * sizeof(float));
    }
  }
  if (leader && v->ckpt_dir[0]) {
    T->scratch.params = dt_malloc((size_t)((1 + DT_OPTIM_MAX_STATES) * m->n_params + 1) * sizeof(float));
    T->scratch.bufs = dt_malloc((size_t)(m->n_bufs + 1) * sizeof(float));
    if (T->ema.params) {
      T->scratch.ema_params = dt_malloc((size_t)(m->n_params + 1) * sizeof(float));
      T->scratch.ema_bufs = dt_malloc((size_t)(m->n_bufs + 1) * sizeof(float));
    }
  }
  loader_start(&T->L, d, &T->smp, m, T->ts.epoch, T->ts.micro, v->epochs, T->cache_x != NULL);
  if (opts->resume)
    log_line(
        &T->lg, "resuming at step %lld (epoch %lld, batch %lld of %lld)%s", (long long)T->ts.step,
        (long long)T->ts.epoch + 1, (long long)T->ts.micro, (long long)T->smp.steps,
        T->ema.params && !opts->resume->has_ema ? "; the checkpoint has no EMA: it starts from these weights" : "");
  log_line(&T->lg,
           "training: %lld optimizer steps (%lld epochs x %lld), global batch %lld on %d rank%s, %s backend, "
           "%d thread%s per rank",
           (long long)T->total, (long long)v->epochs, (long long)T->opt_per_epoch, (long long)(G * T->accum), W,
           W > 1 ? "s" : "", be->name, be->threads, be->threads > 1 ? "s" : "");
  if (T->cache_x) {
    const dt_split *s = &d->train;
    log_line(&T->lg, "data.cache device: %lld training rows per rank in device memory (%.1f MiB as stored)",
             (long long)(s->hi - s->lo), (double)((s->hi - s->lo) * s->row_elems) * (double)s->x_elem / 1048576.0);
  }
  if (be->capture_begin)
    log_line(&T->lg, "cuda graph: %s",
             T->graphs                       ? "on (each full step after the first is replayed as one graph)"
             : v->cuda_graph == DT_GRAPH_OFF ? "off (train.cuda_graph off)"
             : v->grad_accum > 1             ? "off (train.grad_accum > 1)"
                                             : "off (gradients over MPI)");
  T->rank_compute_ms = dt_calloc((size_t)W, sizeof(double));
  if (opts->gpu >= 0 && leader) T->gpu_all = dt_calloc((size_t)W * DT_MON_GPU_FIELDS, sizeof(double));
  T->t_start = T->t_window = dt_now();
  if (T->ts.step >= T->total) T->stop = 1; /* nothing left: the final checkpoint is rewritten below */
  T->snap = (dt_monitor_snapshot){.step = T->ts.step, .total_steps = T->total, .epoch = T->ts.epoch + 1};
  monitor_publish(opts->monitor, &T->snap); /* the stall clock starts now */
  return 0;
}

/* data.cache device: the batch's rows, and their labels or targets, gathered from the cached
 * training split into db (part of a captured step). */
static void queue_gather(dt_trainer *T, const dev_batch *db, int64_t rows) {
  const dt_split *s = &T->d->train;
  dt_op x = {
      .type = DT_OP_GATHER,
      .p.gather = {
          .n = rows, .row = s->row_elems, .type = s->x_type, .src = T->cache_x, .idx = db->rows, .out = db->raw}};
  backend_run(T->be, &x);
  dt_op y = {.type = DT_OP_GATHER,
             .p.gather = {.n = rows,
                          .row = s->labels ? 1 : s->y_k,
                          .type = s->labels ? DT_GATHER_I32 : DT_GATHER_F32,
                          .src = T->cache_y,
                          .idx = db->rows,
                          .out = s->labels ? (void *)db->labels : (void *)db->targets}};
  backend_run(T->be, &y);
}

/* Queues one micro-batch's forward, loss and backward from db (rows rows): gradients accumulate
 * (zeroed with the step's sums before the first), and the last one's backward starts the bucket
 * sums. No host synchronisation: with one micro-batch a step is captured from here. */
static void queue_micro(dt_trainer *T, const dev_batch *db, int64_t rows, int first, int last) {
  dt_model *m = T->m;
  dt_backend *be = T->be;
  if (first) {
    be->zero(be, m->grads, (size_t)m->n_params * sizeof(float));
    be->zero(be, T->stats, STATS * sizeof(double));
    if (T->inject == DT_FAULT_OVERFLOW && m->n_params) { /* backward adds to it: it reaches the sums */
      const float inf = INFINITY;
      be->upload(be, m->grads, &inf, sizeof inf);
    }
  }
  if (T->cache_x) queue_gather(T, db, rows);
  if (T->inject == DT_FAULT_NAN && rows) { /* DDP_TRAIN_FAULT nan: into the batch on the device */
    const float nan = NAN;
    be->upload(be, db->raw, &nan, sizeof nan);
  }
  model_input(m, db->raw, rows);
  dt_pass pass = {.be = be,
                  .batch = rows,
                  .training = 1,
                  .global_targets = T->targets,
                  .loss_weight = T->loss_weight,
                  .grad_scale = T->scaler,
                  .step_seed = db->seed,
                  .params = m->params,
                  .grads = m->grads,
                  .bufs = m->bufs,
                  .allreduce_sum = ctx_allreduce,
                  .grads_ready = last ? ctx_ready : NULL,
                  .ctx = &T->ctx};
  const double t0 = dt_now();
  model_forward(m, &pass);
  model_loss(m, &pass, db->labels, db->targets, T->stats);
  const double t1 = dt_now();
  if (last) T->ctx.t_backward = t1, T->ctx.hook_s = T->ctx.check_s = 0;
  model_backward(m, &pass);
  const double t2 = dt_now();
  if (last) /* buckets no hook started are ready when backward ends (grad_sync_finish starts them) */
    for (int i = T->gs.next; i < T->gs.n_buckets; i++)
      T->ctx.ready_s[i] = t2 - t1, T->ctx.ready_mpi_s[i] = T->ctx.hook_s - T->ctx.check_s;
  T->win_forward += t1 - t0;
  T->win_backward += t2 - t1;
  if (last) T->win_backward_mpi += T->ctx.hook_s - T->ctx.check_s;
}

/* Queues the end of the step: the gradient sums finished (over MPI: waited for), clipping
 * (train.clip_grad_norm), the optimizer step with the values optim_prepare uploaded, the EMA. */
static void queue_update(dt_trainer *T) {
  const dt_config_values *v = T->v;
  dt_model *m = T->m;
  dt_backend *be = T->be;
  grad_sync_finish(&T->gs);
  const double t0 = dt_now();
  if (T->scaler) { /* the summed gradients unscaled, then checked: a non-finite one skips the update */
    dt_op un = {.type = DT_OP_UNSCALE, .p.unscale = {.n = m->n_params, .scaler = T->scaler, .x = m->grads}};
    backend_run(be, &un);
    dt_op check = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = m->n_params, .x = m->grads, .out = T->stats + 4}};
    backend_run(be, &check);
  }
  if (v->clip_grad_norm > 0) {
    be->zero(be, T->clip_sq, 2 * sizeof(double));
    dt_op sq = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = m->n_params, .x = m->grads, .out = T->clip_sq}};
    backend_run(be, &sq);
    dt_op clip = {
        .type = DT_OP_CLIP,
        .p.clip = {.n = m->n_params, .max_norm = (float)v->clip_grad_norm, .sumsq = T->clip_sq, .x = m->grads}};
    backend_run(be, &clip);
  }
  optim_apply(&T->opt, be, m->params, m->grads);
  if (T->ema.params) ema_update(&T->ema, be, m->params, m->bufs); /* every step, as timm's loop */
  if (T->scaler) {
    dt_op up = {.type = DT_OP_SCALER_UPDATE,
                .p.scaler_update = {.overflow = T->stats + 5,
                                    .growth_interval = scale_interval,
                                    .growth = (float)scale_growth,
                                    .backoff = (float)scale_backoff,
                                    .scaler = T->scaler}};
    backend_run(be, &up);
  }
  T->win_update += dt_now() - t0;
}

/* How a step of one micro-batch runs: replayed from the graph captured for this input buffer and
 * shape, when the backend has moved no buffer since; captured now when the step before had this
 * shape (the warm-up that sized every workspace) or a graph of it exists; else eagerly (an
 * injected fault is a one-off: never captured). NCCL requires a collective to be captured on
 * every rank or on none, and these conditions differ between ranks (a rank's rows, its buffers,
 * its faults): each rank says what it could do, and all do the least of those. */
enum { GRAPH_EAGER, GRAPH_CAPTURE, GRAPH_REPLAY };
static int graph_choice(dt_trainer *T, const dev_batch *db, int64_t rows) {
  if (!T->graphs) return GRAPH_EAGER;
  const int i = db ? (int)(db - T->in) : 0;
  const int same_shape = T->graph_rows[i] == rows && T->graph_count[i] == T->count;
  const int mine = !db || T->inject != DT_FAULT_NONE ? GRAPH_EAGER /* no batch: this rank fails the step */
                   : T->graph[i] && same_shape && T->graph_gen[i] == T->be->generation ? GRAPH_REPLAY
                   : rows == T->warm_rows && T->count == T->warm_count                 ? GRAPH_CAPTURE
                                                                                       : GRAPH_EAGER;
  return comm_min_i32(T->comm, mine, "the CUDA graph choice");
}

/* Queues a step of one micro-batch (db, rows): eagerly, captured or replayed (how: graph_choice). */
static void queue_single(dt_trainer *T, const dev_batch *db, int64_t rows, int how) {
  dt_backend *be = T->be;
  const int i = (int)(db - T->in);
  if (how == GRAPH_EAGER) {
    queue_micro(T, db, rows, 1, 1);
    queue_update(T);
  } else if (how == GRAPH_REPLAY) {
    be->replay(be, T->graph[i]);
    optim_advance(&T->opt);
    T->gs.wait_s = 0;
    T->replays++;
  } else {
    be->graph_free(be, T->graph[i]);
    T->graph_gen[i] = be->generation;
    be->capture_begin(be);
    queue_micro(T, db, rows, 1, 1);
    queue_update(T);
    T->graph[i] = be->capture_end(be);
    T->graph_rows[i] = rows;
    T->graph_count[i] = T->count;
    be->replay(be, T->graph[i]);
    T->captures++;
  }
  T->warm_rows = rows;
  T->warm_count = T->count;
}

/* Takes the next micro-batch from the loader and queues its upload (with its dropout seed, from
 * its place in the epoch) into the next device batch; ahead: overlapping the queued work, which
 * must not use that buffer. Returns it, or NULL with st set; with ahead, also NULL (st untouched)
 * while the loader still fills the training cache and the batch is not ready. */
static dev_batch *upload_next(dt_trainer *T, int ahead, int64_t *rows, double *data_s, dt_status *st) {
  double w0 = T->L.wait_s;
  dt_batch *b = loader_next(&T->L, ahead, st);
  if (!b) return NULL;
  *data_s += T->L.wait_s - w0;
  uint64_t seed = dt_hash64(((uint64_t)T->v->seed << 32) ^ (uint64_t)(b->epoch * T->smp.steps + b->step) ^
                            ((uint64_t)T->comm->rank << 52));
  dev_batch *db = &T->in[T->micro_count++ % 2];
  dev_batch_upload(db, T->m, b, T->cache_x != NULL, seed, ahead);
  *rows = b->count;
  return db;
}

/* The step's one host wait: its results downloaded, polling (a failed NCCL peer, the deadline)
 * while the device works. Before it, with one micro-batch per step and a step to follow, the next
 * batch is taken and copied ahead, overlapping this step: its buffer was last read by the step
 * before, which the host has waited for. */
static void wait_step(dt_trainer *T, double *data_s) {
  dt_backend *be = T->be;
  be->download(be, T->stats_host, T->stats, STATS * sizeof(double));
  if (T->scaler) be->download(be, T->scaler_host, T->scaler, 2 * sizeof(float));
  if (T->accum == 1 && !T->ahead && !T->ahead_st.code && T->ts.step + 1 < T->total)
    T->ahead = upload_next(T, 1, &T->ahead_rows, data_s, &T->ahead_st);
  double since = dt_now();
  while (!be->done(be)) {
    if (T->opts->dev)
      T->opts->dev->check(T->opts->dev->ctx, "the training step (forward, backward, NCCL gradient allreduce)", since);
    else if (dt_now() - since > T->comm->timeout_s) {
      fprintf(stderr,
              "ddp_train: error: rank %d: step %lld did not complete on the device within dist.timeout_s = "
              "%.0f s; aborting the job\n",
              T->comm->rank, (long long)T->ts.step + 1, T->comm->timeout_s);
      fflush(stderr);
      MPI_Abort(T->comm->world, DT_EXIT_PEER);
    }
    usleep(50);
  }
}

/* The step's work: every micro-batch uploaded and queued, then the update; the results read
 * once. Adds this rank's loss and hits to *mine. */
static void run_step(dt_trainer *T, dt_step_report *mine, double *data_s, dt_status *st) {
  T->inject = fault_fire(&T->opts->fault, T->comm->rank, T->ts.step + 1);
  T->lr = schedule_lr(T->v, T->ts.step, T->total);
  optim_prepare(&T->opt, T->be, T->lr);
  for (int64_t j = 0; j < T->k && !st->code; j++) {
    int64_t rows = T->ahead_rows;
    if (j == 0 && T->ahead_st.code) *st = T->ahead_st;
    dev_batch *db = st->code ? NULL : j == 0 && T->ahead ? T->ahead : upload_next(T, 0, &rows, data_s, st);
    T->ahead = NULL;
    if (T->k == 1) { /* a collective choice: made by a rank whose batch failed too */
      const int how = graph_choice(T, db, rows);
      if (db) queue_single(T, db, rows, how);
      break;
    }
    if (!db) break;
    queue_micro(T, db, rows, j == 0, j == T->k - 1);
  }
  if (st->code) return;
  if (T->k > 1) queue_update(T);
  wait_step(T, data_s);
  const double *r = T->stats_host;
  if (!isfinite(r[0]))
    dt_fail(st, DT_EXIT_NUMERIC,
            "the loss became %s at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm",
            isnan(r[0]) ? "NaN" : "infinite", (long long)T->ts.step + 1, (long long)T->epoch + 1);
  else if (r[3] > 0 && !T->scaler)
    dt_fail(st, DT_EXIT_NUMERIC,
            "%lld non-finite gradient values at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm",
            (long long)r[3], (long long)T->ts.step + 1, (long long)T->epoch + 1);
  if (T->scaler && !st->code) {
    if (r[5] > 0) { /* the same summed gradients on every rank: every rank skips */
      optim_skipped(&T->opt);
      log_line(&T->lg, "step %lld: %lld gradient values overflowed in fp16: update skipped, loss scale %g -> %g",
               (long long)T->ts.step + 1, (long long)r[5], T->ts.loss_scale, (double)T->scaler_host[0]);
    }
    T->ts.loss_scale = T->scaler_host[0];
    T->ts.scale_growth = T->scaler_host[1];
  }
  mine->loss_sum += r[0];
  mine->correct += r[1];
}

/* Every rank agrees on the outcome, the summed loss and whether to stop (a signal or the time
 * limit on any rank stops every rank at this same step), then the state advances. A failed
 * step ends the run without a checkpoint. Returns the agreed code. */
static int agree_and_advance(dt_trainer *T, dt_step_report *mine, dt_status *st) {
  int sig = signals_caught(), asked = monitor_take_requests(T->opts->monitor);
  int out_of_time = T->v->time_limit > 0 && dt_now() - T->opts->t_launch >= T->v->time_limit;
  mine->stop = sig ? sig : asked & DT_MON_STOP ? DT_STOP_HTTP : out_of_time ? DT_STOP_TIME_LIMIT : 0;
  mine->checkpoint = (asked & DT_MON_CHECKPOINT) != 0;
  mine->code = st->code;
  const double t0 = dt_now();
  int code = comm_step_agree(T->comm, mine, st, &T->all);
  T->win_agree += dt_now() - t0;
  if (code) return code;
  T->ts.step++;
  T->ts.micro = T->micro0 + T->k;
  T->ts.epoch = T->epoch;
  if (T->ts.micro >= T->smp.steps) T->ts.epoch = T->epoch + 1, T->ts.micro = 0;
  return 0;
}

/* The log window's step timing as metrics.jsonl members, means per step over its win_steps steps
 * of span seconds: the input of scripts/scaling.py. Host clock, so only where the backend works as
 * it is called (CPU). Writes the scalars into json (cap bytes); returns the "buckets" member (in
 * T->bucket_json, or a constant). */
static const char *timing_json_text(dt_trainer *T, double span, char *json, size_t cap) {
  const double n = (double)T->win_steps;
  const char *buckets = ", \"buckets\": null";
  if (T->bucket_json) { /* buckets[0] is the end of the gradient buffer: ready first */
    size_t len = (size_t)snprintf(T->bucket_json, T->bucket_json_cap, ", \"buckets\": [");
    for (int i = 0; i < T->gs.n_buckets && len < T->bucket_json_cap; i++)
      len += (size_t)snprintf(T->bucket_json + len, T->bucket_json_cap - len,
                              "%s{\"bytes\": %lld, \"ready_s\": %.6e, \"mpi_s\": %.6e}", i ? ", " : "",
                              (long long)((T->gs.buckets[i].end - T->gs.buckets[i].begin) * (int64_t)sizeof(float)),
                              T->win_ready[i] / n, T->win_ready_mpi[i] / n);
    if (len < T->bucket_json_cap) snprintf(T->bucket_json + len, T->bucket_json_cap - len, "]");
    buckets = T->bucket_json;
  }
  snprintf(json, cap,
           ", \"threads\": %d, \"grad_accum\": %lld, \"rank_batch\": %.2f, \"flops_per_sample\": %lld, "
           "\"step_s\": %.6e, \"data_s\": %.6e, \"forward_s\": %.6e, \"backward_s\": %.6e, \"backward_mpi_s\": %.6e, "
           "\"comm_wait_s\": %.6e, \"update_s\": %.6e, \"agree_s\": %.6e",
           T->be->threads, (long long)T->accum, (double)T->win_samples / n / (double)T->comm->size,
           (long long)model_flops(T->m), span / n, T->win_data / n, T->win_forward / n, T->win_backward / n,
           T->win_backward_mpi / n, T->win_comm / n, T->win_update / n, T->win_agree / n);
  return buckets;
}

/* The progress line every step; every log.every_steps the console and metrics lines, with the
 * straggler report and, on GPUs, each rank's NVML reading (collectives). */
static void log_step(dt_trainer *T, double data_s) {
  const dt_config_values *v = T->v;
  double loss = T->all.loss_sum / T->targets;
  T->win_loss += loss;
  T->win_steps++;
  T->win_samples += (int64_t)T->count;
  T->run_samples += (int64_t)T->count;
  T->win_data += data_s;
  T->win_comm += T->gs.wait_s;
  for (int i = 0; i < T->gs.n_buckets; i++) {
    T->win_ready[i] += T->ctx.ready_s[i];
    T->win_ready_mpi[i] += T->ctx.ready_mpi_s[i];
  }
  double now = dt_now();
  log_progress(&T->lg, T->ts.step, T->total, now - T->t_start, loss);
  char *notes = T->be->take_notes ? T->be->take_notes(T->be) : NULL; /* rank 0's, as its log has them */
  for (char *line = notes, *end; line && *line; line = end + 1) {
    end = strchr(line, '\n');
    if (end) *end = 0;
    log_line(&T->lg, "%s", line);
    if (!end) break;
  }
  free(notes);
  if (T->ts.step % v->log_every_steps != 0 && T->ts.step != T->total) return;
  double span = now - T->t_window, ms = 1e3 * span / (double)T->win_steps;
  double data_ms = 1e3 * T->win_data / (double)T->win_steps, comm_ms = 1e3 * T->win_comm / (double)T->win_steps;
  double sps = span > 0 ? (double)T->win_samples / span : 0, mean_loss = T->win_loss / (double)T->win_steps;
  double min_ms, max_ms;
  int slow;
  straggler_line(T->comm, &T->lg, ms - data_ms - comm_ms, T->rank_compute_ms, &min_ms, &max_ms, &slow);
  char gpu_json[8192] = "";
  if (T->m->tokens) /* a token model's throughput in tokens too */
    snprintf(gpu_json, sizeof gpu_json, ", \"tokens_per_s\": %.1f", sps * (double)T->m->tokens);
  if (T->opts->gpu >= 0) {
    size_t used = strlen(gpu_json);
    gpu_metrics(T->comm, T->opts->gpu, &T->gpu_peak_mib, T->gpu_all, gpu_json + used, sizeof gpu_json - used);
  }
  dt_monitor_snapshot *sn = &T->snap;
  sn->log_step = T->ts.step;
  sn->loss = mean_loss;
  sn->lr = T->lr;
  sn->samples_per_s = sps;
  sn->tokens_per_s = T->m->tokens ? sps * (double)T->m->tokens : 0;
  sn->step_ms = ms;
  sn->compute_ms = ms - data_ms - comm_ms;
  sn->data_ms = data_ms;
  sn->comm_ms = comm_ms;
  sn->straggler_rank = slow;
  sn->rank_compute_ms = T->rank_compute_ms;
  sn->gpu = T->gpu_all;
  log_line(&T->lg,
           "step %lld/%lld epoch %lld loss %.4f lr %.5f | %.0f samples/s | %.1f ms/step (compute %.1f, data %.1f, "
           "comm %.1f)",
           (long long)T->ts.step, (long long)T->total, (long long)T->epoch + 1, mean_loss, T->lr, sps, ms,
           ms - data_ms - comm_ms, data_ms, comm_ms);
  char timing_json[512] = "";
  const char *buckets = T->be->host_memory ? timing_json_text(T, span, timing_json, sizeof timing_json) : "";
  log_metrics(&T->lg,
              "\"step\": %lld, \"epoch\": %lld, \"loss\": %.6g, \"lr\": %.6g, \"samples_per_s\": %.1f, "
              "\"step_ms\": %.3f, \"compute_ms\": %.3f, \"data_ms\": %.3f, \"comm_ms\": %.3f, "
              "\"compute_ms_min\": %.3f, \"compute_ms_max\": %.3f, \"straggler_rank\": %d, \"world_size\": %d, "
              "\"local_size\": %d%s%s%s",
              (long long)T->ts.step, (long long)T->epoch + 1, mean_loss, T->lr, sps, ms, ms - data_ms - comm_ms,
              data_ms, comm_ms, min_ms, max_ms, slow, T->comm->size, T->comm->local_size, timing_json, buckets,
              gpu_json);
  T->t_window = now;
  T->win_loss = T->win_data = T->win_comm = 0;
  T->win_forward = T->win_backward = T->win_update = T->win_agree = T->win_backward_mpi = 0;
  memset(T->win_ready, 0, (size_t)T->gs.n_buckets * sizeof(double));
  memset(T->win_ready_mpi, 0, (size_t)T->gs.n_buckets * sizeof(double));
  T->win_samples = T->win_steps = 0;
}

/* Validates when due (end of epoch, train.eval_every_steps, the last step), logs, tracks the best
 * metric and early stopping. *new_best: this evaluation is the best so far. Returns the code. */
static int evaluate_if_due(dt_trainer *T, int end_of_epoch, dt_train_result *res, int *new_best) {
  const dt_config_values *v = T->v;
  dt_train_state *ts = &T->ts;
  *new_best = 0;
  int due = end_of_epoch || (v->eval_every_steps && ts->step % v->eval_every_steps == 0) || T->stop;
  if (!T->d->has_val || T->stop_signal || !due) return 0;
  loader_wait_filled(&T->L); /* HDF5 is the loader thread's while it fills the cache */
  dt_status st = {0};
  double vl, va, evl = 0, eva = -1, t_eval = dt_now();
  train_evaluate(T->cfg, T->m, NULL, NULL, T->d, T->comm, &vl, &va, &st);
  if (T->ema.params) train_evaluate(T->cfg, T->m, T->ema.params, T->ema.bufs, T->d, T->comm, &evl, &eva, &st);
  T->t_window += dt_now() - t_eval; /* throughput windows count training time only */
  int code = comm_agree(T->comm, &st);
  if (code) return code;
  res->final_val_loss = vl;
  res->final_val_acc = va;
  T->snap.val_step = ts->step;
  T->snap.val_loss = vl;
  T->snap.val_acc = va;
  T->snap.has_ema = T->ema.params != NULL;
  T->snap.ema_val_loss = evl;
  T->snap.ema_val_acc = eva;
  if (va > ts->best_val_acc) ts->best_val_acc = va;
  res->best_val_acc = ts->best_val_acc;
  long long step = (long long)ts->step, epoch = (long long)T->epoch + 1;
  char ema_text[128] = "", ema_json[128] = "";
  if (T->ema.params && va >= 0) {
    snprintf(ema_text, sizeof ema_text, " | ema_val_loss %.4f ema_val_acc %.4f", evl, eva);
    snprintf(ema_json, sizeof ema_json, ", \"ema_val_loss\": %.6g, \"ema_val_acc\": %.6g", evl, eva);
  } else if (T->ema.params) {
    snprintf(ema_text, sizeof ema_text, " | ema_val_mse %.6f", evl);
    snprintf(ema_json, sizeof ema_json, ", \"ema_val_loss\": %.6g", evl);
  }
  if (va >= 0) {
    log_line(&T->lg, "eval step %lld epoch %lld: val_loss %.4f val_acc %.4f%s", step, epoch, vl, va, ema_text);
    log_metrics(&T->lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g, \"val_acc\": %.6g%s", step, epoch, vl, va,
                ema_json);
  } else {
    log_line(&T->lg, "eval step %lld epoch %lld: val_mse %.6f%s", step, epoch, vl, ema_text);
    log_metrics(&T->lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g%s", step, epoch, vl, ema_json);
  }
  int metric = v->early_metric != DT_METRIC_NONE ? v->early_metric : va >= 0 ? DT_METRIC_VAL_ACC : DT_METRIC_VAL_LOSS;
  const double values[] = {0, vl, va, evl, eva};
  double value = values[metric];
  if (!isfinite(ts->best_metric) || improved(metric, value, ts->best_metric)) {
    ts->best_metric = value;
    ts->bad_evals = 0;
    *new_best = 1;
  } else if (v->early_metric != DT_METRIC_NONE && ++ts->bad_evals >= v->early_patience) {
    log_line(&T->lg, "early stopping: %s has not improved for %lld evaluations", metric_name(v->early_metric),
             (long long)ts->bad_evals);
    T->stop = 1;
  }
  return 0;
}

/* best.h5 on a new best (checkpoint.best), then a step checkpoint when periodic or last. */
static int checkpoint_if_due(dt_trainer *T, int end_of_epoch, int new_best) {
  const dt_config_values *v = T->v;
  if (!v->ckpt_dir[0]) return 0;
  int code = 0;
  int periodic = (v->ckpt_every_steps && T->ts.step % v->ckpt_every_steps == 0) ||
                 (end_of_epoch && v->ckpt_every_epochs && (T->epoch + 1) % v->ckpt_every_epochs == 0);
  int step_due = periodic || T->ckpt_asked || T->stop || T->ts.step == T->total;
  if ((new_best && v->ckpt_best) || step_due)
    loader_wait_filled(&T->L); /* HDF5 is the loader thread's while it fills the cache */
  if (new_best && v->ckpt_best &&
      (code = save_checkpoint(T->cfg, T->m, &T->opt, &T->ema, &T->ts, T->comm, &T->scratch, 1, &T->lg)))
    return code;
  if (step_due) {
    code = save_checkpoint(T->cfg, T->m, &T->opt, &T->ema, &T->ts, T->comm, &T->scratch, 0, &T->lg);
    if (!code) T->snap.ckpt_step = T->ts.step, T->snap.ckpt_time = dt_now();
  }
  return code;
}

/* model.loss ignore_index: the targets the step's global batch averages over, summed over ranks
 * (a collective; the sampler gives each rank its rows without reading them). At least 1. */
static double step_targets(dt_trainer *T) {
  double c = 0;
  for (int64_t j = 0; j < T->k; j++) {
    int64_t global, n = sampler_batch(&T->target_smp, T->epoch, T->micro0 + j, T->target_idx, &global);
    c += count_targets(&T->d->train, T->target_idx, n, T->m->loss.ignore_index);
  }
  comm_allreduce_sum_f64(T->comm, &c, 1, "target count");
  return c > 0 ? c : 1;
}

/* One optimizer step: micro-batches, reduce and agree, step, log, evaluate, checkpoint. */
static int train_step(dt_trainer *T, dt_train_result *res) {
  const dt_config_values *v = T->v;
  T->comm->step = T->ts.step + 1;
  T->micro0 = T->os * T->accum;
  T->k = T->smp.steps - T->micro0 < T->accum ? T->smp.steps - T->micro0 : T->accum;
  T->count = 0;
  for (int64_t j = 0; j < T->k; j++) T->count += (double)sampler_count(&T->smp, T->micro0 + j);
  T->targets = T->m->loss.ignore_index_set ? step_targets(T) : T->count * (double)T->m->n_labels;
  if (T->loss_weight) { /* queued before the step (a graph replay reads it) */
    const double w = 1.0 / T->targets;
    T->be->upload(T->be, T->loss_weight, &w, sizeof w);
  }
  dt_status st = {0};
  dt_step_report mine = {0};
  double data_s = 0;
  run_step(T, &mine, &data_s, &st);
  int code = agree_and_advance(T, &mine, &st);
  if (code) return code;
  log_step(T, data_s);
  if (T->all.stop) T->stop = 1, T->stop_signal = T->all.stop;
  T->ckpt_asked = T->all.checkpoint;
  if (T->ckpt_asked)
    log_line(&T->lg, "step %lld: a checkpoint was asked for (POST /checkpoint)", (long long)T->ts.step);
  int end_of_epoch = T->os == T->opt_per_epoch - 1, new_best;
  if (v->max_steps && T->ts.step >= v->max_steps) T->stop = 1;
  if ((code = evaluate_if_due(T, end_of_epoch, res, &new_best))) return code;
  code = checkpoint_if_due(T, end_of_epoch, new_best);
  T->steps_run++;
  T->snap.step = T->ts.step;
  T->snap.total_steps = T->total;
  T->snap.epoch = T->epoch + 1;
  T->snap.steps_run = T->steps_run;
  T->snap.train_s = dt_now() - T->t_start;
  monitor_publish(T->opts->monitor, &T->snap);
  return code;
}

/* The stop message (signal or time limit: exit 75) or the summary; frees the trainer. */
static int trainer_finish(dt_trainer *T, int code, dt_train_result *res) {
  loader_stop(&T->L);
  res->steps = T->ts.step;
  res->wall_s = dt_now() - T->t_start;
  if (!code && T->stop_signal) {
    if (T->comm->rank == 0) {
      int s = T->stop_signal;
      const char *why = s == SIGUSR1        ? "SIGUSR1"
                        : s == SIGTERM      ? "SIGTERM"
                        : s == DT_STOP_HTTP ? "POST /stop"
                                            : "train.time_limit";
      fprintf(stderr,
              "ddp_train: stopped by %s at step %lld after saving a checkpoint%s; continue with --resume auto\n", why,
              (long long)T->ts.step, T->v->ckpt_dir[0] ? "" : " (none: checkpoint.dir is empty)");
      fflush(stderr);
    }
    code = DT_EXIT_STOPPED;
  } else if (!code) {
    log_line(&T->lg, "done: %lld steps in %.1f s, %.0f samples/s mean", (long long)T->ts.step, res->wall_s,
             res->wall_s > 0 ? (double)T->run_samples / res->wall_s : 0.0);
    if (res->best_val_acc >= 0)
      log_line(&T->lg, "best val_acc %.4f, final val_acc %.4f", res->best_val_acc, res->final_val_acc);
    if (T->captures)
      log_line(&T->lg, "cuda graph: %lld steps captured, %lld replayed", (long long)T->captures, (long long)T->replays);
  }
  free(T->target_idx);
  free(T->ctx.ready_s);
  free(T->ctx.ready_mpi_s);
  free(T->win_ready);
  free(T->win_ready_mpi);
  free(T->bucket_json);
  free(T->rank_compute_ms);
  free(T->gpu_all);
  free(T->scratch.params);
  free(T->scratch.bufs);
  free(T->scratch.ema_params);
  free(T->scratch.ema_bufs);
  for (int i = 0; i < 2; i++) {
    if (T->graph[i]) T->be->graph_free(T->be, T->graph[i]);
    dev_batch_free(&T->in[i], T->be);
  }
  T->be->free(T->be, T->stats);
  if (T->scaler) {
    T->be->free(T->be, T->scaler);
    T->be->free_host(T->be, T->scaler_host);
  }
  T->be->free(T->be, T->clip_sq);
  if (T->loss_weight) T->be->free(T->be, T->loss_weight);
  T->be->free(T->be, T->cache_x);
  T->be->free(T->be, T->cache_y);
  T->be->free_host(T->be, T->stats_host);
  if (T->ema.params) ema_free(&T->ema, T->be);
  optim_free(&T->opt, T->be);
  grad_sync_free(&T->gs);
  sampler_free(&T->smp);
  sampler_free(&T->target_smp); /* zeroed when unused */
  log_close(&T->lg);
  return code;
}

int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const dt_train_opts *opts,
              dt_train_result *res) {
  memset(res, 0, sizeof *res);
  dt_trainer T;
  int code = trainer_start(&T, cfg, m, d, comm, opts);
  if (code) return code;
  res->best_val_acc = T.ts.best_val_acc;
  for (T.epoch = T.ts.epoch; T.epoch < cfg->v.epochs && !T.stop && !code; T.epoch++)
    for (T.os = T.epoch == T.ts.epoch ? T.ts.micro / T.accum : 0; T.os < T.opt_per_epoch && !T.stop && !code; T.os++)
      code = train_step(&T, res);
  return trainer_finish(&T, code, res);
}
