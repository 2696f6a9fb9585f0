/* gpu_cuda.c: device count, compute capabilities and library versions through the CUDA runtime,
 * cuDNN, cuBLAS, NCCL; which GPUs this build has code for. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int gpu_compute_capability(int i) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, i) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, i) != cudaSuccess)
    return 0;
  return major * 10 + minor;
}

size_t gpu_shared_per_block(int i) {
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, i) != cudaSuccess) return 0;
  return (size_t)bytes;
}

/* DT_CUDA_SASS and DT_CUDA_PTX: the compute capabilities the Makefile's CUDA_ARCH builds machine
 * code and PTX for ("75 80 90", "90"). Machine code runs on its major version at or above its
 * minor; PTX is compiled by the driver for any later GPU. */
int gpu_build_runs_on(int cc, char *built, size_t cap) {
  int runs = 0;
  size_t len = 0;
  built[0] = 0;
  for (int ptx = 0; ptx < 2; ptx++) {
    const char *p = ptx ? DT_CUDA_PTX : DT_CUDA_SASS;
    char *end;
    for (long v = strtol(p, &end, 10); end != p; p = end, v = strtol(p, &end, 10)) {
      runs |= ptx ? v <= cc : (v / 10 == cc / 10 && v <= cc);
      if (len < cap)
        len += (size_t)snprintf(built + len, cap - len, "%s%s_%ld", len ? ", " : "", ptx ? "PTX compute" : "sm", v);
    }
  }
  return runs;
}

int gpu_bus_id(int i, char *buf, size_t cap) {
  cudaError_t rc = cudaDeviceGetPCIBusId(buf, (int)cap, i);
  if (rc != cudaSuccess) snprintf(buf, cap, "unknown (%s)", cudaGetErrorName(rc));
  return rc != cudaSuccess;
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

/* NVML through dlopen: the driver ships libnvidia-ml.so.1, the toolkit here has no nvml.h.
 * The few types and entry points used, as NVML declares them. */
typedef struct nvml_device *nvml_device_t;
typedef struct {
  unsigned long long total, free, used;
} nvml_memory_t;
typedef struct {
  unsigned int gpu, memory;
} nvml_utilization_t;

typedef struct {
  void *lib;
  int (*init)(void);
  int (*by_pci)(const char *, nvml_device_t *);
  int (*memory)(nvml_device_t, nvml_memory_t *);
  int (*utilization)(nvml_device_t, nvml_utilization_t *);
  int (*power)(nvml_device_t, unsigned int *);
  int (*temperature)(nvml_device_t, int, unsigned int *);
} nvml_api;

/* Loads NVML once per call site's need; returns NULL when it is not there. The handle is kept
 * for the process (NVML has no per-call state worth freeing). */
static const nvml_api *nvml(void) {
  static nvml_api api; /* loaded once; read-only afterwards */
  static int tried;
  if (tried) return api.lib ? &api : NULL;
  tried = 1;
  api.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!api.lib) return NULL;
  *(void **)&api.init = dlsym(api.lib, "nvmlInit_v2");
  *(void **)&api.by_pci = dlsym(api.lib, "nvmlDeviceGetHandleByPciBusId_v2");
  *(void **)&api.memory = dlsym(api.lib, "nvmlDeviceGetMemoryInfo");
  *(void **)&api.utilization = dlsym(api.lib, "nvmlDeviceGetUtilizationRates");
  *(void **)&api.power = dlsym(api.lib, "nvmlDeviceGetPowerUsage");
  *(void **)&api.temperature = dlsym(api.lib, "nvmlDeviceGetTemperature");
  if (!api.init || !api.by_pci || !api.memory || !api.utilization || !api.power || !api.temperature ||
      api.init() != 0) {
    dlclose(api.lib);
    api.lib = NULL;
    return NULL;
  }
  return &api;
}

/* One line about device i without making a CUDA context on it (a context costs hundreds of MiB
 * on that GPU and fails in exclusive-process mode): properties and the bus id need none, and the
 * free memory comes from NVML, which is per device and makes no context either. */
void gpu_describe(int i, char *buf, size_t cap, size_t *free_bytes) {
  struct cudaDeviceProp p;
  *free_bytes = 0;
  cudaError_t rc = cudaGetDeviceProperties(&p, i);
  if (rc != cudaSuccess) {
    snprintf(buf, cap, "GPU %d: cudaGetDeviceProperties: %s", i, cudaGetErrorString(rc));
    return;
  }
  char bus[32] = "", free_text[64];
  rc = cudaDeviceGetPCIBusId(bus, sizeof bus, i);
  if (rc != cudaSuccess) snprintf(bus, sizeof bus, "unknown (%s)", cudaGetErrorName(rc));
  const nvml_api *api = nvml();
  nvml_device_t dev;
  nvml_memory_t mem;
  if (!api)
    snprintf(free_text, sizeof free_text, "free memory unknown (no NVML)");
  else if (rc != cudaSuccess || api->by_pci(bus, &dev) || api->memory(dev, &mem))
    snprintf(free_text, sizeof free_text, "free memory unknown (NVML could not read it)");
  else {
    *free_bytes = (size_t)mem.free;
    snprintf(free_text, sizeof free_text, "%.1f GiB free", (double)mem.free / 1073741824.0);
  }
  snprintf(buf, cap, "GPU %d: %s, %.1f GiB total, %s, compute capability %d.%d, PCI %s", i, p.name,
           (double)p.totalGlobalMem / 1073741824.0, free_text, p.major, p.minor, bus);
}

void gpu_read(int i, double *peak_mib, dt_gpu_reading *r) {
  memset(r, 0, sizeof *r);
  const nvml_api *api = nvml();
  char bus[32] = "";
  nvml_device_t dev;
  if (!api || cudaDeviceGetPCIBusId(bus, sizeof bus, i) != cudaSuccess || api->by_pci(bus, &dev) != 0) return;
  nvml_memory_t mem;
  nvml_utilization_t util;
  unsigned int mw = 0, temp = 0;
  if (api->memory(dev, &mem) || api->utilization(dev, &util) || api->power(dev, &mw) ||
      api->temperature(dev, 0 /* NVML_TEMPERATURE_GPU */, &temp))
    return;
  r->valid = 1;
  r->mem_used_mib = (double)mem.used / 1048576.0;
  if (r->mem_used_mib > *peak_mib) *peak_mib = r->mem_used_mib;
  r->mem_peak_mib = *peak_mib;
  r->util_pct = util.gpu;
  r->power_w = mw / 1000.0;
  r->temp_c = temp;
}
