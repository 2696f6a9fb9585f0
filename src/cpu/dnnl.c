/* dnnl.c: the CPU backend's convolutions through oneDNN (Debian's libdnnl, the library PyTorch's
 * CPU convolutions use). Each (kind, geometry) gets, on first use, a convolution primitive in the
 * layouts oneDNN prefers (channel-blocked, nChw16c on AVX-512) and reorders from our NCHW / OIHW
 * buffers into them and back. The blocked copies live in three scratch buffers shared by every
 * primitive (ops run one at a time), grown to the largest need: one for the activations (x, dx),
 * one for the weights (w, dw), one for the outputs (y, dy); a fourth holds the primitives'
 * scratchpads (user mode: ours, so that the memory estimate can ask for their size, and not
 * allocated by oneDNN at every call). A copy of an input that a convolution left in its buffer
 * serves the next convolution that reads the same buffer in the same layout, when no other op ran
 * between (the backend calls cpu_dnnl_forget before every other op and every
 * copy): a layer's backward-data then reuses the dy its backward-filter reordered. Calls on one
 * geometry always run the same primitive with the same threads, so results repeat bit for bit.
 * With winograd, 3x3 stride-1 convolutions with channels in blocks of 16 try oneDNN's Winograd
 * F(4x4, 3x3) first (its AVX-512 kernels, forward and both backwards: 4x fewer multiplies, somewhat
 * larger rounding errors) and fall back to direct where oneDNN has none for the geometry or CPU. */
#include "dnnl.h"

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

#define DNNL_CHECK(call)                                                                               \
  do {                                                                                                 \
    dnnl_status_t s_ = (call);                                                                         \
    if (s_ != dnnl_success) dt_abort(__FILE__, __LINE__, dnnl_status2str(s_)); /* a library failure */ \
  } while (0)

/* One operand of a convolution: our buffer (user, NCHW/OIHW) and the primitive's layout (inner). */
typedef struct {
  dnnl_memory_desc_t user_md, inner_md;
  dnnl_primitive_t reorder; /* user -> inner (inputs) or inner -> user (the output); NULL: same layout */
  dnnl_memory_t user, inner;
  int slot; /* scratch buffer holding inner when reordered: SLOT_X, SLOT_W or SLOT_Y */
} operand;

enum { SLOT_X, SLOT_W, SLOT_Y, SLOT_PAD, SLOTS };

/* What a scratch buffer holds: a reordered copy of `user` in layout md, while valid. */
typedef struct {
  const void *user;
  dnnl_memory_desc_t md;
  int valid;
} held_copy;

typedef struct {
  int kind;
  dt_conv_geom g;
  int supported, winograd;
  dnnl_primitive_t conv;
  operand op[3];     /* a, b, out as cpu_dnnl_conv names them */
  int arg[3];        /* DNNL_ARG_* of each */
  dnnl_memory_t pad; /* the primitive's scratchpad, in SLOT_PAD; NULL: it needs none */
  size_t pad_bytes;
  size_t pad_copy; /* 0: the run touches all pad_bytes; else the bytes of one of the (pad_threads + 1) copies
                      of a Winograd filter gradient it touches a share of each (wino_filter_copy) */
  int pad_threads;
} conv_entry;

enum { MAX_ENTRIES = 256 };

/* The scratchpad buffer is 2 MiB aligned, so that oneDNN's 2 MiB aligned parts of it start where it
 * books them. */
enum { PAD_ALIGN = 2 << 20 };

struct cpu_dnnl {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  conv_entry *entries[MAX_ENTRIES];
  int n_entries;
  int winograd; /* try Winograd for 3x3 stride 1 */
  void *scratch[SLOTS];
  size_t scratch_bytes[SLOTS];
  held_copy held[SLOTS];  /* per scratch buffer (never valid for SLOT_PAD) */
  int64_t reorders_saved; /* input reorders skipped for a held copy */
  float *dw;              /* the filter gradient in OIHW before it is added into the caller's */
  size_t dw_bytes;
  int64_t runs, winograd_runs; /* convolutions done here, and those by Winograd */
  /* the scratchpad's pages (granule bytes each: 2 MiB where transparent huge pages are always on) that
   * the convolutions planned since cpu_dnnl_plan_start touch: a flag per page, and their count */
  size_t granule, n_granules, n_touched;
  uint8_t *touched;
};

