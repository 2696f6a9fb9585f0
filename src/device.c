/* device.c: the device each rank computes on (device.h). */
#define _GNU_SOURCE
#include "device.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu.h"
#include "memory.h"
#include "optim.h"

/* Threads per rank: the cores this rank may run on, shared with the other ranks on the node.
 * cfg NULL: the default (dist.threads unset). */
int device_threads(const dt_config *cfg, const dt_comm *c) {
  if (cfg && cfg->v.threads > 0) return (int)cfg->v.threads;
  cpu_set_t set;
  int mine = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  int share = (int)(online > 0 ? online : 1) / (c->local_size > 0 ? c->local_size : 1);
  if (share < 1) share = 1;
  return mine < share ? mine : share;
}

/* The CPUs this rank may run on, as ranges: "0-3,8". */
static void affinity_text(char *buf, size_t cap) {
  cpu_set_t set;
  size_t len = 0;
  buf[0] = 0;
  if (sched_getaffinity(0, sizeof set, &set)) {
    snprintf(buf, cap, "?");
    return;
  }
  for (int i = 0; i < CPU_SETSIZE && len < cap; i++) {
    if (!CPU_ISSET(i, &set)) continue;
    int j = i;
    while (j + 1 < CPU_SETSIZE && CPU_ISSET(j + 1, &set)) j++;
    len += (size_t)snprintf(buf + len, cap - len, j > i ? "%s%d-%d" : "%s%d", len ? "," : "", i, j);
    i = j;
  }
}

/* Collective: every rank's line (cap bytes) gathered to rank 0, which prints them under "title:". */
static void print_rank_lines(dt_comm *comm, const char *title, const char *line, size_t cap) {
  char *all = comm->rank == 0 ? dt_calloc((size_t)comm->size, cap) : NULL;
  comm_gather_text(comm, line, cap, all);
  if (comm->rank == 0) {
    printf("%s:\n", title);
    for (int r = 0; r < comm->size; r++) fputs(all + (size_t)r * cap, stdout);
    fflush(stdout);
  }
  free(all);
}

/* Collective: rank 0 prints each rank's host, local rank, CPU threads and CPUs (the start-up table of
 * CPU runs, and --info's, where threads is the default for dist.threads unset). */
void device_print_placement(dt_comm *comm, int threads) {
  enum { CAP = 512 };
  char line[CAP], cpus[256];
  affinity_text(cpus, sizeof cpus);
  snprintf(line, CAP, "  rank %-4d %-20s local rank %d of %d, %d thread%s, cpus %s\n", comm->rank, comm->host,
           comm->local_rank, comm->local_size, threads, threads > 1 ? "s" : "", cpus);
  print_rank_lines(comm, "placement", line, CAP);
}

/* Whether two ranks use one GPU: the same PCI bus id on the same host. Bus ids, not device
 * numbers: with a GPU bound to each task (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES) every
 * rank sees its GPU as device 0. Collective; every rank gets the same answer, with the first such
 * pair described in why (empty when none). */
int device_gpus_shared(dt_comm *comm, int gpu, char *why, size_t cap) {
  enum { KEY = 320 };
  char mine[KEY], bus[32];
  if (gpu >= 0)
    gpu_bus_id(gpu, bus, sizeof bus);
  else
    snprintf(bus, sizeof bus, "none (rank %d)", comm->rank); /* no GPU: shares nothing */
  snprintf(mine, sizeof mine, "%s|%s", bus, comm->host);
  char *all = dt_malloc((size_t)comm->size * KEY);
  comm_allgather_text(comm, mine, KEY, all);
  why[0] = 0;
  for (int a = 0; a < comm->size && !why[0]; a++)
    for (int b = a + 1; b < comm->size && !why[0]; b++)
      if (!strcmp(all + (size_t)a * KEY, all + (size_t)b * KEY)) {
        const char *key = all + (size_t)a * KEY, *host = strchr(key, '|') + 1;
        snprintf(why, cap, "ranks %d and %d use the same GPU (PCI %.*s on %s)", a, b, (int)(host - key - 1), key, host);
      }
  free(all);
  return why[0] != 0;
}

