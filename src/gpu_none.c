/* gpu_none.c: the CPU-only build (make CUDA=0). */
#include <stdio.h>

#include "gpu.h"

int gpu_count(char *why, size_t cap) {
  snprintf(why, cap, "this binary was built without CUDA (make CUDA=0)");
  return 0;
}

void gpu_versions(char *buf, size_t cap) {
  snprintf(buf, cap, "CUDA: not built in");
}

void gpu_build_versions(char *buf, size_t cap) {
  snprintf(buf, cap, "CUDA: not built in");
}

int gpu_compute_capability(int i) {
  (void)i;
  return 0;
}

size_t gpu_shared_per_block(int i) {
  (void)i;
  return 0;
}

int gpu_build_runs_on(int cc, char *built, size_t cap) {
  (void)cc;
  snprintf(built, cap, "no CUDA code");
  return 0;
}

int gpu_bus_id(int i, char *buf, size_t cap) {
  (void)i;
  snprintf(buf, cap, "none");
  return 1;
}

void gpu_describe(int i, char *buf, size_t cap, size_t *free_bytes) {
  (void)i;
  snprintf(buf, cap, "none");
  *free_bytes = 0;
}

void gpu_read(int i, double *peak_mib, dt_gpu_reading *r) {
  (void)i;
  (void)peak_mib;
  r->valid = 0;
}
