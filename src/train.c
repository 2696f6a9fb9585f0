#include "train.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"
#include "layers.h"
#include "log.h"
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

/* Forward over this rank's validation rows; sums[0..1] get loss and hits; logits (rows, K) and
 * labels are kept when given (host). */
static void eval_rows(const dt_config *cfg, dt_model *m, dt_data *d, double *sums, float *logits, int32_t *all_labels,
                      dt_status *st) {
  dt_split *s = &d->val;
  int64_t rows = s->hi - s->lo, cap = m->max_batch;
  float *x = dt_malloc((size_t)(cap * shape_size(m->input)) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)cap * sizeof(int32_t));
  float *targets = dt_malloc((size_t)(cap * m->n_outputs) * sizeof(float));
  int64_t *idx = dt_malloc((size_t)cap * sizeof(int64_t));
  dt_pass pass = {
      .be = m->be, .training = 0, .global_count = 1, .params = m->params, .grads = m->grads, .bufs = m->bufs};
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

void train_evaluate(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, double *loss, double *acc,
                    dt_status *st) {
  int64_t rows = d->val.hi - d->val.lo;
  double sums[3] = {0, 0, (double)rows};
  eval_rows(cfg, m, d, sums, NULL, NULL, st);
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
  eval_rows(cfg, m, d, sums, logits, labels, &st);
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

static int improved(int metric, double value, double best) {
  return metric == DT_METRIC_VAL_LOSS ? value < best : value > best;
}

/* Everything a checkpoint needs, copied to the host. */
static void snapshot(const dt_model *m, const dt_optim *o, const dt_train_state *ts, dt_ckpt_data *d) {
  dt_backend *be = m->be;
  size_t pb = (size_t)m->n_params * sizeof(float);
  be->to_host(be, d->params, m->params, pb);
  be->to_host(be, d->bufs, m->bufs, (size_t)m->n_bufs * sizeof(float));
  for (int k = 0; k < DT_OPTIM_MAX_STATES; k++) {
    d->opt[k] = k < o->n_states ? d->params + (k + 1) * m->n_params : NULL; /* the scratch has room after params */
    if (d->opt[k]) be->to_host(be, d->opt[k], o->states[k], pb);
  }
  d->ts = *ts;
}

/* Rank 0 writes a step checkpoint (or best.h5); all ranks agree on the outcome. */
static int save_checkpoint(const dt_config *cfg, const dt_model *m, const dt_optim *o, const dt_train_state *ts,
                           dt_comm *comm, dt_ckpt_data *scratch, int best, dt_log *lg) {
  dt_status st = {0};
  if (comm->rank == 0) {
    const dt_config_values *v = &cfg->v;
    snapshot(m, o, ts, scratch);
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

int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const dt_train_opts *opts,
              dt_train_result *res) {
  const dt_config_values *v = &cfg->v;
  dt_status st = {0};
  memset(res, 0, sizeof *res);
  const int W = comm->size, leader = comm->rank == 0;
  const int64_t G = v->global_batch_size ? v->global_batch_size : v->batch_size * W;
  dt_sampler smp;
  sampler_init(&smp, d->train.n, W, comm->rank, G, v->sharding == DT_SHARD_CONTIGUOUS, v->drop_last, v->shuffle,
               (uint64_t)v->seed);
  if (v->sharding == DT_SHARD_CONTIGUOUS && G < W)
    dt_fail(&st, DT_EXIT_INPUT,
            "data.sharding contiguous: the global batch (%lld) must be at least the number of "
            "ranks (%d), or some ranks' rows would never be used",
            (long long)G, W);
  if (smp.steps == 0)
    dt_fail(&st, DT_EXIT_INPUT,
            "%s: the global batch (%lld) is larger than the %lld training rows and data.drop_last "
            "is true: no step to run",
            d->path, (long long)G, (long long)d->train.n);
  dt_log lg;
  log_open(&lg, leader, v->log_dir, v->progress, opts->resume != NULL, &st);
  int code = comm_agree(comm, &st);
  if (code) {
    sampler_free(&smp);
    log_close(&lg);
    return code;
  }
  const int64_t accum = v->grad_accum, opt_per_epoch = (smp.steps + accum - 1) / accum;
  int64_t total = opt_per_epoch * v->epochs;
  if (v->max_steps && v->max_steps < total) total = v->max_steps;

  dt_backend *be = m->be;
  dt_optim opt;
  optim_init(&opt, v, be, m->n_params, total);
  dt_grad_sync gs;
  pass_ctx ctx = {comm, &gs, be, m->grads};
  grad_sync_init(&gs, comm, opts->dev, be, m->grads, m->n_params, (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float)),
                 ctx_check, &ctx);
  dt_train_state ts = {.step = 0,
                       .epoch = 0,
                       .micro = 0,
                       .global_batch = G * accum,
                       .world_size = W,
                       .seed = (uint64_t)v->seed,
                       .optim = v->optim,
                       .best_metric = v->early_metric == DT_METRIC_VAL_LOSS ? INFINITY : -INFINITY,
                       .bad_evals = 0,
                       .best_val_acc = -1};
  if (opts->resume) {
    ts = opts->resume->ts;
    ts.world_size = W;
    size_t pb = (size_t)m->n_params * sizeof(float);
    for (int k = 0; k < opt.n_states; k++)
      if (opts->resume->opt[k]) be->to_device(be, opt.states[k], opts->resume->opt[k], pb);
    opt.step = ts.step;
  }
  /* host scratch for checkpoints: params, the optimizer states, buffers */
  dt_ckpt_data scratch = {0};
  if (leader && v->ckpt_dir[0]) {
    scratch.params = dt_malloc((size_t)((1 + DT_OPTIM_MAX_STATES) * m->n_params + 1) * sizeof(float));
    scratch.bufs = dt_malloc((size_t)(m->n_bufs + 1) * sizeof(float));
  }
  dt_loader L;
  loader_start(&L, d, &smp, m, ts.epoch, ts.micro, v->epochs);

  if (opts->resume)
    log_line(&lg, "resuming at step %lld (epoch %lld, batch %lld of %lld)", (long long)ts.step, (long long)ts.epoch + 1,
             (long long)ts.micro, (long long)smp.steps);
  log_line(&lg,
           "training: %lld optimizer steps (%lld epochs x %lld), global batch %lld on %d rank%s, %s backend, "
           "%d thread%s per rank",
           (long long)total, (long long)v->epochs, (long long)opt_per_epoch, (long long)(G * accum), W,
           W > 1 ? "s" : "", be->name, be->threads, be->threads > 1 ? "s" : "");

  double t_start = dt_now(), t_window = t_start, win_data = 0, win_comm = 0, win_loss = 0;
  int64_t win_samples = 0, win_steps = 0, run_samples = 0;
  double gpu_peak_mib = 0;
  int stop = 0, stop_signal = 0;
  res->best_val_acc = ts.best_val_acc;
  if (ts.step >= total) stop = 1; /* nothing left: the final checkpoint is rewritten below */

  for (int64_t epoch = ts.epoch; epoch < v->epochs && !stop && !code; epoch++) {
    for (int64_t os = (epoch == ts.epoch ? ts.micro / accum : 0); os < opt_per_epoch && !stop && !code; os++) {
      comm->step = ts.step + 1;
      int inject_nan = fault_fire(&opts->fault, comm->rank, ts.step + 1);
      int64_t micro0 = os * accum, k = smp.steps - micro0 < accum ? smp.steps - micro0 : accum;
      double count = 0;
      for (int64_t j = 0; j < k; j++) count += (double)sampler_count(&smp, micro0 + j);
      be->zero(be, m->grads, (size_t)m->n_params * sizeof(float));
      dt_step_report mine = {0}, all;
      double data_s = 0;
      for (int64_t j = 0; j < k && !st.code; j++) {
        double w0 = L.wait_s;
        dt_batch *b = loader_next(&L, &st);
        if (!b) break;
        data_s += L.wait_s - w0;
        if (inject_nan && b->count) b->x[0] = NAN;
        load_input(cfg, m, b->x, b->count);
        dt_pass pass = {
            .be = be,
            .batch = b->count,
            .training = 1,
            .global_count = count,
            .dropout_seed = dt_hash64(((uint64_t)v->seed << 32) ^ (uint64_t)(epoch * smp.steps + micro0 + j) ^
                                      ((uint64_t)comm->rank << 52)),
            .params = m->params,
            .grads = m->grads,
            .bufs = m->bufs,
            .allreduce_sum = ctx_allreduce,
            .grads_ready = j == k - 1 ? ctx_ready : NULL,
            .ctx = &ctx};
        model_forward(m, &pass);
        double l = 0, c = 0;
        model_loss(m, &pass, b->labels, b->targets, &l, &c);
        if (!isfinite(l))
          dt_fail(&st, DT_EXIT_NUMERIC,
                  "the loss became %s at step %lld (epoch %lld); lower optim.lr or "
                  "set train.clip_grad_norm",
                  isnan(l) ? "NaN" : "infinite", (long long)ts.step + 1, (long long)epoch + 1);
        mine.loss_sum += l;
        mine.correct += c;
        model_backward(m, &pass);
      }
      /* every bucket is checked for NaN/Inf on this rank before it is sent */
      gs.nonfinite = 0;
      grad_sync_finish(&gs);
      if (gs.nonfinite && !st.code)
        dt_fail(&st, DT_EXIT_NUMERIC,
                "%lld non-finite gradient values at step %lld (epoch %lld); lower "
                "optim.lr or set train.clip_grad_norm",
                (long long)gs.nonfinite, (long long)ts.step + 1, (long long)epoch + 1);
      /* a signal or the time limit on any rank stops every rank at this same step */
      int sig = signals_caught();
      mine.stop = sig ? sig : (v->time_limit > 0 && dt_now() - opts->t_launch >= v->time_limit ? -1 : 0);
      mine.code = st.code;
      if ((code = comm_step_agree(comm, &mine, &st, &all))) break;
      if (v->clip_grad_norm > 0) {
        double sq = 0;
        int64_t bad = 0;
        dt_op op = {.type = DT_OP_SUMSQ};
        op.p.sumsq = (typeof(op.p.sumsq)){.n = m->n_params, .x = m->grads, .sumsq = &sq, .nonfinite = &bad};
        backend_run(be, &op);
        double norm = sqrt(sq);
        if (norm > v->clip_grad_norm) {
          dt_op sc = {.type = DT_OP_SCALE};
          sc.p.scale = (typeof(sc.p.scale)){
              .n = m->n_params, .alpha = (float)(v->clip_grad_norm / (norm + 1e-6)), .x = m->grads};
          backend_run(be, &sc);
        }
      }
      double lr = schedule_lr(v, ts.step, total);
      optim_step(&opt, be, m->params, m->grads, lr);
      ts.step++;
      ts.micro = micro0 + k;
      ts.epoch = epoch;
      if (ts.micro >= smp.steps) ts.epoch = epoch + 1, ts.micro = 0;
      double loss = all.loss_sum / count;
      win_loss += loss;
      win_steps++;
      win_samples += (int64_t)count;
      run_samples += (int64_t)count;
      win_data += data_s;
      win_comm += gs.wait_s;
      double now = dt_now();
      log_progress(&lg, ts.step, total, now - t_start, loss);
      if (ts.step % v->log_every_steps == 0 || ts.step == total) {
        double span = now - t_window, ms = 1e3 * span / (double)win_steps;
        double data_ms = 1e3 * win_data / (double)win_steps, comm_ms = 1e3 * win_comm / (double)win_steps;
        double sps = span > 0 ? (double)win_samples / span : 0, mean_loss = win_loss / (double)win_steps;
        double min_ms, max_ms;
        int slow;
        straggler_line(comm, &lg, ms - data_ms - comm_ms, &min_ms, &max_ms, &slow);
        char gpu_json[8192] = "";
        if (opts->gpu >= 0) gpu_metrics(comm, opts->gpu, &gpu_peak_mib, gpu_json, sizeof gpu_json);
        log_line(&lg,
                 "step %lld/%lld epoch %lld loss %.4f lr %.5f | %.0f samples/s | %.1f ms/step (compute %.1f, "
                 "data %.1f, comm %.1f)",
                 (long long)ts.step, (long long)total, (long long)epoch + 1, mean_loss, lr, sps, ms,
                 ms - data_ms - comm_ms, data_ms, comm_ms);
        log_metrics(&lg,
                    "\"step\": %lld, \"epoch\": %lld, \"loss\": %.6g, \"lr\": %.6g, \"samples_per_s\": %.1f, "
                    "\"step_ms\": %.3f, \"compute_ms\": %.3f, \"data_ms\": %.3f, \"comm_ms\": %.3f, "
                    "\"compute_ms_min\": %.3f, \"compute_ms_max\": %.3f, \"straggler_rank\": %d%s",
                    (long long)ts.step, (long long)epoch + 1, mean_loss, lr, sps, ms, ms - data_ms - comm_ms, data_ms,
                    comm_ms, min_ms, max_ms, slow, gpu_json);
        t_window = now;
        win_loss = win_data = win_comm = 0;
        win_samples = win_steps = 0;
      }
      if (all.stop) stop = 1, stop_signal = all.stop;
      int end_of_epoch = os == opt_per_epoch - 1;
      if (v->max_steps && ts.step >= v->max_steps) stop = 1;
      int eval_now = d->has_val && !stop_signal &&
                     (end_of_epoch || (v->eval_every_steps && ts.step % v->eval_every_steps == 0) || stop);
      int new_best = 0;
      if (eval_now) {
        double vl, va, t_eval = dt_now();
        train_evaluate(cfg, m, d, comm, &vl, &va, &st);
        t_window += dt_now() - t_eval; /* throughput windows count training time only */
        if ((code = comm_agree(comm, &st))) break;
        res->final_val_loss = vl;
        res->final_val_acc = va;
        if (va > ts.best_val_acc) ts.best_val_acc = va;
        res->best_val_acc = ts.best_val_acc;
        if (va >= 0) {
          log_line(&lg, "eval step %lld epoch %lld: val_loss %.4f val_acc %.4f", (long long)ts.step,
                   (long long)epoch + 1, vl, va);
          log_metrics(&lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g, \"val_acc\": %.6g", (long long)ts.step,
                      (long long)epoch + 1, vl, va);
        } else {
          log_line(&lg, "eval step %lld epoch %lld: val_mse %.6f", (long long)ts.step, (long long)epoch + 1, vl);
          log_metrics(&lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g", (long long)ts.step,
                      (long long)epoch + 1, vl);
        }
        int metric = v->early_metric != DT_METRIC_NONE ? v->early_metric
                     : va >= 0                         ? DT_METRIC_VAL_ACC
                                                       : DT_METRIC_VAL_LOSS;
        double value = metric == DT_METRIC_VAL_LOSS ? vl : va;
        if (!isfinite(ts.best_metric) || improved(metric, value, ts.best_metric)) {
          ts.best_metric = value;
          ts.bad_evals = 0;
          new_best = 1;
        } else if (v->early_metric != DT_METRIC_NONE && ++ts.bad_evals >= v->early_patience) {
          log_line(&lg, "early stopping: %s has not improved for %lld evaluations",
                   v->early_metric == DT_METRIC_VAL_LOSS ? "val_loss" : "val_acc", (long long)ts.bad_evals);
          stop = 1;
        }
      }
      if (v->ckpt_dir[0]) {
        if (new_best && v->ckpt_best && (code = save_checkpoint(cfg, m, &opt, &ts, comm, &scratch, 1, &lg))) break;
        int periodic = (v->ckpt_every_steps && ts.step % v->ckpt_every_steps == 0) ||
                       (end_of_epoch && v->ckpt_every_epochs && (epoch + 1) % v->ckpt_every_epochs == 0);
        int last = stop || ts.step == total;
        if ((periodic || last) && (code = save_checkpoint(cfg, m, &opt, &ts, comm, &scratch, 0, &lg))) break;
      }
    }
  }
  loader_stop(&L);
  res->steps = ts.step;
  res->wall_s = dt_now() - t_start;
  if (!code && stop_signal) {
    if (leader) {
      const char *why = stop_signal == SIGUSR1 ? "SIGUSR1" : stop_signal == SIGTERM ? "SIGTERM" : "train.time_limit";
      fprintf(stderr,
              "ddp_train: stopped by %s at step %lld after saving a checkpoint%s; continue with --resume auto\n", why,
              (long long)ts.step, v->ckpt_dir[0] ? "" : " (none: checkpoint.dir is empty)");
      fflush(stderr);
    }
    code = DT_EXIT_STOPPED;
  } else if (!code) {
    log_line(&lg, "done: %lld steps in %.1f s, %.0f samples/s mean", (long long)ts.step, res->wall_s,
             res->wall_s > 0 ? (double)run_samples / res->wall_s : 0.0);
    if (res->best_val_acc >= 0)
      log_line(&lg, "best val_acc %.4f, final val_acc %.4f", res->best_val_acc, res->final_val_acc);
  }
  free(scratch.params);
  free(scratch.bufs);
  optim_free(&opt, be);
  grad_sync_free(&gs);
  sampler_free(&smp);
  log_close(&lg);
  return code;
}
