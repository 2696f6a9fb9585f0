#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define F(field) offsetof(dt_config_values, field)
#define NOB 1, 0 /* no bounds */
#define BIG 1e308

/* The one declaration of every config key. Order is the order of docs and of the effective dump. */
static const dt_key config_keys[] = {
    {"model.input", DT_KEY_INTS, F(input), NULL, 1, 1e9, NULL, "input shape per sample: [C,H,W], [H,W] or [D]"},
    {"model.layers", DT_KEY_NODE, F(layers), NULL, NOB, NULL,
     "list of one-key maps, e.g. `- conv2d: {out: 32, kernel: 3}` (see Layers)"},
    {"model.loss", DT_KEY_NODE, F(loss), "cross_entropy", NOB, NULL,
     "`cross_entropy`, `mse`, or a one-key map such as `{cross_entropy: {label_smoothing: 0.1}}`"},
    {"model.init_from", DT_KEY_STRING, F(init_from), "\"\"", NOB, NULL,
     "HDF5 file in the checkpoint layout to load parameters and batchnorm buffers from; every tensor of the "
     "model must be in its /model, with its shape"},
    {"model.init_from_ignore_extra", DT_KEY_BOOL, F(init_from_ignore_extra), "false", NOB, NULL,
     "load model.init_from even when its /model holds tensors this model does not have (a head weight where the "
     "model ties its head to the embedding, a layer removed), leaving them unused; false: exit 2 naming them, as "
     "PyTorch's strict load_state_dict"},
    {"model.fuse", DT_KEY_BOOL, F(fuse), "true", NOB, NULL,
     "a relu right after a batchnorm, a residual or a linear runs inside it (one pass fewer over the activations, "
     "the same results bit for bit), a layernorm opening a residual's body adds the shortcut's gradient as it "
     "writes its own (the same bits), and a tanh gelu between two linears inside their GEMMs (CUDA: cuBLASLt's "
     "epilogues; one gradient buffer fewer; on the CPU the same bits), and under bf16 and fp16 on CUDA a conv2d "
     "without a bias hands the batchnorm after it its output, and takes its gradient, in cuDNN's 16-bit NHWC, as "
     "such a batchnorm does to a conv2d after it, or to a maxpool before a conv2d (no copies to and from FP32 "
     "between them; the same results, but for the gradient's way through a max that 16 bits make a tie), and a "
     "ResNet's residuals between such layers add 16-bit NHWC values as far as its global_avgpool (the sums "
     "rounded to 16 bits), and "
     "under bf16 on CUDA a last linear without a bias (GPT-2's tied head) writes bfloat16 logits, which the loss "
     "reads and whose bfloat16 gradient the linear's GEMMs read as it is (PyTorch's autocast rounds them so too), "
     "and a transformer keeps in bfloat16 what autocast does between its norms and products: a layernorm's "
     "output before a linear or attention layer, an MLP's hidden activations (the gelu and bias in the first "
     "linear's GEMM) and the fused attention's q, k, v and merged heads, with their gradients; and on CUDA "
     "under bf16 the weights of the linear and attention layers, and under bf16 and fp16 the conv2d filters, are "
     "copied to 16 bits once a forward, all in one pass, not by each GEMM or convolution that reads them (the "
     "same bits); "
     "false runs them apart"},
    {"model.attention", DT_KEY_ENUM, F(attention), "auto", NOB, "auto|fused|materialized",
     "fused: each attention layer's heads in one op that never stores the (B, H, T, T) scores (online softmax; "
     "backward computes them again); on CUDA for heads of up to 128 values whose tiles fit the GPU's shared "
     "memory per block (98 KiB at 64 values: not a T4's 64), else materialized; materialized: the scores and "
     "probabilities in memory, batched GEMMs and a softmax; auto: fused on CUDA, materialized on the CPU (where "
     "BLAS makes it the faster). A distillation teacher follows its own config's"},
    {"data.path", DT_KEY_STRING, F(data_path), NULL, NOB, NULL, "HDF5 file holding the datasets"},
    {"data.train.x", DT_KEY_STRING, F(train_x), "/train/images", NOB, NULL,
     "training inputs: (N,C,H,W), (N,H,W) or (N,D); uint8, float32 or float64"},
    {"data.train.y", DT_KEY_STRING, F(train_y), "/train/labels", NOB, NULL,
     "training targets: integer class labels (N,) or float targets (N,K)"},
    {"data.val.x", DT_KEY_STRING, F(val_x), "/test/images", NOB, NULL, "validation inputs; empty string: none"},
    {"data.val.y", DT_KEY_STRING, F(val_y), "/test/labels", NOB, NULL, "validation targets"},
    {"data.scale", DT_KEY_FLOAT, F(scale), "1.0", NOB, NULL, "inputs are multiplied by this first (1/255 for bytes)"},
    {"data.mean", DT_KEY_FLOATS, F(mean), "[]", NOB, NULL,
     "per-channel mean subtracted after scaling (one per channel)"},
    {"data.std", DT_KEY_FLOATS, F(std), "[]", 1e-12, BIG, NULL, "per-channel std divided by after the mean"},
    {"data.sharding", DT_KEY_ENUM, F(sharding), "global", NOB, "global|contiguous",
     "global: one permutation per epoch, each rank a slice of every global batch; contiguous: rank r "
     "reads only its 1/W of the rows"},
    {"data.shuffle", DT_KEY_BOOL, F(shuffle), "true", NOB, NULL,
     "shuffle the training rows every epoch (false: file order, as PyTorch's shuffle=False)"},
    {"data.drop_last", DT_KEY_BOOL, F(drop_last), "false", NOB, NULL, "drop the final partial global batch"},
    {"data.cache", DT_KEY_ENUM, F(cache), "auto", NOB, "auto|memory|none|device",
     "memory: load the rank's rows once; none: read each batch from the file; auto: memory when under 4 GiB; "
     "device: keep the rank's training rows in device memory, as stored (uint8 stays uint8), and gather each batch "
     "there with a kernel (only the row numbers are copied per step)"},
    {"train.epochs", DT_KEY_INT, F(epochs), "1", 1, BIG, NULL, "passes over the training set"},
    {"train.max_steps", DT_KEY_INT, F(max_steps), "0", 0, BIG, NULL,
     "stop after this many optimizer steps (0: no limit)"},
    {"train.batch_size", DT_KEY_INT, F(batch_size), "0", 0, BIG, "auto",
     "per-rank batch (PyTorch's convention); global batch = batch_size x world size. auto (with "
     "train.global_batch_size): the largest per-rank micro-batch whose estimated memory fits in "
     "train.memory_fraction of what a rank has, with train.grad_accum raised so that the rows of a step stay "
     "train.global_batch_size x train.grad_accum"},
    {"train.global_batch_size", DT_KEY_INT, F(global_batch_size), "0", 0, BIG, NULL,
     "total batch split across ranks, so the trajectory does not depend on the world size"},
    {"train.memory_fraction", DT_KEY_FLOAT, F(memory_fraction), "0.9", 0.01, 1, NULL,
     "train.batch_size auto: the share of a rank's memory (its GPU's free memory, or the node's available "
     "host memory divided among its ranks) the estimate may fill"},
    {"train.grad_accum", DT_KEY_INT, F(grad_accum), "1", 1, 1024, NULL,
     "micro-batches per optimizer step; gradients are communicated on the last one only"},
    {"train.clip_grad_norm", DT_KEY_FLOAT, F(clip_grad_norm), "0", 0, BIG, NULL,
     "clip gradients to this global L2 norm (0: off)"},
    {"train.time_limit", DT_KEY_DURATION, F(time_limit), "0", NOB, NULL,
     "wall-clock budget such as 3h50m: then checkpoint and exit 75 (0: none)"},
    {"train.seed", DT_KEY_INT, F(seed), "0", 0, BIG, NULL, "seed of every random stream (init, data order, dropout)"},
    {"train.eval_every_steps", DT_KEY_INT, F(eval_every_steps), "0", 0, BIG, NULL,
     "also validate every N steps (0: only at the end of each epoch)"},
    {"train.early_stopping.metric", DT_KEY_ENUM, F(early_metric), "none", NOB,
     "none|val_loss|val_acc|ema_val_loss|ema_val_acc",
     "stop when this validation metric has not improved for `patience` evaluations"},
    {"train.early_stopping.patience", DT_KEY_INT, F(early_patience), "3", 1, BIG, NULL,
     "evaluations without improvement before stopping"},
    {"train.ema.decay", DT_KEY_FLOAT, F(ema_decay), "0", 0, 0.999999999, NULL,
     "keep an exponential moving average of the weights (and batchnorm statistics), ema = decay ema + (1 - decay) "
     "w after every step, validated and saved beside the model (0: off; timm's ModelEmaV2 uses 0.9999)"},
    {"train.precision", DT_KEY_ENUM, F(precision), "fp32", NOB, "fp32|tf32|bf16|fp16",
     "math of convolutions and matrix products (CUDA): fp32; tf32 on tensor cores (compute capability 8.0); bf16 "
     "(8.0) or fp16 (7.0) inputs with fp32 accumulation, convolutions in NHWC; weights, optimizer, batchnorm, loss "
     "and gradient sums stay fp32; fp16 adds dynamic loss scaling (GradScaler's rules). The CPU backend is fp32 only"},
    {"train.conv_algo", DT_KEY_ENUM, F(conv_algo), "auto", NOB, "auto|direct",
     "CPU convolutions: auto runs 3x3 stride-1 ones by Winograd F(4x4, 3x3) where oneDNN has it (AVX-512 CPUs; "
     "about 1.4x faster convolutions, rounding errors a few times larger, as cuDNN's Winograd) and the rest "
     "directly; direct runs all directly (PyTorch's CPU choice). GPUs: cuDNN's choice either way"},
    {"train.recompute", DT_KEY_ENUM, F(recompute), "none", NOB, "none|blocks",
     "blocks: keep only each block's input and output through forward (a block is a residual layer, or one "
     "copy of a repeat's layers), and run the block's forward again just before its backward: less activation "
     "memory for about a third more compute, the same results bit for bit; none: keep every activation"},
    {"train.cuda_graph", DT_KEY_ENUM, F(cuda_graph), "auto", NOB, "auto|on|off",
     "capture the training step (forward, backward, gradient allreduce, optimizer, EMA) as one CUDA graph after "
     "a warm-up step and replay it; steps of another shape run eagerly (auto: when the step can be captured: "
     "--device cuda, train.grad_accum 1, and NCCL or a single rank; on: the same, an error where it cannot)"},
    {"train.queue_ahead", DT_KEY_BOOL, F(queue_ahead), "true", NOB, NULL,
     "CUDA graphs: queue each replayed step before the host reads the step before's results, so that the device "
     "does not idle between steps (not after a step that validation or a checkpoint follows, nor under fp16); a "
     "stop or checkpoint asked for then comes one step later"},
    {"optim.name", DT_KEY_ENUM, F(optim), "sgd", NOB, "sgd|adamw", "optimizer"},
    {"optim.lr", DT_KEY_FLOAT, F(lr), "0.01", 0, BIG, NULL, "peak learning rate"},
    {"optim.momentum", DT_KEY_FLOAT, F(momentum), "0", 0, 1, NULL, "SGD momentum"},
    {"optim.nesterov", DT_KEY_BOOL, F(nesterov), "false", NOB, NULL, "SGD Nesterov momentum (needs momentum > 0)"},
    {"optim.weight_decay", DT_KEY_FLOAT, F(weight_decay), "0", 0, BIG, NULL,
     "SGD: L2 added to the gradient; AdamW: decoupled decay"},
    {"optim.no_decay", DT_KEY_NODE, F(no_decay_node), "[]", NOB, NULL,
     "tensor groups weight decay skips, any of [bias, norm, embedding] (GPT-2 fine-tuning: all three): biases, "
     "batchnorm/layernorm weights, embedding matrices (and a head tied to one)"},
    {"optim.betas", DT_KEY_FLOATS, F(betas), "[0.9, 0.999]", 0, 0.999999, NULL, "AdamW betas (two numbers in [0,1))"},
    {"optim.eps", DT_KEY_FLOAT, F(eps), "1e-8", 0, BIG, NULL, "AdamW epsilon"},
    {"optim.schedule.name", DT_KEY_ENUM, F(schedule), "constant", NOB, "constant|step|cosine|onecycle",
     "learning-rate schedule over the optimizer steps of the run"},
    {"optim.schedule.milestones", DT_KEY_INTS, F(milestones), "[]", 0, BIG, NULL,
     "step: multiply lr by gamma at each of these optimizer steps"},
    {"optim.schedule.gamma", DT_KEY_FLOAT, F(gamma), "0.1", 0, BIG, NULL, "step: factor at each milestone"},
    {"optim.schedule.warmup_steps", DT_KEY_INT, F(warmup_steps), "0", 0, BIG, NULL, "cosine: linear warm-up steps"},
    {"optim.schedule.min_lr", DT_KEY_FLOAT, F(min_lr), "0", 0, BIG, NULL, "cosine: final learning rate"},
    {"optim.schedule.pct_start", DT_KEY_FLOAT, F(pct_start), "0.3", 0, 1, NULL,
     "onecycle: fraction of steps spent warming up (from lr/25, then cosine down to lr/25e4, as PyTorch)"},
    {"distill.teacher", DT_KEY_STRING, F(distill_teacher), "\"\"", NOB, NULL,
     "knowledge distillation: a config file whose model section (and data.scale, mean, std) describes a frozen "
     "teacher that runs forward on every training batch, in evaluation mode and the run's precision; the model "
     "learns from its outputs as well as from the labels (empty: off)"},
    {"distill.weights", DT_KEY_STRING, F(distill_weights), "\"\"", NOB, NULL,
     "the teacher's parameters: an HDF5 file in the checkpoint layout (a ddp_train checkpoint or best.h5, "
     "import_gpt2.py's file); read, never written"},
    {"distill.temperature", DT_KEY_FLOAT, F(distill_temperature), "1", 1e-3, 1e3, NULL,
     "kl: both softmaxes are taken of logits / temperature"},
    {"distill.alpha", DT_KEY_FLOAT, F(distill_alpha), "0.5", 0, 1, NULL,
     "loss = alpha x distillation term + (1 - alpha) x the model's own loss"},
    {"distill.loss", DT_KEY_ENUM, F(distill_loss), "kl", NOB, "kl|mse",
     "kl: T^2 KL(softmax(teacher / T) || softmax(model / T)) per label (PyTorch's kl_div, batchmean, per token for a "
     "token model, ignore_index's positions left out); mse: the mean squared difference of the logits"},
    {"checkpoint.dir", DT_KEY_STRING, F(ckpt_dir), "checkpoints", NOB, NULL,
     "where rank 0 writes step-<N>.h5 checkpoints and the `latest` pointer; empty: none at all"},
    {"checkpoint.every_steps", DT_KEY_INT, F(ckpt_every_steps), "0", 0, BIG, NULL,
     "also checkpoint every N optimizer steps (0: off)"},
    {"checkpoint.every_epochs", DT_KEY_INT, F(ckpt_every_epochs), "1", 0, BIG, NULL,
     "checkpoint at the end of every N epochs (0: off); a final checkpoint is always written"},
    {"checkpoint.keep", DT_KEY_INT, F(ckpt_keep), "3", 1, BIG, NULL, "keep the newest K step checkpoints"},
    {"checkpoint.best", DT_KEY_BOOL, F(ckpt_best), "false", NOB, NULL,
     "also keep best.h5, the checkpoint with the best validation metric (train.early_stopping.metric, "
     "else val_acc)"},
    {"log.dir", DT_KEY_STRING, F(log_dir), "runs/latest", NOB, NULL,
     "where rank 0 writes metrics.jsonl, and report.html at the end of a run"},
    {"log.every_steps", DT_KEY_INT, F(log_every_steps), "50", 1, BIG, NULL, "console and metrics line every N steps"},
    {"log.progress", DT_KEY_ENUM, F(progress), "auto", NOB, "auto|on|off",
     "progress bar with ETA (auto: when stdout is a terminal and not under mpirun or Slurm)"},
    {"dist.comm", DT_KEY_ENUM, F(comm), "auto", NOB, "auto|mpi|nccl",
     "gradient communicator (auto: NCCL on GPUs, MPI on CPUs; one rank has none, unless dist.grad_dtype is bf16)"},
    {"dist.grad_dtype", DT_KEY_ENUM, F(grad_dtype), "fp32", NOB, "fp32|bf16",
     "type of the gradient all-reduce: bf16 rounds each bucket to bfloat16 for the NCCL sum and back, halving the "
     "bytes sent (NCCL only; the gradients and the optimizer stay fp32)"},
    {"dist.zero", DT_KEY_INT, F(zero), "0", 0, 1, NULL,
     "ZeRO stage: 1 keeps the optimizer state of 1/W of the parameters on each rank, reduces each gradient to the "
     "rank that owns it instead of to all, and gathers the updated parameters after the step (0: off)"},
    {"dist.bucket_mb", DT_KEY_FLOAT, F(bucket_mb), "25", 1e-6, 4096, NULL,
     "gradient bucket size; each bucket's allreduce starts as soon as backward completes it"},
    {"dist.timeout_s", DT_KEY_FLOAT, F(timeout_s), "600", 1, BIG, NULL,
     "deadline of every collective: a warning naming the missing ranks at half of it, exit 3 at it"},
    {"dist.threads", DT_KEY_INT, F(threads), "0", 0, 1024, NULL, "CPU threads per rank (0: cores / ranks on the node)"},
    {"monitor.listen", DT_KEY_STRING, F(monitor_listen), "\"\"", NOB, NULL,
     "HOST:PORT where rank 0 serves the dashboard page on /, /health, /metrics (Prometheus), /status, /history and "
     "POST /checkpoint, /stop, e.g. 127.0.0.1:9400 (\"[::1]:9400\", quoted, for IPv6; port 0: any free port, logged); "
     "empty: off. An address "
     "other than loopback needs monitor.token_file, and then every request needs the token (but the page's own files)"},
    {"monitor.stall_s", DT_KEY_DURATION, F(monitor_stall_s), "0", NOB, NULL,
     "GET /health answers 503 once no step has finished for this long (0: half of dist.timeout_s)"},
    {"monitor.token_file", DT_KEY_STRING, F(monitor_token_file), "\"\"", NOB, NULL,
     "file holding the bearer token that POST /checkpoint and /stop (and every request off loopback) must send as "
     "`Authorization: Bearer TOKEN`; read at start-up: a regular file owned by you (or root) that group and others "
     "can neither read nor write"},
};
#define N_CONFIG_KEYS ((int)(sizeof config_keys / sizeof *config_keys))

