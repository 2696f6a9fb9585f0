/* train_step.c: the steps of a training run and what they use (train_step.h). Each micro-batch's
 * forward, loss and backward are queued with no host synchronisation, the gradient sums started
 * bucket by bucket during the last backward (ddp.h), then the update: clipping, fp16 loss scaling,
 * the optimizer, the EMA. With one micro-batch a step is captured as a CUDA graph once per input
 * buffer and shape and replayed after, the choice agreed by every rank. The host waits once per
 * step, for the step's sums; where the loop allows, the next step's graph is queued before that
 * wait, so that the device goes from one step to the next while the host reads the results, agrees
 * with the other ranks and logs (else the next batch is copied ahead during it).
 * Owns the dt_step: samplers and the loader, batches, the device cache, the sums, the buckets, the
 * optimizer, the EMA, the graphs. */
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "batch.h"
#include "ddp.h"
#include "distill.h"
#include "ema.h"
#include "fault.h"
#include "optim.h"
#include "signals.h"
#include "train_step.h"

enum { STATS = 6 };
/* fp16 loss scaling, PyTorch GradScaler's defaults */
static const double scale_init = 65536.0, scale_growth = 2.0, scale_backoff = 0.5;
static const int64_t scale_interval = 2000;

/* train.cuda_graph: a step of one micro-batch, captured once per input buffer and replayed. */
typedef struct {
  int on;                      /* steps may be captured */
  void *exec[2];               /* the captured step reading in[i], or NULL */
  int64_t gen[2];              /* be->generation when it was captured */
  int64_t rows[2], warm_rows;  /* this rank's rows in that step, and in the last step run */
  double count[2], warm_count; /* the global batch of each */
  int64_t captures, replays;
} dt_graphs;

/* This step's results, summed on the device and read once: loss, hits, the sum of squares and the
 * non-finite count of the gradient buckets this rank sent (a rank alone: the count of the gradients
 * its optimizer read, or their sum and count as clipping summed them), and (fp16) the same of the summed
 * gradients after unscaling (a non-finite one skips the step); clipping's sum of squares; fp16's
 * loss scale. The device's sums serve each step in turn (stream order); each is downloaded into
 * the host slot of its step's number (step % 2), so that a step queued behind another cannot
 * overwrite the results the host has yet to read. */
typedef struct {
  double *stats, *stats_host;  /* (STATS) backend memory; (2, STATS) host memory it is downloaded to */
  double *clip_sq;             /* (2) backend memory: train.clip_grad_norm's sum of squares */
  int checked_in_update;       /* a rank alone: its gradients are checked by clipping's sum or the optimizer */
  float *scaler, *scaler_host; /* train.precision fp16: (2) loss scale and good steps; (2, 2) host; else NULL */
} dt_step_sums;

/* model.loss ignore_index: the targets a step's loss averages over, counted from the sampler's twin
 * (the loader's is its thread's). */
typedef struct {
  dt_sampler smp;
  int64_t *idx;   /* (local rows cap) scratch */
  double *weight; /* (1) backend memory: 1 / targets, uploaded each step (a replayed graph reads it) */
} dt_target_counter;

/* Everything the steps use. */
struct dt_step {
  dt_sampler smp;
  dt_optim opt;
  int64_t *shard; /* dist.zero 1: (ranks + 1) rank r steps and keeps state for params[shard[r], shard[r + 1]) */
  dt_ema ema;     /* params NULL: train.ema is off */
  dt_ddp ddp;
  dt_loader L;
  dt_dev_batch in[2];  /* micro-batches alternate between the two */
  int64_t micro_count; /* micro-batches uploaded so far: in[micro_count % 2] is next */
  dt_dev_batch *ahead; /* the next step's batch, already uploaded (upload_ahead), or NULL */
  int64_t ahead_rows;
  dt_status ahead_st; /* why taking it failed: reported by the step that needed it */
  dt_dev_cache cache; /* data.cache device */
  dt_graphs graphs;
  dt_step_sums sums;
  dt_target_counter counter; /* ignore_index only */
  int inject;                /* the injected fault of the step being queued: DT_FAULT_NAN, DT_FAULT_OVERFLOW or none */
  double last_wait_s;        /* how long the host waited on the last step's results (wait_step) */
  /* the next step, queued while this one ran (step_run's queue_next): its place, the time its batch
   * waited on the loader, why taking it failed (reported with its results) */
  int next_queued;
  dt_step_at next;
  double next_data_s;
  dt_status next_st;
  int64_t queued_behind; /* steps queued while the step before ran */
};

