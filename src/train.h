/* train.h: the one training loop, for every backend and world size (train.c, train_step.c).
 * Borrows everything: config, model (allocated), data, communicator, backend. Inference: infer.h. */
#ifndef DT_TRAIN_H
#define DT_TRAIN_H

#include "checkpoint.h"
#include "comm.h"
#include "config.h"
#include "data.h"
#include "memory.h"
#include "monitor.h"

typedef struct dt_model dt_model; /* model.h */
typedef struct dt_fault dt_fault; /* fault.h */

typedef struct {
  double best_val_acc, final_val_acc, final_val_loss;
  int64_t steps;
  double wall_s;
} dt_train_result;

/* Seconds from launch (main's first line) to the end of each start-up stage, this rank's clock. */
typedef struct {
  double mpi;      /* MPI started (Open MPI's launch wire-up) */
  double prepared; /* the config, the model, the teacher, the device chosen (a GPU's context made) */
  double data;     /* the data opened (and read into memory under data.cache) */
  double device;   /* the backend: CUDA streams, cuBLAS, cuDNN, NCCL's communicator; or the CPU's */
  double weights;  /* buffers allocated, the weights set (seed, model.init_from or a checkpoint) and shared */
} dt_startup_times;

typedef struct {
  const dt_ckpt_data *resume;  /* host state to continue from (NULL: fresh start) */
  const dt_fault *fault;       /* DDP_TRAIN_FAULT's (tests) */
  double t_launch;             /* dt_now() at start-up, for train.time_limit */
  const dt_device_reduce *dev; /* gradient sums on the device (NCCL); NULL: MPI */
  int gpu;                     /* this rank's visible GPU for monitoring; -1 on the CPU */
  dt_monitor *monitor;         /* rank 0 with monitor.listen: snapshots go to it after each step, and its
                                  POST /stop and /checkpoint come back through the step agreement; else NULL */
  const dt_memory_watch *mem;  /* the baseline of the run's measured memory peak (NULL: not measured) */
  size_t mem_estimate;         /* device_check_memory's estimate of a rank's memory, bytes */
  dt_startup_times startup;    /* where start-up's time went, for the start-up line */
} dt_train_opts;

/* Runs training to the end (epochs, max_steps, early stopping, or a stop request); returns 0
 * or an exit code agreed by all ranks, with the message printed once. */
int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, const dt_train_opts *opts,
              dt_train_result *res);

#endif
