/* memory.h: the parts of a rank's memory that the run adds to the model's (model_memory), for
 * --dry-run's estimate (device_check_memory); and the memory a rank's run holds at most, measured,
 * to hold that estimate against:
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
#include "config.h"
#include "data.h"
#include "model.h"

/* What the run holds beside the model's buffers, bytes. */
typedef struct {
  size_t batches;    /* input batches in backend memory (raw rows, labels or targets, row numbers): the two
                        training alternates between and evaluation's (with validation data), and the step's
                        sums; on a host-memory backend also the loader's two host batches and evaluation's
                        host copy */
  size_t data;       /* host-memory backend: the rank's rows held in memory (data_held_bytes) */
  size_t mpi;        /* host-memory backend on several ranks: what Open MPI's non-blocking gradient sums may
                        hold, a temporary per bucket in flight: at most the gradients once more (dist.zero
                        1: the temporaries of the reduces rooted at this rank, its share) */
  size_t checkpoint; /* host-memory backend with checkpoint.dir: rank 0's, while it writes one: its host copy
                        of the state, the file built in memory (ckpt_write: the state and 1 MiB), and
                        HDF5's copy of one tensor (its checksum filter's buffer) */
  size_t workspace;  /* the backend's scratch (be->scratch) for the ops a run runs: training's of `rows`
                        rows and, with validation data, evaluation's forward of `held` */
} dt_run_memory;

/* The parts above for a rank of `world` training m with config v, data d (opened or not; NULL: none held) on backend
 * be (which plans the model's convolutions to answer, and keeps the plans), `rows` rows per
 * micro-batch and buffers of `held` rows (config_model_rows). */
void memory_run_parts(const dt_config_values *v, const dt_model *m, const dt_data *d, dt_backend *be, int world,
                      int64_t rows, int64_t held, dt_run_memory *out);

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