void step_open(dt_trainer *tr, dt_status *st) {
  const dt_config_values *v = tr->v;
  tr->step = dt_calloc(1, sizeof *tr->step);
  const int W = tr->comm->size, rank = tr->comm->rank;
  const int64_t G = config_global_batch(v, W), n = tr->d->train.n;
  const int contiguous = v->sharding == DT_SHARD_CONTIGUOUS;
  sampler_init(&tr->step->smp, n, W, rank, G, contiguous, v->drop_last, v->shuffle, (uint64_t)v->seed);
  if (tr->m->loss.ignore_index_set) {
    sampler_init(&tr->step->counter.smp, n, W, rank, G, contiguous, v->drop_last, v->shuffle, (uint64_t)v->seed);
    tr->step->counter.idx = dt_malloc((size_t)(sampler_max_local(&tr->step->counter.smp) + 1) * sizeof(int64_t));
  }
  if (contiguous && G < W)
    dt_fail(st, DT_EXIT_INPUT,
            "data.sharding contiguous: the global batch (%lld) must be at least the number of "
            "ranks (%d), or some ranks' rows would never be used",
            (long long)G, W);
  if (tr->step->smp.steps == 0)
    dt_fail(st, DT_EXIT_INPUT,
            "%s: the global batch (%lld) is larger than the %lld training rows and data.drop_last "
            "is true: no step to run",
            tr->d->path, (long long)G, (long long)n);
  const char *no_graph = !tr->be->capture_begin    ? "it runs on the CPU backend (CUDA graphs need --device cuda)"
                         : v->grad_accum > 1       ? "train.grad_accum is above 1 (a captured step has one micro-batch)"
                         : !tr->opts->dev && W > 1 ? "its gradients are summed over MPI through host memory (a "
                                                     "captured step needs NCCL, or a single rank)"
                                                   : NULL;
  if (v->cuda_graph == DT_GRAPH_ON && no_graph)
    dt_fail(st, DT_EXIT_INPUT,
            "train.cuda_graph is on, but this run cannot capture its step: %s; set it to auto or off", no_graph);
  tr->step->graphs.on = v->cuda_graph != DT_GRAPH_OFF && !no_graph;
  tr->step->graphs.warm_rows = -1;
  tr->micro_per_epoch = tr->step->smp.steps;
}

/* The buckets' settle hook (ddp.h): the model's 16-bit filter gradients added in before a bucket reads them. */
static void add_grads16(void *model, int64_t from) {
  model_add_grads16(model, from);
}

const dt_ddp *step_alloc(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  if (tr->step->counter.idx) tr->step->counter.weight = (double *)be->alloc(be, sizeof(double));
  const int W = tr->comm->size;
  int64_t lo, hi;
  optim_slice(v, m->n_params, W, tr->comm->rank, &lo, &hi);
  if (v->zero) { /* every rank's slice, for the buckets' reduces and the gather */
    tr->step->shard = dt_malloc((size_t)(W + 1) * sizeof(int64_t));
    for (int r = 0; r < W; r++) optim_slice(v, m->n_params, W, r, &tr->step->shard[r], &tr->step->shard[r + 1]);
  }
  optim_init(&tr->step->opt, v, be, m->n_params, lo, hi, tr->total);
  if (v->no_decay) { /* optim.no_decay: weight decay only on the other tensors */
    dt_decay_run *runs = dt_malloc((size_t)m->n_tensors * sizeof *runs);
    optim_set_runs(&tr->step->opt, be, model_decay_runs(m, v->no_decay, (float)v->weight_decay, runs), runs);
    free(runs);
  }
  dt_step_sums *s = &tr->step->sums;
  s->stats = (double *)be->alloc(be, STATS * sizeof(double));
  s->stats_host = be->alloc_host(be, 2 * STATS * sizeof(double));
  if (v->precision == DT_PREC_FP16) {
    s->scaler = be->alloc(be, 2 * sizeof(float));
    s->scaler_host = be->alloc_host(be, 2 * 2 * sizeof(float));
    tr->step->opt.skip = s->stats + 5;
  }
  s->clip_sq = (double *)be->alloc(be, 2 * sizeof(double));
  /* A rank alone sends no buckets, so checking each (a pass over the gradients, and its sums) before
   * it is sent would only repeat what the update reads anyway: clipping's sum of squares, or the
   * optimizer, counts the non-finite values into the step's results instead. (fp16 checks the
   * unscaled gradients, and sends its buckets' own counts nowhere.) */
  s->checked_in_update = W == 1 && !tr->opts->dev && !s->scaler && !tr->step->shard;
  if (s->checked_in_update && !(v->clip_grad_norm > 0)) tr->step->opt.nonfinite = s->stats + 3;
  for (int i = 0; i < 2; i++) batch_alloc(&tr->step->in[i], m, m->max_batch);
  if (v->cache == DT_CACHE_DEVICE) cache_fill(&tr->step->cache, be, &tr->d->train); /* one copy, then row numbers */
  ddp_init(&tr->step->ddp, tr->comm, tr->opts->dev, be, m->grads, m->n_params,
           (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float)), s->checked_in_update ? NULL : s->stats + 2,
           tr->step->shard);
  tr->step->ddp.settle = add_grads16, tr->step->ddp.settle_ctx = m;
  return &tr->step->ddp;
}

