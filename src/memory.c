/* memory.c: the run's parts of the memory estimate, and the measured peak (memory.h). */
#include "memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h"
#include "optim.h"

/* batch_alloc's buffers for cap rows (batch.c). */
static size_t device_batch_bytes(const dt_model *m, int64_t cap) {
  const int64_t targets = m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1;
  return (size_t)(cap * shape_size(m->input)) * sizeof(float) + (size_t)(cap * m->n_labels) * sizeof(int32_t) +
         (size_t)(cap * targets) * sizeof(float) + sizeof(uint64_t) + (size_t)cap * sizeof(int32_t);
}

/* A host batch of cap rows, as the loader's slots (data_hdf5.c) and evaluation's copy (infer.c)
 * hold it: x as float, labels, row numbers or indices, targets. */
static size_t host_batch_bytes(const dt_model *m, int64_t cap) {
  const int64_t targets = m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1;
  return (size_t)(cap * shape_size(m->input)) * sizeof(float) + (size_t)(cap * m->n_labels + 1) * sizeof(int32_t) +
         (size_t)(cap + 1) * sizeof(int64_t) + (size_t)(cap * targets) * sizeof(float);
}

/* The most ops scratch_ops lists for one layer: an attention layer's two dense products, each a
 * forward, a weight gradient and an input gradient. */
enum { SCRATCH_OPS_PER_LAYER = 6 };

/* The ops with scratch of their own that a pass of `batch` rows runs: each convolution's forward,
 * and in training (backward) its filter gradient and, but for the first layer's (no dx), its data
 * gradient; each dense product's GEMMs, as dense_forward and dense_backward run them; each
 * batchnorm's statistics (their backward's are the same size) and each layernorm's backward; the
 * loss; the sums of squares. Appends to ops (capacity: SCRATCH_OPS_PER_LAYER per layer + 2). */
static int scratch_ops(const dt_model *m, int64_t batch, int backward, dt_op *ops, int n) {
  for (int i = 0; i < m->n_all; i++) {
    const dt_layer *l = m->all[i];
    const int first = l == m->top.layers[0];
    dt_conv_geom g;
    int64_t dense[2][8];
    const int n_dense = layer_dense_products(l, batch, dense);
    for (int d = 0; d < n_dense; d++) {
      const int64_t rows = dense[d][0], in = dense[d][1], out = dense[d][2];
      /* the 16-bit C and A of the gradients (y16), the 16-bit A and B of the gradients and C of dx (x16), the
       * weight's copy (w16): no copies of them; under y16 a bias's bfloat16 copy */
      const int y16 = (int)dense[d][4], x16 = (int)dense[d][6], w16 = (int)dense[d][7];
      static const float bias_marker; /* these ops are shapes only: never read */
      static float sums_marker;       /* so too */
      ops[n] = dense_gemm(DENSE_FWD, rows, in, out);
      if (dense[d][5]) /* a bias; either way an epilogue: the CUDA backend's cuBLASLt workspace */
        ops[n].p.gemm.bias = &bias_marker;
      else if (dense[d][3])
        ops[n].p.gemm.epilogue = DT_GEMM_GELU_TANH;
      ops[n].p.gemm.a16 = x16, ops[n].p.gemm.b16 = w16, ops[n++].p.gemm.c16 = y16;
      if (backward) { /* with a bias, its gradient summed as dy is copied: partial sums */
        ops[n] = dense_gemm(DENSE_DW, rows, in, out), ops[n].p.gemm.a16 = y16, ops[n].p.gemm.b16 = x16;
        if (dense[d][5]) ops[n].p.gemm.a_col_sums = &sums_marker;
        n++;
      }
      if (backward && !first)
        ops[n] = dense_gemm(DENSE_DX, rows, in, out), ops[n].p.gemm.a16 = y16, ops[n].p.gemm.b16 = w16,
        ops[n++].p.gemm.c16 = x16;
    }
    if (layer_conv_geom(l, batch, &g)) {
      ops[n++] = (dt_op){.type = DT_OP_CONV_FWD, .p.conv_fwd = {.g = g, .w16 = l->w16}};
      if (backward) ops[n++] = (dt_op){.type = DT_OP_CONV_BWD_FILTER, .p.conv_bwd_filter = {.g = g, .dw16 = l->w16}};
      if (backward && !first)
        ops[n++] = (dt_op){.type = DT_OP_CONV_BWD_DATA, .p.conv_bwd_data = {.g = g, .w16 = l->w16}};
    } else if (backward && l->ops == &dt_layer_batchnorm) {
      ops[n++] = (dt_op){.type = DT_OP_BN_STATS, .p.bn_stats = {.b = batch, .c = l->in.c, .s = l->in.h * l->in.w}};
    } else if (backward && l->ops == &dt_layer_layernorm) {
      ops[n++] = (dt_op){.type = DT_OP_LN_BWD, .p.ln_bwd = {.n = shape_rows(l->in, batch), .d = l->in.c}};
    }
  }
  ops[n++] = (dt_op){.type = DT_OP_LOSS, .p.loss = {.b = batch * m->n_labels, .k = m->n_classes}};
  ops[n++] = (dt_op){.type = DT_OP_SUMSQ};
  return n;
}

