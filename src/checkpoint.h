/* checkpoint.h: checkpoints and the model layout they share with model.init_from.
 * A checkpoint is one HDF5 file written by rank 0:
 *   /model/<name>                 float32 tensors named as PyTorch's state_dict keys of an
 *                                 nn.Sequential of the same layers ("0.weight", "4.body.1.running_var")
 *   /optim/<state>/<name>         optimizer state per parameter tensor, named as PyTorch's:
 *                                 momentum_buffer (SGD), exp_avg and exp_avg_sq (AdamW)
 *   /ema/<name>                   with train.ema: the moving average, laid out as /model
 *   /meta (attributes)            config (effective config text), version, world_size, step, epoch,
 *                                 micro (next micro-batch of the epoch), global_batch, seed, optimizer,
 *                                 best_metric, bad_evals, best_val_acc, optimizer_step (updates
 *                                 applied: AdamW's t; step less skipped fp16 steps); with train.precision fp16
 *                                 also loss_scale and loss_scale_growth (GradScaler's growth tracker)
 * Datasets are chunked with Fletcher-32 checksums and the file uses HDF5's newer format with
 * checksummed metadata; both are verified on load. Files are built in memory (h5_image: HDF5 never
 * meets a disk error) and written as step-00000123.h5 under a temporary name, fsynced, renamed, the
 * directory fsynced, then `latest` (a text file holding the name) is replaced the same way. The oldest step files go
 * before the write (keep > 1), so that at most checkpoint.keep exist, the one being written included. */
#ifndef DT_CHECKPOINT_H
#define DT_CHECKPOINT_H

#include "comm.h"
#include "config.h"
#include "model.h"
#include "optim.h"

typedef struct {
  int64_t step;         /* optimizer steps done */
  int64_t epoch, micro; /* data position of the next micro-batch */
  int64_t global_batch, world_size;
  uint64_t seed;
  int optim;          /* index into dt_optim_kinds (optim.name) */
  double best_metric; /* early stopping */
  int64_t bad_evals;
  double best_val_acc;
  double loss_scale, scale_growth; /* train.precision fp16: GradScaler's scale and good steps (0: none) */
  int64_t optim_step;              /* optimizer updates applied: step less the skipped fp16 steps */
} dt_train_state;

/* Host copies of everything a checkpoint holds. opt[k]: the optimizer's state k (n_params
 * floats, named by its descriptor's state_names[k]); NULL past the ones it has. ema_params,
 * ema_bufs: the EMA (NULL: none); has_ema says whether a loaded file held one. */
typedef struct {
  float *params, *bufs, *opt[DT_OPTIM_MAX_STATES];
  float *ema_params, *ema_bufs;
  int has_ema;
  dt_train_state ts;
} dt_ckpt_data;

/* Loads the /model tensors of path into params and bufs (model.init_from, distill.weights: `what`,
 * for messages). Exit 2 naming the file and the tensor on a missing tensor or a shape mismatch, and
 * naming them when /model holds tensors the model does not have, unless ignore_extra
 * (model.init_from_ignore_extra). */
int ckpt_read_model(const char *path, const dt_model *m, float *params, float *bufs, int ignore_extra, const char *what,
                    dt_status *st);

/* Collective: rank 0's parameters and buffers of m (backend memory), read from path's /model first
 * unless path is empty (ckpt_read_model, naming `what`), become every rank's. Returns the agreed code. */
int ckpt_share_model(const char *path, dt_model *m, int ignore_extra, const char *what, dt_comm *comm);

/* Writes a checkpoint to path atomically. Exit 5 naming the path on any failure, with any
 * earlier file left as it was. */
int ckpt_write(const char *path, const dt_model *m, const dt_ckpt_data *d, const dt_config *cfg, dt_status *st);

/* Writes dir/step-<step>.h5, points dir/latest at it and keeps the newest `keep` step files,
 * removing the oldest before writing (keep > 1) so that no more than `keep` are ever on disk:
 * stale temporary files go first (ckpt_clean_stale), and a live writer's counts as a checkpoint. */
int ckpt_save_step(const char *dir, int64_t keep, const dt_model *m, const dt_ckpt_data *d, const dt_config *cfg,
                   char *written, size_t cap, dt_status *st);

/* Removes the temporary files (step-N.h5.tmp.PID, best.h5.tmp.PID, latest.tmp.PID) that crashed
 * writers left in dir: those whose PID is not another running process of this program on this host.
 * Returns how many remain (a live writer's); *removed (may be NULL): how many went. */
int ckpt_clean_stale(const char *dir, int *removed);

/* Reads only the /meta attributes: the training state and the stored config (caller frees).
 * Exit 2 naming the file when it is unreadable or not a ddp_train checkpoint. */
int ckpt_read_meta(const char *path, dt_train_state *ts, char **config_text, dt_status *st);

/* Loads a checkpoint: tensors, optimizer state (into the d->opt[k] that are set), the EMA (when d->ema_params is set
 * and the file has one) and the training state; *config_text receives the stored config (caller frees). Exit 2 naming
 * the file when it is missing, truncated, corrupt (checksums) or does not fit the model. */
int ckpt_load(const char *path, const dt_model *m, dt_ckpt_data *d, char **config_text, dt_status *st);

/* Writes /logits (n, k) float32 and /labels (n,) int32 (labels may be NULL) atomically. Exit 5. */
int ckpt_write_predictions(const char *path, const float *logits, const int32_t *labels, int64_t n, int64_t k,
                           dt_status *st);

/* Candidate files for --resume auto, newest first: latest's target, then step files by step.
 * Returns the count; names are written into names[i] (cap each). */
int ckpt_candidates(const char *dir, char names[][1024], int max);

/* Host buffers for everything a checkpoint of model m trained as v says holds: its params and
 * bufs, the optimizer's states and, with train.ema, the EMA's. ckpt_data_free frees them (and
 * zeroes d). */
void ckpt_data_alloc(dt_ckpt_data *d, const dt_model *m, const dt_config_values *v);
void ckpt_data_free(dt_ckpt_data *d);

/* --resume PATH or --resume auto (the newest good checkpoint in checkpoint.dir, falling back past
 * unreadable ones; none: a fresh start, *resumed 0). Rank 0 reads it, checks that it fits this
 * run (the model, the data order and the optimizer unchanged: frozen keys; the same global batch),
 * and every rank receives it: into d (allocated here, ckpt_data_alloc: the caller frees) and into
 * the model's params and bufs. Collective; returns the agreed exit code. */
int ckpt_resume(const char *which, const dt_config *cfg, dt_model *m, dt_comm *comm, dt_ckpt_data *d, int *resumed);

#endif