void step_restore(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  const dt_ckpt_data *resume = tr->opts->resume;
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  dt_step *s = tr->step;
  if (resume) {
    if (!s->sums.scaler) tr->ts.loss_scale = tr->ts.scale_growth = 0;
    for (int k = 0; k < s->opt.n_states; k++) /* this rank's slice (all of it without dist.zero) */
      if (resume->opt[k] && s->opt.hi > s->opt.lo)
        be->to_device(be, s->opt.states[k], resume->opt[k] + s->opt.lo,
                      (size_t)(s->opt.hi - s->opt.lo) * sizeof(float));
    s->opt.step = tr->ts.optim_step;
  }
  if (s->sums.scaler) { /* a run that did not scale starts from GradScaler's initial scale */
    if (!(tr->ts.loss_scale > 0)) tr->ts.loss_scale = scale_init, tr->ts.scale_growth = 0;
    float sc[2] = {(float)tr->ts.loss_scale, (float)tr->ts.scale_growth};
    be->to_device(be, s->sums.scaler, sc, sizeof sc);
  }
  if (v->ema_decay > 0) {
    const int64_t lo = s->opt.lo, n = s->opt.hi - lo; /* its slice, like the optimizer's */
    ema_init(&s->ema, be, v->ema_decay, m->params + lo, n, m->bufs, m->n_bufs);
    if (resume && resume->has_ema) {
      be->to_device(be, s->ema.params, resume->ema_params + lo, (size_t)n * sizeof(float));
      be->to_device(be, s->ema.bufs, resume->ema_bufs, (size_t)m->n_bufs * sizeof(float));
    }
  }
  loader_start(&s->L, tr->d, &s->smp, m, tr->ts.epoch, tr->ts.micro, v->epochs, s->cache.x != NULL);
}

void step_log_setup(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  const dt_optim *o = &tr->step->opt;
  if (tr->step->shard)
    log_line(&tr->lg,
             "dist.zero 1: rank 0 keeps the optimizer state of parameters [%lld, %lld), %lld of %lld (%.2f MiB instead "
             "of %.2f); gradients are reduced to each slice's rank, parameters gathered after each step",
             (long long)o->lo, (long long)o->hi, (long long)(o->hi - o->lo), (long long)o->n,
             (double)(o->n_states * (o->hi - o->lo)) * sizeof(float) / 1048576.0,
             (double)(o->n_states * o->n) * sizeof(float) / 1048576.0);
  if (tr->step->cache.x) {
    const dt_split *s = &tr->d->train;
    log_line(&tr->lg, "data.cache device: %lld training rows per rank in device memory (%.1f MiB as stored)",
             (long long)(s->hi - s->lo), (double)((s->hi - s->lo) * s->row_elems) * (double)s->x_elem / 1048576.0);
  }
  if (tr->be->capture_begin)
    log_line(&tr->lg, "cuda graph: %s",
             tr->step->graphs.on             ? "on (each full step after the first is replayed as one graph)"
             : v->cuda_graph == DT_GRAPH_OFF ? "off (train.cuda_graph off)"
             : v->grad_accum > 1             ? "off (train.grad_accum > 1)"
                                             : "off (gradients over MPI)");
}

/* model.loss ignore_index: the targets step a's global batch averages over, summed over ranks
 * (a collective; the sampler gives each rank its rows without reading them). At least 1. */
static double count_step_targets(dt_trainer *tr, const dt_step_at *a) {
  dt_target_counter *c = &tr->step->counter;
  double n_targets = 0;
  for (int64_t j = 0; j < a->k; j++) {
    int64_t global, n = sampler_batch(&c->smp, a->epoch, a->micro0 + j, c->idx, &global);
    n_targets += count_targets(&tr->d->train, c->idx, n, tr->m->loss.ignore_index);
  }
  comm_allreduce_sum_f64(tr->comm, &n_targets, 1, "target count");
  return n_targets > 0 ? n_targets : 1;
}

/* The optimizer step at (epoch, os), after `done` steps: its micro-batches, rows, targets (a
 * collective with ignore_index) and learning rate. */
static dt_step_at place(dt_trainer *tr, int64_t epoch, int64_t os, int64_t done) {
  dt_step_at a = {.epoch = epoch, .os = os, .micro0 = os * tr->accum};
  a.k = tr->micro_per_epoch - a.micro0 < tr->accum ? tr->micro_per_epoch - a.micro0 : tr->accum;
  for (int64_t j = 0; j < a.k; j++) a.count += (double)sampler_count(&tr->step->smp, a.micro0 + j);
  a.target_count = tr->m->loss.ignore_index_set ? count_step_targets(tr, &a) : a.count * (double)tr->m->n_labels;
  a.lr = schedule_lr(tr->v, done, tr->total);
  return a;
}

