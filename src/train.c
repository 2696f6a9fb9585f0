/* train.c: the one training loop, for every backend and world size (train.h): the run's start in
 * three phases (check, allocate, restore), the loop over epochs and optimizer steps (one step:
 * train_step.c), the reports after each step (train_metrics.h), validation (infer.h), best-metric
 * tracking and early stopping, checkpoints when due, and the end (the summary, or the stop message
 * and exit 75). The state the steps share is a dt_trainer (trainer.h). */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "infer.h"
#include "log.h"
#include "trainer.h"

/* fp16 loss scaling: GradScaler's initial scale (the rest of its rules: train_step.c) */
static const double scale_init = 65536.0;

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

/* Phase one of the start: the sampler (and its twin for ignore_index), the refusals, whether steps
 * may be captured, the log. Returns the agreed code (then nothing is left to free). */
static int trainer_check(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  dt_status st = {0};
  const int W = tr->comm->size, rank = tr->comm->rank;
  const int64_t G = config_global_batch(v, W), n = tr->d->train.n;
  const int contiguous = v->sharding == DT_SHARD_CONTIGUOUS;
  sampler_init(&tr->smp, n, W, rank, G, contiguous, v->drop_last, v->shuffle, (uint64_t)v->seed);
  if (tr->m->loss.ignore_index_set) {
    sampler_init(&tr->counter.smp, n, W, rank, G, contiguous, v->drop_last, v->shuffle, (uint64_t)v->seed);
    tr->counter.idx = dt_malloc((size_t)(sampler_max_local(&tr->counter.smp) + 1) * sizeof(int64_t));
  }
  if (contiguous && G < W)
    dt_fail(&st, DT_EXIT_INPUT,
            "data.sharding contiguous: the global batch (%lld) must be at least the number of "
            "ranks (%d), or some ranks' rows would never be used",
            (long long)G, W);
  if (tr->smp.steps == 0)
    dt_fail(&st, DT_EXIT_INPUT,
            "%s: the global batch (%lld) is larger than the %lld training rows and data.drop_last "
            "is true: no step to run",
            tr->d->path, (long long)G, (long long)n);
  const char *no_graph = !tr->be->capture_begin    ? "it runs on the CPU backend (CUDA graphs need --device cuda)"
                         : v->grad_accum > 1       ? "train.grad_accum is above 1 (a captured step has one micro-batch)"
                         : !tr->opts->dev && W > 1 ? "its gradients are summed over MPI through host memory (a "
                                                     "captured step needs NCCL, or a single rank)"
                                                   : NULL;
  if (v->cuda_graph == DT_GRAPH_ON && no_graph)
    dt_fail(&st, DT_EXIT_INPUT,
            "train.cuda_graph is on, but this run cannot capture its step: %s; set it to auto or off", no_graph);
  tr->graphs.on = v->cuda_graph != DT_GRAPH_OFF && !no_graph;
  tr->graphs.warm_rows = -1;
  log_open(&tr->lg, rank == 0, v->log_dir, v->progress, tr->opts->resume != NULL, &st);
  int code = comm_agree(tr->comm, &st);
  if (code) {
    sampler_free(&tr->smp);
    sampler_free(&tr->counter.smp); /* zeroed when unused */
    free(tr->counter.idx);
    log_close(&tr->lg);
  }
  return code;
}

/* Phase two: the optimizer, the step's buffers, the batches, the device cache, the gradient
 * buckets, the reports' window and rank 0's checkpoint scratch. */