/* The bytes the kernel makes resident at a time in a large buffer: a huge page where transparent huge
 * pages are "always" on (not "madvise", Debian's default), else a page. */
static size_t resident_granule(void) {
  char mode[128] = "";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (f) {
    if (!fgets(mode, sizeof mode, f)) mode[0] = 0;
    fclose(f);
  }
  if (strstr(mode, "[always]")) return (size_t)2 << 20;
  long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? (size_t)page : 4096;
}

cpu_dnnl *cpu_dnnl_create(int winograd) {
  cpu_dnnl *d = dt_calloc(1, sizeof *d);
  d->winograd = winograd;
  d->granule = resident_granule();
  if (dnnl_engine_create(&d->engine, dnnl_cpu, 0) != dnnl_success) {
    free(d);
    return NULL;
  }
  DNNL_CHECK(dnnl_stream_create(&d->stream, d->engine, dnnl_stream_default_flags));
  return d;
}

static void operand_free(operand *o) {
  if (o->reorder) dnnl_primitive_destroy(o->reorder);
  if (o->user) dnnl_memory_destroy(o->user);
  if (o->inner) dnnl_memory_destroy(o->inner);
}

void cpu_dnnl_destroy(cpu_dnnl *d) {
  if (!d) return;
  for (int i = 0; i < d->n_entries; i++) {
    conv_entry *e = d->entries[i];
    if (e->conv) dnnl_primitive_destroy(e->conv);
    if (e->pad) dnnl_memory_destroy(e->pad);
    for (int k = 0; k < 3; k++) operand_free(&e->op[k]);
    free(e);
  }
  for (int k = 0; k < SLOTS; k++) free(d->scratch[k]);
  free(d->dw);
  free(d->touched);
  dnnl_stream_destroy(d->stream);
  dnnl_engine_destroy(d->engine);
  free(d);
}

static void md_plain(dnnl_memory_desc_t *md, int64_t n0, int64_t n1, int64_t n2, int64_t n3, dnnl_format_tag_t tag) {
  dnnl_dims_t dims = {n0, n1, n2, n3};
  DNNL_CHECK(dnnl_memory_desc_init_by_tag(md, 4, dims, dnnl_f32, tag));
}

/* The operand's memories and, when the layouts differ, its reorder. */
static void operand_init(cpu_dnnl *d, operand *o, const dnnl_memory_desc_t *inner, int is_output, int slot) {
  o->inner_md = *inner;
  o->slot = slot;
  DNNL_CHECK(dnnl_memory_create(&o->user, &o->user_md, d->engine, DNNL_MEMORY_NONE));
  if (dnnl_memory_desc_equal(&o->user_md, inner)) return;
  DNNL_CHECK(dnnl_memory_create(&o->inner, inner, d->engine, DNNL_MEMORY_NONE));
  dnnl_primitive_desc_t rpd;
  if (is_output)
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&rpd, inner, d->engine, &o->user_md, d->engine, NULL));
  else
    DNNL_CHECK(dnnl_reorder_primitive_desc_create(&rpd, &o->user_md, d->engine, inner, d->engine, NULL));
  DNNL_CHECK(dnnl_primitive_create(&o->reorder, rpd));
  DNNL_CHECK(dnnl_primitive_desc_destroy(rpd));
}

/* The primitive descriptor of the entry's convolution by `alg`, or NULL when oneDNN has none;
 * attr: its scratchpad is the caller's (user mode). */
