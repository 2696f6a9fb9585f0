/* gpu.h: what the CUDA toolkit reports, when the binary is built with CUDA (DT_WITH_CUDA).
 * Without CUDA the functions report no device and no versions. */
#ifndef DT_GPU_H
#define DT_GPU_H

#include <stddef.h>

/* Visible CUDA devices (0 when none, when the driver is missing, or without CUDA). */
int gpu_count(char *why, size_t cap);
/* "CUDA runtime 13.0, driver 13.0, cuDNN 9.x, cuBLAS ..., NCCL 2.28.x", or "" without CUDA. */
void gpu_versions(char *buf, size_t cap);
/* The CUDA libraries' versions this binary was built against, without loading them (--version). */
void gpu_build_versions(char *buf, size_t cap);

/* Compute capability of visible device i as major * 10 + minor (0 when unknown); makes no context. */
int gpu_compute_capability(int i);
/* The shared memory a block of visible device i may opt in to, bytes (0 when unknown); makes no context. */
size_t gpu_shared_per_block(int i);
/* Whether this build has code for compute capability cc (major * 10 + minor): machine code for
 * the same major at or below it, or PTX at or below it. built: what it has ("sm_75, sm_80, ..."). */
int gpu_build_runs_on(int cc, char *built, size_t cap);
/* The PCI bus id of visible device i ("0000:18:00.0"), which tells GPUs apart across processes
 * that see different devices (CUDA_VISIBLE_DEVICES); makes no context. 0 on success. */
int gpu_bus_id(int i, char *buf, size_t cap);

/* One line about visible device i: name, memory total and free, compute capability, PCI bus id.
 * *free_bytes receives the free memory (0 when unknown). */
void gpu_describe(int i, char *buf, size_t cap, size_t *free_bytes);

/* NVML readings of one GPU; valid is 0 when NVML is missing or the call failed. */
typedef struct {
  int valid;
  double mem_used_mib, mem_peak_mib, util_pct, power_w, temp_c;
} dt_gpu_reading;

/* Reads visible device i through NVML (loaded at run time). peak_mib carries the running
 * maximum of used memory between calls (caller-owned). */
void gpu_read(int i, double *peak_mib, dt_gpu_reading *r);

#endif
