/* main.c: the CLI, start-up order and the exit-code contract (README "Exit codes").
 * Every rank runs the same steps; after each stage that can find bad input, the ranks agree
 * (comm_agree) so that all exit together with one message. */
#include <cblas.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <yaml.h>

#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "device.h"
#include "distill.h"
#include "gpu.h"
#include "model.h"
#include "fault.h"
#include "infer.h"
#include "monitor.h"
#include "optim.h"
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
    "  --device DEV      auto, cpu or cuda (auto: cuda when every rank has a GPU of its own, else cpu)\n"
    "  --resume PATH     continue from a checkpoint file; `--resume auto` takes the newest good one in\n"
    "                    checkpoint.dir (falling back past unreadable ones) or starts fresh when there is none\n"
    "  --predict OUT.h5  write the validation logits of the model (from --resume or model.init_from) and exit\n"
    "  --sample N        print N tokens a token model (from --resume or model.init_from) samples after --prompt\n"
    "  --prompt TEXT     the text to continue (encoded with data.path's /vocab; else bytes for a vocab-256\n"
    "                    model, token ids for others), default a newline\n"
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

/* --info: one block per node, gathered to rank 0, so a node with a missing GPU shows before training. */
static void print_info(dt_comm *comm) {
  enum { CAP = 4096 };
  char text[CAP] = "", why[256] = "", shared[512];
  const int n = gpu_count(why, sizeof why);
  device_gpus_shared(comm, n ? comm->local_rank % n : -1, shared, sizeof shared); /* the GPU --device cuda would use */
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
  device_print_placement(comm, device_threads(NULL, comm));
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

/* monitor.listen or log.dir: every rank sends its host and device; rank 0 starts serving (monitor.h)
 * and hears about its long collective waits, or keeps the state for report.html. Collective;
 * returns the agreed code. */
static int start_monitor(const dt_config *cfg, const dt_model *m, dt_comm *comm, dt_monitor *mon, int gpu) {
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
    int64_t lo, hi; /* rank 0's optimizer state: all of it, or under dist.zero 1 its slice */
    optim_slice(v, m->n_params, comm->size, 0, &lo, &hi);
    char *summary = NULL;
    size_t summary_len = 0;
    FILE *f = open_memstream(&summary, &summary_len);
    if (!f) dt_abort(__FILE__, __LINE__, "open_memstream failed");
    model_summary(m, f);
    if (fclose(f)) dt_abort(__FILE__, __LINE__, "writing the model summary to memory failed");
    dt_monitor_run run = {
        .config_path = cfg->path,
        .model_summary = summary,
        .data_path = v->data_path,
        .config_hash = cfg->hash,
        .world_size = comm->size,
        .hosts = hosts,
        .devices = devices,
        .global_batch = config_global_batch(v, comm->size) * v->grad_accum,
        .rank_rows = config_max_local_rows(v, comm->size),
        .grad_accum = v->grad_accum,
        .auto_batch = cfg->auto_batch,
        .optim_name = dt_optim_kinds[v->optim]->name,
        .zero = (int)v->zero,
        .optim_state_bytes = (int64_t)dt_optim_kinds[v->optim]->n_states(v) * (hi - lo) * (int64_t)sizeof(float),
        .epochs = v->epochs,
        .teacher = m->teacher ? v->distill_teacher : "",
        .teacher_weights = v->distill_weights,
        .distill_loss = v->distill_loss ? "mse" : "kl",
        .teacher_params = m->teacher ? m->teacher->n_params : 0,
        .temperature = v->distill_temperature,
        .alpha = v->distill_alpha};
    if (!monitor_start(mon, &run, &st)) {
      comm->wait_hook = monitor_note_wait;
      comm->wait_ctx = mon;
    }
    free(hosts);
    free(devices);
    free(summary);
  }
  free(all);
  return comm_agree(comm, &st);
}

