/* gpu_cuda.c: device count and library versions through the CUDA runtime, cuDNN, cuBLAS, NCCL. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>
#include <stdio.h>

#include "gpu.h"

int gpu_count(char *why, size_t cap) {
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    snprintf(why, cap, "cudaGetDeviceCount: %s", cudaGetErrorString(rc));
    return 0;
  }
  if (n == 0) snprintf(why, cap, "no CUDA device is visible");
  return n;
}

void gpu_versions(char *buf, size_t cap) {
  int rt = 0, drv = 0, nccl = 0;
  cudaRuntimeGetVersion(&rt);
  if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
  ncclGetVersion(&nccl);
  size_t cudnn = cudnnGetVersion();
  int cublas = 0;
  cublasGetProperty(MAJOR_VERSION, &cublas);
  int cublas_minor = 0;
  cublasGetProperty(MINOR_VERSION, &cublas_minor);
  snprintf(buf, cap, "CUDA runtime %d.%d, driver %s%d.%d, cuDNN %zu.%zu.%zu, cuBLAS %d.%d, NCCL %d.%d.%d", rt / 1000,
           (rt % 1000) / 10, drv ? "" : "none ", drv / 1000, (drv % 1000) / 10, cudnn / 10000, (cudnn % 10000) / 100,
           cudnn % 100, cublas, cublas_minor, nccl / 10000, (nccl % 10000) / 100, nccl % 100);
}

void gpu_describe(int i, char *buf, size_t cap, size_t *free_bytes) {
  struct cudaDeviceProp p;
  *free_bytes = 0;
  cudaError_t rc = cudaGetDeviceProperties(&p, i);
  if (rc != cudaSuccess) {
    snprintf(buf, cap, "GPU %d: cudaGetDeviceProperties: %s", i, cudaGetErrorString(rc));
    return;
  }
  size_t free_b = 0, total_b = p.totalGlobalMem;
  int prev = 0;
  cudaGetDevice(&prev);
  if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) *free_bytes = free_b;
  cudaSetDevice(prev);
  char bus[32] = "";
  cudaDeviceGetPCIBusId(bus, sizeof bus, i);
  snprintf(buf, cap, "GPU %d: %s, %.1f GiB total, %.1f GiB free, compute capability %d.%d, PCI %s", i, p.name,
           (double)total_b / 1073741824.0, (double)free_b / 1073741824.0, p.major, p.minor, bus);
}
