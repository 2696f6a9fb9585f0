#include "train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "layers.h"
#include "log.h"
#include "optim.h"

typedef struct {
  dt_comm *comm;
  dt_grad_sync *gs;
} pass_ctx;

static void ctx_allreduce(void *ctx, double *data, int n) { comm_allreduce_sum_f64(((pass_ctx *)ctx)->comm, data, n); }
static void ctx_ready(void *ctx, int64_t from) { grad_sync_ready(((pass_ctx *)ctx)->gs, from); }

/* Raw host rows -> the model's input buffer, normalised per channel. */
static void load_input(const dt_config *cfg, dt_model *m, const float *raw, int64_t rows, float *mean, float *std) {
  const dt_config_values *v = &cfg->v;
  for (int c = 0; c < v->mean.n; c++) mean[c] = (float)v->mean.v[c];
  for (int c = 0; c < v->std.n; c++) std[c] = (float)v->std.v[c];
  int64_t ch = m->input.rank == 3 ? m->input.c : 1;
  dt_op op = {.type = DT_OP_INPUT};
  op.p.input = (typeof(op.p.input)){rows, ch, shape_size(m->input) / ch, (float)v->scale,
                                    v->mean.n ? mean : NULL, v->std.n ? std : NULL, raw, m->input_x};
  backend_run(m->be, &op);
}

void train_evaluate(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, double *loss, double *acc,
                    dt_status *st) {
  dt_split *s = &d->val;
  int64_t rows = s->hi - s->lo, cap = m->max_batch;
  float *x = dt_malloc((size_t)(cap * shape_size(m->input)) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)cap * sizeof(int32_t));
  float *targets = dt_malloc((size_t)(cap * m->n_outputs) * sizeof(float));
  int64_t *idx = dt_malloc((size_t)cap * sizeof(int64_t));
  float mean[DT_MAX_LIST], std[DT_MAX_LIST];
  double sums[3] = {0, 0, (double)rows};
  dt_pass pass = {.be = m->be, .training = 0, .global_count = 1, .params = m->params, .grads = m->grads, .bufs = m->bufs};
  for (int64_t i = 0; i < rows && !st->code; i += cap) {
    int64_t n = rows - i < cap ? rows - i : cap;
    for (int64_t k = 0; k < n; k++) idx[k] = s->lo + i + k;
    if (data_gather(d, s, idx, n, x, labels, targets, st)) break;
    load_input(cfg, m, x, n, mean, std);
    pass.batch = n;
    model_forward(m, &pass);
    loss_compute(m, &pass, labels, targets, &sums[0], &sums[1]);
  }
  free(x);
  free(labels);
  free(targets);
  free(idx);
  comm_allreduce_sum_f64(comm, sums, 3);
  *loss = sums[2] > 0 ? sums[0] / sums[2] : 0;
  *acc = m->loss_kind == DT_LOSS_CROSS_ENTROPY && sums[2] > 0 ? sums[1] / sums[2] : -1;
}

static int improved(int metric, double value, double best) {
  return metric == DT_METRIC_VAL_LOSS ? value < best : value > best;
}

