/* cuda_check.h: the one check of CUDA runtime, cuBLAS and cuDNN calls, for the CUDA code (the CUDA
 * backend, comm_nccl.c). A failed call is a bug or a broken device, not a user error: it aborts the
 * job (MPI_Abort, exit 70) naming the rank, the call and the library's own message; a bug through
 * dt_abort with the file and line, a fault of the device's work as a fault (cuda_failed). CUBLAS_CHECK
 * and CUDNN_CHECK expand to their library's calls: a file that uses them includes cublas_v2.h or
 * cudnn.h itself. */
#ifndef DT_CUDA_CHECK_H
#define DT_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>

#include "common.h"

/* Whether e leaves the CUDA context unusable: a fault of the device's work (every later call returns it). */
static inline int cuda_error_is_fault(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorHardwareStackError:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorExternalDevice:
    case cudaErrorTensorMemoryLeak: return 1;
    default: return 0;
  }
}

/* The fault that broke this process's CUDA context, or cudaSuccess: what a query of the legacy stream
 * returns (after a fault every call returns it, where a library that met it first, cuBLAS or NCCL, may
 * have left the runtime's last error clean). For failure paths only. */
static inline cudaError_t cuda_context_fault(void) {
  cudaError_t e = cudaStreamQuery(cudaStreamLegacy);
  return cuda_error_is_fault(e) ? e : cudaSuccess;
}

/* A failed call (call: its text; why: a library's message, or NULL for e's). A device fault (e, or the
 * context's sticky error behind a library's failure) is named as one, with where to look: it surfaces
 * at whatever call comes after the work that faulted, so the call's file and line are not the cause.
 * Anything else is a bug. */
static inline _Noreturn void cuda_failed(cudaError_t e, const char *call, const char *why, const char *file, int line) {
  cudaError_t fault = cuda_error_is_fault(e) ? e : cuda_context_fault();
  if (fault != cudaSuccess)
    dt_die(
        "the GPU faulted: %s (%s), reported by %s at %s:%d. The work that faulted (a kernel, a copy or a "
        "library call) was queued before that call, and this process cannot use the GPU any more. To name it, "
        "rerun with CUDA_LAUNCH_BLOCKING=1 and --set train.cuda_graph=off (each op then reports its own fault), "
        "or under compute-sanitizer; for a hardware fault (an Xid, an uncorrectable ECC error) see nvidia-smi -q "
        "and the kernel log",
        cudaGetErrorString(fault), cudaGetErrorName(fault), call, file, line);
  char w[512];
  if (why)
    snprintf(w, sizeof w, "%s failed: %s", call, why);
  else
    snprintf(w, sizeof w, "%s failed: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
  dt_abort(file, line, w);
}

/* CUDA_CHECK_AS: a result already in hand (result), with the call's text for the message. */
#define CUDA_CHECK_AS(result, call_text)                                         \
  do {                                                                           \
    cudaError_t e_ = (result);                                                   \
    if (e_ != cudaSuccess) cuda_failed(e_, call_text, NULL, __FILE__, __LINE__); \
  } while (0)
#define CUDA_CHECK(call) CUDA_CHECK_AS(call, #call)

#define CUBLAS_CHECK(call)                                                                                           \
  do {                                                                                                               \
    cublasStatus_t e_ = (call);                                                                                      \
    if (e_ != CUBLAS_STATUS_SUCCESS) cuda_failed(cudaSuccess, #call, cublasGetStatusString(e_), __FILE__, __LINE__); \
  } while (0)

#define CUDNN_CHECK(call)                                                                                         \
  do {                                                                                                            \
    cudnnStatus_t e_ = (call);                                                                                    \
    if (e_ != CUDNN_STATUS_SUCCESS) cuda_failed(cudaSuccess, #call, cudnnGetErrorString(e_), __FILE__, __LINE__); \
  } while (0)

#endif
