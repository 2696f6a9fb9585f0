/* gpu_plugin.c: the CUDA build's GPU entry points (gpu.h, backend_cuda_create, nccl_*) as doors
 * to libddp_train_cuda.so, which holds gpu_cuda.c, the CUDA backend (src/cuda/), comm_nccl.c and
 * kernels/ and links cuDNN, cuBLAS, cudart and NCCL. It is loaded on first use, so a process that
 * never looks for a GPU (--help, --version, --dry-run and training on the CPU) does not pay the
 * 56 ms that loading those libraries costs here (benchmarks/startup.py). The library sits beside
 * the binary (or in ../lib/ddp_train once installed); it calls back into the binary (comm_*,
 * dt_*), which exports its symbols (-rdynamic). */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <cudnn_version.h>
#include <dlfcn.h>
#include <limits.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "comm_nccl.h"
#include "common.h"
#include "gpu.h"

#define PLUGIN "libddp_train_cuda.so"

typedef struct {
  int loaded; /* 1: the functions below are set; -1: loading failed, why says so */
  char why[512];
  int (*count)(char *why, size_t cap);
  void (*versions)(char *buf, size_t cap);
  int (*compute_capability)(int i);
  size_t (*shared_per_block)(int i);
  void (*describe)(int i, char *buf, size_t cap, size_t *free_bytes);
  int (*bus_id)(int i, char *buf, size_t cap);
  int (*build_runs_on)(int cc, char *built, size_t cap);
  void (*read)(int i, double *peak_mib, dt_gpu_reading *r);
  dt_backend *(*backend_create)(int device, int precision);
  dt_nccl *(*nccl_create)(dt_comm *c, dt_backend *be, int grad_bf16, dt_status *st);
  const dt_device_reduce *(*nccl_reducer)(dt_nccl *n);
  void (*nccl_destroy)(dt_nccl *n, int failed);
} gpu_api;

static int try_open(const char *path, void **lib, char *why, size_t cap) {
  *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!*lib) snprintf(why, cap, "%s", dlerror());
  return *lib != NULL;
}

/* The plugin's functions, loaded once (the first GPU question of the process; read-only after). */
static const gpu_api *api(void) {
  static gpu_api a;
  if (a.loaded) return &a;
  char exe[PATH_MAX], path[PATH_MAX + 64];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  exe[n > 0 ? n : 0] = 0;
  char *slash = strrchr(exe, '/');
  if (slash) *slash = 0;
  void *lib = NULL;
  char first[256] = "";
  snprintf(path, sizeof path, "%s/" PLUGIN, exe);
  if (!try_open(path, &lib, first, sizeof first)) {
    snprintf(path, sizeof path, "%s/../lib/ddp_train/" PLUGIN, exe);
    char second[256];
    if (!try_open(path, &lib, second, sizeof second)) {
      snprintf(a.why, sizeof a.why, "the GPU code (" PLUGIN ") could not be loaded: %s", first);
      a.loaded = -1;
      return &a;
    }
  }
  /* the names as gpu.h, backend.h and comm.h declare them; a missing one is a broken build */
#define SYM(field, name)                                                                         \
  do {                                                                                           \
    *(void **)&a.field = dlsym(lib, name);                                                       \
    if (!a.field) dt_die("%s has no %s: rebuild ddp_train and " PLUGIN " together", path, name); \
  } while (0)
  SYM(count, "gpu_count");
  SYM(versions, "gpu_versions");
  SYM(compute_capability, "gpu_compute_capability");
  SYM(shared_per_block, "gpu_shared_per_block");
  SYM(describe, "gpu_describe");
  SYM(bus_id, "gpu_bus_id");
  SYM(build_runs_on, "gpu_build_runs_on");
  SYM(read, "gpu_read");
  SYM(backend_create, "backend_cuda_create");
  SYM(nccl_create, "nccl_create");
  SYM(nccl_reducer, "nccl_reducer");
  SYM(nccl_destroy, "nccl_destroy");
#undef SYM
  a.loaded = 1;
  return &a;
}

/* A GPU function reached without a GPU: callers ask gpu_count first, so this is a bug. */
static const gpu_api *loaded(void) {
  const gpu_api *a = api();
  if (a->loaded != 1) dt_die("%s", a->why);
  return a;
}

int gpu_count(char *why, size_t cap) {
  const gpu_api *a = api();
  if (a->loaded != 1) {
    snprintf(why, cap, "%s", a->why);
    return 0;
  }
  return a->count(why, cap);
}

void gpu_versions(char *buf, size_t cap) {
  const gpu_api *a = api();
  if (a->loaded != 1) {
    snprintf(buf, cap, "CUDA: %s", a->why);
    return;
  }
  a->versions(buf, cap);
}

void gpu_build_versions(char *buf, size_t cap) {
  snprintf(buf, cap, "built with CUDA runtime %d.%d, cuDNN %d.%d.%d, NCCL %d.%d.%d (loaded on the first GPU use)",
           CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10, CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL, NCCL_MAJOR,
           NCCL_MINOR, NCCL_PATCH);
}

int gpu_compute_capability(int i) {
  return loaded()->compute_capability(i);
}

size_t gpu_shared_per_block(int i) {
  return loaded()->shared_per_block(i);
}

void gpu_describe(int i, char *buf, size_t cap, size_t *free_bytes) {
  loaded()->describe(i, buf, cap, free_bytes);
}

int gpu_bus_id(int i, char *buf, size_t cap) {
  return loaded()->bus_id(i, buf, cap);
}

int gpu_build_runs_on(int cc, char *built, size_t cap) {
  return loaded()->build_runs_on(cc, built, cap);
}

void gpu_read(int i, double *peak_mib, dt_gpu_reading *r) {
  loaded()->read(i, peak_mib, r);
}

dt_backend *backend_cuda_create(int device, int precision) {
  return loaded()->backend_create(device, precision);
}

dt_nccl *nccl_create(dt_comm *c, dt_backend *be, int grad_bf16, dt_status *st) {
  return loaded()->nccl_create(c, be, grad_bf16, st);
}

const dt_device_reduce *nccl_reducer(dt_nccl *n) {
  return loaded()->nccl_reducer(n);
}

void nccl_destroy(dt_nccl *n, int failed) {
  if (n) loaded()->nccl_destroy(n, failed);
}
