/* train.c: the one training loop, for every backend and world size (train.h): the run's start in
 * three phases (check, allocate, restore), the loop over epochs and optimizer steps (one step:
 * train_step.c), the reports after each step (train_metrics.h), validation (infer.h), best-metric
 * tracking and early stopping, checkpoints when due, and the end (the summary, or the stop message
 * and exit 75). The state the steps share is a dt_trainer (train_step.h). */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "infer.h"
#include "train_step.h"

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

/* The run's start: the steps' samplers and refusals (step_open), the log; then the step's buffers,
 * the reports' window, rank 0's checkpoint scratch; then the training state, fresh or resumed, the
 * start-up lines and the monitor's first snapshot. Returns the agreed code. */
static int trainer_start(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  const dt_ckpt_data *resume = tr->opts->resume;
  dt_status st = {0};
  const int W = tr->comm->size;
  const int64_t G = config_global_batch(v, W);
  step_open(tr, &st);
  log_open(&tr->lg, tr->comm->rank == 0, v->log_dir, v->progress, resume != NULL, &st);
  int code = infer_check_val(tr->m, tr->d, tr->comm, &st);
  if (code) return code;
  tr->accum = v->grad_accum;
  tr->opt_per_epoch = (tr->micro_per_epoch + tr->accum - 1) / tr->accum;
  tr->total = tr->opt_per_epoch * v->epochs;
  if (v->max_steps && v->max_steps < tr->total) tr->total = v->max_steps;
  const dt_metrics_src src = {.log = &tr->lg,
                              .comm = tr->comm,
                              .be = tr->be,
                              .m = tr->m,
                              .ddp = step_alloc(tr),
                              .gpu = tr->opts->gpu,
                              .accum = tr->accum};
  metrics_init(&tr->win, &src);
  if (tr->comm->rank == 0 && v->ckpt_dir[0]) ckpt_data_alloc(&tr->scratch, tr->m, v);
  tr->ts = (dt_train_state){.global_batch = G * tr->accum,
                            .world_size = W,
                            .seed = (uint64_t)v->seed,
                            .optim = v->optim,
                            .best_metric = lower_is_better(v->early_metric) ? INFINITY : -INFINITY,
                            .best_val_acc = -1};
  if (resume) {
    tr->ts = resume->ts;
    tr->ts.world_size = W;
  }
  step_restore(tr);
  int stale = 0;
  if (tr->comm->rank == 0 && v->ckpt_dir[0]) ckpt_clean_stale(v->ckpt_dir, &stale);
  if (stale)
    log_line(&tr->lg, "removed %d temporary file%s that crashed runs left in %s", stale, stale > 1 ? "s" : "",
             v->ckpt_dir);
  if (resume)
    log_line(&tr->lg, "resuming at step %lld (epoch %lld, batch %lld of %lld)%s", (long long)tr->ts.step,
             (long long)tr->ts.epoch + 1, (long long)tr->ts.micro, (long long)tr->micro_per_epoch,
             step_ema(tr, NULL, NULL) && !resume->has_ema ? "; the checkpoint has no EMA: it starts from these weights"
                                                          : "");
  log_line(&tr->lg,
           "training: %lld optimizer steps (%lld epochs x %lld), global batch %lld on %d rank%s, %s backend, "
           "%d thread%s per rank",
           (long long)tr->total, (long long)v->epochs, (long long)tr->opt_per_epoch, (long long)(G * tr->accum), W,
           W > 1 ? "s" : "", tr->be->name, tr->be->threads, tr->be->threads > 1 ? "s" : "");
  const dt_startup_times *t = &tr->opts->startup;
  const double total = dt_now() - tr->opts->t_launch;
  log_line(&tr->lg,
           "start-up: %.3f s (MPI %.3f, config and model %.3f, data %.3f, device %.3f, weights %.3f, the rest "
           "%.3f)",
           total, t->mpi, t->prepared - t->mpi, t->data - t->prepared, t->device - t->data, t->weights - t->device,
           total - t->weights);
  if (tr->m->recompute) /* what its memory estimate gained */
    log_line(&tr->lg,
             "train.recompute blocks: %d blocks run forward again before their backward; activations %.1f "
             "MiB instead of %.1f",
             tr->m->top.n_blocks,
             (double)model_activation_bytes(tr->m, tr->m->max_batch, DT_RECOMPUTE_BLOCKS) / 1048576.0,
             (double)model_activation_bytes(tr->m, tr->m->max_batch, DT_RECOMPUTE_NONE) / 1048576.0);
  step_log_setup(tr);
  tr->win.t_start = tr->win.t_window = dt_now();
  if (tr->ts.step >= tr->total) tr->stop = 1; /* nothing left: the final checkpoint is rewritten below */
  tr->win.snap = (dt_monitor_snapshot){.step = tr->ts.step, .total_steps = tr->total, .epoch = tr->ts.epoch + 1};
  monitor_publish(tr->opts->monitor, &tr->win.snap); /* the stall clock starts now */
  return 0;
}

