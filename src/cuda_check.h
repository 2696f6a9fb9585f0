/* cuda_check.h: the one check of CUDA runtime, cuBLAS and cuDNN calls, for the CUDA code (the CUDA
 * backend, comm_nccl.c). A failed call is a bug or a broken device, not a user error: it aborts the
 * job through dt_abort (rank, file and line; MPI_Abort) naming the call and the library's own
 * message. CUBLAS_CHECK and CUDNN_CHECK expand to their library's calls: a file that uses them
 * includes cublas_v2.h or cudnn.h itself. */
#ifndef DT_CUDA_CHECK_H
#define DT_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>

#include "common.h"

#define CUDA_CHECK(call)                                                                                  \
  do {                                                                                                    \
    cudaError_t e_ = (call);                                                                              \
    if (e_ != cudaSuccess) {                                                                              \
      char w_[512];                                                                                       \
      snprintf(w_, sizeof w_, "%s failed: %s (%s)", #call, cudaGetErrorString(e_), cudaGetErrorName(e_)); \
      dt_abort(__FILE__, __LINE__, w_);                                                                   \
    }                                                                                                     \
  } while (0)

#define CUBLAS_CHECK(call)                                                        \
  do {                                                                            \
    cublasStatus_t e_ = (call);                                                   \
    if (e_ != CUBLAS_STATUS_SUCCESS) {                                            \
      char w_[512];                                                               \
      snprintf(w_, sizeof w_, "%s failed: %s", #call, cublasGetStatusString(e_)); \
      dt_abort(__FILE__, __LINE__, w_);                                           \
    }                                                                             \
  } while (0)

#define CUDNN_CHECK(call)                                                       \
  do {                                                                          \
    cudnnStatus_t e_ = (call);                                                  \
    if (e_ != CUDNN_STATUS_SUCCESS) {                                           \
      char w_[512];                                                             \
      snprintf(w_, sizeof w_, "%s failed: %s", #call, cudnnGetErrorString(e_)); \
      dt_abort(__FILE__, __LINE__, w_);                                         \
    }                                                                           \
  } while (0)

#endif
