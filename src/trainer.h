/* trainer.h: the state a training run's steps share (dt_trainer), private to train.c (the run:
 * its start, the loop over steps, validation and checkpoints when due, its end) and train_step.c
 * (one step: the micro-batches, the update, CUDA graphs, the host wait, the agreement).
 * A dt_trainer borrows the config, model, data, communicator and options, and owns the rest. */
#ifndef DT_TRAINER_H
#define DT_TRAINER_H

#include "batch.h"
#include "ddp.h"
#include "ema.h"
#include "optim.h"
#include "train.h"
#include "train_metrics.h"

enum { STATS = 6 };

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
 * non-finite count of the gradient buckets this rank sent, and (fp16) the same of the summed
 * gradients after unscaling (a non-finite one skips the step); clipping's sum of squares; fp16's
 * loss scale. */
typedef struct {
  double *stats, *stats_host;  /* (STATS): backend memory, and host memory it is downloaded to */
  double *clip_sq;             /* (2) backend memory: train.clip_grad_norm's sum of squares */
  float *scaler, *scaler_host; /* train.precision fp16: (2) the loss scale and good steps; else NULL */
} dt_step_sums;

/* model.loss ignore_index: the targets a step's loss averages over, counted from the sampler's twin
 * (the loader's is its thread's). */
typedef struct {
  dt_sampler smp;
  int64_t *idx;   /* (local rows cap) scratch */
  double *weight; /* (1) backend memory: 1 / targets, uploaded each step (a replayed graph reads it) */
} dt_target_counter;

/* The loop's state. */
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
  dt_ddp ddp;
  dt_loader L;
  dt_log lg;
  dt_ckpt_data scratch; /* rank 0 with checkpoints: host copies for writing */
  dt_dev_batch in[2];   /* micro-batches alternate between the two */
  int64_t micro_count;  /* micro-batches uploaded so far: in[micro_count % 2] is next */
  dt_dev_batch *ahead;  /* the next step's batch, already uploaded (upload_ahead), or NULL */
  int64_t ahead_rows;
  dt_status ahead_st; /* why taking it failed: reported by the step that needed it */
  dt_dev_cache cache; /* data.cache device */
  dt_graphs graphs;
  dt_step_sums sums;
  dt_target_counter counter; /* ignore_index only */
  int inject;                /* this step's injected fault: DT_FAULT_NAN, DT_FAULT_OVERFLOW or none */
  dt_train_state ts;
  int64_t accum, opt_per_epoch, total; /* micro-batches per step, steps per epoch, steps in all */
  /* this optimizer step: epoch, step within it, its first micro-batch, micro-batches */
  int64_t epoch, os, micro0, k;
  double count;        /* rows in its global batch */
  double target_count; /* targets in it the loss averages over: rows x labels per row, less ignore_index's */
  double lr;
  dt_step_report all; /* the ranks' summed report */
  dt_step_window win; /* the reports' window, and the monitor's snapshot */
  int stop, stop_signal;
  int ckpt_asked; /* some rank asked for a checkpoint at this step (POST /checkpoint) */
} dt_trainer;

/* One optimizer step's work (train_step.c): every micro-batch uploaded and queued, then the update;
 * the results read once; this rank's loss and hits added to *mine; st set on failure. Then the
 * agreement of every rank on the outcome and on whether to stop, and the state advanced: returns
 * the agreed code. */
void step_run(dt_trainer *tr, dt_step_report *mine, double *data_s, dt_status *st);
int step_agree(dt_trainer *tr, dt_step_report *mine, dt_status *st);

#endif
