#include "train.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"
#include "layers.h"
#include "log.h"
#include "ema.h"
#include "optim.h"
#include "signals.h"

typedef struct {
  dt_comm *comm;
  dt_grad_sync *gs;
  dt_backend *be;
  float *grads;
} pass_ctx;

static void ctx_allreduce(void *ctx, double *data, int n) {
  comm_allreduce_sum_f64(((pass_ctx *)ctx)->comm, data, n, "batchnorm statistics allreduce");
}
static void ctx_ready(void *ctx, int64_t from) {
  grad_sync_ready(((pass_ctx *)ctx)->gs, from);
}

/* Non-finite gradients in [begin, end), checked before the range is sent. */
static int64_t ctx_check(void *ctx, int64_t begin, int64_t end) {
  pass_ctx *c = ctx;
  double sq;
  int64_t bad = 0;
  dt_op op = {.type = DT_OP_SUMSQ};
  op.p.sumsq = (typeof(op.p.sumsq)){.n = end - begin, .x = c->grads + begin, .sumsq = &sq, .nonfinite = &bad};
  backend_run(c->be, &op);
  return bad;
}

/* Raw host rows -> the model's input buffer, normalised per channel. */
static void load_input(const dt_config *cfg, dt_model *m, const float *raw, int64_t rows) {
  const dt_config_values *v = &cfg->v;
  float mean[DT_MAX_LIST], std[DT_MAX_LIST];
  for (int c = 0; c < v->mean.n; c++) mean[c] = (float)v->mean.v[c];
  for (int c = 0; c < v->std.n; c++) std[c] = (float)v->std.v[c];
  int64_t ch = m->input.rank == 3 ? m->input.c : 1;
  dt_op op = {.type = DT_OP_INPUT};
  op.p.input = (typeof(op.p.input)){.b = rows,
                                    .c = ch,
                                    .s = shape_size(m->input) / ch,
                                    .scale = (float)v->scale,
                                    .mean = v->mean.n ? mean : NULL,
                                    .std = v->std.n ? std : NULL,
                                    .raw = raw,
                                    .x = m->input_x};
  backend_run(m->be, &op);
}

/* Forward over this rank's validation rows with params and bufs (backend memory: the model's or
 * the EMA's); sums[0..1] get loss and hits; logits (rows, K) and labels are kept when given (host). */
static void eval_rows(const dt_config *cfg, dt_model *m, const float *params, const float *bufs, dt_data *d,
                      double *sums, float *logits, int32_t *all_labels, dt_status *st) {
  dt_split *s = &d->val;
  int64_t rows = s->hi - s->lo, cap = m->max_batch;
  float *x = dt_malloc((size_t)(cap * shape_size(m->input)) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)cap * sizeof(int32_t));
  float *targets = dt_malloc((size_t)(cap * m->n_outputs) * sizeof(float));
  int64_t *idx = dt_malloc((size_t)cap * sizeof(int64_t));
  dt_pass pass = {.be = m->be,
                  .training = 0,
                  .global_count = 1,
                  .params = (float *)params,
                  .grads = m->grads,
                  .bufs = (float *)bufs};
  for (int64_t i = 0; i < rows && !st->code; i += cap) {
    int64_t n = rows - i < cap ? rows - i : cap;
    for (int64_t k = 0; k < n; k++) idx[k] = s->lo + i + k;
    if (data_gather(d, s, idx, n, x, labels, targets, st)) break;
    load_input(cfg, m, x, n);
    pass.batch = n;
    model_forward(m, &pass);
    model_loss(m, &pass, labels, targets, &sums[0], &sums[1]);
    if (logits)
      m->be->to_host(m->be, logits + i * m->n_outputs, model_logits(m), (size_t)(n * m->n_outputs) * sizeof(float));
    if (all_labels && s->y_k == 0) memcpy(all_labels + i, labels, (size_t)n * sizeof(int32_t));
  }
  free(x);
  free(labels);
  free(targets);
  free(idx);
}

void train_evaluate(const dt_config *cfg, dt_model *m, const float *params, const float *bufs, dt_data *d,
                    dt_comm *comm, double *loss, double *acc, dt_status *st) {
  int64_t rows = d->val.hi - d->val.lo;
  double sums[3] = {0, 0, (double)rows};
  eval_rows(cfg, m, params ? params : m->params, bufs ? bufs : m->bufs, d, sums, NULL, NULL, st);
  comm_allreduce_sum_f64(comm, sums, 3, "validation allreduce");
  *loss = sums[2] > 0 ? sums[0] / sums[2] : 0;
  *acc = m->loss.kind == DT_LOSS_CROSS_ENTROPY && sums[2] > 0 ? sums[1] / sums[2] : -1;
}