int device_auto_cuda(dt_comm *comm, char *why, size_t cap) {
  char mine[256] = "", shared[512];
  int n = gpu_count(mine, sizeof mine), gpu = n > 0 ? comm->local_rank % n : -1;
  int ok = n > 0;
  if (ok) {
    char built[256];
    int cc = gpu_compute_capability(gpu);
    ok = gpu_build_runs_on(cc, built, sizeof built);
    if (!ok)
      snprintf(mine, sizeof mine,
               "GPU %d of rank %d (%s) has compute capability %d.%d, which this build has no code for", gpu, comm->rank,
               comm->host, cc / 10, cc % 10);
  }
  int sharing = device_gpus_shared(comm, gpu, shared, sizeof shared); /* collective */
  int all_ok = comm_min_i32(comm, ok && !sharing, "--device auto");
  int any_gpu = -comm_min_i32(comm, -(n > 0), "--device auto"); /* the highest */
  why[0] = 0;                                                   /* filled on rank 0 */
  if (all_ok || !any_gpu) return all_ok;
  if (sharing)
    snprintf(why, cap, "%s (--device cuda shares them over MPI)", shared);
  else { /* the first rank that lacks a usable GPU says why */
    char *all = comm->rank == 0 ? dt_calloc((size_t)comm->size, sizeof mine) : NULL;
    if (ok) mine[0] = 0;
    comm_gather_text(comm, mine, sizeof mine, all);
    for (int r = 0; comm->rank == 0 && r < comm->size && !why[0]; r++)
      if (all[(size_t)r * sizeof mine]) snprintf(why, cap, "rank %d: %s", r, all + (size_t)r * sizeof mine);
    free(all);
  }
  return 0;
}

/* The GPU this rank uses (-1: the CPU backend). --device cuda, or --device auto where
 * device_auto_cuda agrees. Rank i of a node uses visible GPU i; with dist.comm mpi several ranks
 * may share one GPU. */
int device_select(int cuda, const dt_config *cfg, dt_model *m, const dt_comm *comm, dt_status *st) {
  static const char *const precisions[] = {"fp32", "tf32", "bf16", "fp16"};
  const int prec = cfg->v.precision;
  if (!cuda) {
    if (prec != DT_PREC_FP32)
      dt_fail(st, DT_EXIT_INPUT,
              "train.precision %s: the CPU backend computes in fp32 only; use --device cuda, or train.precision "
              "fp32",
              precisions[prec]);
    return -1;
  }
  char why[256] = "";
  int n = gpu_count(why, sizeof why);
  if (n == 0) {
    dt_fail(st, DT_EXIT_INPUT, "--device cuda: %s; use --device cpu", why);
    return -1;
  }
  int gpu = comm->local_rank % n, cc = gpu_compute_capability(gpu);
  char built[256];
  if (!gpu_build_runs_on(cc, built, sizeof built)) {
    dt_fail(st, DT_EXIT_INPUT,
            "GPU %d of rank %d (%s) has compute capability %d.%d, and this build has no code for it (%s); CUDA 13 "
            "builds for 7.5 and later: rebuild with make CUDA_ARCH='-gencode arch=compute_XY,code=sm_XY' for it",
            gpu, comm->rank, comm->host, cc / 10, cc % 10, built);
    return -1;
  }
  int need = prec == DT_PREC_TF32 || prec == DT_PREC_BF16 ? 80 : prec == DT_PREC_FP16 ? 70 : 0;
  if (cc < need) {
    dt_fail(st, DT_EXIT_INPUT,
            "train.precision %s needs tensor cores of compute capability %d.%d or later, but GPU %d of rank %d "
            "(%s) has %d.%d; use train.precision %s",
            precisions[prec], need / 10, need % 10, gpu, comm->rank, comm->host, cc / 10, cc % 10,
            cc >= 70 ? "fp16 or fp32" : "fp32");
    return -1;
  }
  model_pick_ops(m, 1, gpu_shared_per_block(gpu));
  /* the kernels and cuDNN index a tensor with 32 bits (train.batch_size auto keeps to it as it chooses) */
  int64_t rows = config_model_rows(&cfg->v, comm->size), values = rows * model_max_row(m); /* an eval chunk's */
  if (cfg->v.batch_size != -1 && values >= ((int64_t)1 << 31)) {
    dt_fail(st, DT_EXIT_INPUT,
            "--device cuda: the largest tensor holds %lld values per rank (%lld rows x %lld), over the 2^31 "
            "that the CUDA kernels and cuDNN index; lower train.batch_size or train.global_batch_size, or use "
            "more ranks",
            (long long)values, (long long)rows, (long long)model_max_row(m));
    return -1;
  }
  return gpu;
}