/* Queues one micro-batch's forward, loss and backward from db (rows rows): gradients accumulate
 * (zeroed with the step's sums before the first), and the last one's backward starts the bucket
 * sums. No host synchronisation: with one micro-batch a step is captured from here. */
static void queue_micro(dt_trainer *tr, const dt_step_at *a, const dt_dev_batch *db, int64_t rows, int first,
                        int last) {
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  if (first) {
    be->zero(be, m->grads, (size_t)m->n_params * sizeof(float));
    be->zero(be, tr->step->sums.stats, STATS * sizeof(double));
    if (tr->step->inject == DT_FAULT_OVERFLOW && m->n_params) { /* backward adds to it: it reaches the sums */
      const float inf = INFINITY;
      be->upload(be, m->grads, &inf, sizeof inf);
    }
  }
  if (tr->step->cache.x) cache_gather(&tr->step->cache, be, &tr->d->train, db, rows);
  if (tr->step->inject == DT_FAULT_NAN && rows) { /* DDP_TRAIN_FAULT nan: into the batch on the device */
    const float nan = NAN;
    be->upload(be, db->raw, &nan, sizeof nan);
  }
  const double t0 = dt_now();
  model_input(m, db->raw, rows);
  if (m->teacher) teacher_forward(m->teacher, db->raw, rows); /* distillation: its logits join the loss */
  dt_pass pass = {.be = be,
                  .batch = rows,
                  .training = 1,
                  .global_targets = a->target_count,
                  .loss_weight = tr->step->counter.weight,
                  .grad_scale = tr->step->sums.scaler,
                  .step_seed = db->seed,
                  .teacher_logits = m->teacher ? model_logits(m->teacher) : NULL,
                  .params = m->params,
                  .grads = m->grads,
                  .bufs = m->bufs,
                  .allreduce_sum = ddp_allreduce_sum,
                  .grads_ready = last ? ddp_ready : NULL,
                  .ctx = &tr->step->ddp};
  model_forward(m, &pass);
  model_loss(m, &pass, db->labels, db->targets, tr->step->sums.stats);
  const double t1 = dt_now();
  if (last) ddp_backward_begin(&tr->step->ddp);
  model_backward(m, &pass);
  if (last) ddp_backward_end(&tr->step->ddp); /* buckets no hook started are ready when backward ends */
  tr->win.forward_s += t1 - t0;
  tr->win.backward_s += dt_now() - t1;
  if (last) tr->win.backward_mpi_s += ddp_backward_mpi_s(&tr->step->ddp);
}

/* Queues the end of the step: the gradient sums finished (over MPI: waited for), clipping
 * (train.clip_grad_norm), the optimizer step with the values optim_prepare uploaded, the EMA. */
static void queue_update(dt_trainer *tr) {
  const dt_config_values *v = tr->v;
  dt_model *m = tr->m;
  dt_backend *be = tr->be;
  dt_step_sums *s = &tr->step->sums;
  ddp_finish(&tr->step->ddp);
  const double t0 = dt_now();
  /* the summed gradients: all of them, or under dist.zero this rank's shard, whose partial sums of
   * squares and counts are then summed over the ranks, so that every rank clips and skips alike */
  const int64_t lo = tr->step->opt.lo, n = tr->step->opt.hi - lo;
  float *grads = m->grads + lo;
  if (s->scaler) { /* unscaled, then checked: a non-finite one skips the update */
    dt_op un = {.type = DT_OP_UNSCALE, .p.unscale = {.n = n, .scaler = s->scaler, .x = grads}};
    backend_run(be, &un);
    dt_op check = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = n, .x = grads, .out = s->stats + 4}};
    backend_run(be, &check);
    if (tr->step->shard) ddp_allreduce_sum(&tr->step->ddp, s->stats + 4, 2);
  }
  if (v->clip_grad_norm > 0) { /* a rank alone sums into the step's results (zeroed), its check */
    double *sumsq = s->checked_in_update ? s->stats + 2 : s->clip_sq;
    if (!s->checked_in_update) be->zero(be, sumsq, 2 * sizeof(double));
    dt_op sq = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = n, .x = grads, .out = sumsq}};
    backend_run(be, &sq);
    if (tr->step->shard) ddp_allreduce_sum(&tr->step->ddp, sumsq, 2);
    dt_op clip = {.type = DT_OP_CLIP,
                  .p.clip = {.n = n, .max_norm = (float)v->clip_grad_norm, .sumsq = sumsq, .x = grads}};
    backend_run(be, &clip);
  }
  optim_apply(&tr->step->opt, be, m->params, m->grads);
  if (tr->step->shard) ddp_gather(&tr->step->ddp, m->params); /* every rank's updated shard to all */
  if (tr->step->ema.params)                                   /* every step, as timm's loop */
    ema_update(&tr->step->ema, be, m->params + tr->step->opt.lo, m->bufs);
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
static int graph_choice(dt_trainer *tr, const dt_step_at *a, const dt_dev_batch *db, int64_t rows) {
  const dt_graphs *g = &tr->step->graphs;
  if (!g->on) return GRAPH_EAGER;
  const int i = db ? (int)(db - tr->step->in) : 0;
  const int same_shape = g->rows[i] == rows && g->count[i] == a->count;
  const int mine = !db || tr->step->inject != DT_FAULT_NONE ? GRAPH_EAGER /* no batch: this rank fails the step */
                   : g->exec[i] && same_shape && g->gen[i] == tr->be->generation ? GRAPH_REPLAY
                   : rows == g->warm_rows && a->count == g->warm_count           ? GRAPH_CAPTURE
                                                                                 : GRAPH_EAGER;
  return comm_min_i32(tr->comm, mine, "the CUDA graph choice");
}