/* Collective at log steps: every rank's mean compute time per step. Returns the slowest rank and
 * fills min/max/median; prints a straggler line when W > 1. */
static void straggler_line(dt_comm *comm, dt_log *lg, double compute_ms, double *min_ms, double *max_ms, int *slow) {
  int W = comm->size;
  double *all = dt_malloc((size_t)W * sizeof(double)), *sorted = dt_malloc((size_t)W * sizeof(double));
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
  free(all);
  free(sorted);
}

int train_predict(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const char *path) {
  dt_status st = {0};
  if (!d->has_val) dt_fail(&st, DT_EXIT_INPUT, "--predict: there is no validation split (data.val.x is empty)");
  int code = comm_agree(comm, &st);
  if (code) return code;
  int64_t rows = d->val.hi - d->val.lo, k = m->n_outputs, n = d->val.n;
  float *logits = dt_malloc((size_t)(rows * k + 1) * sizeof(float));
  float *labels_f = dt_malloc((size_t)(rows + 1) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)(rows + 1) * sizeof(int32_t));
  double sums[2] = {0, 0};
  eval_rows(cfg, m, m->params, m->bufs, d, sums, logits, labels, &st);
  if ((code = comm_agree(comm, &st))) goto out;
  for (int64_t i = 0; i < rows; i++) labels_f[i] = (float)labels[i]; /* exact for class indices */
  float *all = comm->rank == 0 ? dt_malloc((size_t)(n * k + 1) * sizeof(float)) : NULL;
  float *all_labels = comm->rank == 0 ? dt_malloc((size_t)(n + 1) * sizeof(float)) : NULL;
  comm_gather_rows(comm, logits, rows, k, all);
  comm_gather_rows(comm, labels_f, rows, 1, all_labels);
  if (comm->rank == 0) {
    int32_t *li = dt_malloc((size_t)(n + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < n; i++) li[i] = (int32_t)all_labels[i];
    if (!ckpt_write_predictions(path, all, m->loss.kind == DT_LOSS_CROSS_ENTROPY ? li : NULL, n, k, &st))
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

/* Collective at log steps on GPU runs: every rank's NVML reading, written by rank 0 into the
 * metrics line as "gpu": [{rank, mem_used_mib, mem_peak_mib, util_pct, power_w, temp_c}, ...]. */
static void gpu_metrics(dt_comm *comm, int gpu, double *peak, char *json, size_t cap) {
  enum { CAP = 160 };
  dt_gpu_reading r;
  gpu_read(gpu, peak, &r);
  char mine[CAP] = "";
  if (r.valid)
    snprintf(mine, CAP,
             "{\"rank\": %d, \"mem_used_mib\": %.0f, \"mem_peak_mib\": %.0f, \"util_pct\": %.0f, "
             "\"power_w\": %.0f, \"temp_c\": %.0f}",
             comm->rank, r.mem_used_mib, r.mem_peak_mib, r.util_pct, r.power_w, r.temp_c);
  char *all = comm->rank == 0 ? dt_calloc((size_t)comm->size, CAP) : NULL;
  comm_gather_text(comm, mine, CAP, all);
  json[0] = 0;
  if (comm->rank == 0) {
    size_t len = (size_t)snprintf(json, cap, ", \"gpu\": [");
    int any = 0;
    for (int k = 0; k < comm->size && len < cap; k++)
      if (all[(size_t)k * CAP])
        len += (size_t)snprintf(json + len, cap - len, "%s%s", any++ ? ", " : "", all + (size_t)k * CAP);
    if (len < cap) snprintf(json + len, cap - len, "]");
    if (!any) json[0] = 0;
  }
  free(all);
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
  dt_train_state ts;
  int64_t accum, opt_per_epoch, total; /* micro-batches per step, steps per epoch, steps in all */
  /* this optimizer step */
  int64_t epoch, os, micro0, k; /* epoch, step within it, its first micro-batch, micro-batches */
  double count;                 /* rows in its global batch */
  double lr;
  dt_step_report all; /* the ranks' summed report */
  /* the log window */
  double t_start, t_window, win_data, win_comm, win_loss;
  int64_t win_samples, win_steps, run_samples;
  double gpu_peak_mib;
  int stop, stop_signal;
} dt_trainer;

/* Sampler, log, optimizer, gradient sync, resume state and loader. Returns the agreed code. */
static int trainer_start(dt_trainer *T, const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm,
                         const dt_train_opts *opts) {
  memset(T, 0, sizeof *T);
  const dt_config_values *v = &cfg->v;
  *T = (dt_trainer){.cfg = cfg, .v = v, .m = m, .d = d, .comm = comm, .opts = opts, .be = m->be};
  dt_status st = {0};
  const int W = comm->size, leader = comm->rank == 0;
  const int64_t G = v->global_batch_size ? v->global_batch_size : v->batch_size * W;
  sampler_init(&T->smp, d->train.n, W, comm->rank, G, v->sharding == DT_SHARD_CONTIGUOUS, v->drop_last, v->shuffle,
               (uint64_t)v->seed);
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
  log_open(&T->lg, leader, v->log_dir, v->progress, opts->resume != NULL, &st);
  int code = comm_agree(comm, &st);
  if (code) {
    sampler_free(&T->smp);
    log_close(&T->lg);
    return code;
  }
  T->accum = v->grad_accum;
  T->opt_per_epoch = (T->smp.steps + T->accum - 1) / T->accum;
  T->total = T->opt_per_epoch * v->epochs;
  if (v->max_steps && v->max_steps < T->total) T->total = v->max_steps;

  dt_backend *be = T->be;
  optim_init(&T->opt, v, be, m->n_params, T->total);
  T->ctx = (pass_ctx){comm, &T->gs, be, m->grads};
  grad_sync_init(&T->gs, comm, opts->dev, be, m->grads, m->n_params,
                 (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float)), ctx_check, &T->ctx);
  T->ts = (dt_train_state){.global_batch = G * T->accum,
                           .world_size = W,
                           .seed = (uint64_t)v->seed,
                           .optim = v->optim,
                           .best_metric = lower_is_better(v->early_metric) ? INFINITY : -INFINITY,
                           .best_val_acc = -1};
  if (opts->resume) {
    T->ts = opts->resume->ts;
    T->ts.world_size = W;
    size_t pb = (size_t)m->n_params * sizeof(float);
    for (int k = 0; k < T->opt.n_states; k++)
      if (opts->resume->opt[k]) be->to_device(be, T->opt.states[k], opts->resume->opt[k], pb);
    T->opt.step = T->ts.step;
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
  loader_start(&T->L, d, &T->smp, m, T->ts.epoch, T->ts.micro, v->epochs);
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
  T->t_start = T->t_window = dt_now();
  if (T->ts.step >= T->total) T->stop = 1; /* nothing left: the final checkpoint is rewritten below */
  return 0;
}

/* Forward, loss and backward over this step's micro-batches; gradients accumulate, and the last
 * micro-batch's backward starts the bucket sums. Adds this rank's loss and hits to *mine. */
static void micro_batches(dt_trainer *T, dt_step_report *mine, double *data_s, dt_status *st) {
  const dt_config_values *v = T->v;
  dt_model *m = T->m;
  int inject_nan = fault_fire(&T->opts->fault, T->comm->rank, T->ts.step + 1);
  T->be->zero(T->be, m->grads, (size_t)m->n_params * sizeof(float));
  for (int64_t j = 0; j < T->k && !st->code; j++) {
    double w0 = T->L.wait_s;
    dt_batch *b = loader_next(&T->L, st);
    if (!b) break;
    *data_s += T->L.wait_s - w0;
    if (inject_nan && b->count) b->x[0] = NAN;
    load_input(T->cfg, m, b->x, b->count);
    dt_pass pass = {
        .be = T->be,
        .batch = b->count,
        .training = 1,
        .global_count = T->count,
        .dropout_seed = dt_hash64(((uint64_t)v->seed << 32) ^ (uint64_t)(T->epoch * T->smp.steps + T->micro0 + j) ^
                                  ((uint64_t)T->comm->rank << 52)),
        .params = m->params,
        .grads = m->grads,
        .bufs = m->bufs,
        .allreduce_sum = ctx_allreduce,
        .grads_ready = j == T->k - 1 ? ctx_ready : NULL,
        .ctx = &T->ctx};
    model_forward(m, &pass);
    double l = 0, c = 0;
    model_loss(m, &pass, b->labels, b->targets, &l, &c);
    if (!isfinite(l))
      dt_fail(st, DT_EXIT_NUMERIC,
              "the loss became %s at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm",
              isnan(l) ? "NaN" : "infinite", (long long)T->ts.step + 1, (long long)T->epoch + 1);
    mine->loss_sum += l;
    mine->correct += c;
    model_backward(m, &pass);
  }
}

/* Finishes the gradient sums (each bucket checked for NaN/Inf on this rank before it was sent)
 * and agrees with every rank on the outcome, the summed loss and whether to stop (a signal or
 * the time limit on any rank stops every rank at this same step). Returns the agreed code. */
static int reduce_and_agree(dt_trainer *T, dt_step_report *mine, dt_status *st) {
  T->gs.nonfinite = 0;
  grad_sync_finish(&T->gs);
  if (T->gs.nonfinite && !st->code)
    dt_fail(st, DT_EXIT_NUMERIC,
            "%lld non-finite gradient values at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm",
            (long long)T->gs.nonfinite, (long long)T->ts.step + 1, (long long)T->epoch + 1);
  int sig = signals_caught();
  mine->stop = sig ? sig : (T->v->time_limit > 0 && dt_now() - T->opts->t_launch >= T->v->time_limit ? -1 : 0);
  mine->code = st->code;
  return comm_step_agree(T->comm, mine, st, &T->all);
}

/* Clips the summed gradients (train.clip_grad_norm), steps the optimizer and advances the state. */
static void optimizer_step(dt_trainer *T) {
  const dt_config_values *v = T->v;
  dt_model *m = T->m;
  if (v->clip_grad_norm > 0) {
    double sq = 0;
    int64_t bad = 0;
    dt_op op = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = m->n_params, .x = m->grads, .sumsq = &sq, .nonfinite = &bad}};
    backend_run(T->be, &op);
    double norm = sqrt(sq);
    if (norm > v->clip_grad_norm) {
      dt_op sc = {.type = DT_OP_SCALE,
                  .p.scale = {.n = m->n_params, .alpha = (float)(v->clip_grad_norm / (norm + 1e-6)), .x = m->grads}};
      backend_run(T->be, &sc);
    }
  }
  T->lr = schedule_lr(v, T->ts.step, T->total);
  optim_step(&T->opt, T->be, m->params, m->grads, T->lr);
  if (T->ema.params) ema_update(&T->ema, T->be, m->params, m->bufs);
  T->ts.step++;
  T->ts.micro = T->micro0 + T->k;
  T->ts.epoch = T->epoch;
  if (T->ts.micro >= T->smp.steps) T->ts.epoch = T->epoch + 1, T->ts.micro = 0;
}