static dnnl_primitive_desc_t entry_pd(cpu_dnnl *d, conv_entry *e, dnnl_alg_kind_t alg,
                                      const_dnnl_primitive_attr_t attr) {
  const dt_conv_geom *g = &e->g;
  dnnl_dims_t strides = {g->stride, g->stride}, pad_l = {g->pad, g->pad}, pad_r = {g->pad, g->pad};
  dnnl_memory_desc_t x_any, w_any, y_any;
  md_plain(&x_any, g->b, g->c, g->h, g->w, dnnl_format_tag_any);
  md_plain(&w_any, g->o, g->c, g->k, g->k, dnnl_format_tag_any);
  md_plain(&y_any, g->b, g->o, g->ho, g->wo, dnnl_format_tag_any);
  dnnl_convolution_desc_t fwd_desc, desc;
  if (dnnl_convolution_forward_desc_init(&fwd_desc, dnnl_forward_training, alg, &x_any, &w_any, NULL, &y_any, strides,
                                         pad_l, pad_r) != dnnl_success)
    return NULL;
  dnnl_primitive_desc_t fwd_pd = NULL, pd = NULL;
  if (dnnl_primitive_desc_create(&fwd_pd, &fwd_desc, attr, d->engine, NULL) != dnnl_success) return NULL;
  if (e->kind == CPU_DNNL_FWD) return fwd_pd;
  dnnl_status_t s;
  if (e->kind == CPU_DNNL_BWD_DATA)
    s = dnnl_convolution_backward_data_desc_init(&desc, alg, &x_any, &w_any, &y_any, strides, pad_l, pad_r);
  else
    s = dnnl_convolution_backward_weights_desc_init(&desc, alg, &x_any, &w_any, NULL, &y_any, strides, pad_l, pad_r);
  if (s == dnnl_success) s = dnnl_primitive_desc_create(&pd, &desc, attr, d->engine, fwd_pd);
  DNNL_CHECK(dnnl_primitive_desc_destroy(fwd_pd));
  return s == dnnl_success ? pd : NULL;
}

/* Bytes of one copy of the filter gradient when the entry is oneDNN 2.6's Winograd backward-filter
 * schedule that keeps one per thread (S_D_Giot_W), else 0. Its scratchpad is (threads + 1) copies U
 * of the transformed filter gradient (36 ic oc floats), the transformed x V (36 ic tiles) and dy M (36
 * oc tiles), the bias partials (threads oc), each booked with 2 MiB to align it. Copy 0 is the sum
 * and wholly written; thread t writes its share of the filter gradient's blocks in copy t + 1 only,
 * so that (threads - 1) copies' worth is never touched. The layout is known only by its size: a
 * scratchpad of any other size (another schedule or oneDNN) counts whole. */
static size_t wino_filter_copy(const conv_entry *e) {
  const dt_conv_geom *g = &e->g;
  if (!e->winograd || e->kind != CPU_DNNL_BWD_FILTER || e->pad_threads < 2) return 0;
  const size_t threads = (size_t)e->pad_threads, ic = (size_t)g->c, oc = (size_t)g->o;
  const size_t tiles = (size_t)g->b * (size_t)((g->ho + 3) / 4) * (size_t)((g->wo + 3) / 4); /* 4x4 outputs */
  const size_t u = 36 * ic * oc * sizeof(float);
  const size_t booked = (threads + 1) * u + 36 * (ic + oc) * tiles * sizeof(float) + threads * oc * sizeof(float);
  return booked + 4 * ((size_t)2 << 20) == e->pad_bytes ? u : 0;
}