void memory_run_parts(const dt_config_values *v, const dt_model *m, const dt_data *d, dt_backend *be, int world,
                      int64_t rows, int64_t held, dt_run_memory *out) {
  memset(out, 0, sizeof *out);
  const int val = v->val_x[0] != 0, host = be->host_memory;
  /* the step's sums: stats, clipping's, fp16's scaler, ignore_index's weight */
  const size_t sums = 6 * sizeof(double) + 2 * sizeof(double) + 2 * sizeof(float) + sizeof(double);
  out->batches = (size_t)(2 + val) * device_batch_bytes(m, held) + sums;
  if (host) out->batches += 2 * host_batch_bytes(m, rows) + (val ? host_batch_bytes(m, held) : 0);
  if (host && d) out->data = data_held_bytes(d, v->cache, m->tokens != 0); /* d NULL: not open yet */
  if (host && world > 1) /* dist.zero 1: a reduce needs a temporary at its root only, for this rank's share */
    out->mpi = (size_t)(v->zero ? (m->n_params + world - 1) / world : m->n_params) * sizeof(float);
  if (host && v->ckpt_dir[0]) { /* while it writes: its copy, the file built in memory, a tensor's chunk */
    const size_t pb = (size_t)m->n_params * sizeof(float), bb = (size_t)m->n_bufs * sizeof(float);
    const int states = dt_optim_kinds[v->optim]->n_states(v);
    const size_t copy = pb + bb + (size_t)states * pb + (v->ema_decay > 0 ? pb + bb : 0);
    int64_t largest = 0;
    for (int i = 0; i < m->n_tensors; i++)
      if (m->tensors[i].count > largest) largest = m->tensors[i].count;
    out->checkpoint = copy + (copy + ((size_t)1 << 20)) + (size_t)largest * sizeof(float);
  }
  if (be->scratch) {
    const int per_model = SCRATCH_OPS_PER_LAYER * m->n_all + 2;
    const int teacher_ops = m->teacher ? SCRATCH_OPS_PER_LAYER * m->teacher->n_all + 2 : 0;
    dt_op *ops = dt_malloc((size_t)(2 * per_model + teacher_ops) * sizeof *ops);
    int n = scratch_ops(m, rows, 1, ops, 0);
    if (val) n = scratch_ops(m, held, 0, ops, n);                 /* evaluation's chunks: forward only */
    if (m->teacher) n = scratch_ops(m->teacher, rows, 0, ops, n); /* distillation's teacher: forward only */
    out->workspace = be->scratch(be, ops, n);
    free(ops);
  }
}

/* VmRSS and VmHWM of this process in bytes; 0 when /proc/self/status cannot be read. */
static int read_status(size_t *rss, size_t *hwm) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kib;
  int found = 0;
  while (fgets(line, sizeof line, f)) {
    if (sscanf(line, "VmRSS: %llu kB", &kib) == 1) *rss = (size_t)kib << 10, found |= 1;
    if (sscanf(line, "VmHWM: %llu kB", &kib) == 1) *hwm = (size_t)kib << 10, found |= 2;
  }
  fclose(f);
  return found == 3;
}

void memory_watch_start(dt_memory_watch *w) {
  memset(w, 0, sizeof *w);
  size_t rss = 0, hwm = 0;
  /* "5" resets the peak resident set to the current one (Linux 4.0 and later; proc(5)) */
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (f) {
    w->reset = fputs("5", f) >= 0;
    w->reset = fclose(f) == 0 && w->reset;
  }
  w->ok = read_status(&rss, &hwm);
  w->rss_base = rss;
}

size_t memory_watch_peak(const dt_memory_watch *w, const dt_backend *be) {
  if (!be->host_memory) return be->mem_peak;
  size_t rss = 0, hwm = 0;
  if (!w->ok || !read_status(&rss, &hwm)) return 0;
  return hwm > w->rss_base ? hwm - w->rss_base : 0;
}

const char *memory_watch_kind(const dt_backend *be) {
  return be->host_memory ? "host RSS" : "device";
}
