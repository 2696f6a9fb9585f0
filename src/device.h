/* device.h: the device each rank computes on: the CPU (its threads: the cores it may use, shared
 * with the node's other ranks) or its GPU (--device cuda: the node's GPU of its local rank, checked
 * against the build's code, the precision and the kernels' 32-bit indices), the transport of its
 * gradients (NCCL when no two ranks share a GPU, by PCI bus id; MPI otherwise), and whether a
 * rank's batch fits its memory (--dry-run). Functions marked collective are called by every rank.
 * Owns: the backend and the NCCL communicator of a dt_device. */
#ifndef DT_DEVICE_H
#define DT_DEVICE_H

#include "comm_nccl.h"
#include "config.h"
#include "data.h"
#include "model.h"

/* Threads per rank: the cores this rank may run on, shared with the other ranks on the node.
 * cfg NULL: the default (dist.threads unset). */
int device_threads(const dt_config *cfg, const dt_comm *c);
/* Collective: rank 0 prints each rank's host, local rank, CPU threads and CPUs. */
void device_print_placement(dt_comm *comm, int threads);

/* The GPU this rank uses (cuda: --device cuda), or -1 for the CPU backend; exit 2 in st where the
 * device cannot run the model as configured. With a GPU, m's layers (and its teacher's) pick their
 * ops for it (model_pick_ops) before the 32-bit index check, which counts what they picked. */
int device_select(int cuda, const dt_config *cfg, dt_model *m, const dt_comm *comm, dt_status *st);
/* Collective, for --device auto: 1 when every rank has a GPU of its own (rank i of a node GPU i, no two
 * ranks on one by PCI bus id) that this build has code for, else 0 with why saying what is missing
 * (on rank 0; empty when no rank sees a GPU at all). Every rank gets the same answer. */
int device_auto_cuda(dt_comm *comm, char *why, size_t cap);
/* Collective: whether two ranks use one GPU (gpu -1: this rank none); why names the first pair. */
int device_gpus_shared(dt_comm *comm, int gpu, char *why, size_t cap);

/* The memory a rank needs against what it has (its GPU's free memory when it runs on one, else the
 * host's available memory shared by the ranks on the node); exit 2 when it does not fit, or when a
 * tensor of the batch would hold more than 2^40 values. --dry-run and every run before allocating
 * (the same check, the same code). be: the backend the run uses (device_backend_create's), asked
 * what scratch its ops take (it keeps the plans it makes). report: rank 0 prints the parts. Returns
 * the estimate, bytes. */
size_t device_check_memory(const dt_config *cfg, const dt_model *m, const dt_data *d, const dt_comm *comm, int gpu,
                           dt_backend *be, int report, dt_status *st);

/* Collective: train.batch_size auto. Sets train.global_batch_size and train.grad_accum in cfg to the
 * largest micro-batch whose memory (device_check_memory's estimate, with the rows d says a rank
 * keeps: d opened for its shapes, or NULL where there is no data) fits train.memory_fraction of what
 * every rank has, the rows of a step unchanged; the choice and why go to cfg->auto_batch and rank
 * 0's stdout. Exit 2 in st, naming the largest part, when none fits. Returns st->code. */
int device_auto_batch(dt_config *cfg, const dt_model *m, const dt_data *d, dt_comm *comm, int gpu, dt_status *st);

typedef struct {
  dt_backend *be;
  dt_nccl *nccl;                   /* NULL: gradients over MPI */
  const dt_device_reduce *reducer; /* the NCCL communicator's, or NULL */
  int cpu_threads;                 /* the CPU backend's threads; 0 on a GPU */
} dt_device;

/* The backend alone for gpu (-1: the CPU, with *cpu_threads threads; else *cpu_threads = 0): what
 * device_open makes, and --dry-run's, which its memory estimate asks. Caller owns. */
dt_backend *device_backend_create(const dt_config *cfg, const dt_comm *comm, int gpu, int *cpu_threads);
/* Collective: the backend for gpu (-1: the CPU) and, for a GPU, the gradients' transport: shared
 * is device_gpus_shared's answer. Returns the agreed exit code. */
int device_open(dt_device *dev, const dt_config *cfg, dt_comm *comm, int gpu, const char *shared, dt_status *st);
/* failed: the job is ending on an error (NCCL is aborted, not finalised). */
void device_close(dt_device *dev, int failed);

#endif