#ifdef DT_WITH_CUDA
/* Rank 0 prints rank, host, GPU and PCI bus id of every rank. */
static void print_device_table(dt_comm *comm, int gpu) {
  enum { CAP = 600 };
  char line[CAP], desc[512];
  size_t free_b;
  gpu_describe(gpu, desc, sizeof desc, &free_b);
  snprintf(line, CAP, "  rank %-4d %-20s %s\n", comm->rank, comm->host, desc);
  print_rank_lines(comm, "devices", line, CAP);
}

#endif

static double mib(size_t b) {
  return (double)b / 1048576.0;
}

/* The host memory a new allocation can have: MemAvailable (free pages and the page cache the kernel
 * can reclaim), or the free pages where the kernel does not say. */
static size_t host_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  unsigned long long kib = 0;
  int found = 0;
  while (f && !found && fgets(line, sizeof line, f)) found = sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
  if (f) fclose(f);
  if (found) return (size_t)kib * 1024;
  long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

/* What a rank needs at the config's batch on backend be: the model's buffers and the optimizer's
 * hyperparameters, the EMA, what the run holds beside the model (memory.h: batches, data, MPI sums,
 * the checkpoint being written, the backend's scratch), the device cache of the data (d NULL: before
 * the data is open, none), one bf16 gradient bucket. run_part and extra (cap bytes each) name the
 * additions for the printed line. */
static dt_memory rank_memory(const dt_config_values *v, const dt_model *m, const dt_data *d, const dt_comm *comm,
                             int threads, dt_backend *be, char *run_part, char *extra, size_t cap) {
  const int64_t rows = config_max_local_rows(v, comm->size), held = config_model_rows(v, comm->size);
  int states = dt_optim_kinds[v->optim]->n_states(v);
  dt_memory mem = model_memory(m, held, states, threads);
  mem.optim += DT_OPTIM_HYPER * sizeof(float); /* the step's learning rate etc., beside the states */
  mem.total += DT_OPTIM_HYPER * sizeof(float);
  extra[0] = 0;
  int64_t lo, hi; /* the parameters whose optimizer state and EMA this rank keeps (dist.zero 1: a slice) */
  optim_slice(v, m->n_params, comm->size, comm->rank, &lo, &hi);
  const int64_t slice = hi - lo;
  const size_t saved = (size_t)states * (size_t)(m->n_params - slice) * sizeof(float);
  mem.optim -= saved;
  mem.total -= saved;
  if (v->ema_decay > 0) {
    mem.ema = (size_t)(slice + m->n_bufs) * sizeof(float);
    mem.total += mem.ema;
  }
  if (m->teacher) { /* distillation: its parameters, buffers and forward's activations; scratch shared */
    dt_memory t = model_memory(m->teacher, held, 0, threads);
    mem.teacher = t.params + t.buffers + t.activations;
    if (t.workspace > mem.workspace) mem.total += t.workspace - mem.workspace, mem.workspace = t.workspace;
    mem.total += mem.teacher;
  }
  dt_run_memory run; /* what the run holds beside the model (memory.h) */
  memory_run_parts(v, m, d, be, comm->size, rows, held, &run);
  mem.workspace += run.workspace;
  mem.total += run.batches + run.data + run.mpi + run.checkpoint + run.workspace;
  int len = snprintf(run_part, cap, " + batches %.1f", mib(run.batches));
  if (run.data) len += snprintf(run_part + len, cap - (size_t)len, " + data %.1f", mib(run.data));
  if (run.mpi) len += snprintf(run_part + len, cap - (size_t)len, " + MPI sums %.1f", mib(run.mpi));
  if (run.checkpoint) snprintf(run_part + len, cap - (size_t)len, " + checkpoint %.1f", mib(run.checkpoint));
  if (d && v->cache == DT_CACHE_DEVICE) { /* the rank's training rows as stored, and their labels or targets */
    const dt_split *s = &d->train;
    size_t rows_held = (size_t)(s->hi - s->lo);
    size_t bytes =
        rows_held * ((size_t)s->row_elems * s->x_elem + (s->labels ? sizeof(int32_t) : (size_t)s->y_k * sizeof(float)));
    mem.total += bytes;
    snprintf(extra, cap, " + data.cache device %.1f", mib(bytes));
  }
  if (v->grad_dtype == DT_GRAD_BF16 && (!be->host_memory || comm->size > 1)) { /* NCCL's bucket in bf16 */
    int64_t bucket = (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float));
    size_t bytes = (size_t)(bucket < m->n_params ? bucket : m->n_params) * 2;
    mem.total += bytes;
    snprintf(extra + strlen(extra), cap - strlen(extra), " + bf16 bucket %.1f", mib(bytes));
  }
  return mem;
}