uint64_t dt_fnv1a(const void *data, size_t len, uint64_t h) {
  const unsigned char *p = data;
  if (!h) h = 1469598103934665603ULL;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

static char *read_file(const char *path, size_t *len, dt_status *st) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    dt_fail(st, DT_EXIT_INPUT, "%s: cannot open config: %s", path, strerror(errno));
    return NULL;
  }
  size_t cap = 4096, n = 0;
  char *buf = dt_malloc(cap);
  for (;;) {
    if (n + 1 >= cap) buf = dt_realloc(buf, cap *= 2);
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    dt_fail(st, DT_EXIT_INPUT, "%s: cannot read config", path);
    return NULL;
  }
  buf[n] = 0;
  *len = n;
  return buf;
}

/* Applies "a.b.c=VALUE": VALUE is parsed as YAML (so lists and maps work) and replaces a.b.c. */
static int apply_set(dt_config *cfg, const char *arg, int idx, dt_status *st) {
  const char *eq = strchr(arg, '=');
  if (!eq || eq == arg)
    return dt_fail(st, DT_EXIT_INPUT, "--set %s: expected KEY=VALUE, e.g. --set train.epochs=3", arg);
  size_t klen = (size_t)(eq - arg);
  char *key = dt_malloc(klen + 1);
  memcpy(key, arg, klen);
  key[klen] = 0;
  char origin[300];
  snprintf(origin, sizeof origin, "--set %s", key);
  cfg->set_origins[idx] = dt_strdup(origin);
  dt_node *value = yaml_tree_parse(eq + 1, strlen(eq + 1), cfg->set_origins[idx], st);
  if (!value) {
    free(key);
    return st->code;
  }
  if (eq[1] == 0) { /* "--set k=" is the empty string */
    yaml_tree_free(value);
    value = yaml_new_map(cfg->set_origins[idx]);
    value->kind = DT_NODE_SCALAR;
    value->scalar = dt_strdup("");
    value->quoted = 1;
  }
  /* Nodes parsed from the argument keep line/col of the argument; drop them so messages say --set. */
  value->line = value->col = 0;
  dt_node *map = cfg->tree;
  char *part = key, *dot;
  while ((dot = strchr(part, '.'))) {
    *dot = 0;
    dt_node *child = yaml_map_get(map, part);
    if (!child) {
      child = yaml_new_map(cfg->set_origins[idx]);
      yaml_map_set(map, part, child);
    } else if (child->kind != DT_NODE_MAP) {
      dt_fail(st, DT_EXIT_INPUT, "--set %s: '%s' is not a section", arg, part);
      yaml_tree_free(value);
      free(key);
      return st->code;
    }
    map = child;
    part = dot + 1;
  }
  yaml_map_set(map, part, value);
  free(key);
  return 0;
}