int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, dt_train_result *res) {
  const dt_config_values *v = &cfg->v;
  dt_status st = {0};
  memset(res, 0, sizeof *res);
  const int W = comm->size, leader = comm->rank == 0;
  const int64_t G = v->global_batch_size ? v->global_batch_size : v->batch_size * W;
  dt_sampler smp;
  sampler_init(&smp, d->train.n, W, comm->rank, G, v->sharding == DT_SHARD_CONTIGUOUS, v->drop_last, v->shuffle,
               (uint64_t)v->seed);
  if (v->sharding == DT_SHARD_CONTIGUOUS && G < W)
    dt_fail(&st, DT_EXIT_INPUT, "data.sharding contiguous: the global batch (%lld) must be at least the number of "
            "ranks (%d), or some ranks' rows would never be used", (long long)G, W);
  if (smp.steps == 0)
    dt_fail(&st, DT_EXIT_INPUT, "%s: the global batch (%lld) is larger than the %lld training rows and data.drop_last "
            "is true: no step to run", d->path, (long long)G, (long long)d->train.n);
  dt_log lg;
  log_open(&lg, leader, v->log_dir, v->progress, &st);
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
  grad_sync_init(&gs, comm, m->grads, m->n_params, (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float)));
  pass_ctx ctx = {comm, &gs};
  dt_loader L;
  loader_start(&L, d, &smp, m, 0, 0, v->epochs);
  float mean[DT_MAX_LIST], std[DT_MAX_LIST];

  log_line(&lg, "training: %lld optimizer steps (%lld epochs x %lld), global batch %lld on %d rank%s, %s backend, "
           "%d thread%s per rank",
           (long long)total, (long long)v->epochs, (long long)opt_per_epoch, (long long)(G * accum), W, W > 1 ? "s" : "",
           be->name, be->threads, be->threads > 1 ? "s" : "");

  double t_start = dt_now(), t_window = t_start, win_data = 0, win_comm = 0, win_loss = 0;
  int64_t win_samples = 0, win_steps = 0, step = 0;
  double best_metric = v->early_metric == DT_METRIC_VAL_LOSS ? INFINITY : -INFINITY;
  int64_t bad_evals = 0;
  int stop = 0;
  res->best_val_acc = -1;

  for (int64_t epoch = 0; epoch < v->epochs && !stop && !code; epoch++) {
    for (int64_t os = 0; os < opt_per_epoch && !stop && !code; os++) {
      int64_t micro0 = os * accum, k = smp.steps - micro0 < accum ? smp.steps - micro0 : accum;
      double count = 0;
      for (int64_t j = 0; j < k; j++) count += (double)sampler_count(&smp, micro0 + j);
      be->zero(be, m->grads, (size_t)m->n_params * sizeof(float));
      double sums[3] = {0, 0, 0}; /* loss sum, correct, non-finite losses */
      double data_s = 0;
      for (int64_t j = 0; j < k && !st.code; j++) {
        double w0 = L.wait_s;
        dt_batch *b = loader_next(&L, &st);
        if (!b) break;
        data_s += L.wait_s - w0;
        load_input(cfg, m, b->x, b->count, mean, std);
        dt_pass pass = {.be = be,
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
        loss_compute(m, &pass, b->labels, b->targets, &l, &c);
        if (!isfinite(l)) sums[2] += 1;
        sums[0] += l;
        sums[1] += c;
        model_backward(m, &pass);
      }
      /* a data error on one rank must not leave the others in a collective */
      if ((code = comm_agree(comm, &st))) break;
      grad_sync_finish(&gs);
      comm_allreduce_sum_f64(comm, sums, 3);
      if (sums[2] > 0) {
        dt_status nan_st = {0};
        dt_fail(&nan_st, DT_EXIT_NUMERIC, "the loss became non-finite at step %lld (epoch %lld); lower optim.lr or "
                "set train.clip_grad_norm", (long long)step, (long long)epoch);
        code = comm_agree(comm, &nan_st);
        break;
      }
      if (v->clip_grad_norm > 0) {
        double sq = 0;
        int64_t bad = 0;
        dt_op op = {.type = DT_OP_SUMSQ};
        op.p.sumsq = (typeof(op.p.sumsq)){m->n_params, m->grads, &sq, &bad};
        backend_run(be, &op);
        double norm = sqrt(sq);
        if (norm > v->clip_grad_norm) {
          dt_op sc = {.type = DT_OP_SCALE};
          sc.p.scale = (typeof(sc.p.scale)){m->n_params, (float)(v->clip_grad_norm / (norm + 1e-6)), m->grads};
          backend_run(be, &sc);
        }
      }
      double lr = schedule_lr(v, step, total);
      optim_step(&opt, be, m->params, m->grads, lr);
      step++;
      double loss = sums[0] / count;
      win_loss += loss;
      win_steps++;
      win_samples += (int64_t)count;
      win_data += data_s;
      win_comm += gs.wait_s;
      double now = dt_now();
      log_progress(&lg, step, total, now - t_start, loss);
      if (step % v->log_every_steps == 0 || step == total) {
        double span = now - t_window, ms = 1e3 * span / (double)win_steps;
        double data_ms = 1e3 * win_data / (double)win_steps, comm_ms = 1e3 * win_comm / (double)win_steps;
        double sps = span > 0 ? (double)win_samples / span : 0, mean_loss = win_loss / (double)win_steps;
        log_line(&lg, "step %lld/%lld epoch %lld loss %.4f lr %.5f | %.0f samples/s | %.1f ms/step (compute %.1f, "
                 "data %.1f, comm %.1f)",
                 (long long)step, (long long)total, (long long)epoch + 1, mean_loss, lr, sps, ms,
                 ms - data_ms - comm_ms, data_ms, comm_ms);
        log_metrics(&lg, "\"step\": %lld, \"epoch\": %lld, \"loss\": %.6g, \"lr\": %.6g, \"samples_per_s\": %.1f, "
                    "\"step_ms\": %.3f, \"compute_ms\": %.3f, \"data_ms\": %.3f, \"comm_ms\": %.3f",
                    (long long)step, (long long)epoch + 1, mean_loss, lr, sps, ms, ms - data_ms - comm_ms, data_ms,
                    comm_ms);
        t_window = now;
        win_loss = win_data = win_comm = 0;
        win_samples = win_steps = 0;
      }
      int end_of_epoch = os == opt_per_epoch - 1;
      int eval_now = d->has_val && (end_of_epoch || (v->eval_every_steps && step % v->eval_every_steps == 0));
      if (v->max_steps && step >= v->max_steps) stop = 1;
      if (eval_now || (stop && d->has_val)) {
        double vl, va, t_eval = dt_now();
        train_evaluate(cfg, m, d, comm, &vl, &va, &st);
        t_window += dt_now() - t_eval; /* throughput windows count training time only */
        if ((code = comm_agree(comm, &st))) break;
        res->final_val_loss = vl;
        res->final_val_acc = va;
        if (va > res->best_val_acc) res->best_val_acc = va;
        if (va >= 0)
          log_line(&lg, "eval step %lld epoch %lld: val_loss %.4f val_acc %.4f", (long long)step, (long long)epoch + 1,
                   vl, va);
        else
          log_line(&lg, "eval step %lld epoch %lld: val_mse %.6f", (long long)step, (long long)epoch + 1, vl);
        if (va >= 0)
          log_metrics(&lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g, \"val_acc\": %.6g", (long long)step,
                      (long long)epoch + 1, vl, va);
        else
          log_metrics(&lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g", (long long)step, (long long)epoch + 1,
                      vl);
        if (v->early_metric != DT_METRIC_NONE) {
          double value = v->early_metric == DT_METRIC_VAL_LOSS ? vl : va;
          if (improved(v->early_metric, value, best_metric)) {
            best_metric = value;
            bad_evals = 0;
          } else if (++bad_evals >= v->early_patience) {
            log_line(&lg, "early stopping: %s has not improved for %lld evaluations",
                     v->early_metric == DT_METRIC_VAL_LOSS ? "val_loss" : "val_acc", (long long)bad_evals);
            stop = 1;
          }
        }
      }
    }
  }
  loader_stop(&L);
  res->steps = step;
  res->wall_s = dt_now() - t_start;
  if (!code && v->ckpt_dir[0]) {
    dt_status cst = {0};
    if (leader) {
      float *hp = dt_malloc((size_t)(m->n_params ? m->n_params : 1) * sizeof(float));
      float *hb = dt_malloc((size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float));
      be->to_host(be, hp, m->params, (size_t)m->n_params * sizeof(float));
      be->to_host(be, hb, m->bufs, (size_t)m->n_bufs * sizeof(float));
      char path[1200];
      snprintf(path, sizeof path, "%s/final.h5", v->ckpt_dir);
      if (!log_mkdirs(v->ckpt_dir, &cst) && !ckpt_write_model(path, m, hp, hb, cfg, W, step, &cst))
        log_line(&lg, "saved %s", path);
      free(hp);
      free(hb);
    }
    code = comm_agree(comm, &cst);
  }
  if (!code) {
    log_line(&lg, "done: %lld steps in %.1f s, %.0f samples/s mean%s", (long long)step, res->wall_s,
             res->wall_s > 0 ? (double)step * (double)(G * accum) / res->wall_s : 0.0, "");
    if (res->best_val_acc >= 0)
      log_line(&lg, "best val_acc %.4f, final val_acc %.4f", res->best_val_acc, res->final_val_acc);
  }
  optim_free(&opt, be);
  grad_sync_free(&gs);
  sampler_free(&smp);
  log_close(&lg);
  return code;
}