/* Builds the entry's primitive; supported = 0 when oneDNN has none for it. */
static void entry_build(cpu_dnnl *d, conv_entry *e) {
  const dt_conv_geom *g = &e->g;
  /* oneDNN sizes the output as ours, (h + pad_l + pad_r - k) / stride + 1 rounded down */
  if ((g->h + 2 * g->pad - g->k) / g->stride + 1 != g->ho || (g->w + 2 * g->pad - g->k) / g->stride + 1 != g->wo)
    return;
  dnnl_memory_desc_t x_user, w_user, y_user;
  md_plain(&x_user, g->b, g->c, g->h, g->w, dnnl_nchw);
  md_plain(&w_user, g->o, g->c, g->k, g->k, dnnl_oihw);
  md_plain(&y_user, g->b, g->o, g->ho, g->wo, dnnl_nchw);
  dnnl_primitive_desc_t pd = NULL;
  dnnl_primitive_attr_t attr;
  DNNL_CHECK(dnnl_primitive_attr_create(&attr));
  DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user));
  /* channels in whole blocks of 16 and at least one sample: oneDNN 2.6 accepts narrower channels and
   * an empty batch, and then divides by zero creating the primitive */
  if (d->winograd && g->k == 3 && g->stride == 1 && g->c % 16 == 0 && g->o % 16 == 0 && g->b > 0)
    pd = entry_pd(d, e, dnnl_convolution_winograd, attr);
  e->winograd = pd != NULL;
  if (!pd) pd = entry_pd(d, e, dnnl_convolution_direct, attr);
  DNNL_CHECK(dnnl_primitive_attr_destroy(attr));
  if (!pd) return;
  /* a, b, out in our order, with the query that gives each one's layout */
  static const struct {
    int arg[3];
    dnnl_query_t q[3];
  } roles[3] = {
      [CPU_DNNL_FWD] = {{DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST},
                        {dnnl_query_src_md, dnnl_query_weights_md, dnnl_query_dst_md}},
      [CPU_DNNL_BWD_DATA] = {{DNNL_ARG_DIFF_DST, DNNL_ARG_WEIGHTS, DNNL_ARG_DIFF_SRC},
                             {dnnl_query_diff_dst_md, dnnl_query_weights_md, dnnl_query_diff_src_md}},
      [CPU_DNNL_BWD_FILTER] = {{DNNL_ARG_SRC, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_WEIGHTS},
                               {dnnl_query_src_md, dnnl_query_diff_dst_md, dnnl_query_diff_weights_md}},
  };
  const dnnl_memory_desc_t *users[3][3] = {
      [CPU_DNNL_FWD] = {&x_user, &w_user, &y_user},
      [CPU_DNNL_BWD_DATA] = {&y_user, &w_user, &x_user},
      [CPU_DNNL_BWD_FILTER] = {&x_user, &y_user, &w_user},
  };
  static const int slots[3][3] = {
      [CPU_DNNL_FWD] = {SLOT_X, SLOT_W, SLOT_Y},
      [CPU_DNNL_BWD_DATA] = {SLOT_Y, SLOT_W, SLOT_X},
      [CPU_DNNL_BWD_FILTER] = {SLOT_X, SLOT_Y, SLOT_W},
  };
  for (int k = 0; k < 3; k++) {
    e->arg[k] = roles[e->kind].arg[k];
    e->op[k].user_md = *users[e->kind][k];
    operand_init(d, &e->op[k], dnnl_primitive_desc_query_md(pd, roles[e->kind].q[k], 0), k == 2, slots[e->kind][k]);
  }
  const dnnl_memory_desc_t *pad_md = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
  e->pad_bytes = pad_md ? dnnl_memory_desc_get_size(pad_md) : 0;
  if (e->pad_bytes) DNNL_CHECK(dnnl_memory_create(&e->pad, pad_md, d->engine, DNNL_MEMORY_NONE));
  e->pad_threads = omp_get_max_threads(); /* oneDNN's threads, as it sized the scratchpad */
  e->pad_copy = wino_filter_copy(e);
  /* refused for a batch beyond its kernels' indexing (the memory estimate plans any batch it is
   * given, before saying it does not fit): im2col would run it */
  if (dnnl_primitive_create(&e->conv, pd) != dnnl_success) e->conv = NULL;
  DNNL_CHECK(dnnl_primitive_desc_destroy(pd));
  e->supported = e->conv != NULL;
}

