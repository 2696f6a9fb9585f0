/* nvml.c: the NVML entry points gpu_cuda.c loads at run time (libnvidia-ml.so.1), for the GPU
 * stand-in. Memory is what the stand-in device holds in this process (with its context);
 * utilisation is the share of wall time the device spent executing queued work since the last
 * reading; power and temperature follow utilisation on an H100-like scale (70 to 700 W). They are
 * there so the reading path runs, not to be believed. */
#include <stddef.h>
#include <string.h>
#include <time.h>

int gpusim_device_reading(const char *bus, size_t *total, size_t *used, double *busy_s);

typedef struct {
  char bus[32];
  double last_busy, last_wall, util;
} nvml_device;

typedef struct {
  unsigned long long total, free, used;
} nvml_memory;
typedef struct {
  unsigned int gpu, memory;
} nvml_utilization;

enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_FOUND = 6 };

static nvml_device devices[64]; /* NVML hands out process-lifetime handles too */
static int n_devices;

static double wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int nvmlInit_v2(void) {
  return NVML_SUCCESS;
}

int nvmlShutdown(void) {
  return NVML_SUCCESS;
}

int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvml_device **out) {
  size_t total, used;
  double busy;
  if (!bus || !out) return NVML_ERROR_INVALID_ARGUMENT;
  if (gpusim_device_reading(bus, &total, &used, &busy)) return NVML_ERROR_NOT_FOUND;
  for (int i = 0; i < n_devices; i++)
    if (!strcmp(devices[i].bus, bus)) {
      *out = &devices[i];
      return NVML_SUCCESS;
    }
  if (n_devices == 64) return NVML_ERROR_NOT_FOUND;
  nvml_device *d = &devices[n_devices++];
  strncpy(d->bus, bus, sizeof d->bus - 1);
  d->last_busy = busy;
  d->last_wall = wall();
  *out = d;
  return NVML_SUCCESS;
}

int nvmlDeviceGetMemoryInfo(nvml_device *d, nvml_memory *m) {
  size_t total, used;
  double busy;
  if (!d || !m || gpusim_device_reading(d->bus, &total, &used, &busy)) return NVML_ERROR_INVALID_ARGUMENT;
  m->total = total;
  m->used = used;
  m->free = total - used;
  return NVML_SUCCESS;
}

int nvmlDeviceGetUtilizationRates(nvml_device *d, nvml_utilization *u) {
  size_t total, used;
  double busy, now = wall();
  if (!d || !u || gpusim_device_reading(d->bus, &total, &used, &busy)) return NVML_ERROR_INVALID_ARGUMENT;
  if (now > d->last_wall) d->util = 100.0 * (busy - d->last_busy) / (now - d->last_wall);
  if (d->util > 100) d->util = 100;
  d->last_busy = busy;
  d->last_wall = now;
  u->gpu = (unsigned)(d->util + 0.5);
  u->memory = u->gpu / 2;
  return NVML_SUCCESS;
}

int nvmlDeviceGetPowerUsage(nvml_device *d, unsigned int *mw) {
  if (!d || !mw) return NVML_ERROR_INVALID_ARGUMENT;
  *mw = (unsigned)(70000 + 6300 * d->util);
  return NVML_SUCCESS;
}

int nvmlDeviceGetTemperature(nvml_device *d, int sensor, unsigned int *c) {
  (void)sensor;
  if (!d || !c) return NVML_ERROR_INVALID_ARGUMENT;
  *c = (unsigned)(34 + 0.4 * d->util);
  return NVML_SUCCESS;
}