/* Rank 0 writes a step checkpoint (or best.h5); all ranks agree on the outcome. */
static int save_checkpoint(dt_trainer *tr, int best) {
  dt_status st = {0};
  step_gather_shards(tr, tr->comm->rank == 0 ? &tr->scratch : NULL); /* dist.zero 1's optimizer state */
  if (tr->comm->rank == 0) {
    const dt_config_values *v = tr->v;
    step_snapshot(tr, &tr->scratch);
    char path[1200];
    if (!log_mkdirs(v->ckpt_dir, &st)) {
      if (best) {
        ckpt_clean_stale(v->ckpt_dir, NULL);
        snprintf(path, sizeof path, "%s/best.h5", v->ckpt_dir);
        if (!ckpt_write(path, tr->m, &tr->scratch, tr->cfg, &st)) log_line(&tr->lg, "saved %s (best so far)", path);
      } else if (!ckpt_save_step(v->ckpt_dir, v->ckpt_keep, tr->m, &tr->scratch, tr->cfg, path, sizeof path, &st)) {
        log_line(&tr->lg, "saved %s", path);
      }
    }
  }
  return comm_agree(tr->comm, &st);
}

/* This step (tr->at) is its epoch's last. */
static int ends_epoch(const dt_trainer *tr) {
  return tr->at.os == tr->opt_per_epoch - 1;
}

/* Validation's schedule after step `step`: the end of an epoch, or train.eval_every_steps (and the
 * last step, and a stop). */
static int evaluation_scheduled(const dt_trainer *tr, int64_t step, int end_of_epoch) {
  return tr->d->has_val && (end_of_epoch || (tr->v->eval_every_steps && step % tr->v->eval_every_steps == 0));
}

/* The periodic checkpoints' schedule after step `step` (checkpoint.every_steps and every_epochs). */
static int checkpoint_scheduled(const dt_trainer *tr, int64_t step, int end_of_epoch) {
  const dt_config_values *v = tr->v;
  return v->ckpt_dir[0] && ((v->ckpt_every_steps && step % v->ckpt_every_steps == 0) ||
                            (end_of_epoch && v->ckpt_every_epochs && (tr->at.epoch + 1) % v->ckpt_every_epochs == 0));
}

/* Validates when due (end of epoch, train.eval_every_steps, the last step), logs, tracks the best
 * metric and early stopping. *new_best: this evaluation is the best so far. Returns the code. */
