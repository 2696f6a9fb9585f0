/* main.c: the CLI, start-up order and the exit-code contract (README "Exit codes").
 * Every rank runs the same steps; after each stage that can find bad input, the ranks agree
 * (comm_agree) so that all exit together with one message. */
#define _GNU_SOURCE
#include <cblas.h>
#include <hdf5.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <yaml.h>

#include "checkpoint.h"
#include "comm.h"
#include "config.h"
#include "data.h"
#include "gpu.h"
#include "model.h"
#include "fault.h"
#include "monitor.h"
#include "signals.h"
#include "train.h"

static const char usage_text[] =
    "usage: ddp_train [options] CONFIG.yaml\n"
    "\n"
    "Data-parallel training of the network CONFIG.yaml describes; launch with\n"
    "`mpirun -np N ddp_train CONFIG.yaml` for N ranks.\n"
    "\n"
    "options:\n"
    "  --set KEY=VALUE   override a config key (dotted path, repeatable), e.g. --set train.epochs=3\n"
    "  --dry-run         validate the config and the data, print the model summary, exit 0\n"
    "  --device DEV      auto, cpu or cuda (auto: cpu until the CUDA backend is validated on a GPU)\n"
    "  --resume PATH     continue from a checkpoint file; `--resume auto` takes the newest good one in\n"
    "                    checkpoint.dir (falling back past unreadable ones) or starts fresh when there is none\n"
    "  --predict OUT.h5  write the validation logits of the model (from --resume or model.init_from) and exit\n"
    "  --sample N        print N tokens a token model (from --resume or model.init_from) samples after --prompt\n"
    "  --prompt TEXT     the text to continue (bytes for a vocab-256 model, else token ids), default a newline\n"
    "  --temperature X   sampling temperature (default 0.8; 0: always the most likely token)\n"
    "  --top-k K         sample among the K most likely tokens (default 40; 0: all)\n"
    "  --info            print each node's host, GPUs, library versions and communicator, then exit\n"
    "  --config-keys     print every config key with its type, default and meaning (Markdown)\n"
    "  --version         print the versions of ddp_train and its libraries\n"
    "  --help            print this help\n"
    "\n"
    "exit codes: 0 success, 2 bad input (usage, config, data), 3 peer failure or collective timeout,\n"
    "4 numerical failure (NaN/Inf), 5 I/O failure, 75 stopped by a signal or time limit after a checkpoint,\n"
    "70 aborted (out of memory, or a bug)\n";

enum { DEV_AUTO, DEV_CPU, DEV_CUDA };

typedef struct {
  const char *config;
  char **sets;
  int n_sets;
  int dry_run, help, version, config_keys, device, info;
  const char *resume;    /* NULL, "auto" or a path */
  const char *predict;   /* NULL or the output path */
  int64_t sample, top_k; /* --sample N (0: none) */
  const char *prompt;
  double temperature;
} cli_args;

/* A number option's value; 0 or st (exit 2) naming the option. */
static int number_arg(const char *opt, const char *val, double lo, double hi, double *out, dt_status *st) {
  char *end;
  double x = val ? strtod(val, &end) : 0;
  if (!val || !*val || *end || !(x >= lo && x <= hi))
    return dt_fail(st, DT_EXIT_INPUT, "%s needs a number in [%g, %g], got '%s'", opt, lo, hi, val ? val : "");
  *out = x;
  return 0;
}