static void trainer_alloc(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  tr->accum = v->grad_accum;
  tr->opt_per_epoch = (tr->smp.steps + tr->accum - 1) / tr->accum;
  tr->total = tr->opt_per_epoch * v->epochs;
  if (v->max_steps && v->max_steps < tr->total) tr->total = v->max_steps;
  if (tr->counter.idx) tr->counter.weight = (double *)be->alloc(be, sizeof(double));
  optim_init(&tr->opt, v, be, m->n_params, tr->total);
  if (v->no_decay) { /* optim.no_decay: weight decay only on the other tensors */
    int64_t *off = dt_malloc((size_t)m->n_tensors * sizeof(int64_t)),
            *len = dt_malloc((size_t)m->n_tensors * sizeof(int64_t));
    int *decay = dt_malloc((size_t)m->n_tensors * sizeof(int));
    optim_set_runs(&tr->opt, model_decay_runs(m, v->no_decay, off, len, decay), off, len, decay);
    free(off);
    free(len);
    free(decay);
  }
  dt_step_sums *s = &tr->sums;
  s->stats = (double *)be->alloc(be, STATS * sizeof(double));
  s->stats_host = be->alloc_host(be, STATS * sizeof(double));
  if (v->precision == DT_PREC_FP16) {
    s->scaler = be->alloc(be, 2 * sizeof(float));
    s->scaler_host = be->alloc_host(be, 2 * sizeof(float));
    tr->opt.skip = s->stats + 5;
  }
  s->clip_sq = (double *)be->alloc(be, 2 * sizeof(double));
  for (int i = 0; i < 2; i++) batch_alloc(&tr->in[i], m, m->max_batch);
  if (v->cache == DT_CACHE_DEVICE) cache_fill(&tr->cache, be, &tr->d->train); /* one copy, then row numbers */
  ddp_init(&tr->ddp, tr->comm, tr->opts->dev, be, m->grads, m->n_params,
           (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float)), s->stats + 2);
  const dt_metrics_src src = {
      .log = &tr->lg, .comm = tr->comm, .be = be, .m = m, .ddp = &tr->ddp, .gpu = tr->opts->gpu, .accum = tr->accum};
  metrics_init(&tr->win, &src);
  if (tr->comm->rank == 0 && v->ckpt_dir[0])
    ckpt_data_alloc(&tr->scratch, m, dt_optim_kinds[v->optim]->n_states(v), v->ema_decay > 0);
}

/* Phase three: the training state, fresh or from the checkpoint resumed (optimizer state, loss
 * scale, EMA), the loader at its position, the start-up lines and the monitor's first snapshot. */
static void trainer_restore(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  const dt_ckpt_data *resume = tr->opts->resume;
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  const int W = tr->comm->size;
  const int64_t G = config_global_batch(v, W);
  tr->ts = (dt_train_state){.global_batch = G * tr->accum,
                            .world_size = W,
                            .seed = (uint64_t)v->seed,
                            .optim = v->optim,
                            .best_metric = lower_is_better(v->early_metric) ? INFINITY : -INFINITY,
                            .best_val_acc = -1};
  if (resume) {
    tr->ts = resume->ts;
    tr->ts.world_size = W;
    if (!tr->sums.scaler) tr->ts.loss_scale = tr->ts.scale_growth = 0;
    for (int k = 0; k < tr->opt.n_states; k++)
      if (resume->opt[k]) be->to_device(be, tr->opt.states[k], resume->opt[k], (size_t)m->n_params * sizeof(float));
    tr->opt.step = tr->ts.optim_step;
  }
  if (tr->sums.scaler) { /* a run that did not scale starts from GradScaler's initial scale */
    if (!(tr->ts.loss_scale > 0)) tr->ts.loss_scale = scale_init, tr->ts.scale_growth = 0;
    float s[2] = {(float)tr->ts.loss_scale, (float)tr->ts.scale_growth};
    be->to_device(be, tr->sums.scaler, s, sizeof s);
  }
  if (v->ema_decay > 0) {
    ema_init(&tr->ema, be, v->ema_decay, m->params, m->n_params, m->bufs, m->n_bufs);
    if (resume && resume->has_ema) {
      be->to_device(be, tr->ema.params, resume->ema_params, (size_t)m->n_params * sizeof(float));
      be->to_device(be, tr->ema.bufs, resume->ema_bufs, (size_t)m->n_bufs * sizeof(float));
    }
  }
  loader_start(&tr->L, tr->d, &tr->smp, m, tr->ts.epoch, tr->ts.micro, v->epochs, tr->cache.x != NULL);
  if (resume)
    log_line(&tr->lg, "resuming at step %lld (epoch %lld, batch %lld of %lld)%s", (long long)tr->ts.step,
             (long long)tr->ts.epoch + 1, (long long)tr->ts.micro, (long long)tr->smp.steps,
             tr->ema.params && !resume->has_ema ? "; the checkpoint has no EMA: it starts from these weights" : "");
  log_line(&tr->lg,
           "training: %lld optimizer steps (%lld epochs x %lld), global batch %lld on %d rank%s, %s backend, "
           "%d thread%s per rank",
           (long long)tr->total, (long long)v->epochs, (long long)tr->opt_per_epoch, (long long)(G * tr->accum), W,
           W > 1 ? "s" : "", be->name, be->threads, be->threads > 1 ? "s" : "");
  if (tr->cache.x) {
    const dt_split *s = &tr->d->train;
    log_line(&tr->lg, "data.cache device: %lld training rows per rank in device memory (%.1f MiB as stored)",
             (long long)(s->hi - s->lo), (double)((s->hi - s->lo) * s->row_elems) * (double)s->x_elem / 1048576.0);
  }
  if (be->capture_begin)
    log_line(&tr->lg, "cuda graph: %s",
             tr->graphs.on                   ? "on (each full step after the first is replayed as one graph)"
             : v->cuda_graph == DT_GRAPH_OFF ? "off (train.cuda_graph off)"
             : v->grad_accum > 1             ? "off (train.grad_accum > 1)"
                                             : "off (gradients over MPI)");
  tr->win.t_start = tr->win.t_window = dt_now();
  if (tr->ts.step >= tr->total) tr->stop = 1; /* nothing left: the final checkpoint is rewritten below */
  tr->win.snap = (dt_monitor_snapshot){.step = tr->ts.step, .total_steps = tr->total, .epoch = tr->ts.epoch + 1};
  monitor_publish(tr->opts->monitor, &tr->win.snap); /* the stall clock starts now */
}