/* The progress line every step; every log.every_steps the console and metrics lines, with the
 * straggler report and, on GPUs, each rank's NVML reading (collectives). */
static void log_step(dt_trainer *T, double data_s) {
  const dt_config_values *v = T->v;
  double loss = T->all.loss_sum / T->count;
  T->win_loss += loss;
  T->win_steps++;
  T->win_samples += (int64_t)T->count;
  T->run_samples += (int64_t)T->count;
  T->win_data += data_s;
  T->win_comm += T->gs.wait_s;
  double now = dt_now();
  log_progress(&T->lg, T->ts.step, T->total, now - T->t_start, loss);
  if (T->ts.step % v->log_every_steps != 0 && T->ts.step != T->total) return;
  double span = now - T->t_window, ms = 1e3 * span / (double)T->win_steps;
  double data_ms = 1e3 * T->win_data / (double)T->win_steps, comm_ms = 1e3 * T->win_comm / (double)T->win_steps;
  double sps = span > 0 ? (double)T->win_samples / span : 0, mean_loss = T->win_loss / (double)T->win_steps;
  double min_ms, max_ms;
  int slow;
  straggler_line(T->comm, &T->lg, ms - data_ms - comm_ms, &min_ms, &max_ms, &slow);
  char gpu_json[8192] = "";
  if (T->opts->gpu >= 0) gpu_metrics(T->comm, T->opts->gpu, &T->gpu_peak_mib, gpu_json, sizeof gpu_json);
  log_line(&T->lg,
           "step %lld/%lld epoch %lld loss %.4f lr %.5f | %.0f samples/s | %.1f ms/step (compute %.1f, data %.1f, "
           "comm %.1f)",
           (long long)T->ts.step, (long long)T->total, (long long)T->epoch + 1, mean_loss, T->lr, sps, ms,
           ms - data_ms - comm_ms, data_ms, comm_ms);
  log_metrics(&T->lg,
              "\"step\": %lld, \"epoch\": %lld, \"loss\": %.6g, \"lr\": %.6g, \"samples_per_s\": %.1f, "
              "\"step_ms\": %.3f, \"compute_ms\": %.3f, \"data_ms\": %.3f, \"comm_ms\": %.3f, "
              "\"compute_ms_min\": %.3f, \"compute_ms_max\": %.3f, \"straggler_rank\": %d%s",
              (long long)T->ts.step, (long long)T->epoch + 1, mean_loss, T->lr, sps, ms, ms - data_ms - comm_ms,
              data_ms, comm_ms, min_ms, max_ms, slow, gpu_json);
  T->t_window = now;
  T->win_loss = T->win_data = T->win_comm = 0;
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
  dt_status st = {0};
  double vl, va, evl = 0, eva = -1, t_eval = dt_now();
  train_evaluate(T->cfg, T->m, NULL, NULL, T->d, T->comm, &vl, &va, &st);
  if (T->ema.params) train_evaluate(T->cfg, T->m, T->ema.params, T->ema.bufs, T->d, T->comm, &evl, &eva, &st);
  T->t_window += dt_now() - t_eval; /* throughput windows count training time only */
  int code = comm_agree(T->comm, &st);
  if (code) return code;
  res->final_val_loss = vl;
  res->final_val_acc = va;
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
  if (new_best && v->ckpt_best &&
      (code = save_checkpoint(T->cfg, T->m, &T->opt, &T->ema, &T->ts, T->comm, &T->scratch, 1, &T->lg)))
    return code;
  int periodic = (v->ckpt_every_steps && T->ts.step % v->ckpt_every_steps == 0) ||
                 (end_of_epoch && v->ckpt_every_epochs && (T->epoch + 1) % v->ckpt_every_epochs == 0);
  if (periodic || T->stop || T->ts.step == T->total)
    code = save_checkpoint(T->cfg, T->m, &T->opt, &T->ema, &T->ts, T->comm, &T->scratch, 0, &T->lg);
  return code;
}