static int check_cross(dt_config *cfg, int model_only, dt_status *st) {
  dt_config_values *v = &cfg->v;
  char where[512];
  if (!model_only) { /* a run's config; a teacher's batch is the run's */
    if (v->batch_size == -1 && !v->global_batch_size)
      return dt_fail(st, DT_EXIT_INPUT,
                     "%s: train.batch_size auto needs train.global_batch_size: the rows of a step it keeps while "
                     "choosing the micro-batch",
                     cfg->path);
    if (v->batch_size > 0 && v->global_batch_size)
      return dt_fail(st, DT_EXIT_INPUT,
                     "%s: train.batch_size and train.global_batch_size are both set; set only one (per-rank "
                     "or total)",
                     cfg->path);
    if (!v->batch_size && !v->global_batch_size)
      return dt_fail(st, DT_EXIT_INPUT, "%s: set train.batch_size (per rank) or train.global_batch_size (total)",
                     cfg->path);
  }
  if (v->input.n < 1 || v->input.n > 3)
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.input: expected [C,H,W], [H,W] or [D], got %d numbers", cfg->path,
                   v->input.n);
  int channels = v->input.n == 3 ? (int)v->input.v[0] : 1;
  if (v->mean.n && v->mean.n != channels)
    return dt_fail(st, DT_EXIT_INPUT, "%s: data.mean has %d values but the input has %d channels", cfg->path, v->mean.n,
                   channels);
  if (v->std.n && v->std.n != channels)
    return dt_fail(st, DT_EXIT_INPUT, "%s: data.std has %d values but the input has %d channels", cfg->path, v->std.n,
                   channels);
  if (v->betas.n != 2) return dt_fail(st, DT_EXIT_INPUT, "%s: optim.betas: expected two numbers", cfg->path);
  const dt_node *nd = v->no_decay_node;
  v->no_decay = 0;
  if (nd && nd->kind != DT_NODE_SEQ)
    return dt_fail(st, DT_EXIT_INPUT, "%s: optim.no_decay: expected a list such as [bias, norm, embedding]",
                   yaml_where(nd, where, sizeof where));
  for (int i = 0; nd && i < nd->n; i++) {
    const dt_node *it = nd->items[i];
    static const char *const groups[] = {"bias", "norm", "embedding"};
    int bit = -1;
    for (int g = 0; g < 3 && it->kind == DT_NODE_SCALAR; g++)
      if (!strcmp(it->scalar, groups[g])) bit = g;
    if (bit < 0) {
      const char *near = it->kind == DT_NODE_SCALAR ? keys_suggest(it->scalar, groups, 3) : NULL;
      return dt_fail(st, DT_EXIT_INPUT, "%s: optim.no_decay[%d]: expected bias, norm or embedding%s%s%s",
                     yaml_where(it, where, sizeof where), i, near ? "; did you mean '" : "", near ? near : "",
                     near ? "'?" : "");
    }
    v->no_decay |= 1 << bit;
  }
  if (!model_only && v->distill_teacher[0] && !v->distill_weights[0])
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s: distill.teacher %s needs distill.weights: the teacher's trained parameters (a checkpoint)",
                   cfg->path, v->distill_teacher);
  if ((v->early_metric == DT_METRIC_EMA_VAL_LOSS || v->early_metric == DT_METRIC_EMA_VAL_ACC) && v->ema_decay <= 0)
    return dt_fail(st, DT_EXIT_INPUT, "%s: train.early_stopping.metric %s needs train.ema.decay > 0", cfg->path,
                   v->early_metric == DT_METRIC_EMA_VAL_LOSS ? "ema_val_loss" : "ema_val_acc");
  if ((v->early_metric != DT_METRIC_NONE || v->ckpt_best) && !v->val_x[0]) /* else never evaluated */
    return dt_fail(st, DT_EXIT_INPUT, "%s: %s needs a validation split: data.val.x is empty", cfg->path,
                   v->ckpt_best ? "checkpoint.best" : "train.early_stopping.metric");
  if (v->nesterov && v->momentum <= 0)
    return dt_fail(st, DT_EXIT_INPUT, "%s: optim.nesterov needs optim.momentum > 0", cfg->path);
  for (int i = 1; i < v->milestones.n; i++)
    if (v->milestones.v[i] <= v->milestones.v[i - 1])
      return dt_fail(st, DT_EXIT_INPUT, "%s: optim.schedule.milestones must increase", cfg->path);
  if (!v->layers || v->layers->kind != DT_NODE_SEQ || v->layers->n == 0) {
    const dt_node *at = v->layers ? v->layers : cfg->tree;
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.layers: expected a non-empty list of layers",
                   yaml_where(at, where, sizeof where));
  }
  return 0;
}