/* Everything a checkpoint needs, copied to the host (d: the trainer's scratch, ckpt_data_alloc'd
 * for the optimizer's states and the EMA when there is one). */
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
  for (int k = 0; k < o->n_states; k++) be->to_host(be, d->opt[k], o->states[k], pb);
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

/* Validates when due (end of epoch, train.eval_every_steps, the last step), logs, tracks the best
 * metric and early stopping. *new_best: this evaluation is the best so far. Returns the code. */
static int evaluate_if_due(dt_trainer *tr, int end_of_epoch, dt_train_result *res, int *new_best) {
  const dt_config_values *v = tr->v;
  dt_train_state *ts = &tr->ts;
  *new_best = 0;
  int due = end_of_epoch || (v->eval_every_steps && ts->step % v->eval_every_steps == 0) || tr->stop;
  if (!tr->d->has_val || tr->stop_signal || !due) return 0;
  loader_wait_filled(&tr->L); /* HDF5 is the loader thread's while it fills the cache */
  dt_status st = {0};
  double vl, va, evl = 0, eva = -1, t_eval = dt_now();
  infer_evaluate(tr->m, NULL, NULL, tr->d, tr->comm, &vl, &va, &st);
  if (tr->ema.params) infer_evaluate(tr->m, tr->ema.params, tr->ema.bufs, tr->d, tr->comm, &evl, &eva, &st);
  tr->win.t_window += dt_now() - t_eval; /* throughput windows count training time only */
  int code = comm_agree(tr->comm, &st);
  if (code) return code;
  res->final_val_loss = vl;
  res->final_val_acc = va;
  tr->win.snap.val_step = ts->step;
  tr->win.snap.val_loss = vl;
  tr->win.snap.val_acc = va;
  tr->win.snap.has_ema = tr->ema.params != NULL;
  tr->win.snap.ema_val_loss = evl;
  tr->win.snap.ema_val_acc = eva;
  if (va > ts->best_val_acc) ts->best_val_acc = va;
  res->best_val_acc = ts->best_val_acc;
  long long step = (long long)ts->step, epoch = (long long)tr->epoch + 1;
  char ema_text[128] = "", ema_json[128] = "";
  if (tr->ema.params && va >= 0) {
    snprintf(ema_text, sizeof ema_text, " | ema_val_loss %.4f ema_val_acc %.4f", evl, eva);
    snprintf(ema_json, sizeof ema_json, ", \"ema_val_loss\": %.6g, \"ema_val_acc\": %.6g", evl, eva);
  } else if (tr->ema.params) {
    snprintf(ema_text, sizeof ema_text, " | ema_val_mse %.6f", evl);
    snprintf(ema_json, sizeof ema_json, ", \"ema_val_loss\": %.6g", evl);
  }
  if (va >= 0) {
    log_line(&tr->lg, "eval step %lld epoch %lld: val_loss %.4f val_acc %.4f%s", step, epoch, vl, va, ema_text);
    log_metrics(&tr->lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g, \"val_acc\": %.6g%s", step, epoch, vl,
                va, ema_json);
  } else {
    log_line(&tr->lg, "eval step %lld epoch %lld: val_mse %.6f%s", step, epoch, vl, ema_text);
    log_metrics(&tr->lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.6g%s", step, epoch, vl, ema_json);
  }
  int metric = v->early_metric != DT_METRIC_NONE ? v->early_metric : va >= 0 ? DT_METRIC_VAL_ACC : DT_METRIC_VAL_LOSS;
  const double values[] = {0, vl, va, evl, eva};
  double value = values[metric];
  if (!isfinite(ts->best_metric) || improved(metric, value, ts->best_metric)) {
    ts->best_metric = value;
    ts->bad_evals = 0;
    *new_best = 1;
  } else if (v->early_metric != DT_METRIC_NONE && ++ts->bad_evals >= v->early_patience) {
    log_line(&tr->lg, "early stopping: %s has not improved for %lld evaluations", metric_name(v->early_metric),
             (long long)ts->bad_evals);
    tr->stop = 1;
  }
  return 0;
}

/* best.h5 on a new best (checkpoint.best), then a step checkpoint when periodic or last. */
static int checkpoint_if_due(dt_trainer *tr, int end_of_epoch, int new_best) {
  const dt_config_values *v = tr->v;
  if (!v->ckpt_dir[0]) return 0;
  int code = 0;
  int periodic = (v->ckpt_every_steps && tr->ts.step % v->ckpt_every_steps == 0) ||
                 (end_of_epoch && v->ckpt_every_epochs && (tr->epoch + 1) % v->ckpt_every_epochs == 0);
  int step_due = periodic || tr->ckpt_asked || tr->stop || tr->ts.step == tr->total;
  if ((new_best && v->ckpt_best) || step_due)
    loader_wait_filled(&tr->L); /* HDF5 is the loader thread's while it fills the cache */
  if (new_best && v->ckpt_best &&
      (code = save_checkpoint(tr->cfg, tr->m, &tr->opt, &tr->ema, &tr->ts, tr->comm, &tr->scratch, 1, &tr->lg)))
    return code;
  if (step_due) {
    code = save_checkpoint(tr->cfg, tr->m, &tr->opt, &tr->ema, &tr->ts, tr->comm, &tr->scratch, 0, &tr->lg);
    if (!code) tr->win.snap.ckpt_step = tr->ts.step, tr->win.snap.ckpt_time = dt_now();
  }
  return code;
}

/* model.loss ignore_index: the targets the step's global batch averages over, summed over ranks
 * (a collective; the sampler gives each rank its rows without reading them). At least 1. */
static double step_targets(dt_trainer *tr) {
  double c = 0;
  for (int64_t j = 0; j < tr->k; j++) {
    int64_t global, n = sampler_batch(&tr->counter.smp, tr->epoch, tr->micro0 + j, tr->counter.idx, &global);
    c += count_targets(&tr->d->train, tr->counter.idx, n, tr->m->loss.ignore_index);
  }
  comm_allreduce_sum_f64(tr->comm, &c, 1, "target count");
  return c > 0 ? c : 1;
}

/* One optimizer step: micro-batches, reduce and agree, step, log, evaluate, checkpoint. */
static int train_step(dt_trainer *tr, dt_train_result *res) {
  const dt_config_values *v = tr->v;
  tr->comm->step = tr->ts.step + 1;
  tr->micro0 = tr->os * tr->accum;
  tr->k = tr->smp.steps - tr->micro0 < tr->accum ? tr->smp.steps - tr->micro0 : tr->accum;
  tr->count = 0;
  for (int64_t j = 0; j < tr->k; j++) tr->count += (double)sampler_count(&tr->smp, tr->micro0 + j);
  tr->target_count = tr->m->loss.ignore_index_set ? step_targets(tr) : tr->count * (double)tr->m->n_labels;
  if (tr->counter.weight) { /* queued before the step (a graph replay reads it) */
    const double w = 1.0 / tr->target_count;
    tr->be->upload(tr->be, tr->counter.weight, &w, sizeof w);
  }
  dt_status st = {0};
  dt_step_report mine = {0};
  double data_s = 0;
  step_run(tr, &mine, &data_s, &st);
  int code = step_agree(tr, &mine, &st);
  if (code) return code;
  metrics_step(&tr->win, tr->ts.step, tr->total, tr->epoch, tr->lr, tr->all.loss_sum / tr->target_count, tr->count,
               data_s, tr->v->log_every_steps);
  if (tr->all.stop) tr->stop = 1, tr->stop_signal = tr->all.stop;
  tr->ckpt_asked = tr->all.checkpoint;
  if (tr->ckpt_asked)
    log_line(&tr->lg, "step %lld: a checkpoint was asked for (POST /checkpoint)", (long long)tr->ts.step);
  int end_of_epoch = tr->os == tr->opt_per_epoch - 1, new_best;
  if (v->max_steps && tr->ts.step >= v->max_steps) tr->stop = 1;
  if ((code = evaluate_if_due(tr, end_of_epoch, res, &new_best))) return code;
  code = checkpoint_if_due(tr, end_of_epoch, new_best);
  dt_monitor_snapshot *sn = &tr->win.snap;
  sn->steps_run++;
  sn->step = tr->ts.step;
  sn->total_steps = tr->total;
  sn->epoch = tr->epoch + 1;
  sn->train_s = dt_now() - tr->win.t_start;
  monitor_publish(tr->opts->monitor, sn);
  return code;
}

/* The stop message (signal or time limit: exit 75) or the summary. */
static int trainer_report_end(dt_trainer *tr, int code, dt_train_result *res) {
  res->steps = tr->ts.step;
  res->wall_s = dt_now() - tr->win.t_start;
  if (!code && tr->stop_signal) {
    if (tr->comm->rank == 0) {
      int s = tr->stop_signal;
      const char *why = s == SIGUSR1        ? "SIGUSR1"
                        : s == SIGTERM      ? "SIGTERM"
                        : s == DT_STOP_HTTP ? "POST /stop"
                                            : "train.time_limit";
      fprintf(stderr,
              "ddp_train: stopped by %s at step %lld after saving a checkpoint%s; continue with --resume auto\n", why,
              (long long)tr->ts.step, tr->v->ckpt_dir[0] ? "" : " (none: checkpoint.dir is empty)");
      fflush(stderr);
    }
    return DT_EXIT_STOPPED;
  }
  if (!code) {
    log_line(&tr->lg, "done: %lld steps in %.1f s, %.0f samples/s mean", (long long)tr->ts.step, res->wall_s,
             res->wall_s > 0 ? (double)tr->win.run_samples / res->wall_s : 0.0);
    if (res->best_val_acc >= 0)
      log_line(&tr->lg, "best val_acc %.4f, final val_acc %.4f", res->best_val_acc, res->final_val_acc);
    if (tr->graphs.captures)
      log_line(&tr->lg, "cuda graph: %lld steps captured, %lld replayed", (long long)tr->graphs.captures,
               (long long)tr->graphs.replays);
  }
  return code;
}

/* Frees what trainer_alloc and trainer_restore made, and what trainer_check kept. */
static void trainer_free(dt_trainer *tr) {
  dt_backend *be = tr->be;
  loader_stop(&tr->L);
  for (int i = 0; i < 2; i++) {
    if (tr->graphs.exec[i]) be->graph_free(be, tr->graphs.exec[i]);
    batch_free(&tr->in[i], be);
  }
  be->free(be, tr->sums.stats);
  be->free_host(be, tr->sums.stats_host);
  be->free(be, tr->sums.clip_sq);
  if (tr->sums.scaler) {
    be->free(be, tr->sums.scaler);
    be->free_host(be, tr->sums.scaler_host);
  }
  if (tr->counter.weight) be->free(be, tr->counter.weight);
  free(tr->counter.idx);
  sampler_free(&tr->counter.smp); /* zeroed when unused */
  cache_free(&tr->cache, be);
  if (tr->ema.params) ema_free(&tr->ema, be);
  optim_free(&tr->opt, be);
  ddp_free(&tr->ddp);
  metrics_free(&tr->win);
  ckpt_data_free(&tr->scratch);
  sampler_free(&tr->smp);
  log_close(&tr->lg);
}

int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const dt_train_opts *opts,
              dt_train_result *res) {
  memset(res, 0, sizeof *res);
  dt_trainer run = {.cfg = cfg, .v = &cfg->v, .m = m, .d = d, .comm = comm, .opts = opts, .be = m->be};
  dt_trainer *tr = &run;
  int code = trainer_check(tr);
  if (code) return code;
  trainer_alloc(tr);
  trainer_restore(tr);
  res->best_val_acc = tr->ts.best_val_acc;
  for (tr->epoch = tr->ts.epoch; tr->epoch < cfg->v.epochs && !tr->stop && !code; tr->epoch++)
    for (tr->os = tr->epoch == tr->ts.epoch ? tr->ts.micro / tr->accum : 0;
         tr->os < tr->opt_per_epoch && !tr->stop && !code; tr->os++)
      code = train_step(tr, res);
  code = trainer_report_end(tr, code, res);
  trainer_free(tr);
  return code;
}
