/* optim.h: learning-rate schedules and the optimizers over the flat parameter buffer.
 * Schedules are functions of the optimizer step t in [0, total) (PyTorch's order: step t uses
 * lr(t), then the scheduler advances). An optimizer is a descriptor (one file each,
 * optim_<name>.c): its state tensors, named as PyTorch's optimizer state, and its step, queued
 * as one backend op. Adding one touches its file, its backend op and the optim.name key.
 * Owns: the optimizer state buffers and the table of optim.no_decay's runs (backend memory). */
#ifndef DT_OPTIM_H
#define DT_OPTIM_H

#include "backend.h"
#include "config.h"

enum { DT_OPTIM_MAX_STATES = 2, DT_OPTIM_HYPER = 4 };

typedef struct {
  const char *name;                             /* optim.name */
  const char *state_names[DT_OPTIM_MAX_STATES]; /* PyTorch's per-parameter state keys */
  /* state tensors this config needs (SGD without momentum: none) */
  int (*n_states)(const dt_config_values *c);
  /* The step's host-side values (DT_OPTIM_HYPER floats) for step t (steps already taken) at lr. */
  void (*hyper)(const dt_config_values *c, int64_t t, double lr, float *out);
  /* Queues one step over n values reading `hyper` (backend memory, uploaded before it runs). The
   * op itself depends on t only through `first` values fixed after step 0, so a captured step
   * replays. skip: NULL, or device memory that, above 0, makes the step a no-op (fp16 overflow).
   * nonfinite: NULL, or device memory the count of the non-finite gradient values is added to.
   * runs: NULL (weight_decay on every value), or (n_runs, backend memory) each run's weight decay.
   * states: n_states tensors of n. */
  void (*step)(const dt_config_values *c, dt_backend *be, int64_t n, int64_t t, const float *hyper, const double *skip,
               double *nonfinite, float weight_decay, const dt_decay_run *runs, int n_runs, float *params,
               const float *grads, float *const *states);
} dt_optim_ops;

extern const dt_optim_ops dt_optim_sgd;   /* optim_sgd.c */
extern const dt_optim_ops dt_optim_adamw; /* optim_adamw.c */

/* Indexed by optim.name's enum value (the key's choices, in this order). */
extern const dt_optim_ops *const dt_optim_kinds[];
extern const int dt_n_optim_kinds;
/* The index of the optimizer named `name` (optim.name's value), or -1. */
int optim_index(const char *name);

typedef struct {
  const dt_optim_ops *ops;
  const dt_config_values *cfg; /* borrowed */
  int64_t total_steps;
  int64_t n;
  int64_t lo, hi; /* the slice of the flat buffer this rank steps: [0, n), or its shard under dist.zero 1 */
  int n_states;
  float *states[DT_OPTIM_MAX_STATES]; /* (hi - lo) each, backend memory: the state of params[lo, hi) */
  float *hyper;                       /* (DT_OPTIM_HYPER) backend memory: this step's learning rate etc. */
  const double *skip;                 /* (1) backend memory or NULL: the op's skip (set by the trainer) */
  double *nonfinite;                  /* (1) backend memory or NULL: the op's count (set by the trainer) */
  int64_t step;                       /* optimizer steps taken */
  /* optim.no_decay: the runs of [lo, hi) stepped with and without weight decay, all in one op (NULL:
   * every value with decay) */
  dt_decay_run *runs; /* (n_runs) backend memory */
  int n_runs;
} dt_optim;

double schedule_lr(const dt_config_values *cfg, int64_t t, int64_t total);

/* The slice [*lo, *hi) of a flat buffer of n values whose optimizer state rank `rank` of `world`
 * keeps: all of it, or under dist.zero 1 its share (the sampler's split_lo). */
void optim_slice(const dt_config_values *cfg, int64_t n, int world, int rank, int64_t *lo, int64_t *hi);
/* The optimizer of a flat buffer of n values, keeping state for and stepping [lo, hi) only. */
void optim_init(dt_optim *o, const dt_config_values *cfg, dt_backend *be, int64_t n, int64_t lo, int64_t hi,
                int64_t total_steps);
void optim_free(dt_optim *o, dt_backend *be);
/* Steps the runs of the whole buffer (n, host memory: model_decay_runs's) each with its own weight decay:
 * their parts in [lo, hi), uploaded as the ops' table of runs. */
void optim_set_runs(dt_optim *o, dt_backend *be, int n, const dt_decay_run *all);
/* Uploads the next step's values at lr (queued; outside a captured step). */
void optim_prepare(dt_optim *o, dt_backend *be, double lr);
/* Queues the step prepared last over params[lo, hi) with grads[lo, hi); advances o->step. */
void optim_apply(dt_optim *o, dt_backend *be, float *params, const float *grads);
/* Counts a step whose optim_apply work was queued by replaying a captured one. */
void optim_advance(dt_optim *o);
/* Uncounts the last step: its update was skipped on the device (o->skip), as GradScaler skips
 * optimizer.step(), so the next step's values are those of this one. */
void optim_skipped(dt_optim *o);
/* optim_prepare then optim_apply. */
void optim_step(dt_optim *o, dt_backend *be, float *params, const float *grads, double lr);

#endif