int64_t config_global_batch(const dt_config_values *v, int world) {
  return v->global_batch_size ? v->global_batch_size : v->batch_size * world;
}

int64_t config_max_local_rows(const dt_config_values *v, int world) {
  int64_t G = config_global_batch(v, world);
  return (G + world - 1) / world; /* shares differ by one at most: the largest is the rounded-up one */
}

int64_t config_model_rows(const dt_config_values *v, int world) {
  return config_max_local_rows(v, world) + 1;
}

static int load(dt_config *cfg, const char *path, char *const *sets, int n_sets, int model_only, dt_status *st) {
  memset(cfg, 0, sizeof *cfg);
  cfg->path = dt_strdup(path);
  size_t len;
  char *text = read_file(path, &len, st);
  if (!text) return st->code;
  cfg->tree = yaml_tree_parse(text, len, cfg->path, st);
  free(text);
  if (!cfg->tree) return st->code;
  if (cfg->tree->kind != DT_NODE_MAP) {
    char where[512];
    return dt_fail(st, DT_EXIT_INPUT, "%s: the config must be a map of sections (model, data, train, ...)",
                   yaml_where(cfg->tree, where, sizeof where));
  }
  cfg->set_origins = dt_calloc((size_t)(n_sets > 0 ? n_sets : 1), sizeof(char *));
  cfg->n_set = n_sets;
  for (int i = 0; i < n_sets; i++)
    if (apply_set(cfg, sets[i], i, st)) return st->code;
  const dt_node *data = yaml_map_get(cfg->tree, "data");
  if (model_only && !(data && data->kind == DT_NODE_MAP && yaml_map_get(data, "path"))) { /* a model alone */
    char *none[] = {"data.path=''"};
    cfg->n_set = 1; /* set_origins has its one slot */
    if (apply_set(cfg, none[0], 0, st)) return st->code;
  }
  if (keys_read(config_keys, N_CONFIG_KEYS, &cfg->v, cfg->tree, NULL, "", "key", st)) return st->code;
  if (check_cross(cfg, model_only, st)) return st->code;
  size_t elen = 0, ecap = 0;
  keys_dump(config_keys, N_CONFIG_KEYS, &cfg->v, "", &cfg->effective, &elen, &ecap);
  cfg->hash = dt_fnv1a(cfg->effective, elen, 0);
  return 0;
}