/* The memory a rank has: its GPU's free memory (gpu >= 0: a CPU run never looks for a GPU), read
 * once this process's backend (and so its CUDA context) exists, else the host's available memory
 * shared by the ranks on the node; *where says which. */
static size_t rank_available(const dt_comm *comm, int gpu, const char **where) {
  size_t have = 0;
  if (gpu >= 0) {
    char line[512];
    gpu_describe(gpu, line, sizeof line, &have);
    *where = "free on this rank's GPU";
  } else {
    have = host_available() / (size_t)(comm->local_size > 0 ? comm->local_size : 1);
    *where = "of available host memory per rank on this node";
  }
  return have;
}

size_t device_check_memory(const dt_config *cfg, const dt_model *m, const dt_data *d, const dt_comm *comm, int gpu,
                           dt_backend *be, int report, dt_status *st) {
  const dt_config_values *v = &cfg->v;
  /* the training batch's rows are reported; the buffers, and so the memory, hold config_model_rows */
  int64_t rows = config_max_local_rows(v, comm->size), held = config_model_rows(v, comm->size);
  const double limit = (double)((int64_t)1 << 40); /* values in a tensor, as model.c's shapes */
  if ((double)held * (double)model_max_row(m) > limit) {
    dt_fail(st, DT_EXIT_INPUT,
            "the batch does not fit: a rank's %lld rows of up to %lld values each are more than 2^40 values in one "
            "tensor; lower train.batch_size or train.global_batch_size, or use more ranks",
            (long long)rows, (long long)model_max_row(m));
    return 0;
  }
  char run_part[160], extra[160], state_part[64] = "";
  dt_memory mem = rank_memory(v, m, d, comm, device_threads(cfg, comm), be, run_part, extra, sizeof extra);
  if (mem.ema) snprintf(state_part, sizeof state_part, " + ema %.1f", mib(mem.ema));
  if (mem.teacher)
    snprintf(state_part + strlen(state_part), sizeof state_part - strlen(state_part), " + teacher %.1f",
             mib(mem.teacher));
  const char *where;
  size_t have = rank_available(comm, gpu, &where);
  char tokens[64] = ""; /* a token model's rows are sequences */
  if (m->tokens) snprintf(tokens, sizeof tokens, " of %lld tokens", (long long)m->tokens);
  if (report && comm->rank == 0) {
    printf(
        "memory per rank at %lld rows%s: %.1f MiB = parameters %.1f + gradients %.1f + optimizer %.1f%s%s + "
        "buffers %.1f + activations %.1f%s + workspace %.1f%s; %.0f MiB %s\n",
        (long long)rows, tokens, mib(mem.total), mib(mem.params), mib(mem.grads), mib(mem.optim),
        v->zero && comm->size > 1 ? " (dist.zero 1: rank 0's slice)" : "", state_part, mib(mem.buffers),
        mib(mem.activations), run_part, mib(mem.workspace), extra, mib(have), where);
    printf(
        "activations of the layers at %lld rows: %.1f MiB with train.recompute none, %.1f MiB with blocks (%d "
        "blocks)%s\n",
        (long long)rows, mib(model_activation_bytes(m, held, DT_RECOMPUTE_NONE)),
        mib(model_activation_bytes(m, held, DT_RECOMPUTE_BLOCKS)), m->top.n_blocks,
        v->recompute == DT_RECOMPUTE_BLOCKS && !m->top.n_blocks
            ? "; this model has no residual layer or repeat, so train.recompute blocks recomputes nothing"
            : "");
    fflush(stdout);
  }
  if (have && mem.total > have)
    dt_fail(st, DT_EXIT_INPUT,
            "the batch does not fit: a rank needs %.1f MiB but has %.1f MiB %s; lower "
            "train.batch_size or train.global_batch_size, or use more ranks",
            mib(mem.total), mib(have), where);
  return mem.total;
}