static int parse_args(int argc, char **argv, cli_args *a, dt_status *st) {
  memset(a, 0, sizeof *a);
  a->sets = dt_calloc((size_t)argc + 1, sizeof(char *));
  a->temperature = 0.8;
  a->top_k = 40;
  a->prompt = "";
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (!strcmp(s, "--help") || !strcmp(s, "-h"))
      a->help = 1;
    else if (!strcmp(s, "--version"))
      a->version = 1;
    else if (!strcmp(s, "--dry-run"))
      a->dry_run = 1;
    else if (!strcmp(s, "--config-keys"))
      a->config_keys = 1;
    else if (!strcmp(s, "--info"))
      a->info = 1;
    else if (!strcmp(s, "--set") || !strncmp(s, "--set=", 6)) {
      const char *val = s[5] == '=' ? s + 6 : (i + 1 < argc ? argv[++i] : NULL);
      if (!val) return dt_fail(st, DT_EXIT_INPUT, "--set needs KEY=VALUE\n%s", usage_text);
      a->sets[a->n_sets++] = (char *)val;
    } else if (!strcmp(s, "--device") || !strncmp(s, "--device=", 9)) {
      const char *val = s[8] == '=' ? s + 9 : (i + 1 < argc ? argv[++i] : NULL);
      if (!val) return dt_fail(st, DT_EXIT_INPUT, "--device needs auto, cpu or cuda");
      if (!strcmp(val, "auto"))
        a->device = DEV_AUTO;
      else if (!strcmp(val, "cpu"))
        a->device = DEV_CPU;
      else if (!strcmp(val, "cuda"))
        a->device = DEV_CUDA;
      else
        return dt_fail(st, DT_EXIT_INPUT, "--device %s: expected auto, cpu or cuda", val);
    } else if (!strcmp(s, "--predict") || !strncmp(s, "--predict=", 10)) {
      const char *val = s[9] == '=' ? s + 10 : (i + 1 < argc ? argv[++i] : NULL);
      if (!val || !*val) return dt_fail(st, DT_EXIT_INPUT, "--predict needs an output path");
      a->predict = val;
    } else if (!strcmp(s, "--sample") || !strcmp(s, "--temperature") || !strcmp(s, "--top-k")) {
      double x = 0;
      const int temperature = !strcmp(s, "--temperature"), sample = !strcmp(s, "--sample");
      if (number_arg(s, i + 1 < argc ? argv[++i] : NULL, sample ? 1 : 0, temperature ? 100 : 1e9, &x, st))
        return st->code;
      if (!temperature && x != (double)(int64_t)x)
        return dt_fail(st, DT_EXIT_INPUT, "%s needs a whole number, got %g", s, x);
      if (sample)
        a->sample = (int64_t)x;
      else if (temperature)
        a->temperature = x;
      else
        a->top_k = (int64_t)x;
    } else if (!strcmp(s, "--prompt")) {
      if (i + 1 >= argc) return dt_fail(st, DT_EXIT_INPUT, "--prompt needs the text to continue");
      a->prompt = argv[++i];
    } else if (!strcmp(s, "--resume") || !strncmp(s, "--resume=", 9)) {
      const char *val = s[8] == '=' ? s + 9 : (i + 1 < argc ? argv[++i] : NULL);
      if (!val || !*val) return dt_fail(st, DT_EXIT_INPUT, "--resume needs a checkpoint path or auto");
      a->resume = val;
    } else if (s[0] == '-' && s[1]) {
      return dt_fail(st, DT_EXIT_INPUT, "unknown option '%s'\n%s", s, usage_text);
    } else if (a->config) {
      return dt_fail(st, DT_EXIT_INPUT, "more than one config given ('%s' and '%s')\n%s", a->config, s, usage_text);
    } else {
      a->config = s;
    }
  }
  if (!a->help && !a->version && !a->config_keys && !a->info && !a->config)
    return dt_fail(st, DT_EXIT_INPUT, "no config given\n%s", usage_text);
  return 0;
}

static void library_versions(char *buf, size_t cap) {
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(mpi, &len);
  mpi[strcspn(mpi, ",\n")] = 0;
  unsigned maj, min, rel;
  H5get_libversion(&maj, &min, &rel);
  char gpu[512];
  gpu_versions(gpu, sizeof gpu);
  snprintf(buf, cap, "%s, HDF5 %u.%u.%u, libyaml %s; %s", mpi, maj, min, rel, yaml_get_version_string(), gpu);
}

/* Threads per rank: the cores this rank may run on, shared with the other ranks on the node.
 * cfg NULL: the default (dist.threads unset). */