static conv_entry *entry_find(cpu_dnnl *d, int kind, const dt_conv_geom *g) {
  for (int i = 0; i < d->n_entries; i++)
    if (d->entries[i]->kind == kind && !memcmp(&d->entries[i]->g, g, sizeof *g)) return d->entries[i];
  if (d->n_entries == MAX_ENTRIES) return NULL; /* more shapes than any model here: im2col for the rest */
  conv_entry *e = dt_calloc(1, sizeof *e);
  e->kind = kind;
  e->g = *g;
  entry_build(d, e);
  d->entries[d->n_entries++] = e;
  return e;
}

int64_t cpu_dnnl_runs(const cpu_dnnl *d) {
  return d ? d->runs : 0;
}

int64_t cpu_dnnl_winograd_runs(const cpu_dnnl *d) {
  return d ? d->winograd_runs : 0;
}

void cpu_dnnl_forget(cpu_dnnl *d) {
  if (!d) return;
  for (int k = 0; k < SLOTS; k++) d->held[k].valid = 0;
}

int64_t cpu_dnnl_reorders_saved(const cpu_dnnl *d) {
  return d ? d->reorders_saved : 0;
}

/* Every held copy of `user` goes stale: the convolution writes it. */
static void forget_user(cpu_dnnl *d, const void *user) {
  for (int k = 0; k < 3; k++)
    if (d->held[k].user == user) d->held[k].valid = 0;
}

static void *scratch(cpu_dnnl *d, int slot, size_t bytes) {
  if (d->scratch_bytes[slot] < bytes) {
    d->held[slot].valid = 0;
    free(d->scratch[slot]);
    if (posix_memalign(&d->scratch[slot], slot == SLOT_PAD ? PAD_ALIGN : 64, bytes))
      dt_die("out of host memory allocating %zu bytes for a convolution's blocked copy", bytes);
    d->scratch_bytes[slot] = bytes;
  }
  return d->scratch[slot];
}

static void run(cpu_dnnl *d, dnnl_primitive_t p, int n, const dnnl_exec_arg_t *args) {
  DNNL_CHECK(dnnl_primitive_execute(p, d->stream, n, args));
}

int cpu_dnnl_conv(cpu_dnnl *d, int kind, const dt_conv_geom *g, const float *a, const float *b, float *out) {
  conv_entry *e = entry_find(d, kind, g);
  if (!e || !e->supported) {
    cpu_dnnl_forget(d); /* the caller's own convolution writes out, which a held copy may be of */
    return 0;
  }
  size_t nw = (size_t)(g->o * g->c * g->k * g->k);
  if (kind == CPU_DNNL_BWD_FILTER && d->dw_bytes < nw * sizeof(float)) {
    free(d->dw);
    d->dw = dt_malloc(nw * sizeof(float));
    d->dw_bytes = nw * sizeof(float);
  }
  void *user_ptr[3] = {(void *)a, (void *)b, kind == CPU_DNNL_BWD_FILTER ? (void *)d->dw : (void *)out};
  dnnl_exec_arg_t args[4];
  for (int k = 0; k < 3; k++) {
    operand *o = &e->op[k];
    DNNL_CHECK(dnnl_memory_set_data_handle(o->user, user_ptr[k]));
    dnnl_memory_t m = o->user;
    if (o->reorder) {
      DNNL_CHECK(dnnl_memory_set_data_handle(o->inner, scratch(d, o->slot, dnnl_memory_desc_get_size(&o->inner_md))));
      m = o->inner;
      held_copy *h = &d->held[o->slot];
      if (k < 2 && h->valid && h->user == user_ptr[k] && dnnl_memory_desc_equal(&h->md, &o->inner_md)) {
        d->reorders_saved++;
      } else if (k < 2) {
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, o->user}, {DNNL_ARG_TO, o->inner}};
        run(d, o->reorder, 2, r);
        *h = (held_copy){.user = user_ptr[k], .md = o->inner_md, .valid = 1};
      } else {
        h->valid = 0; /* the output's blocked copy */
      }
    }
    args[k] = (dnnl_exec_arg_t){e->arg[k], m};
  }
  if (e->pad) {
    DNNL_CHECK(dnnl_memory_set_data_handle(e->pad, scratch(d, SLOT_PAD, e->pad_bytes)));
    args[3] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, e->pad};
  }
  forget_user(d, out);
  run(d, e->conv, e->pad ? 4 : 3, args);
  operand *o = &e->op[2];
  if (o->reorder) {
    dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, o->inner}, {DNNL_ARG_TO, o->user}};
    run(d, o->reorder, 2, r);
  }
  DNNL_CHECK(dnnl_stream_wait(d->stream));
  d->runs++;
  d->winograd_runs += e->winograd;
  if (kind == CPU_DNNL_BWD_FILTER) {
    const float *dw = d->dw;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < nw; i++) out[i] += dw[i];
  }
  return 1;
}

