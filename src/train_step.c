/* train_step.c: one optimizer step of a training run (trainer.h). Each micro-batch's forward, loss
 * and backward are queued with no host synchronisation, the gradient sums started bucket by bucket
 * during the last backward (ddp.h), then the update: clipping, fp16 loss scaling, the optimizer,
 * the EMA. With one micro-batch a step is captured as a CUDA graph once per input buffer and shape
 * and replayed after, the choice agreed by every rank. The host waits once per step, for the
 * step's sums, while the next batch is copied ahead. */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "signals.h"
#include "trainer.h"

/* fp16 loss scaling, PyTorch GradScaler's defaults (the initial scale: train.c) */
static const double scale_growth = 2.0, scale_backoff = 0.5;
static const int64_t scale_interval = 2000;

/* Queues one micro-batch's forward, loss and backward from db (rows rows): gradients accumulate
 * (zeroed with the step's sums before the first), and the last one's backward starts the bucket
 * sums. No host synchronisation: with one micro-batch a step is captured from here. */
static void queue_micro(dt_trainer *tr, const dt_dev_batch *db, int64_t rows, int first, int last) {
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  if (first) {
    be->zero(be, m->grads, (size_t)m->n_params * sizeof(float));
    be->zero(be, tr->sums.stats, STATS * sizeof(double));
    if (tr->inject == DT_FAULT_OVERFLOW && m->n_params) { /* backward adds to it: it reaches the sums */
      const float inf = INFINITY;
      be->upload(be, m->grads, &inf, sizeof inf);
    }
  }
  if (tr->cache.x) cache_gather(&tr->cache, be, &tr->d->train, db, rows);
  if (tr->inject == DT_FAULT_NAN && rows) { /* DDP_TRAIN_FAULT nan: into the batch on the device */
    const float nan = NAN;
    be->upload(be, db->raw, &nan, sizeof nan);
  }
  model_input(m, db->raw, rows);
  dt_pass pass = {.be = be,
                  .batch = rows,
                  .training = 1,
                  .global_targets = tr->target_count,
                  .loss_weight = tr->counter.weight,
                  .grad_scale = tr->sums.scaler,
                  .step_seed = db->seed,
                  .params = m->params,
                  .grads = m->grads,
                  .bufs = m->bufs,
                  .allreduce_sum = ddp_allreduce_sum,
                  .grads_ready = last ? ddp_ready : NULL,
                  .ctx = &tr->ddp};
  const double t0 = dt_now();
  model_forward(m, &pass);
  model_loss(m, &pass, db->labels, db->targets, tr->sums.stats);
  const double t1 = dt_now();
  if (last) ddp_backward_begin(&tr->ddp);
  model_backward(m, &pass);
  if (last) ddp_backward_end(&tr->ddp); /* buckets no hook started are ready when backward ends */
  tr->win.forward_s += t1 - t0;
  tr->win.backward_s += dt_now() - t1;
  if (last) tr->win.backward_mpi_s += ddp_backward_mpi_s(&tr->ddp);
}

/* Queues the end of the step: the gradient sums finished (over MPI: waited for), clipping
 * (train.clip_grad_norm), the optimizer step with the values optim_prepare uploaded, the EMA. */
static void queue_update(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  dt_step_sums *s = &tr->sums;
  ddp_finish(&tr->ddp);
  const double t0 = dt_now();
  if (s->scaler) { /* the summed gradients unscaled, then checked: a non-finite one skips the update */
    dt_op un = {.type = DT_OP_UNSCALE, .p.unscale = {.n = m->n_params, .scaler = s->scaler, .x = m->grads}};
    backend_run(be, &un);
    dt_op check = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = m->n_params, .x = m->grads, .out = s->stats + 4}};
    backend_run(be, &check);
  }
  if (v->clip_grad_norm > 0) {
    be->zero(be, s->clip_sq, 2 * sizeof(double));
    dt_op sq = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = m->n_params, .x = m->grads, .out = s->clip_sq}};
    backend_run(be, &sq);
    dt_op clip = {
        .type = DT_OP_CLIP,
        .p.clip = {.n = m->n_params, .max_norm = (float)v->clip_grad_norm, .sumsq = s->clip_sq, .x = m->grads}};
    backend_run(be, &clip);
  }
  optim_apply(&tr->opt, be, m->params, m->grads);
  if (tr->ema.params) ema_update(&tr->ema, be, m->params, m->bufs); /* every step, as timm's loop */
  if (s->scaler) {
    dt_op up = {.type = DT_OP_SCALER_UPDATE,
                .p.scaler_update = {.overflow = s->stats + 5,
                                    .growth_interval = scale_interval,
                                    .growth = (float)scale_growth,
                                    .backoff = (float)scale_backoff,
                                    .scaler = s->scaler}};
    backend_run(be, &up);
  }
  tr->win.update_s += dt_now() - t0;
}