static int pick_threads(const dt_config *cfg, const dt_comm *c) {
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
static void print_placement(dt_comm *comm, int threads) {
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
static int gpus_shared(dt_comm *comm, int gpu, char *why, size_t cap) {
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

/* --info: one block per node, gathered to rank 0, so a node with a missing GPU shows before training. */
static void print_info(dt_comm *comm) {
  enum { CAP = 4096 };
  char text[CAP] = "", why[256] = "", shared[512];
  const int n = gpu_count(why, sizeof why);
  gpus_shared(comm, n ? comm->local_rank % n : -1, shared, sizeof shared); /* the GPU --device cuda would use */
  if (comm->local_rank == 0) {
    char versions[1024];
    library_versions(versions, sizeof versions);
    size_t len = (size_t)snprintf(text, CAP, "node %s: %d rank%s (world ranks from %d)\n  %s\n", comm->host,
                                  comm->local_size, comm->local_size > 1 ? "s" : "", comm->rank, versions);
    if (n == 0) len += (size_t)snprintf(text + len, CAP - len, "  GPUs: none (%s)\n", why);
    for (int i = 0; i < n && len < CAP; i++) {
      char line[512];
      size_t free_b;
      gpu_describe(i, line, sizeof line, &free_b);
      len += (size_t)snprintf(text + len, CAP - len, "  %s\n", line);
    }
    if (n == 0)
      snprintf(text + len, CAP - len, "  communicator for dist.comm auto: mpi (the CPU backend)\n");
    else if (shared[0])
      snprintf(text + len, CAP - len, "  communicator for dist.comm auto: mpi (%s: --device cuda shares them)\n",
               shared);
    else
      snprintf(text + len, CAP - len,
               "  communicator for dist.comm auto: nccl with --device cuda (a GPU per rank, by PCI bus id); mpi with "
               "the CPU backend\n");
  }
  char *all = comm->rank == 0 ? dt_calloc((size_t)comm->size, CAP) : NULL;
  comm_gather_text(comm, text, CAP, all);
  if (comm->rank == 0) {
    printf("ddp_train %s: %d rank%s\n", DT_VERSION, comm->size, comm->size > 1 ? "s" : "");
    for (int r = 0; r < comm->size; r++)
      if (all[(size_t)r * CAP]) fputs(all + (size_t)r * CAP, stdout);
    fflush(stdout);
  }
  free(all);
  print_placement(comm, pick_threads(NULL, comm));
}

static void print_version(void) {
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(mpi, &len);
  char *nl = strchr(mpi, '\n');
  if (nl) *nl = 0;
  char *comma = strchr(mpi, ',');
  if (comma) *comma = 0;
  unsigned maj, min, rel;
  H5get_libversion(&maj, &min, &rel);
  char gpu[512];
  gpu_build_versions(gpu, sizeof gpu); /* --info loads them and prints what it found */
  printf("ddp_train %s\n", DT_VERSION);
  printf("  MPI: %s\n", mpi);
  printf("  HDF5: %u.%u.%u\n", maj, min, rel);
  printf("  libyaml: %s\n", yaml_get_version_string());
  printf("  OpenBLAS: %s\n", openblas_get_config());
  printf("  %s\n", gpu);
}

/* Rows of the largest local batch: the global batch split over W ranks, plus one for the uneven split. */
static int64_t max_local_rows(const dt_config *cfg, int64_t W) {
  int64_t G = config_global_batch(&cfg->v, (int)W);
  return (G + W - 1) / W + 1;
}

/* The GPU this rank uses (-1: the CPU backend). --device auto stays on the CPU until the CUDA
 * backend has been validated on a GPU (README "Status"); --device cuda opts in. Rank i of a node
 * uses visible GPU i; with dist.comm mpi several ranks may share one GPU. */
static int select_device(const cli_args *a, const dt_config *cfg, const dt_model *m, const dt_comm *comm,
                         dt_status *st) {
  static const char *const precisions[] = {"fp32", "tf32", "bf16", "fp16"};
  const int prec = cfg->v.precision;
  if (a->device != DEV_CUDA) {
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
  /* the kernels and cuDNN index a tensor with 32 bits */
  int64_t rows = max_local_rows(cfg, comm->size), values = rows * model_max_row(m);
  if (values >= ((int64_t)1 << 31)) {
    dt_fail(st, DT_EXIT_INPUT,
            "--device cuda: the largest tensor holds %lld values per rank (%lld rows x %lld), over the 2^31 "
            "that the CUDA kernels and cuDNN index; lower train.batch_size or train.global_batch_size, or use "
            "more ranks",
            (long long)values, (long long)rows, (long long)model_max_row(m));
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

/* monitor.listen: every rank sends its host and device; rank 0 starts serving (monitor.h) and
 * hears about its long collective waits. Collective; returns the agreed code. */
static int start_monitor(const dt_config *cfg, dt_comm *comm, dt_monitor *mon, int gpu) {
  enum { CAP = 512 };
  dt_status st = {0};
  char mine[CAP] = "cpu";
  size_t free_b;
  if (gpu >= 0) gpu_describe(gpu, mine, sizeof mine, &free_b); /* "GPU 0: name, memory, ..., PCI bus id" */
  char *all = comm->rank == 0 ? dt_calloc((size_t)comm->size, 2 * CAP) : NULL;
  comm_gather_text(comm, comm->host, CAP, all);
  comm_gather_text(comm, mine, CAP, all ? all + (size_t)comm->size * CAP : NULL);
  if (comm->rank == 0) {
    const char **hosts = dt_calloc((size_t)comm->size, sizeof(char *)),
               **devices = dt_calloc((size_t)comm->size, sizeof(char *));
    for (int r = 0; r < comm->size; r++) {
      hosts[r] = all + (size_t)r * CAP;
      devices[r] = all + (size_t)(comm->size + r) * CAP;
    }
    const dt_config_values *v = &cfg->v;
    dt_monitor_run run = {.config_path = cfg->path,
                          .config_hash = cfg->hash,
                          .world_size = comm->size,
                          .hosts = hosts,
                          .devices = devices,
                          .global_batch = config_global_batch(v, comm->size) * v->grad_accum,
                          .epochs = v->epochs};
    if (!monitor_start(mon, &run, &st)) {
      comm->wait_hook = monitor_note_wait;
      comm->wait_ctx = mon;
    }
    free(hosts);
    free(devices);
  }
  free(all);
  return comm_agree(comm, &st);
}

/* Rank 0's parameters (from init_from or the seed) become everyone's. */
static int init_params(const dt_config *cfg, dt_model *m, dt_comm *comm) {
  dt_status st = {0};
  dt_backend *be = m->be;
  float *hp = dt_malloc((size_t)(m->n_params ? m->n_params : 1) * sizeof(float));
  float *hb = dt_malloc((size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float));
  be->to_host(be, hp, m->params, (size_t)m->n_params * sizeof(float));
  be->to_host(be, hb, m->bufs, (size_t)m->n_bufs * sizeof(float));
  if (comm->rank == 0 && cfg->v.init_from[0]) ckpt_read_model(cfg->v.init_from, m, hp, hb, &st);
  int code = comm_agree(comm, &st);
  if (!code) {
    comm_bcast(comm, hp, (size_t)m->n_params * sizeof(float), 0);
    comm_bcast(comm, hb, (size_t)m->n_bufs * sizeof(float), 0);
    be->to_device(be, m->params, hp, (size_t)m->n_params * sizeof(float));
    be->to_device(be, m->bufs, hb, (size_t)m->n_bufs * sizeof(float));
  }
  free(hp);
  free(hb);
  return code;
}

/* Keys whose change makes a checkpoint unusable: the model, and what decides the data order
 * and the optimizer state. Everything else may change on resume (README "Resuming"). */
static const char *const frozen_keys[] = {"model.input",   "model.layers",   "model.loss",
                                          "optim.name",    "train.seed",     "data.shuffle",
                                          "data.sharding", "data.drop_last", "train.grad_accum"};

static const char *find_line(const char *text, const char *key, size_t *len) {
  size_t k = strlen(key);
  for (const char *p = text; p && *p;) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    if (n > k && !strncmp(p, key, k) && p[k] == ':') {
      *len = n;
      return p;
    }
    p = nl ? nl + 1 : NULL;
  }
  return NULL;
}

static int check_compatible(const char *path, const char *stored, const dt_config *cfg, const dt_train_state *ts,
                            int64_t global_batch, dt_status *st) {
  for (size_t i = 0; i < sizeof frozen_keys / sizeof *frozen_keys; i++) {
    size_t la = 0, lb = 0;
    const char *a = find_line(stored, frozen_keys[i], &la), *b = find_line(cfg->effective, frozen_keys[i], &lb);
    if (!a || !b || la != lb || strncmp(a, b, la))
      return dt_fail(st, DT_EXIT_INPUT,
                     "cannot resume from %s: %s differs\n  checkpoint: %.*s\n  config:     %.*s\n"
                     "(README \"Resuming\" lists what may change)",
                     path, frozen_keys[i], (int)la, a ? a : "(none)", (int)lb, b ? b : "(none)");
  }
  if (ts->global_batch != global_batch)
    return dt_fail(st, DT_EXIT_INPUT,
                   "cannot resume from %s: its global batch was %lld, this run's is %lld, so the "
                   "data position cannot carry over; set train.global_batch_size to %lld",
                   path, (long long)ts->global_batch, (long long)global_batch, (long long)ts->global_batch);
  return 0;
}

/* Rank 0 finds and loads the checkpoint; every rank receives it. *resumed is 0 when --resume auto
 * found nothing. The caller frees d's arrays. */
static int load_resume(const cli_args *args, const dt_config *cfg, dt_model *m, dt_comm *comm, dt_ckpt_data *d,
                       int *resumed) {
  dt_status st = {0};
  const dt_config_values *v = &cfg->v;
  size_t pb = (size_t)(m->n_params ? m->n_params : 1) * sizeof(float);
  d->params = dt_malloc(pb);
  d->bufs = dt_malloc((size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float));
  int states = dt_optim_kinds[v->optim]->n_states(v);
  for (int k = 0; k < states; k++) d->opt[k] = dt_malloc(pb);
  if (v->ema_decay > 0) {
    d->ema_params = dt_malloc(pb);
    d->ema_bufs = dt_malloc((size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float));
  }
  int64_t W = comm->size;
  int64_t G = config_global_batch(v, (int)W) * v->grad_accum;
  int found = 0;
  if (comm->rank == 0) {
    char names[64][1024];
    int n = 0;
    int is_auto = !strcmp(args->resume, "auto");
    if (is_auto) {
      if (!v->ckpt_dir[0])
        dt_fail(&st, DT_EXIT_INPUT, "--resume auto needs checkpoint.dir");
      else
        n = ckpt_candidates(v->ckpt_dir, names, 64);
    } else {
      snprintf(names[0], sizeof names[0], "%s", args->resume);
      n = 1;
    }
    for (int i = 0; i < n && !st.code && !found; i++) {
      char *stored = NULL;
      dt_status ls = {0};
      /* the stored config first: a changed model is the user's error, not a reason to fall back */
      if (!ckpt_read_meta(names[i], &d->ts, &stored, &ls) && check_compatible(names[i], stored, cfg, &d->ts, G, &st)) {
        free(stored);
        break;
      }
      free(stored);
      stored = NULL;
      if (!ls.code && !ckpt_load(names[i], m, d, &stored, &ls)) {
        found = 1;
        printf("resuming from %s%s\n", names[i], i ? " (the newest good checkpoint)" : "");
      } else if (!is_auto) {
        st = ls;
      } else {
        fprintf(stderr, "ddp_train: warning: %s%s\n", ls.msg, i + 1 < n ? "; falling back to an older checkpoint" : "");
      }
      free(stored);
    }
    if (is_auto && !found && !st.code) {
      if (n)
        dt_fail(&st, DT_EXIT_INPUT, "--resume auto: none of the %d checkpoints in %s could be loaded", n, v->ckpt_dir);
      else
        printf("no checkpoint in %s: starting from the beginning\n", v->ckpt_dir);
    }
    fflush(stdout);
  }
  int code = comm_agree(comm, &st);
  if (code) return code;
  comm_bcast(comm, &found, sizeof found, 0);
  *resumed = found;
  if (!found) return 0;
  comm_bcast(comm, d->params, (size_t)m->n_params * sizeof(float), 0);
  comm_bcast(comm, d->bufs, (size_t)m->n_bufs * sizeof(float), 0);
  for (int k = 0; k < states; k++) comm_bcast(comm, d->opt[k], (size_t)m->n_params * sizeof(float), 0);
  comm_bcast(comm, &d->has_ema, sizeof d->has_ema, 0);
  if (d->has_ema) {
    comm_bcast(comm, d->ema_params, (size_t)m->n_params * sizeof(float), 0);
    comm_bcast(comm, d->ema_bufs, (size_t)m->n_bufs * sizeof(float), 0);
  }
  comm_bcast(comm, &d->ts, sizeof d->ts, 0);
  dt_backend *be = m->be;
  be->to_device(be, m->params, d->params, (size_t)m->n_params * sizeof(float));
  be->to_device(be, m->bufs, d->bufs, (size_t)m->n_bufs * sizeof(float));
  return 0;
}

static double mib(size_t b) {
  return (double)b / 1048576.0;
}

/* --dry-run: the memory a rank needs against what it has (its GPU's free memory when it runs on
 * one, else the host's available memory shared by the ranks on the node). */
static void check_memory(const dt_config *cfg, const dt_model *m, const dt_data *d, const dt_comm *comm, int gpu,
                         dt_status *st) {
  const dt_config_values *v = &cfg->v;
  int64_t rows = max_local_rows(cfg, comm->size);
  int states = dt_optim_kinds[v->optim]->n_states(v);
  dt_memory mem = model_memory(m, rows, states, pick_threads(cfg, comm));
  char ema_part[32] = "";
  if (v->ema_decay > 0) {
    mem.ema = (size_t)(m->n_params + m->n_bufs) * sizeof(float);
    mem.total += mem.ema;
    snprintf(ema_part, sizeof ema_part, " + ema %.1f", mib(mem.ema));
  }
  char extra[160] = "";
  if (v->cache == DT_CACHE_DEVICE) { /* the rank's training rows as stored, and their labels or targets */
    const dt_split *s = &d->train;
    size_t rows_held = (size_t)(s->hi - s->lo);
    size_t bytes =
        rows_held * ((size_t)s->row_elems * s->x_elem + (s->labels ? sizeof(int32_t) : (size_t)s->y_k * sizeof(float)));
    mem.total += bytes;
    snprintf(extra, sizeof extra, " + data.cache device %.1f", mib(bytes));
  }
  if (v->grad_dtype == DT_GRAD_BF16) { /* one bucket in bf16 */
    int64_t bucket = (int64_t)(v->bucket_mb * 1048576.0 / sizeof(float));
    size_t bytes = (size_t)(bucket < m->n_params ? bucket : m->n_params) * 2;
    mem.total += bytes;
    snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " + bf16 bucket %.1f", mib(bytes));
  }
  size_t have = 0;
  const char *where;
  char gpu_line[512];
  if (gpu >= 0) { /* the run's device: a CPU run never looks for a GPU */
    gpu_describe(gpu, gpu_line, sizeof gpu_line, &have);
    where = "free on this rank's GPU";
  } else {
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    have = pages > 0 && page > 0 ? (size_t)pages * (size_t)page / (size_t)comm->local_size : 0;
    where = "of available host memory per rank on this node";
  }
  char tokens[64] = ""; /* a token model's rows are sequences */
  if (m->tokens) snprintf(tokens, sizeof tokens, " of %lld tokens", (long long)m->tokens);
  if (comm->rank == 0) {
    printf(
        "memory per rank at %lld rows%s: %.1f MiB = parameters %.1f + gradients %.1f + optimizer %.1f%s + "
        "buffers %.1f + activations %.1f + workspace %.1f%s; %.0f MiB %s\n",
        (long long)rows, tokens, mib(mem.total), mib(mem.params), mib(mem.grads), mib(mem.optim), ema_part,
        mib(mem.buffers), mib(mem.activations), mib(mem.workspace), extra, mib(have), where);
    fflush(stdout);
  }
  if (have && mem.total > have)
    dt_fail(st, DT_EXIT_INPUT,
            "the batch does not fit: a rank needs %.1f MiB but has %.1f MiB %s; lower "
            "train.batch_size or train.global_batch_size, or use more ranks",
            mib(mem.total), mib(have), where);
}

static void print_data_summary(const dt_data *d, const dt_config *cfg, int world) {
  const dt_config_values *v = &cfg->v;
  int64_t G = config_global_batch(v, world);
  if (d->train.tokens) { /* a token model's targets are its inputs shifted by one */
    int64_t t = d->train.row_elems;
    printf("data: %s: train %lld sequences of %lld tokens ('%s'), ", d->path, (long long)d->train.n, (long long)t,
           d->train.x_name);
    if (d->has_val) printf("val %lld sequences ('%s'); targets: the next tokens\n", (long long)d->val.n, d->val.x_name);
  } else {
    printf("data: %s: train %lld rows ('%s', '%s'), ", d->path, (long long)d->train.n, d->train.x_name,
           d->train.y_name);
    if (d->has_val) printf("val %lld rows ('%s', '%s')\n", (long long)d->val.n, d->val.x_name, d->val.y_name);
  }
  if (!d->has_val) printf("no validation split\n");
  printf("batch: global %lld = %d rank%s x %s%lld, %s sharding\n", (long long)G, world, world > 1 ? "s" : "",
         v->global_batch_size && G % world ? "~" : "", (long long)(G / world),
         v->sharding == DT_SHARD_GLOBAL ? "global" : "contiguous");
}

/* The launcher's rank of this process (Open MPI, PMIx, PMI, Slurm), or 0 when run alone. */
static int launcher_rank(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    if (v && *v) return atoi(v);
  }
  return 0;
}

/* Open MPI defaults chosen for start-up time, each only where the user set nothing (README
 * "Start-up time"): the cm PML probes the PSM, PSM2 and OFI (libfabric) providers, 0.2 s of every
 * MPI_Init here, for Omni-Path and EFA networks only (ob1 and ucx stay: TCP, shared memory,
 * InfiniBand); a process started without mpirun does not start an orted beside itself (0.1 s). */
static void mpi_start_defaults(void) {
  setenv("OMPI_MCA_pml", "^cm", 0);
  if (!getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMIX_RANK")) setenv("OMPI_MCA_ess_singleton_isolated", "1", 0);
}

int main(int argc, char **argv) {
  double t_launch = dt_now();
  cli_args args;
  dt_status st = {0};
  /* --help, --version and --config-keys need neither MPI nor a device: rank 0 of the launch prints */
  if (!parse_args(argc, argv, &args, &st) && !args.info && (args.help || args.version || args.config_keys)) {
    if (launcher_rank() == 0) {
      if (args.help) fputs(usage_text, stdout);
      if (args.version) print_version();
      if (args.config_keys) {
        config_print_keys(stdout);
        model_print_layer_keys(stdout);
      }
    }
    free(args.sets);
    return 0;
  }
  mpi_start_defaults();
  dt_comm comm;
  comm_init(&comm, &argc, &argv);
  signals_install();
  dt_train_opts opts = {.t_launch = t_launch, .gpu = -1};
  dt_ckpt_data resume = {0};
  dt_config cfg;
  memset(&cfg, 0, sizeof cfg);
  dt_model model;
  memset(&model, 0, sizeof model);
  dt_data data;
  memset(&data, 0, sizeof data);
  data.file = -1;
  data.train.dset_x = data.val.dset_x = -1;
  dt_backend *be = NULL;
  dt_nccl *nccl = NULL;
  dt_monitor *mon = NULL;
  int code = 0;

  if ((code = comm_agree(&comm, &st))) goto done;
  if (args.info) {
    print_info(&comm);
    goto done;
  }
  config_load(&cfg, args.config, args.sets, args.n_sets, &st);
  if (!st.code) fault_parse(&opts.fault, getenv("DDP_TRAIN_FAULT"), &st);
  if ((code = comm_agree(&comm, &st))) goto done;
  comm.timeout_s = cfg.v.timeout_s;
  comm_check_same(&comm, cfg.hash, "the effective config", &st);
  if ((code = comm_agree(&comm, &st))) goto done;
  if (comm.rank == 0 && cfg.v.monitor_listen[0]) { /* found before any data is read; served once training starts */
    const int trains = !args.dry_run && !args.predict && !args.sample;
    dt_monitor_opts mo = {.listen = cfg.v.monitor_listen,
                          .token_file = cfg.v.monitor_token_file,
                          .stall_s = cfg.v.monitor_stall_s > 0 ? cfg.v.monitor_stall_s : cfg.v.timeout_s / 2,
                          .log_dir = cfg.v.log_dir,
                          .checkpoints = cfg.v.ckpt_dir[0] != 0};
    mon = monitor_open(&mo, trains, &st);
  }
  if ((code = comm_agree(&comm, &st))) goto done;
  model_build(&model, &cfg, &st);
  if ((code = comm_agree(&comm, &st))) goto done;
  int gpu = select_device(&args, &cfg, &model, &comm, &st);
  if ((code = comm_agree(&comm, &st))) goto done;
  char shared[512] = ""; /* gpu is >= 0 on every rank or on none */
  if (gpu >= 0 && gpus_shared(&comm, gpu, shared, sizeof shared) && cfg.v.comm == DT_COMM_NCCL)
    dt_fail(&st, DT_EXIT_INPUT,
            "dist.comm nccl: %s, and NCCL refuses two ranks on one GPU; give each rank a GPU of its own, or set "
            "dist.comm: mpi to share GPUs",
            shared);
  if ((code = comm_agree(&comm, &st))) goto done;
  /* --dry-run with data.path empty plans a job whose data does not exist yet: model and memory only */
  int no_data = args.dry_run && !cfg.v.data_path[0]; /* --set data.path= */
  if (!no_data && !args.sample) {                    /* --sample reads none */
    /* --dry-run checks datasets, shapes, types and labels but need not load the rows (data.cache none) */
    dt_config opened = cfg;
    if (args.dry_run && (cfg.v.cache == DT_CACHE_AUTO || cfg.v.cache == DT_CACHE_MEMORY))
      opened.v.cache = DT_CACHE_NONE;
    data_open(&data, &opened, &model, comm.size, comm.rank, &st);
  }
  if ((code = comm_agree(&comm, &st))) goto done;
  if (args.dry_run) {
    if (comm.rank == 0) {
      printf("config: %s (hash %016llx), %d rank%s\n", cfg.path, (unsigned long long)cfg.hash, comm.size,
             comm.size > 1 ? "s" : "");
      if (no_data)
        printf("data: none (data.path is empty): the model and its memory only\n");
      else
        print_data_summary(&data, &cfg, comm.size);
      printf("model:\n");
      model_summary(&model, stdout);
      fflush(stdout);
    }
    check_memory(&cfg, &model, &data, &comm, gpu, &st);
    code = comm_agree(&comm, &st);
    goto done;
  }
#ifdef DT_WITH_CUDA
  if (gpu >= 0) {
    print_device_table(&comm, gpu);
    be = backend_cuda_create(gpu, cfg.v.precision);
    opts.gpu = gpu;
    /* NCCL when every rank has a GPU of its own (or dist.comm nccl, refused above otherwise); MPI
     * through host memory otherwise. gpus_shared gives every rank the same answer, so all make the
     * same choice (NCCL's collectives on some would wait forever for MPI's on the others). */
    if (cfg.v.comm == DT_COMM_NCCL || (cfg.v.comm == DT_COMM_AUTO && !shared[0])) {
      nccl = nccl_create(&comm, be->stream, cfg.v.grad_dtype == DT_GRAD_BF16, &st);
      if ((code = comm_agree(&comm, &st))) goto done;
      opts.dev = nccl_reducer(nccl);
    }
    if (comm.rank == 0) {
      if (nccl)
        printf("gradients: NCCL\n");
      else if (cfg.v.comm == DT_COMM_MPI)
        printf("gradients: MPI through host memory (dist.comm mpi)\n");
      else
        printf("gradients: MPI through host memory (dist.comm auto: %s)\n", shared);
    }
  }
#else
  (void)gpu; /* without CUDA, select_device has already refused --device cuda */
#endif
  if (cfg.v.grad_dtype == DT_GRAD_BF16 && !nccl && comm.size > 1)
    dt_fail(&st, DT_EXIT_INPUT,
            "dist.grad_dtype bf16: gradients are summed in bf16 only over NCCL (--device cuda, a GPU per rank), "
            "and this run sums them over MPI; use dist.grad_dtype fp32");
  if ((code = comm_agree(&comm, &st))) goto done;
  int cpu_threads = 0; /* the CPU backend's, on every rank or none (a rank without its GPU failed above) */
  if (!be)
    be = backend_cpu_create_with(cpu_threads = pick_threads(&cfg, &comm),
                                 cfg.v.conv_algo == DT_CONV_ALGO_DIRECT ? DT_CPU_CONV_DIRECT : DT_CPU_CONV_WINOGRAD);
  model_alloc(&model, be, max_local_rows(&cfg, comm.size), (uint64_t)cfg.v.seed);
  int resumed = 0;
  if (args.resume && (code = load_resume(&args, &cfg, &model, &comm, &resume, &resumed))) goto done;
  if (!resumed && (code = init_params(&cfg, &model, &comm))) goto done;
  opts.resume = resumed ? &resume : NULL;
  if (args.predict) {
    code = train_predict(&cfg, &model, &data, &comm, args.predict);
    goto done;
  }
  if (args.sample) {
    code = train_sample(&cfg, &model, &comm, args.sample, args.prompt, args.temperature, args.top_k);
    goto done;
  }
  if (cfg.v.monitor_listen[0] && (code = start_monitor(&cfg, &comm, mon, opts.gpu))) goto done;
  opts.monitor = mon;
  if (cpu_threads) print_placement(&comm, cpu_threads);
  dt_train_result res;
  code = train_run(&cfg, &model, &data, &comm, &opts, &res);

done:
  comm.wait_hook = NULL;
  monitor_close(mon);
#ifdef DT_WITH_CUDA
  nccl_destroy(nccl, code != 0 && code != DT_EXIT_STOPPED);
#endif
  (void)nccl;
  free(resume.params);
  free(resume.bufs);
  for (int k = 0; k < DT_OPTIM_MAX_STATES; k++) free(resume.opt[k]);
  free(resume.ema_params);
  free(resume.ema_bufs);
  model_free(&model);
  data_close(&data);
  if (be) be->destroy(be);
  config_free(&cfg);
  free(args.sets);
  comm_finalize(&comm);
  return code;
}
