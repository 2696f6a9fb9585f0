/* backend.c: the CPU backend, the reference the CUDA one is checked against: the dt_backend of
 * backend.h (host memory, synchronous copies, threads), the op names and the op table that
 * dispatches each op to its family's function (cpu.h). Owns the cpu_impl and the oneDNN state
 * (dnnl.c); the ops' loops are in the family files. Matrix products and convolutions go through
 * OpenBLAS and oneDNN; loops are parallel with OpenMP (OpenBLAS's OpenMP build shares the pool). */
#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* The op names, DT_OPS's second column: backend.h declares them, the reference backend holds them. */
const char *const dt_op_names[DT_OP_COUNT] = {
#define OP_NAME_(NAME, name) #name,
    DT_OPS(OP_NAME_)
#undef OP_NAME_
};

/* cpu_<name> for each X(NAME, name) of DT_OPS */
typedef void (*cpu_op_fn)(cpu_impl *im, const dt_op *op);
static const cpu_op_fn cpu_ops[DT_OP_COUNT] = {
#define CPU_OP_(NAME, name) [DT_OP_##NAME] = cpu_##name,
    DT_OPS(CPU_OP_)
#undef CPU_OP_
};

static void cpu_run(dt_backend *be, const dt_op *op) {
  DT_ASSERT(op->type >= 0 && op->type < DT_OP_COUNT);
  cpu_impl *im = be->impl;
  /* a convolution may reuse the blocked copy of an input that the one before it made */
  if (op->type != DT_OP_CONV_FWD && op->type != DT_OP_CONV_BWD_DATA && op->type != DT_OP_CONV_BWD_FILTER)
    cpu_dnnl_forget(im->dnnl);
  cpu_ops[op->type](im, op);
}

/* 64-byte aligned and zeroed. calloc takes large blocks straight from the kernel, whose pages are
 * already zero and are only touched on first use: no start-up pass over every activation buffer.
 * The block's own address sits just below the aligned one, for cpu_free. */
static float *cpu_alloc(dt_backend *be, size_t bytes) {
  (void)be;
  char *raw = calloc(1, (bytes ? bytes : 64) + 64);
  if (!raw)
    dt_die(
        "out of host memory allocating %zu bytes (%.1f MiB) for model buffers; lower train.batch_size or "
        "train.global_batch_size, or use more ranks",
        bytes, (double)bytes / 1048576.0);
  char *p = raw + 64 - ((uintptr_t)raw & 63); /* 16 to 64 bytes above raw (malloc aligns to 16) */
  memcpy(p - sizeof raw, &raw, sizeof raw);
  return (float *)p;
}

static void cpu_free(dt_backend *be, void *p) {
  (void)be;
  if (!p) return;
  char *raw;
  memcpy(&raw, (char *)p - sizeof raw, sizeof raw);
  free(raw);
}

static void cpu_copy_bytes(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cpu_dnnl_forget(((cpu_impl *)be->impl)->dnnl);
  if (bytes) memmove(dst, src, bytes);
}

static void cpu_zero(dt_backend *be, void *p, size_t bytes) {
  cpu_dnnl_forget(((cpu_impl *)be->impl)->dnnl);
  memset(p, 0, bytes);
}

static void cpu_sync(dt_backend *be) {
  (void)be;
}

static void cpu_mark(dt_backend *be, int slot) {
  (void)be, (void)slot;
}

static int cpu_reached(dt_backend *be, int slot) {
  (void)be, (void)slot;
  return 1;
}

static void *cpu_alloc_host(dt_backend *be, size_t bytes) {
  return cpu_alloc(be, bytes);
}

static size_t cpu_scratch(dt_backend *be, const dt_op *ops, int n) {
  return cpu_conv_scratch(be->impl, ops, n); /* the only ops with scratch of their own */
}

static void cpu_destroy(dt_backend *be) {
  cpu_impl *im = be->impl;
  for (int t = 0; t < im->threads; t++) {
    free(im->col[t]);
    free(im->dw[t]);
  }
  free(im->col);
  free(im->dw);
  cpu_dnnl_destroy(im->dnnl);
  free(im);
  free(be);
}

int64_t backend_cpu_onednn_runs(const dt_backend *be) {
  return cpu_dnnl_runs(((const cpu_impl *)be->impl)->dnnl);
}

int64_t backend_cpu_winograd_runs(const dt_backend *be) {
  return cpu_dnnl_winograd_runs(((const cpu_impl *)be->impl)->dnnl);
}

int64_t backend_cpu_reorders_saved(const dt_backend *be) {
  return cpu_dnnl_reorders_saved(((const cpu_impl *)be->impl)->dnnl);
}

dt_backend *backend_cpu_create(int threads) {
  return backend_cpu_create_with(threads, DT_CPU_CONV_DIRECT);
}

dt_backend *backend_cpu_create_with(int threads, int conv) {
  dt_backend *be = dt_calloc(1, sizeof *be);
  cpu_impl *im = dt_calloc(1, sizeof *im);
  if (threads < 1) threads = 1;
  im->threads = threads;
  im->col = dt_calloc((size_t)threads, sizeof(float *));
  im->dw = dt_calloc((size_t)threads, sizeof(float *));
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  if (conv != DT_CPU_CONV_IM2COL) im->dnnl = cpu_dnnl_create(conv == DT_CPU_CONV_WINOGRAD);
  *be = (dt_backend){.name = "cpu",
                     .run = cpu_run,
                     .alloc = cpu_alloc,
                     .free = cpu_free,
                     .to_device = cpu_copy_bytes,
                     .to_host = cpu_copy_bytes,
                     .upload = cpu_copy_bytes,
                     .upload_ahead = cpu_copy_bytes,
                     .download = cpu_copy_bytes,
                     .mark = cpu_mark,
                     .reached = cpu_reached,
                     .alloc_host = cpu_alloc_host,
                     .free_host = cpu_free,
                     .zero = cpu_zero,
                     .sync = cpu_sync,
                     .destroy = cpu_destroy,
                     .scratch = cpu_scratch,
                     .threads = threads,
                     .host_memory = 1,
                     .impl = im};
  return be;
}