/* Queues step a of one micro-batch (db, rows): eagerly, captured or replayed (how: graph_choice). */
static void queue_single(dt_trainer *tr, const dt_step_at *a, const dt_dev_batch *db, int64_t rows, int how) {
  dt_backend *be = tr->be;
  dt_graphs *g = &tr->step->graphs;
  const int i = (int)(db - tr->step->in);
  if (how == GRAPH_EAGER) {
    queue_micro(tr, a, db, rows, 1, 1);
    queue_update(tr);
  } else if (how == GRAPH_REPLAY) {
    be->replay(be, g->exec[i]);
    optim_advance(&tr->step->opt);
    tr->step->ddp.wait_s = 0;
    g->replays++;
  } else {
    be->graph_free(be, g->exec[i]);
    g->gen[i] = be->generation;
    be->capture_begin(be);
    queue_micro(tr, a, db, rows, 1, 1);
    queue_update(tr);
    g->exec[i] = be->capture_end(be);
    g->rows[i] = rows;
    g->count[i] = a->count;
    be->replay(be, g->exec[i]);
    g->captures++;
  }
  g->warm_rows = rows;
  g->warm_count = a->count;
}

/* Takes the next micro-batch from the loader and queues its upload (with its dropout seed, from
 * its place in the epoch) into the next device batch; ahead: overlapping the queued work, which
 * must not use that buffer. Returns it, or NULL with st set; with ahead, also NULL (st untouched)
 * while the loader still fills the training cache and the batch is not ready. */
static dt_dev_batch *upload_next(dt_trainer *tr, int ahead, int64_t *rows, double *data_s, dt_status *st) {
  double w0 = tr->step->L.wait_s;
  dt_batch *b = loader_next(&tr->step->L, ahead, st);
  if (!b) return NULL;
  *data_s += tr->step->L.wait_s - w0;
  uint64_t seed = dt_hash64(((uint64_t)tr->v->seed << 32) ^ (uint64_t)(b->epoch * tr->micro_per_epoch + b->step) ^
                            ((uint64_t)tr->comm->rank << 52));
  dt_dev_batch *db = &tr->step->in[tr->step->micro_count++ % 2];
  batch_upload(db, tr->m, b, tr->step->cache.x != NULL, seed, ahead);
  *rows = b->count;
  return db;
}

int step_wait_spins(double waited_s, double last_wait_s) {
  const double window = fmin(0.1 * last_wait_s + 100e-6, 2e-3);
  return last_wait_s > 0 && fabs(waited_s - last_wait_s) <= window;
}

/* A host wait for step n's work (its mark, host slot n % 2), polling for a failed NCCL peer and the
 * deadline while the device works. Where nothing is queued behind the step, the device idles from
 * its end until the host sees it and queues the next one, so the polls stop sleeping around the end
 * (step_wait_spins): a sleep of 50 us oversleeps to about 100 (the kernel's timer slack), which was
 * 20-40% of a small model's step. With the next step queued the device has work, and the polls sleep,
 * leaving the core to the loader. The failure checks still run every 50 us. */
static void wait_step(dt_trainer *tr, int64_t n) {
  dt_backend *be = tr->be;
  const double since = dt_now();
  double checked = -1.0, now = since;
  while (!be->reached(be, (int)(n % 2))) {
    if (now - checked >= 50e-6) {
      checked = now;
      if (tr->opts->dev)
        tr->opts->dev->check(tr->opts->dev->ctx, "the training step (forward, backward, NCCL gradient allreduce)",
                             since);
      else if (now - since > tr->comm->timeout_s) {
        fprintf(stderr,
                "ddp_train: error: rank %d: step %lld did not complete on the device within dist.timeout_s = "
                "%.0f s; aborting the job\n",
                tr->comm->rank, (long long)n, tr->comm->timeout_s);
        fflush(stderr);
        comm_abort(tr->comm, DT_EXIT_PEER);
      }
    }
    if (!tr->step->next_queued && step_wait_spins(now - since, tr->step->last_wait_s))
      sched_yield();
    else
      usleep(50);
    now = dt_now();
  }
  tr->step->last_wait_s = dt_now() - since;
}

