/* dnnl.h: the CPU backend's convolutions through oneDNN (Debian's libdnnl). */
#pragma once

#include "backend.h"

typedef struct cpu_dnnl cpu_dnnl;

enum { CPU_DNNL_FWD, CPU_DNNL_BWD_DATA, CPU_DNNL_BWD_FILTER };

/* NULL when oneDNN has no CPU engine here (the caller keeps its own convolution). winograd: 3x3
 * stride-1 convolutions with channels in multiples of 16 use oneDNN's Winograd F(4x4, 3x3) where it
 * has one (AVX-512), else direct. */
cpu_dnnl *cpu_dnnl_create(int winograd);
void cpu_dnnl_destroy(cpu_dnnl *d);

/* One convolution with the semantics of the backend's ops, on NCHW activations and OIHW weights:
 *   CPU_DNNL_FWD:        a = x, b = w, out = y  (y overwritten)
 *   CPU_DNNL_BWD_DATA:   a = dy, b = w, out = dx (dx overwritten)
 *   CPU_DNNL_BWD_FILTER: a = x, b = dy, out = dw (dw += the filter gradient)
 * Returns 1 when done, 0 when oneDNN has no implementation for this geometry (nothing written; the
 * held blocked copies are forgotten, as the caller then writes `out` itself). */
int cpu_dnnl_conv(cpu_dnnl *d, int kind, const dt_conv_geom *g, const float *a, const float *b, float *out);

/* The scratch buffers of cpu_dnnl_conv: the blocked copies of x, w and y, the primitives'
 * scratchpad, the filter gradient in OIHW; each grows to the most any convolution needs. */
enum { CPU_DNNL_BUFFERS = 5 };
/* Makes the primitive of convolution (kind, g) now (kept for the run), and raises need[i] to the
 * bytes each scratch buffer must hold for it: for the primitives' scratchpad, the bytes that the runs of
 * every convolution planned since cpu_dnnl_plan_start touch (a Winograd filter gradient books a copy per
 * thread and touches a share of each). Returns 0 where oneDNN has none (the caller's own convolution
 * runs it). */
void cpu_dnnl_plan_start(cpu_dnnl *d);
int cpu_dnnl_plan(cpu_dnnl *d, int kind, const dt_conv_geom *g, size_t need[CPU_DNNL_BUFFERS]);

/* The backend calls this before any op but a convolution, and any copy into its memory: the
 * blocked copies of inputs that cpu_dnnl_conv keeps for the next convolution go stale. */
void cpu_dnnl_forget(cpu_dnnl *d);
/* Input reorders skipped so far because the blocked copy was still held (0 for NULL). */
int64_t cpu_dnnl_reorders_saved(const cpu_dnnl *d);

/* Convolutions run through oneDNN so far, and those of them by Winograd (0 for NULL). */
int64_t cpu_dnnl_runs(const cpu_dnnl *d);
int64_t cpu_dnnl_winograd_runs(const cpu_dnnl *d);
