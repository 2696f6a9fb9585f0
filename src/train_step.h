/* train_step.h: the state a training run shares between train.c (the run: its start, the loop over
 * optimizer steps, validation and checkpoints when due, its end) and train_step.c (the steps and
 * everything they use: batches, samplers and the loader, the gradient buckets, the optimizer, the
 * EMA, CUDA graphs, fp16 loss scaling; held in a dt_step that only train_step.c looks into).
 * A dt_trainer borrows the config, model, data, communicator and options, and owns the rest. */
#ifndef DT_TRAIN_STEP_H
#define DT_TRAIN_STEP_H

#include "train.h"
#include "train_metrics.h"

typedef struct dt_step dt_step;

/* An optimizer step's place in the run and what its report reads. */
typedef struct {
  int64_t epoch, os, micro0, k; /* its epoch, its step in the epoch, its first micro-batch, micro-batches */
  double count;                 /* rows in its global batch */
  double target_count;          /* targets the loss averages over: rows x labels per row, less ignore_index's */
  double lr;
} dt_step_at;

/* The loop's state. */
typedef struct {
  const dt_config *cfg;
  const dt_config_values *v;
  dt_model *m;
  dt_data *d;
  dt_comm *comm;
  const dt_train_opts *opts;
  dt_backend *be;
  dt_step *step; /* train_step.c's */
  dt_log lg;
  dt_ckpt_data scratch; /* rank 0 with checkpoints: host copies for writing */
  dt_train_state ts;
  int64_t micro_per_epoch;             /* micro-batches in an epoch (the sampler's steps) */
  int64_t accum, opt_per_epoch, total; /* micro-batches per step, steps per epoch, steps in all */
  dt_step_at at;                       /* this optimizer step (the loop sets epoch and os) */
  dt_step_report all;                  /* the ranks' summed report */
  dt_step_window win;                  /* the reports' window, and the monitor's snapshot */
  int stop, stop_signal;
  int ckpt_asked; /* some rank asked for a checkpoint at this step (POST /checkpoint) */
  /* a stop (its signal) or a checkpoint agreed while the next step was already queued: done after it */
  int held_stop, held_ckpt;
} dt_trainer;

/* ---- train_step.c ---- */

/* The samplers, the refusals of the step's settings (sharding, drop_last, train.cuda_graph on),
 * micro_per_epoch. Sets st; step_close undoes it whatever st says. */
void step_open(dt_trainer *tr, dt_status *st);
/* The step's buffers: optimizer, sums, batches, the device cache, the gradient buckets. After
 * accum and total are set. Returns the gradient buckets, for the reports. */
const dt_ddp *step_alloc(dt_trainer *tr);
/* The training state tr->ts resumed into the step (optimizer state, loss scale, EMA: from
 * tr->opts->resume when set), and the loader at tr->ts's position. */
void step_restore(dt_trainer *tr);
/* The start-up lines of what the step chose: the device cache, CUDA graphs. */
void step_log_setup(dt_trainer *tr);
/* One optimizer step, at tr->at's epoch and os: its place (tr->at: micro-batches, rows, targets, lr;
 * a collective with ignore_index), every micro-batch uploaded and queued, then the update, unless
 * the step before queued it already; with queue_next (the same on every rank: the run goes on, and
 * nothing between the steps reads this one's parameters), the next step queued too where it is a
 * replayed graph (not under fp16), so that the device goes on while the host reads this step's
 * results; then the results read once, this rank's loss and hits added to *mine; st set on failure. */
void step_run(dt_trainer *tr, int queue_next, dt_step_report *mine, double *data_s, dt_status *st);
/* Whether the next step is queued already (step_run's queue_next). */
int step_next_queued(const dt_trainer *tr);
/* Whether the host, having waited waited_s on a step's results, polls without sleeping: within 10%
 * plus 100 us (at most 2 ms) either side of the last step's wait, last_wait_s; never without one (0),
 * and not past that (a slow peer, a hang: a core would spin until dist.timeout_s). */
int step_wait_spins(double waited_s, double last_wait_s);
/* Every rank agrees on the outcome and on whether to stop, and the state advances: returns the
 * agreed code. */
int step_agree(dt_trainer *tr, dt_step_report *mine, dt_status *st);
/* The loader is done filling its cache (HDF5 is its thread's until then). */
void step_wait_filled(dt_trainer *tr);
/* The EMA's params and bufs (backend memory), or 0 when train.ema is off. Under dist.zero 1, params
 * (collective) are every rank's slice gathered into the gradient buffer, good until the next step. */
int step_ema(dt_trainer *tr, const float **params, const float **bufs);
/* What a checkpoint holds, copied to host memory d (ckpt_data_alloc'd for this run). */
void step_snapshot(const dt_trainer *tr, dt_ckpt_data *d);
/* dist.zero 1, collective, before rank 0's step_snapshot: every rank's slice of the optimizer state
 * and the EMA into d (rank 0's; NULL elsewhere). Nothing without it. */
void step_gather_shards(const dt_trainer *tr, dt_ckpt_data *d);
/* Counts of captured and replayed steps, and of steps queued while the step before ran. */
void step_graph_counts(const dt_trainer *tr, int64_t *captures, int64_t *replays, int64_t *queued_behind);
void step_close(dt_trainer *tr);

#endif