/* After a non-finite loss or gradient: this rank's inputs of the step read again, row by row (the
 * rows from a twin of the sampler: the loader's belongs to its thread), from memory or the file.
 * When one holds a NaN or an Inf, it was the data: why gets "FILE: 'X'[row] holds ..." and 1 is
 * returned. Bytes and tokens cannot be non-finite. Only on this failure path: no cost per step. */
static int inputs_non_finite(dt_trainer *tr, char *why, size_t cap) {
  const dt_config_values *v = tr->v;
  dt_data *d = tr->d;
  dt_split *s = &d->train;
  if (s->x_type == DT_X_U8 || s->tokens) return 0;
  loader_wait_filled(&tr->step->L); /* HDF5 is the loader thread's while it fills the cache */
  dt_sampler smp;
  sampler_init(&smp, s->n, tr->comm->size, tr->comm->rank, config_global_batch(v, tr->comm->size),
               v->sharding == DT_SHARD_CONTIGUOUS, v->drop_last, v->shuffle, (uint64_t)v->seed);
  int64_t *idx = dt_malloc((size_t)(sampler_max_local(&smp) + 1) * sizeof(int64_t)), global;
  float *x = dt_malloc((size_t)s->row_elems * sizeof(float)),
        *targets = dt_malloc((size_t)(s->y_k + 1) * sizeof(float));
  int32_t label;
  int found = 0;
  for (int64_t j = 0; j < tr->at.k && !found; j++) {
    const int64_t n = sampler_batch(&smp, tr->at.epoch, tr->at.micro0 + j, idx, &global);
    for (int64_t i = 0; i < n && !found; i++) {
      dt_status st = {0};
      if (data_gather(d, s, idx + i, 1, x, &label, targets, &st)) break; /* unreadable now: no answer */
      for (int64_t e = 0; e < s->row_elems && !found; e++)
        if (!isfinite(x[e]))
          found = snprintf(why, cap, "%s: '%s'[%lld] holds %s", d->path, s->x_name, (long long)idx[i],
                           isnan(x[e]) ? "a NaN" : "an infinity") > 0;
    }
  }
  free(idx);
  free(x);
  free(targets);
  sampler_free(&smp);
  return found;
}

/* What the step's results say: a non-finite loss or gradient fails it (the data's fault when the
 * step's inputs hold a NaN or an Inf, else the optimisation's); an fp16 overflow skips the update on
 * every rank (the summed gradients are the same everywhere) and moves the scale. */
static void read_results(dt_trainer *tr, dt_step_report *mine, dt_status *st) {
  const int slot = (int)((tr->ts.step + 1) % 2);
  const double *r = tr->step->sums.stats_host + slot * STATS;
  const float *scaler = tr->step->sums.scaler ? tr->step->sums.scaler_host + slot * 2 : NULL;
  char what[96] = "", data[1400];
  if (!isfinite(r[0]))
    snprintf(what, sizeof what, "the loss became %s", isnan(r[0]) ? "NaN" : "infinite");
  else if (r[3] > 0 && !tr->step->sums.scaler)
    snprintf(what, sizeof what, "%lld non-finite gradient values", (long long)r[3]);
  if (what[0] && !st->code && inputs_non_finite(tr, data, sizeof data))
    dt_fail(st, DT_EXIT_NUMERIC,
            "%s at step %lld (epoch %lld), and this rank's inputs of the step are not finite: %s; it is the "
            "data, not the learning rate: mend or drop those rows",
            what, (long long)tr->ts.step + 1, (long long)tr->at.epoch + 1, data);
  else if (what[0])
    dt_fail(st, DT_EXIT_NUMERIC, "%s at step %lld (epoch %lld); lower optim.lr or set train.clip_grad_norm", what,
            (long long)tr->ts.step + 1, (long long)tr->at.epoch + 1);
  if (tr->step->sums.scaler && !st->code) {
    if (r[5] > 0) {
      optim_skipped(&tr->step->opt);
      log_line(&tr->lg, "step %lld: %lld gradient values overflowed in fp16: update skipped, loss scale %g -> %g",
               (long long)tr->ts.step + 1, (long long)r[5], tr->ts.loss_scale, (double)scaler[0]);
    }
    tr->ts.loss_scale = scaler[0];
    tr->ts.scale_growth = scaler[1];
  }
  mine->loss_sum += r[0];
  mine->correct += r[1];
}

/* What a rank whose batch failed (st set) runs instead: one zeroed row (input, label or target, row
 * number), so that its step's collectives (the gradient sums, the graph choice, a batchnorm's sums)
 * meet the other ranks'. The step agreement then ends the run on every rank at this step. */