static void print_data_summary(const dt_data *d, const dt_config *cfg, int world) {
  const dt_config_values *v = &cfg->v;
  int64_t G = config_global_batch(v, world);
  if (d->train.tok_stride) { /* a token model's targets are its inputs shifted by one */
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

/* Everything a run holds, in the order main makes it. */
typedef struct {
  cli_args args;
  dt_comm comm;
  dt_config cfg;
  dt_model model;
  dt_teacher teacher; /* distill.teacher's (distill.h): the model borrows it */
  dt_data data;
  dt_monitor *mon;
  int gpu;          /* this rank's GPU, or -1 */
  char shared[512]; /* with a GPU: the ranks that share one (device_gpus_shared), else empty */
  dt_device dev;
  dt_ckpt_data resume;
  dt_fault fault;      /* DDP_TRAIN_FAULT */
  dt_memory_watch mem; /* the baseline of the measured memory peak: before the data and every buffer */
  dt_train_opts opts;
} dt_run;

/* The config (and DDP_TRAIN_FAULT), the same on every rank; the status endpoint's socket (rank 0,
 * before any data is read); the model; the device. Returns the agreed code. */
static int run_prepare(dt_run *r, dt_status *st) {
  const cli_args *a = &r->args;
  dt_comm *comm = &r->comm;
  int code;
  config_load(&r->cfg, a->config, a->sets, a->n_sets, st);
  if (!st->code) fault_parse(&r->fault, getenv("DDP_TRAIN_FAULT"), st);
  if ((code = comm_agree(comm, st))) return code;
  const dt_config_values *v = &r->cfg.v;
  comm->timeout_s = v->timeout_s;
  comm_check_same(comm, r->cfg.hash, "the effective config", st);
  if ((code = comm_agree(comm, st))) return code;
  const int trains = !a->dry_run && !a->predict && !a->sample;
  /* served once training starts; without monitor.listen its state is report.html's */
  if (comm->rank == 0 && (v->monitor_listen[0] || (trains && v->log_dir[0]))) {
    dt_monitor_opts mo = {.listen = v->monitor_listen,
                          .token_file = v->monitor_token_file,
                          .stall_s = v->monitor_stall_s > 0 ? v->monitor_stall_s : v->timeout_s / 2,
                          .log_dir = v->log_dir,
                          .checkpoints = v->ckpt_dir[0] != 0};
    r->mon = monitor_open(&mo, trains, st);
  }
  if ((code = comm_agree(comm, st))) return code;
  model_build(&r->model, &r->cfg, st);
  if ((code = comm_agree(comm, st))) return code;
  if (!a->predict && !a->sample) teacher_build(&r->teacher, &r->cfg, &r->model, st); /* training's only */
  if ((code = comm_agree(comm, st))) return code;
  int cuda = a->device == DEV_CUDA;
  if (a->device == DEV_AUTO) { /* the GPUs when every rank has one of its own; said whenever there are any */
    char why[768];
    cuda = device_auto_cuda(comm, why, sizeof why);
    if (comm->rank == 0 && (cuda || why[0]))
      printf("device: %s (--device auto: %s)\n", cuda ? "cuda" : "cpu", cuda ? "every rank has a GPU of its own" : why);
  }
  r->gpu = device_select(cuda, &r->cfg, &r->model, comm, st);
  if ((code = comm_agree(comm, st))) return code;
  if (r->gpu >= 0 && device_gpus_shared(comm, r->gpu, r->shared, sizeof r->shared) && v->comm == DT_COMM_NCCL)
    dt_fail(st, DT_EXIT_INPUT,
            "dist.comm nccl: %s, and NCCL refuses two ranks on one GPU; give each rank a GPU of its own, or set "
            "dist.comm: mpi to share GPUs",
            r->shared);
  if ((code = comm_agree(comm, st))) return code;
  if (v->batch_size == -1) { /* the data's shapes count (the rows a rank keeps in memory): none is read */
    const int shapes = r->cfg.v.data_path[0] && !a->sample;
    dt_data probe = {0};
    dt_config opened = r->cfg;
    opened.v.cache = DT_CACHE_NONE;
    if (shapes) data_open(&probe, &opened, &r->model, comm->size, comm->rank, st);
    if (!(code = comm_agree(comm, st))) device_auto_batch(&r->cfg, &r->model, shapes ? &probe : NULL, comm, r->gpu, st);
    if (shapes) data_close(&probe);
    if (code) return code;
  }
  return comm_agree(comm, st);
}

/* The data, unless --sample (which reads none) or a --dry-run with data.path empty (a job whose
 * data does not exist yet: the model and its memory only); --dry-run checks the datasets, shapes,
 * types and labels without loading the rows. Returns the agreed code. */
static int run_open_data(dt_run *r, dt_status *st) {
  const cli_args *a = &r->args;
  const int no_data = a->dry_run && !r->cfg.v.data_path[0];
  if (!no_data && !a->sample) {
    dt_config opened = r->cfg;
    if (a->dry_run && (r->cfg.v.cache == DT_CACHE_AUTO || r->cfg.v.cache == DT_CACHE_MEMORY))
      opened.v.cache = DT_CACHE_NONE;
    data_open(&r->data, &opened, &r->model, r->comm.size, r->comm.rank, st);
  }
  return comm_agree(&r->comm, st);
}

/* --dry-run: the config, the data, the model summary and the memory estimate. */
static int run_dry(dt_run *r, dt_status *st) {
  dt_comm *comm = &r->comm;
  if (comm->rank == 0) {
    printf("config: %s (hash %016llx), %d rank%s\n", r->cfg.path, (unsigned long long)r->cfg.hash, comm->size,
           comm->size > 1 ? "s" : "");
    if (!r->cfg.v.data_path[0])
      printf("data: none (data.path is empty): the model and its memory only\n");
    else
      print_data_summary(&r->data, &r->cfg, comm->size);
    printf("model:\n");
    model_summary(&r->model, stdout);
    fflush(stdout);
  }
  int threads;
  dt_backend *be = device_backend_create(&r->cfg, comm, r->gpu, &threads); /* asked what its scratch takes */
  device_check_memory(&r->cfg, &r->model, &r->data, comm, r->gpu, be, 1, st);
  be->destroy(be);
  return comm_agree(comm, st);
}

/* The backend, the memory check (--dry-run's, unprinted: before any buffer), the model's buffers,
 * the parameters (resumed, or model.init_from or the seed), then what was asked: --predict,
 * --sample, or training. Returns the agreed code. */
static int run_work(dt_run *r, dt_status *st) {
  const cli_args *a = &r->args;
  dt_comm *comm = &r->comm;
  int code = device_open(&r->dev, &r->cfg, comm, r->gpu, r->shared, st);
  if (code) return code;
  r->opts.startup.device = dt_now() - r->opts.t_launch;
  r->opts.mem_estimate = device_check_memory(&r->cfg, &r->model, &r->data, comm, r->gpu, r->dev.be, 0, st);
  if ((code = comm_agree(comm, st))) return code;
  r->opts.dev = r->dev.reducer;
  r->opts.gpu = r->gpu;
  model_alloc(&r->model, r->dev.be, config_model_rows(&r->cfg.v, comm->size), (uint64_t)r->cfg.v.seed);
  int resumed = 0;
  if (a->resume && (code = ckpt_resume(a->resume, &r->cfg, &r->model, comm, &r->resume, &resumed))) return code;
  if (!resumed && (code = ckpt_share_model(r->cfg.v.init_from, &r->model, r->cfg.v.init_from_ignore_extra,
                                           "model.init_from", comm)))
    return code; /* rank 0's parameters, from model.init_from or the seed, become everyone's */
  if (r->teacher.on &&
      (code = teacher_load(&r->teacher, &r->cfg, r->dev.be, config_model_rows(&r->cfg.v, comm->size), comm)))
    return code;
  r->opts.resume = resumed ? &r->resume : NULL;
  r->opts.startup.weights = dt_now() - r->opts.t_launch;
  if (a->predict) return infer_predict(&r->model, &r->data, comm, a->predict);
  if (a->sample) return infer_sample(&r->cfg, &r->model, comm, a->sample, a->prompt, a->temperature, a->top_k);
  if ((r->cfg.v.monitor_listen[0] || r->cfg.v.log_dir[0]) &&
      (code = start_monitor(&r->cfg, &r->model, comm, r->mon, r->gpu)))
    return code;
  r->opts.monitor = r->mon;
  if (r->dev.cpu_threads) device_print_placement(comm, r->dev.cpu_threads);
  dt_train_result res;
  code = train_run(&r->cfg, &r->model, &r->data, comm, &r->opts, &res);
  if (code == 0 || code == DT_EXIT_STOPPED) { /* rank 0's; a failure to write it is said, and the run stands */
    dt_status rst = {0};
    if (monitor_write_report(r->mon, code, &rst)) fprintf(stderr, "ddp_train: warning: no report.html: %s\n", rst.msg);
  }
  return code;
}

static void run_close(dt_run *r, int code) {
  r->comm.wait_hook = NULL;
  monitor_close(r->mon);
  ckpt_data_free(&r->resume);
  model_free(&r->model);
  teacher_free(&r->teacher);
  data_close(&r->data);
  device_close(&r->dev, code != 0 && code != DT_EXIT_STOPPED);
  config_free(&r->cfg);
  free(r->args.sets);
  comm_finalize(&r->comm);
}

int main(int argc, char **argv) {
  double t_launch = dt_now();
  dt_run run;
  memset(&run, 0, sizeof run); /* every field starts empty */
  dt_run *r = &run;
  dt_status st = {0};
  /* --help, --version and --config-keys need neither MPI nor a device: rank 0 of the launch prints */
  if (!parse_args(argc, argv, &r->args, &st) && !r->args.info &&
      (r->args.help || r->args.version || r->args.config_keys)) {
    if (launcher_rank() == 0) {
      if (r->args.help) fputs(usage_text, stdout);
      if (r->args.version) print_version();
      if (r->args.config_keys) {
        config_print_keys(stdout);
        model_print_layer_keys(stdout);
      }
    }
    free(r->args.sets);
    return 0;
  }
  /* before MPI starts (the slow part of start-up): a stop asked for then is honoured at step 1 */
  const cli_args *a = &r->args;
  if (!a->info && !a->dry_run && !a->predict && !a->sample) signals_install();
  mpi_start_defaults();
  comm_init(&r->comm, &argc, &argv);
  r->opts = (dt_train_opts){.t_launch = t_launch, .gpu = -1, .fault = &r->fault};
  r->opts.startup.mpi = dt_now() - t_launch;
  r->gpu = -1;
  r->data.file = -1;
  r->data.train.dset_x = r->data.val.dset_x = -1;
  int code = comm_agree(&r->comm, &st);
  if (!code && r->args.info)
    print_info(&r->comm);
  else if (!code && !(code = run_prepare(r, &st))) {
    r->opts.startup.prepared = dt_now() - t_launch;
    memory_watch_start(&r->mem); /* the data and everything after it count */
    r->opts.mem = &r->mem;
    if (!(code = run_open_data(r, &st))) {
      r->opts.startup.data = dt_now() - t_launch;
      code = r->args.dry_run ? run_dry(r, &st) : run_work(r, &st);
    }
  }
  run_close(r, code);
  return code;
}