/* The part of mem that takes the most, named for a message (the largest layer's activations). */
static void largest_part(const dt_model *m, const dt_memory *mem, int64_t held, char *buf, size_t cap) {
  const struct {
    const char *name;
    size_t bytes;
  } parts[] = {{"the parameters", mem->params},
               {"the gradients", mem->grads},
               {"the optimizer state", mem->optim},
               {"the EMA", mem->ema},
               {"the activations", mem->activations}};
  int most = 0;
  for (int i = 1; i < 5; i++)
    if (parts[i].bytes > parts[most].bytes) most = i;
  int n = snprintf(buf, cap, "%s, %.1f MiB", parts[most].name, mib(parts[most].bytes));
  size_t layer_bytes;
  const dt_layer *l = model_largest_activations(m, held, &layer_bytes);
  if (most == 4 && l && n > 0 && (size_t)n < cap)
    snprintf(buf + n, cap - (size_t)n, " (the most: layer %s %s, %.1f MiB)", l->name, l->ops->kind, mib(layer_bytes));
}

/* train.batch_size auto's exit 2 when not even the smallest micro-batch (trial) fits: what a rank
 * needs and may use, the largest part, and whether train.recompute blocks or dist.zero 1 (each, or
 * together) would make it fit. */
static void nothing_fits(const dt_config_values *v, const dt_config_values *trial, const dt_model *m, const dt_data *d,
                         const dt_comm *comm, int threads, dt_backend *be, double may_use, size_t have,
                         const char *where, dt_status *st) {
  char run_part[160], extra[160], largest[256];
  const dt_memory mem = rank_memory(trial, m, d, comm, threads, be, run_part, extra, sizeof extra);
  const int64_t held = config_model_rows(trial, comm->size), rows = config_max_local_rows(trial, comm->size);
  largest_part(m, &mem, held, largest, sizeof largest);
  const int can_recompute = v->recompute == DT_RECOMPUTE_NONE, can_shard = !v->zero && comm->size > 1;
  const size_t saved = can_recompute ? model_activation_bytes(m, held, DT_RECOMPUTE_NONE) -
                                           model_activation_bytes(m, held, DT_RECOMPUTE_BLOCKS)
                                     : 0;
  size_t sharded = mem.total;
  if (can_shard) {
    dt_config_values z = *trial;
    z.zero = 1;
    sharded = rank_memory(&z, m, d, comm, threads, be, run_part, extra, sizeof extra).total;
  }
  const int by_recompute = can_recompute && (double)(mem.total - saved) <= may_use,
            by_zero = can_shard && (double)sharded <= may_use,
            by_both = can_recompute && can_shard && (double)(sharded - saved) <= may_use;
  const char *hint = by_recompute && by_zero ? "; train.recompute: blocks would fit it, and so would dist.zero: 1"
                     : by_recompute          ? "; train.recompute: blocks would fit it"
                     : by_zero               ? "; dist.zero: 1 would fit it"
                     : by_both               ? "; train.recompute: blocks with dist.zero: 1 would fit it"
                                             : "";
  dt_fail(
      st, DT_EXIT_INPUT,
      "train.batch_size auto: not even %lld row%s per rank fit%s (train.grad_accum %lld): a rank needs %.1f MiB but "
      "may use %.1f MiB (train.memory_fraction %g of %.1f MiB %s); the largest part is %s%s",
      (long long)rows, rows == 1 ? "" : "s", rows == 1 ? "s" : "", (long long)trial->grad_accum, mib(mem.total),
      may_use / 1048576.0, v->memory_fraction, mib(have), where, largest, hint);
}

/* The estimate asks a backend what its scratch takes, as --dry-run does: one made for the choice
 * (on a GPU, its CUDA context is then counted out of the free memory, as in the run's own check). */