void cpu_dnnl_plan_start(cpu_dnnl *d) {
  if (!d) return;
  if (d->touched) memset(d->touched, 0, d->n_granules); /* NULL until the first plan touches a page */
  d->n_touched = 0;
}

/* Marks the pages of bytes [from, to) of the scratchpad as touched. */
static void touch(cpu_dnnl *d, size_t from, size_t to) {
  const size_t end = (to + d->granule - 1) / d->granule;
  if (end > d->n_granules) {
    d->touched = realloc(d->touched, end);
    if (!d->touched) dt_die("out of host memory planning the convolutions' scratchpad");
    memset(d->touched + d->n_granules, 0, end - d->n_granules);
    d->n_granules = end;
  }
  for (size_t i = from / d->granule; i < end; i++) {
    d->n_touched += !d->touched[i];
    d->touched[i] = 1;
  }
}

/* The bytes of the scratchpad (at the start of the buffer) that a run of the entry touches. Thread t of
 * a per-thread-copy schedule (wino_filter_copy) writes the blocks of its work items in copy t + 1:
 * oneDNN splits the items as balance211 does, starting a thread at most threads / 4 items after an even
 * share, and an item is at most one block, 1/36 of a copy (36 = the 6x6 transformed positions). */
static void pad_touch(cpu_dnnl *d, const conv_entry *e) {
  if (!e->pad_copy) {
    if (e->pad_bytes) touch(d, 0, e->pad_bytes);
    return;
  }
  const size_t u = e->pad_copy, threads = (size_t)e->pad_threads, block = u / 36 + 1;
  touch(d, 0, u); /* copy 0: the sum */
  for (size_t t = 0; t < threads; t++) {
    const size_t copy = (t + 1) * u, lo = t * u / threads, hi = (t + 1) * u / threads + ((threads + 3) / 4 + 1) * block;
    touch(d, copy + (lo > block ? lo - block : 0), copy + (hi < u ? hi : u));
  }
  touch(d, (threads + 1) * u, e->pad_bytes); /* V, M, the bias partials and their alignment */
}

int cpu_dnnl_plan(cpu_dnnl *d, int kind, const dt_conv_geom *g, size_t need[CPU_DNNL_BUFFERS]) {
  conv_entry *e = entry_find(d, kind, g);
  if (!e || !e->supported) return 0;
  for (int k = 0; k < 3; k++)
    if (e->op[k].reorder) {
      size_t b = dnnl_memory_desc_get_size(&e->op[k].inner_md);
      if (b > need[e->op[k].slot]) need[e->op[k].slot] = b;
    }
  pad_touch(d, e);
  if (d->n_touched * d->granule > need[SLOT_PAD]) need[SLOT_PAD] = d->n_touched * d->granule;
  size_t dw = (size_t)(g->o * g->c * g->k * g->k) * sizeof(float);
  if (kind == CPU_DNNL_BWD_FILTER && dw > need[SLOTS]) need[SLOTS] = dw; /* d->dw, the last buffer */
  return 1;
}