static int evaluate_if_due(dt_trainer *tr, int end_of_epoch, dt_train_result *res, int *new_best) {
  const dt_config_values *v = tr->v;
  dt_train_state *ts = &tr->ts;
  *new_best = 0;
  int due = evaluation_scheduled(tr, ts->step, end_of_epoch) || tr->stop;
  /* a stop skips validation, but for the last step's, which a resumed run would never reach */
  if (!tr->d->has_val || (tr->stop_signal && ts->step < tr->total) || !due) return 0;
  step_wait_filled(tr); /* HDF5 is the loader thread's while it fills the cache */
  dt_status st = {0};
  const float *ema_params, *ema_bufs;
  const int ema = step_ema(tr, &ema_params, &ema_bufs);
  double vl, va, evl = 0, eva = -1, t_eval = dt_now();
  infer_evaluate(tr->m, NULL, NULL, tr->d, tr->comm, &vl, &va, &st);
  if (ema) infer_evaluate(tr->m, ema_params, ema_bufs, tr->d, tr->comm, &evl, &eva, &st);
  tr->win.t_window += dt_now() - t_eval; /* throughput windows count training time only */
  int code = comm_agree(tr->comm, &st);
  if (code) return code;
  res->final_val_loss = vl;
  res->final_val_acc = va;
  tr->win.snap.val_step = ts->step;
  tr->win.snap.val_loss = vl;
  tr->win.snap.val_acc = va;
  tr->win.snap.has_ema = ema;
  tr->win.snap.ema_val_loss = evl;
  tr->win.snap.ema_val_acc = eva;
  if (va > ts->best_val_acc) ts->best_val_acc = va;
  res->best_val_acc = ts->best_val_acc;
  long long step = (long long)ts->step, epoch = (long long)tr->at.epoch + 1;
  char ema_text[128] = "", ema_json[128] = "";
  const int classifier = tr->m->loss.kind == DT_LOSS_CROSS_ENTROPY; /* the metric names follow the loss */
  if (ema && classifier) {
    snprintf(ema_text, sizeof ema_text, " | ema_val_loss %.4f ema_val_acc %.4f", evl, eva);
    snprintf(ema_json, sizeof ema_json, ", \"ema_val_loss\": %.9g, \"ema_val_acc\": %.9g", evl, eva);
  } else if (ema) {
    snprintf(ema_text, sizeof ema_text, " | ema_val_mse %.6f", evl);
    snprintf(ema_json, sizeof ema_json, ", \"ema_val_loss\": %.9g", evl);
  }
  if (classifier) {
    log_line(&tr->lg, "eval step %lld epoch %lld: val_loss %.4f val_acc %.4f%s", step, epoch, vl, va, ema_text);
    log_metrics(&tr->lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.9g, \"val_acc\": %.9g%s", step, epoch, vl,
                va, ema_json);
  } else {
    log_line(&tr->lg, "eval step %lld epoch %lld: val_mse %.6f%s", step, epoch, vl, ema_text);
    log_metrics(&tr->lg, "\"step\": %lld, \"epoch\": %lld, \"val_loss\": %.9g%s", step, epoch, vl, ema_json);
  }
  int metric = v->early_metric != DT_METRIC_NONE ? v->early_metric
               : classifier                      ? DT_METRIC_VAL_ACC
                                                 : DT_METRIC_VAL_LOSS;
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
  int step_due =
      checkpoint_scheduled(tr, tr->ts.step, end_of_epoch) || tr->ckpt_asked || tr->stop || tr->ts.step == tr->total;
  if ((new_best && v->ckpt_best) || step_due)
    step_wait_filled(tr); /* HDF5 is the loader thread's while it fills the cache */
  if (new_best && v->ckpt_best && (code = save_checkpoint(tr, 1))) return code;
  if (step_due) {
    code = save_checkpoint(tr, 0);
    if (!code) tr->win.snap.ckpt_step = tr->ts.step, tr->win.snap.ckpt_time = dt_now();
  }
  return code;
}

/* Whether the step after this one may be queued before this one's results are read (train.queue_ahead):
 * the run goes on past it, nothing after it reads its parameters (validation, a checkpoint), and no
 * stop or checkpoint agreed already waits for the step queued before. The same on every rank. */
static int may_queue_next(const dt_trainer *tr) {
  const int64_t step = tr->ts.step + 1;
  const int end_of_epoch = ends_epoch(tr);
  return tr->v->queue_ahead && !tr->stop && !tr->held_stop && !tr->held_ckpt && step < tr->total &&
         !evaluation_scheduled(tr, step, end_of_epoch) && !checkpoint_scheduled(tr, step, end_of_epoch);
}