static dt_dev_batch *stand_in(dt_trainer *tr, int64_t *rows) {
  const dt_model *m = tr->m;
  dt_backend *be = tr->be;
  dt_dev_batch *db = &tr->step->in[tr->step->micro_count++ % 2];
  be->zero(be, db->raw, (size_t)shape_size(m->input) * sizeof(float));
  be->zero(be, db->labels, (size_t)m->n_labels * sizeof(int32_t));
  be->zero(be, db->targets, (size_t)(m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1) * sizeof(float));
  be->zero(be, db->rows, sizeof(int32_t));
  be->zero(be, db->seed, sizeof(uint64_t));
  *rows = 1;
  return db;
}

/* Queues step n (after n - 1 steps) at a, then its results' download into host slot n % 2 and its
 * mark. behind: step n - 1 may still run; a graph replay then overlaps it, anything else (a capture,
 * an eager step) waits for it first. A failed batch sets st (its rank runs a stand-in). */
static void queue_step(dt_trainer *tr, const dt_step_at *a, int64_t n, int behind, double *data_s, dt_status *st) {
  dt_step *s = tr->step;
  dt_backend *be = tr->be;
  const int64_t named = tr->comm->step; /* the step a collective's timeout names */
  tr->comm->step = n;
  s->inject = fault_fire(tr->opts->fault, tr->comm->rank, n);
  if (s->counter.weight) { /* queued before the step (a graph replay reads it) */
    const double w = 1.0 / a->target_count;
    be->upload(be, s->counter.weight, &w, sizeof w);
  }
  optim_prepare(&s->opt, be, a->lr);
  for (int64_t j = 0; j < a->k; j++) {
    int64_t rows = s->ahead_rows;
    if (j == 0 && s->ahead_st.code) *st = s->ahead_st;
    dt_dev_batch *db = st->code ? NULL : j == 0 && s->ahead ? s->ahead : NULL;
    if (!db && !st->code && behind) /* its buffer's last reader, step n - 2, is done: copy alongside n - 1 */
      db = upload_next(tr, 1, &rows, data_s, st);
    if (!db && !st->code) db = upload_next(tr, 0, &rows, data_s, st);
    s->ahead = NULL;
    s->ahead_st = (dt_status){0};
    const int failed = !db;
    if (failed) db = stand_in(tr, &rows);
    if (a->k == 1) { /* a collective choice: a rank whose batch failed runs its stand-in eagerly */
      const int how = graph_choice(tr, a, failed ? NULL : db, rows);
      if (behind && how != GRAPH_REPLAY) wait_step(tr, n - 1);
      s->queued_behind += behind && how == GRAPH_REPLAY;
      queue_single(tr, a, db, rows, how);
      break;
    }
    queue_micro(tr, a, db, rows, j == 0, j == a->k - 1);
  }
  if (a->k > 1) queue_update(tr);
  const int slot = (int)(n % 2);
  be->download(be, s->sums.stats_host + slot * STATS, s->sums.stats, STATS * sizeof(double));
  if (s->sums.scaler) be->download(be, s->sums.scaler_host + slot * 2, s->sums.scaler, 2 * sizeof(float));
  be->mark(be, slot);
  tr->comm->step = named;
}

void step_run(dt_trainer *tr, int queue_next, dt_step_report *mine, double *data_s, dt_status *st) {
  dt_step *s = tr->step;
  const int64_t n = tr->ts.step + 1;
  if (s->next_queued) { /* by the step before */
    DT_ASSERT(s->next.epoch == tr->at.epoch && s->next.os == tr->at.os);
    tr->at = s->next;
    *data_s += s->next_data_s;
    if (s->next_st.code) *st = s->next_st;
    s->next_queued = 0;
  } else {
    tr->at = place(tr, tr->at.epoch, tr->at.os, n - 1);
    queue_step(tr, &tr->at, n, 0, data_s, st);
  }
  /* the next step behind this one: replayed graphs only, and not under fp16, where the host learns
   * of a skipped update (AdamW's step count) from this step's results */
  if (queue_next && s->graphs.on && !s->sums.scaler && n < tr->total) {
    const int64_t wraps = tr->at.os + 1 == tr->opt_per_epoch;
    s->next = place(tr, tr->at.epoch + wraps, wraps ? 0 : tr->at.os + 1, n);
    s->next_data_s = 0;
    s->next_st = (dt_status){0};
    queue_step(tr, &s->next, n + 1, 1, &s->next_data_s, &s->next_st);
    s->next_queued = 1;
  } else if (tr->accum == 1 && !s->ahead && !s->ahead_st.code && n < tr->total) {
    /* the next batch copied ahead instead, overlapping this step: its buffer was last read by the step
     * before, which the host has waited for */
    s->ahead = upload_next(tr, 1, &s->ahead_rows, data_s, &s->ahead_st);
  }
  wait_step(tr, n);
  read_results(tr, mine, st); /* a failed batch's status stays: dt_fail keeps the first */
}