int device_auto_batch(dt_config *cfg, const dt_model *m, const dt_data *d, dt_comm *comm, int gpu, dt_status *st) {
  dt_config_values *v = &cfg->v;
  const int64_t step_rows = v->global_batch_size * v->grad_accum, first_accum = v->grad_accum;
  int be_threads;
  dt_backend *be = device_backend_create(cfg, comm, gpu, &be_threads);
  const int threads = device_threads(cfg, comm);
  const char *where;
  const size_t have = rank_available(comm, gpu, &where);
  const double may_use = v->memory_fraction * (double)have;
  /* candidates: each grad_accum from the configured one up that divides the step's rows and leaves
   * every rank a row (the configured one whatever it leaves), fewest first; with train.cuda_graph on,
   * only grad_accum 1, which a captured step needs; none holding a tensor the kernels cannot index */
  const double values_limit = gpu >= 0 ? (double)((int64_t)1 << 31) : (double)((int64_t)1 << 40);
  const int graphs = gpu >= 0 && v->cuda_graph == DT_GRAPH_ON;
  int64_t accums[1024];
  int n = 0;
  for (int64_t a = first_accum; a <= 1024 && (a == first_accum || step_rows / a >= comm->size); a++) {
    if (step_rows % a || (graphs && a > 1)) continue;
    dt_config_values c = *v;
    c.global_batch_size = step_rows / a;
    c.grad_accum = a;
    if ((double)config_model_rows(&c, comm->size) * (double)model_max_row(m) < values_limit) accums[n++] = a;
  }
  int mine = n; /* the first candidate that fits this rank */
  if (!have && n) {
    dt_fail(st, DT_EXIT_INPUT, "train.batch_size auto: the free memory %s cannot be read; set train.batch_size", where);
    mine = -1;
  }
  char run_part[160], extra[160];
  dt_config_values trial = *v;
  for (int i = 0; i < n && mine == n; i++) {
    trial.batch_size = 0;
    trial.global_batch_size = step_rows / accums[i];
    trial.grad_accum = accums[i];
    if ((double)rank_memory(&trial, m, d, comm, threads, be, run_part, extra, sizeof extra).total <= may_use) mine = i;
  }
  const int chosen = -comm_min_i32(comm, -mine, "train.batch_size auto"); /* the rank that needs most decides */
  if (mine < 0 || (chosen == n && mine != n)) { /* this rank's own failure, or another's that it reports */
    be->destroy(be);
    return st->code;
  }
  if (chosen == n && !n) {
    be->destroy(be);
    return dt_fail(st, DT_EXIT_INPUT,
                   "train.batch_size auto: no split of the step's %lld rows keeps a rank's largest tensor under %s%s; "
                   "lower train.global_batch_size or use more ranks",
                   (long long)step_rows, gpu >= 0 ? "2^31 values (the CUDA kernels' 32-bit indices)" : "2^40 values",
                   graphs ? " with train.cuda_graph on (grad_accum 1)" : "");
  }
  if (chosen == n) {
    nothing_fits(v, &trial, m, d, comm, threads, be, may_use, have, where, st);
    be->destroy(be);
    return st->code;
  }
  v->batch_size = 0;
  v->global_batch_size = step_rows / accums[chosen];
  v->grad_accum = accums[chosen];
  config_refresh_effective(cfg); /* checkpoints say what ran, so a resume splitting otherwise is refused */
  const size_t need = rank_memory(v, m, d, comm, threads, be, run_part, extra, sizeof extra).total;
  snprintf(cfg->auto_batch, sizeof cfg->auto_batch,
           "train.batch_size auto: %lld row%s per rank, train.grad_accum %lld (%lld rows a step on %d rank%s); a rank "
           "needs %.1f MiB of the %.1f MiB it may use (train.memory_fraction %g of %.1f MiB %s)",
           (long long)config_max_local_rows(v, comm->size), config_max_local_rows(v, comm->size) == 1 ? "" : "s",
           (long long)v->grad_accum, (long long)step_rows, comm->size, comm->size > 1 ? "s" : "", mib(need),
           may_use / 1048576.0, v->memory_fraction, mib(have), where);
  if (chosen > 0) { /* why not the larger micro-batch before it */
    trial = *v;
    trial.global_batch_size = step_rows / accums[chosen - 1];
    trial.grad_accum = accums[chosen - 1];
    size_t more = rank_memory(&trial, m, d, comm, threads, be, run_part, extra, sizeof extra).total,
           len = strlen(cfg->auto_batch);
    snprintf(cfg->auto_batch + len, sizeof cfg->auto_batch - len, "; %lld rows would need %.1f MiB",
             (long long)config_max_local_rows(&trial, comm->size), mib(more));
  }
  be->destroy(be);
  if (comm->rank == 0) {
    printf("%s\n", cfg->auto_batch);
    fflush(stdout);
  }
  return 0;
}

