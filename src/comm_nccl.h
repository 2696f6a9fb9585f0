/* comm_nccl.h: gradient sums over NCCL (comm_nccl.c, in the GPU library of CUDA builds; reached
 * through gpu_plugin.c). An NCCL communicator over the ranks of c, its unique id sent by MPI from
 * rank 0, initialised non-blocking under c's deadline. Sums run on a communication stream that
 * waits (CUDA events) for the backend's work (be->stream) queued before each start; the bf16 bucket
 * it allocates on the device is counted in the backend's (be->mem_used). */
#ifndef DT_COMM_NCCL_H
#define DT_COMM_NCCL_H

#include "backend.h"
#include "comm.h"

typedef struct dt_nccl dt_nccl;
/* NULL when NCCL fails to initialise: on the rank that failed st is set (exit 3) and the others are
 * told at once, so they stop waiting (their st stays clear; the caller's comm_agree reports it).
 * grad_bf16: sum the gradient buckets as bfloat16 (dist.grad_dtype bf16). */
dt_nccl *nccl_create(dt_comm *c, dt_backend *be, int grad_bf16, dt_status *st);
const dt_device_reduce *nccl_reducer(dt_nccl *n);
/* Finalizes and destroys the communicator; aborts it instead when the job is failing (failed). */
void nccl_destroy(dt_nccl *n, int failed);

#endif