int step_next_queued(const dt_trainer *tr) {
  return tr->step->next_queued;
}

/* A signal or the time limit on any rank stops every rank at this same step; a failed step ends
 * the run without a checkpoint. */
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
  tr->ts.micro = tr->at.micro0 + tr->at.k;
  tr->ts.epoch = tr->at.epoch;
  if (tr->ts.micro >= tr->micro_per_epoch) tr->ts.epoch = tr->at.epoch + 1, tr->ts.micro = 0;
  return 0;
}

void step_wait_filled(dt_trainer *tr) {
  loader_wait_filled(&tr->step->L);
}

int step_ema(dt_trainer *tr, const float **params, const float **bufs) {
  dt_step *s = tr->step;
  const dt_ema *e = &s->ema;
  if (params) *params = e->params;
  if (bufs) *bufs = e->bufs;
  if (params && e->params && s->shard) { /* every rank's slice into the gradients, free until the next step */
    dt_backend *be = tr->be;
    float *whole = tr->m->grads;
    const int64_t lo = s->opt.lo, n = s->opt.hi - lo;
    if (n) {
      be->zero(be, whole + lo, (size_t)n * sizeof(float)); /* a copy through the op set, as ema.c's */
      dt_op op = {.type = DT_OP_EMA, .p.ema = {.n = n, .decay = 0.0f, .x = e->params, .ema = whole + lo}};
      backend_run(be, &op);
    }
    ddp_gather(&s->ddp, whole);
    *params = whole;
  }
  return e->params != NULL;
}

void step_snapshot(const dt_trainer *tr, dt_ckpt_data *d) {
  const dt_model *m = tr->m;
  const dt_step *s = tr->step;
  dt_backend *be = m->be;
  size_t pb = (size_t)m->n_params * sizeof(float), bb = (size_t)m->n_bufs * sizeof(float);
  be->to_host(be, d->params, m->params, pb);
  be->to_host(be, d->bufs, m->bufs, bb);
  if (s->ema.params) {
    if (!s->shard) be->to_host(be, d->ema_params, s->ema.params, pb);
    be->to_host(be, d->ema_bufs, s->ema.bufs, bb);
  }
  if (!s->shard) /* else step_gather_shards has put them there */
    for (int k = 0; k < s->opt.n_states; k++) be->to_host(be, d->opt[k], s->opt.states[k], pb);
  d->ts = tr->ts;
  d->ts.optim_step = s->opt.step;
}

void step_gather_shards(const dt_trainer *tr, dt_ckpt_data *d) {
  const dt_step *s = tr->step;
  if (!s->shard) return;
  dt_backend *be = tr->be;
  const int64_t n = s->opt.hi - s->opt.lo;
  float *mine = dt_malloc((size_t)(n ? n : 1) * sizeof(float));
  for (int k = 0; k <= s->opt.n_states; k++) {
    const float *state = k < s->opt.n_states ? s->opt.states[k] : s->ema.params; /* then the EMA's */
    if (!state) break;
    be->to_host(be, mine, state, (size_t)n * sizeof(float));
    comm_gather_rows(tr->comm, mine, n, 1, d ? (k < s->opt.n_states ? d->opt[k] : d->ema_params) : NULL);
  }
  free(mine);
}

void step_graph_counts(const dt_trainer *tr, int64_t *captures, int64_t *replays, int64_t *queued_behind) {
  *captures = tr->step->graphs.captures;
  *replays = tr->step->graphs.replays;
  *queued_behind = tr->step->queued_behind;
}

void step_close(dt_trainer *tr) {
  dt_step *s = tr->step;
  dt_backend *be = tr->be;
  if (!s) return;
  loader_stop(&s->L);
  for (int i = 0; i < 2; i++) {
    if (s->graphs.exec[i]) be->graph_free(be, s->graphs.exec[i]);
    if (s->in[i].raw) batch_free(&s->in[i], be);
  }
  if (s->sums.stats) {
    be->free(be, s->sums.stats);
    be->free_host(be, s->sums.stats_host);
    be->free(be, s->sums.clip_sq);
  }
  if (s->sums.scaler) {
    be->free(be, s->sums.scaler);
    be->free_host(be, s->sums.scaler_host);
  }
  if (s->counter.weight) be->free(be, s->counter.weight);
  free(s->counter.idx);
  sampler_free(&s->counter.smp); /* zeroed when unused */
  if (s->cache.x) cache_free(&s->cache, be);
  if (s->ema.params) ema_free(&s->ema, be);
  if (s->opt.ops) optim_free(&s->opt, be);
  ddp_free(&s->ddp);
  free(s->shard);
  sampler_free(&s->smp);
  free(s);
  tr->step = NULL;
}