/* How a step of one micro-batch runs: replayed from the graph captured for this input buffer and
 * shape, when the backend has moved no buffer since; captured now when the step before had this
 * shape (the warm-up that sized every workspace) or a graph of it exists; else eagerly (an
 * injected fault is a one-off: never captured). NCCL requires a collective to be captured on
 * every rank or on none, and these conditions differ between ranks (a rank's rows, its buffers,
 * its faults): each rank says what it could do, and all do the least of those. */
enum { GRAPH_EAGER, GRAPH_CAPTURE, GRAPH_REPLAY };
static int graph_choice(dt_trainer *tr, const dt_dev_batch *db, int64_t rows) {
  const dt_graphs *g = &tr->graphs;
  if (!g->on) return GRAPH_EAGER;
  const int i = db ? (int)(db - tr->in) : 0;
  const int same_shape = g->rows[i] == rows && g->count[i] == tr->count;
  const int mine = !db || tr->inject != DT_FAULT_NONE ? GRAPH_EAGER /* no batch: this rank fails the step */
                   : g->exec[i] && same_shape && g->gen[i] == tr->be->generation ? GRAPH_REPLAY
                   : rows == g->warm_rows && tr->count == g->warm_count          ? GRAPH_CAPTURE
                                                                                 : GRAPH_EAGER;
  return comm_min_i32(tr->comm, mine, "the CUDA graph choice");
}

/* Queues a step of one micro-batch (db, rows): eagerly, captured or replayed (how: graph_choice). */
static void queue_single(dt_trainer *tr, const dt_dev_batch *db, int64_t rows, int how) {
  dt_backend *be = tr->be;
  dt_graphs *g = &tr->graphs;
  const int i = (int)(db - tr->in);
  if (how == GRAPH_EAGER) {
    queue_micro(tr, db, rows, 1, 1);
    queue_update(tr);
  } else if (how == GRAPH_REPLAY) {
    be->replay(be, g->exec[i]);
    optim_advance(&tr->opt);
    tr->ddp.wait_s = 0;
    g->replays++;
  } else {
    be->graph_free(be, g->exec[i]);
    g->gen[i] = be->generation;
    be->capture_begin(be);
    queue_micro(tr, db, rows, 1, 1);
    queue_update(tr);
    g->exec[i] = be->capture_end(be);
    g->rows[i] = rows;
    g->count[i] = tr->count;
    be->replay(be, g->exec[i]);
    g->captures++;
  }
  g->warm_rows = rows;
  g->warm_count = tr->count;
}

/* Takes the next micro-batch from the loader and queues its upload (with its dropout seed, from
 * its place in the epoch) into the next device batch; ahead: overlapping the queued work, which
 * must not use that buffer. Returns it, or NULL with st set; with ahead, also NULL (st untouched)
 * while the loader still fills the training cache and the batch is not ready. */
static dt_dev_batch *upload_next(dt_trainer *tr, int ahead, int64_t *rows, double *data_s, dt_status *st) {
  double w0 = tr->L.wait_s;
  dt_batch *b = loader_next(&tr->L, ahead, st);
  if (!b) return NULL;
  *data_s += tr->L.wait_s - w0;
  uint64_t seed = dt_hash64(((uint64_t)tr->v->seed << 32) ^ (uint64_t)(b->epoch * tr->smp.steps + b->step) ^
                            ((uint64_t)tr->comm->rank << 52));
  dt_dev_batch *db = &tr->in[tr->micro_count++ % 2];
  batch_upload(db, tr->m, b, tr->cache.x != NULL, seed, ahead);
  *rows = b->count;
  return db;
}

/* The step's one host wait: its results downloaded, polling (a failed NCCL peer, the deadline)
 * while the device works. Before it, with one micro-batch per step and a step to follow, the next
 * batch is taken and copied ahead, overlapping this step: its buffer was last read by the step
 * before, which the host has waited for. */