int config_load(dt_config *cfg, const char *path, char *const *sets, int n_sets, dt_status *st) {
  return load(cfg, path, sets, n_sets, 0, st);
}

int config_load_model(dt_config *cfg, const char *path, dt_status *st) {
  return load(cfg, path, NULL, 0, 1, st);
}

void config_refresh_effective(dt_config *cfg) {
  size_t elen = 0, ecap = 0;
  free(cfg->effective);
  cfg->effective = NULL;
  keys_dump(config_keys, N_CONFIG_KEYS, &cfg->v, "", &cfg->effective, &elen, &ecap);
  cfg->hash = dt_fnv1a(cfg->effective, elen, 0);
}

void config_free(dt_config *cfg) {
  keys_free(config_keys, N_CONFIG_KEYS, &cfg->v);
  yaml_tree_free(cfg->tree);
  for (int i = 0; i < cfg->n_set; i++) free(cfg->set_origins[i]);
  free(cfg->set_origins);
  free(cfg->path);
  free(cfg->effective);
  memset(cfg, 0, sizeof *cfg);
}

void config_print_keys(FILE *out) {
  fprintf(out, "| key | type | default | meaning |\n|---|---|---|---|\n");
  for (int i = 0; i < N_CONFIG_KEYS; i++) {
    const dt_key *k = &config_keys[i];
    char bounds[96];
    keys_bounds_text(k, bounds, sizeof bounds);
    /* enum choices are "a|b": escape the bars inside a Markdown table */
    char type[256];
    size_t t = 0;
    for (const char *c = keys_type_name(k); *c && t < sizeof type - 3; c++) {
      if (*c == '|') type[t++] = '\\';
      type[t++] = *c;
    }
    type[t] = 0;
    fprintf(out, "| `%s` | %s%s | %s | %s |\n", k->path, type, bounds, k->deflt ? k->deflt : "(required)", k->doc);
  }
}