/* One optimizer step: micro-batches, reduce and agree, step, log, evaluate, checkpoint. */
static int train_step(dt_trainer *T, dt_train_result *res) {
  const dt_config_values *v = T->v;
  T->comm->step = T->ts.step + 1;
  T->micro0 = T->os * T->accum;
  T->k = T->smp.steps - T->micro0 < T->accum ? T->smp.steps - T->micro0 : T->accum;
  T->count = 0;
  for (int64_t j = 0; j < T->k; j++) T->count += (double)sampler_count(&T->smp, T->micro0 + j);
  dt_status st = {0};
  dt_step_report mine = {0};
  double data_s = 0;
  micro_batches(T, &mine, &data_s, &st);
  int code = reduce_and_agree(T, &mine, &st);
  if (code) return code;
  optimizer_step(T);
  log_step(T, data_s);
  if (T->all.stop) T->stop = 1, T->stop_signal = T->all.stop;
  int end_of_epoch = T->os == T->opt_per_epoch - 1, new_best;
  if (v->max_steps && T->ts.step >= v->max_steps) T->stop = 1;
  if ((code = evaluate_if_due(T, end_of_epoch, res, &new_best))) return code;
  return checkpoint_if_due(T, end_of_epoch, new_best);
}

/* The stop message (signal or time limit: exit 75) or the summary; frees the trainer. */
static int trainer_finish(dt_trainer *T, int code, dt_train_result *res) {
  loader_stop(&T->L);
  res->steps = T->ts.step;
  res->wall_s = dt_now() - T->t_start;
  if (!code && T->stop_signal) {
    if (T->comm->rank == 0) {
      int s = T->stop_signal;
      const char *why = s == SIGUSR1 ? "SIGUSR1" : s == SIGTERM ? "SIGTERM" : "train.time_limit";
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
  }
  free(T->scratch.params);
  free(T->scratch.bufs);
  free(T->scratch.ema_params);
  free(T->scratch.ema_bufs);
  if (T->ema.params) ema_free(&T->ema, T->be);
  optim_free(&T->opt, T->be);
  grad_sync_free(&T->gs);
  sampler_free(&T->smp);
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