static void wait_step(dt_trainer *tr, double *data_s) {
  dt_backend *be = tr->be;
  be->download(be, tr->sums.stats_host, tr->sums.stats, STATS * sizeof(double));
  if (tr->sums.scaler) be->download(be, tr->sums.scaler_host, tr->sums.scaler, 2 * sizeof(float));
  if (tr->accum == 1 && !tr->ahead && !tr->ahead_st.code && tr->ts.step + 1 < tr->total)
    tr->ahead = upload_next(tr, 1, &tr->ahead_rows, data_s, &tr->ahead_st);
  double since = dt_now();
  while (!be->done(be)) {
    if (tr->opts->dev)
      tr->opts->dev->check(tr->opts->dev->ctx, "the training step (forward, backward, NCCL gradient allreduce)", since);
    else if (dt_now() - since > tr->comm->timeout_s) {
      fprintf(stderr,
              "ddp_train: error: rank %d: step %lld did not complete on the device within dist.timeout_s = "
              "%.0f s; aborting the job\n",
              tr->comm->rank, (long long)tr->ts.step + 1, tr->comm->timeout_s);
      fflush(stderr);
      comm_abort(tr->comm, DT_EXIT_PEER);
    }
    usleep(50);
  }
}

/* What the step's results say: a non-finite loss or gradient fails it; an fp16 overflow skips
 * the update on every rank (the summed gradients are the same everywhere) and moves the scale. */
static void read_results(dt_trainer *tr, dt_step_report *mine, dt_status *st) {
  const double *r = tr->sums.stats_host;
  if (!isfinite(r[0]))
    dt_fail(st, DT_EXIT_NUMERIC,
            "the loss became %s at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm",
            isnan(r[0]) ? "NaN" : "infinite", (long long)tr->ts.step + 1, (long long)tr->epoch + 1);
  else if (r[3] > 0 && !tr->sums.scaler)
    dt_fail(st, DT_EXIT_NUMERIC,
            "%lld non-finite gradient values at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm",
            (long long)r[3], (long long)tr->ts.step + 1, (long long)tr->epoch + 1);
  if (tr->sums.scaler && !st->code) {
    if (r[5] > 0) {
      optim_skipped(&tr->opt);
      log_line(&tr->lg, "step %lld: %lld gradient values overflowed in fp16: update skipped, loss scale %g -> %g",
               (long long)tr->ts.step + 1, (long long)r[5], tr->ts.loss_scale, (double)tr->sums.scaler_host[0]);
    }
    tr->ts.loss_scale = tr->sums.scaler_host[0];
    tr->ts.scale_growth = tr->sums.scaler_host[1];
  }
  mine->loss_sum += r[0];
  mine->correct += r[1];
}

/* The step's work (trainer.h). */
void step_run(dt_trainer *tr, dt_step_report *mine, double *data_s, dt_status *st) {
  tr->inject = fault_fire(&tr->opts->fault, tr->comm->rank, tr->ts.step + 1);
  tr->lr = schedule_lr(tr->v, tr->ts.step, tr->total);
  optim_prepare(&tr->opt, tr->be, tr->lr);
  for (int64_t j = 0; j < tr->k && !st->code; j++) {
    int64_t rows = tr->ahead_rows;
    if (j == 0 && tr->ahead_st.code) *st = tr->ahead_st;
    dt_dev_batch *db = st->code ? NULL : j == 0 && tr->ahead ? tr->ahead : upload_next(tr, 0, &rows, data_s, st);
    tr->ahead = NULL;
    if (tr->k == 1) { /* a collective choice: made by a rank whose batch failed too */
      const int how = graph_choice(tr, db, rows);
      if (db) queue_single(tr, db, rows, how);
      break;
    }
    if (!db) break;
    queue_micro(tr, db, rows, j == 0, j == tr->k - 1);
  }
  if (st->code) return;
  if (tr->k > 1) queue_update(tr);
  wait_step(tr, data_s);
  read_results(tr, mine, st);
}

/* Every rank agrees on the outcome, the summed loss and whether to stop (a signal or the time
 * limit on any rank stops every rank at this same step), then the state advances. A failed
 * step ends the run without a checkpoint. */
int step_agree(dt_trainer *tr, dt_step_report *mine, dt_status *st) {
  int sig = signals_caught(), asked = monitor_take_requests(tr->opts->monitor);
  int out_of_time = tr->v->time_limit > 0 && dt_now() - tr->opts->t_launch >= tr->v->time_limit;
  mine->stop = sig ? sig : asked & DT_MON_STOP ? DT_STOP_HTTP : out_of_time ? DT_STOP_TIME_LIMIT : 0;
  mine->checkpoint = (asked & DT_MON_CHECKPOINT) != 0;
  mine->code = st->code;
  const double t0 = dt_now();
  int code = comm_step_agree(tr->comm, mine, st, &tr->all);
  tr->win.agree_s += dt_now() - t0;
  if (code) return code;
  tr->ts.step++;
  tr->ts.micro = tr->micro0 + tr->k;
  tr->ts.epoch = tr->epoch;
  if (tr->ts.micro >= tr->smp.steps) tr->ts.epoch = tr->epoch + 1, tr->ts.micro = 0;
  return 0;
}