/* One optimizer step: micro-batches, reduce and agree, step, log, evaluate, checkpoint. A stop or a
 * checkpoint agreed while the next step was already queued waits for that step. */
static int train_step(dt_trainer *tr, dt_train_result *res) {
  const dt_config_values *v = tr->v;
  tr->comm->step = tr->ts.step + 1;
  dt_status st = {0};
  dt_step_report mine = {0};
  double data_s = 0;
  step_run(tr, may_queue_next(tr), &mine, &data_s, &st);
  if (!st.code && tr->lg.st.code) st = tr->lg.st; /* a metrics line lost since the last step */
  int code = step_agree(tr, &mine, &st);
  if (code) return code;
  metrics_step(&tr->win, tr->ts.step, tr->total, tr->at.epoch, tr->at.lr, tr->all.loss_sum / tr->at.target_count,
               tr->at.count, data_s, tr->v->log_every_steps);
  int stop = tr->all.stop ? tr->all.stop : tr->held_stop, ckpt = tr->all.checkpoint || tr->held_ckpt;
  tr->held_stop = tr->held_ckpt = 0;
  if (step_next_queued(tr)) /* the next step reads and writes the parameters already */
    tr->held_stop = stop, tr->held_ckpt = ckpt, stop = ckpt = 0;
  if (stop) tr->stop = 1, tr->stop_signal = stop;
  tr->ckpt_asked = ckpt;
  if (tr->ckpt_asked)
    log_line(&tr->lg, "step %lld: a checkpoint was asked for (POST /checkpoint)", (long long)tr->ts.step);
  int end_of_epoch = ends_epoch(tr), new_best;
  if (v->max_steps && tr->ts.step >= v->max_steps) tr->stop = 1;
  if ((code = evaluate_if_due(tr, end_of_epoch, res, &new_best))) return code;
  code = checkpoint_if_due(tr, end_of_epoch, new_best);
  dt_monitor_snapshot *sn = &tr->win.snap;
  sn->steps_run++;
  sn->step = tr->ts.step;
  sn->total_steps = tr->total;
  sn->epoch = tr->at.epoch + 1;
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
    int64_t captures, replays, behind;
    step_graph_counts(tr, &captures, &replays, &behind);
    if (captures)
      log_line(&tr->lg, "cuda graph: %lld steps captured, %lld replayed", (long long)captures, (long long)replays);
    if (behind)
      log_line(&tr->lg, "queued ahead: %lld of %lld steps were queued while the step before ran", (long long)behind,
               (long long)tr->ts.step);
  }
  return code;
}

int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const dt_train_opts *opts,
              dt_train_result *res) {
  memset(res, 0, sizeof *res);
  dt_trainer run = {.cfg = cfg, .v = &cfg->v, .m = m, .d = d, .comm = comm, .opts = opts, .be = m->be};
  dt_trainer *tr = &run;
  int code = trainer_start(tr);
  if (code) {
    step_close(tr);
    log_close(&tr->lg);
    return code;
  }
  res->best_val_acc = tr->ts.best_val_acc;
  for (tr->at.epoch = tr->ts.epoch; tr->at.epoch < cfg->v.epochs && !tr->stop && !code; tr->at.epoch++)
    for (tr->at.os = tr->at.epoch == tr->ts.epoch ? tr->ts.micro / tr->accum : 0;
         tr->at.os < tr->opt_per_epoch && !tr->stop && !code; tr->at.os++)
      code = train_step(tr, res);
  if (!code) { /* the last lines (the last step's, the last evaluation's) are in, or the run fails */
    metrics_memory(&tr->win, opts->mem, opts->mem_estimate, tr->ts.step);
    dt_status st = {0};
    log_finish(&tr->lg, &st);
    code = comm_agree(comm, &st);
  }
  code = trainer_report_end(tr, code, res);
  step_close(tr);
  metrics_free(&tr->win);
  ckpt_data_free(&tr->scratch);
  log_close(&tr->lg);
  return code;
}
