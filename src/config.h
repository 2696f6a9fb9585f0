/* config.h: the typed run configuration, read from YAML plus --set overrides.
 * Every key is declared once in config.c's table (type, bounds, default, doc); `ddp_train
 * --config-keys` prints that table, and docs/config.md is generated from it.
 * Owns: the YAML tree (model.layers and model.loss point into it) and all strings. */
#ifndef DT_CONFIG_H
#define DT_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "keys.h"
#include "yaml_tree.h"

enum { DT_SHARD_GLOBAL, DT_SHARD_CONTIGUOUS };
enum { DT_CACHE_AUTO, DT_CACHE_MEMORY, DT_CACHE_NONE, DT_CACHE_DEVICE };
enum { DT_SCHED_CONSTANT, DT_SCHED_STEP, DT_SCHED_COSINE, DT_SCHED_ONECYCLE };
enum { DT_METRIC_NONE, DT_METRIC_VAL_LOSS, DT_METRIC_VAL_ACC, DT_METRIC_EMA_VAL_LOSS, DT_METRIC_EMA_VAL_ACC };
enum { DT_COMM_AUTO, DT_COMM_MPI, DT_COMM_NCCL };
enum { DT_PROGRESS_AUTO, DT_PROGRESS_ON, DT_PROGRESS_OFF };
enum { DT_GRAPH_AUTO, DT_GRAPH_ON, DT_GRAPH_OFF };
enum { DT_GRAD_FP32, DT_GRAD_BF16 };
enum { DT_CONV_ALGO_AUTO, DT_CONV_ALGO_DIRECT };
enum { DT_RECOMPUTE_NONE, DT_RECOMPUTE_BLOCKS };
enum { DT_ATTENTION_AUTO, DT_ATTENTION_FUSED, DT_ATTENTION_MATERIALIZED }; /* model.attention */

typedef struct {
  /* model */
  dt_list input;         /* (C,H,W), (H,W) or (D) */
  const dt_node *layers; /* borrowed from tree */
  const dt_node *loss;   /* borrowed from tree */
  char *init_from;
  int init_from_ignore_extra;
  int fuse;
  int attention; /* DT_ATTENTION_* */
  /* data */
  char *data_path, *train_x, *train_y, *val_x, *val_y;
  double scale;
  dt_list mean, std;
  int sharding, drop_last, cache, shuffle;
  /* train */
  int64_t epochs, max_steps, batch_size, global_batch_size, grad_accum, seed,
      eval_every_steps; /* batch_size -1: auto */
  double clip_grad_norm, time_limit, memory_fraction;
  int early_metric;
  int64_t early_patience;
  double ema_decay;
  int cuda_graph, queue_ahead, precision, conv_algo, recompute;
  /* optim */
  int optim;
  double lr, momentum, weight_decay, eps;
  const dt_node *no_decay_node;
  int no_decay; /* DT_NO_DECAY_* bits: tensors weight decay skips */
  int nesterov;
  dt_list betas;
  int schedule;
  dt_list milestones;
  double gamma, min_lr, pct_start;
  int64_t warmup_steps;
  /* distill */
  char *distill_teacher, *distill_weights; /* "": no distillation */
  double distill_temperature, distill_alpha;
  int distill_loss; /* 0 kl, 1 mse: backend.h's DT_DISTILL_KL + it */
  /* checkpoint */
  char *ckpt_dir;
  int64_t ckpt_every_steps, ckpt_every_epochs, ckpt_keep;
  int ckpt_best;
  /* log */
  char *log_dir;
  int64_t log_every_steps;
  int progress;
  /* dist */
  int comm, grad_dtype;
  int64_t zero; /* dist.zero: 0 or 1 */
  double bucket_mb, timeout_s;
  int64_t threads;
  /* monitor */
  char *monitor_listen, *monitor_token_file;
  double monitor_stall_s;
} dt_config_values;

typedef struct {
  dt_config_values v;
  dt_node *tree;      /* owned */
  char *path;         /* owned: the config file's path (origin of node locations) */
  char **set_origins; /* owned: "--set KEY" strings, origins of --set nodes */
  int n_set;
  char *effective;      /* owned: canonical text of every effective value (hashed, logged, checkpointed) */
  uint64_t hash;        /* FNV-1a of effective */
  char auto_batch[512]; /* train.batch_size auto: what device_auto_batch chose and why ("": not auto) */
} dt_config;

/* Reads path, applies each "KEY=VALUE" of sets in order, validates all keys.
 * Returns 0, or sets st (exit 2 for config errors). cfg must be freed with config_free either way. */
int config_load(dt_config *cfg, const char *path, char *const *sets, int n_sets, dt_status *st);
/* Reads path for a model only (distill.teacher's config: its model section and data.scale, mean and
 * std): the keys of training need not be set. The same checks otherwise; cfg freed with config_free. */
int config_load_model(dt_config *cfg, const char *path, dt_status *st);
void config_free(dt_config *cfg);
/* Writes effective (and hash) again from the values, after a value was chosen at start-up
 * (train.batch_size auto's split): logs and checkpoints then say what ran. */
void config_refresh_effective(dt_config *cfg);
/* Rows of one global micro-batch on `world` ranks: train.global_batch_size, or train.batch_size per rank. */
int64_t config_global_batch(const dt_config_values *v, int world);
/* Rows of the largest local batch: the global batch split over `world` ranks, rounded up (an
 * uneven split's largest share; sampler.h's split_lo). */
int64_t config_max_local_rows(const dt_config_values *v, int world);
/* Rows the model's buffers hold (model_alloc): one more than the largest local batch. No training
 * batch uses the extra row, but evaluation and --predict run the validation rows in chunks of this
 * many, and a convolution's last bits depend on its batch (oneDNN chooses its kernel by it): one row
 * fewer changes the validation results, so it stays. */
int64_t config_model_rows(const dt_config_values *v, int world);

/* Prints the key table as a Markdown table (docs/config.md). */
void config_print_keys(FILE *out);

uint64_t dt_fnv1a(const void *data, size_t len, uint64_t h);

enum { DT_NO_DECAY_BIAS = 1, DT_NO_DECAY_NORM = 2, DT_NO_DECAY_EMBEDDING = 4 };

#endif