dt_backend *device_backend_create(const dt_config *cfg, const dt_comm *comm, int gpu, int *cpu_threads) {
  const dt_config_values *v = &cfg->v;
  *cpu_threads = 0;
#ifdef DT_WITH_CUDA
  if (gpu >= 0) return backend_cuda_create(gpu, v->precision);
#else
  (void)gpu;               /* without CUDA, device_select has refused --device cuda */
#endif
  return backend_cpu_create_with(*cpu_threads = device_threads(cfg, comm),
                                 v->conv_algo == DT_CONV_ALGO_DIRECT ? DT_CPU_CONV_DIRECT : DT_CPU_CONV_WINOGRAD);
}

/* The backend of the device: --device cuda's GPU, with the gradients over NCCL when no two ranks
 * share a GPU (or dist.comm nccl), else over MPI through host memory; or the CPU backend. One rank
 * has nothing to sum (unless dist.grad_dtype bf16 rounds its gradients as NCCL's bf16 sum would):
 * no NCCL communicator, whose set-up (its topology search, its kernels) would only lengthen start-up. */
int device_open(dt_device *dev, const dt_config *cfg, dt_comm *comm, int gpu, const char *shared, dt_status *st) {
  memset(dev, 0, sizeof *dev);
  const dt_config_values *v = &cfg->v;
#ifdef DT_WITH_CUDA
  if (gpu >= 0) {
    print_device_table(comm, gpu);
    dev->be = device_backend_create(cfg, comm, gpu, &dev->cpu_threads);
    const int alone = comm->size == 1 && v->grad_dtype != DT_GRAD_BF16;
    /* gpus_shared gave every rank the same answer, so all make the same choice (NCCL's collectives
     * on some would wait forever for MPI's on the others) */
    if (!alone && (v->comm == DT_COMM_NCCL || (v->comm == DT_COMM_AUTO && !shared[0]))) {
      dev->nccl = nccl_create(comm, dev->be, v->grad_dtype == DT_GRAD_BF16, st);
      int code = comm_agree(comm, st);
      if (code) return code;
      dev->reducer = nccl_reducer(dev->nccl);
    }
    if (comm->rank == 0) {
      if (dev->nccl)
        printf("gradients: NCCL\n");
      else if (alone)
        printf("gradients: one rank, nothing to sum (no NCCL communicator)\n");
      else if (v->comm == DT_COMM_MPI)
        printf("gradients: MPI through host memory (dist.comm mpi)\n");
      else
        printf("gradients: MPI through host memory (dist.comm auto: %s)\n", shared);
    }
  }
#else
  (void)gpu, (void)shared; /* without CUDA, device_select has refused --device cuda */
#endif
  if (v->grad_dtype == DT_GRAD_BF16 && !dev->nccl && comm->size > 1)
    dt_fail(st, DT_EXIT_INPUT,
            "dist.grad_dtype bf16: gradients are summed in bf16 only over NCCL (--device cuda, a GPU per rank), "
            "and this run sums them over MPI; use dist.grad_dtype fp32");
  int code = comm_agree(comm, st);
  if (code) return code;
  if (!dev->be) /* the CPU backend's, on every rank or none (a rank without its GPU failed before) */
    dev->be = device_backend_create(cfg, comm, -1, &dev->cpu_threads);
  return 0;
}

void device_close(dt_device *dev, int failed) {
#ifdef DT_WITH_CUDA
  nccl_destroy(dev->nccl, failed);
#else
  (void)failed;
#endif
  if (dev->be) dev->be->destroy(dev->be);
  memset(dev, 0, sizeof *dev);
}
