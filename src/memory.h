/* memory.h: the memory a rank's run holds at most, measured, to hold --dry-run's estimate
 * (device_check_memory) against:
 * - on the CPU backend, the process's peak resident set (VmHWM) above its resident set at the
 *   baseline, which main takes after MPI, the libraries, the config and the model's description,
 *   and before the data, the backend and every buffer: so the data held in memory, the buffers,
 *   the libraries' own scratch (OpenBLAS, oneDNN) and glibc's arenas all count;
 * - on a GPU, the most device memory the backend held (dt_backend.mem_peak: its own count of every
 *   buffer, workspace and scratch it allocated, and of the bf16 gradient bucket NCCL's side
 *   allocates); not the CUDA context, nor what cuBLAS, cuDNN and NCCL allocate for themselves.
 * Owns nothing. */
#ifndef DT_MEMORY_H
#define DT_MEMORY_H

#include <stddef.h>

#include "backend.h"

typedef struct {
  size_t rss_base; /* VmRSS at the baseline, bytes */
  int reset;       /* VmHWM was reset to VmRSS there (Linux's clear_refs 5); else it is the process's peak */
  int ok;          /* /proc/self/status could be read at the baseline */
} dt_memory_watch;

/* The baseline: VmRSS now, and VmHWM reset to it where the kernel allows. */
void memory_watch_start(dt_memory_watch *w);
/* The most bytes the run has held above the baseline so far: host RSS on a host-memory backend
 * (be->host_memory), else the backend's device peak. 0 where it cannot be read. */
size_t memory_watch_peak(const dt_memory_watch *w, const dt_backend *be);
/* "host RSS" or "device": what memory_watch_peak measures for be. */
const char *memory_watch_kind(const dt_backend *be);

#endif
