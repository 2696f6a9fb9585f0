/* test_gpu: the CUDA backend against the CPU reference. For tiny models covering every layer and
 * loss, the same parameters and inputs go through both backends: logits, loss, parameter
 * gradients, input gradients, batchnorm statistics and an optimizer step must agree to a relative
 * error of 1e-5 (norm-wise; TF32 is off). Skipped when no GPU is visible. */
#include <math.h>

#include "dt_test.h"

#include "config.h"
#include "gpu.h"
#include "layers.h"
#include "model.h"
#include "optim.h"

typedef struct {
  dt_config cfg;
  dt_model m;
  dt_backend *be;
} side;

static void build(side *sd, const char *model_yaml, dt_backend *be, int64_t batch) {
  char text[4096];
  snprintf(text, sizeof text, "model:\n%sdata: {path: x.h5}\ntrain: {batch_size: 4}\noptim: {momentum: 0.9}\n",
           model_yaml);
  char *path = write_tmp(text);
  dt_status st = {0};
  memset(sd, 0, sizeof *sd);
  if (config_load(&sd->cfg, path, NULL, 0, &st) || model_build(&sd->m, &sd->cfg, &st)) fail_msg("%s", st.msg);
  unlink(path);
  free(path);
  sd->be = be;
  model_alloc(&sd->m, be, batch, 3);
}

static double rel_err(const float *a, const float *b, int64_t n) {
  double d = 0, na = 0;
  for (int64_t i = 0; i < n; i++) {
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    na += (double)b[i] * b[i];
  }
  return sqrt(d) / (sqrt(na) > 1e-6 ? sqrt(na) : 1e-6);
}

/* Copies n floats of backend memory to a fresh host array. */
static float *host_copy(dt_backend *be, const float *p, int64_t n) {
  float *h = malloc((size_t)(n + 1) * sizeof(float));
  be->to_host(be, h, p, (size_t)n * sizeof(float));
  return h;
}

static void compare(const char *what, dt_backend *cpu, const float *a, dt_backend *gpu, const float *b, int64_t n,
                    const char *model) {
  float *ha = host_copy(cpu, a, n), *hb = host_copy(gpu, b, n);
  double e = rel_err(hb, ha, n);
  free(ha);
  free(hb);
  if (e > 1e-5) fail_msg("%s: %s differs between CUDA and CPU: relative error %.3g", model, what, e);
}

static void check_model(const char *model_yaml, int64_t batch) {
  side c, g;
  dt_backend *cpu = backend_cpu_create(1), *gpu = backend_cuda_create(0, DT_PREC_FP32);
  build(&c, model_yaml, cpu, batch);
  build(&g, model_yaml, gpu, batch);
  /* the same parameters (with batchnorm affine values moved off 1/0) and inputs on both */
  for (int64_t i = 0; i < c.m.n_params; i++) c.m.params[i] += 0.1f * (dt_hash_uniform(5, (uint64_t)i) - 0.5f);
  gpu->to_device(gpu, g.m.params, c.m.params, (size_t)c.m.n_params * sizeof(float));
  gpu->to_device(gpu, g.m.bufs, c.m.bufs, (size_t)c.m.n_bufs * sizeof(float));
  int64_t nin = batch * shape_size(c.m.input), k = c.m.n_outputs;
  float *raw = malloc((size_t)nin * sizeof(float)), *targets = malloc((size_t)(batch * k) * sizeof(float));
  int32_t *labels = malloc((size_t)batch * sizeof(int32_t));
  for (int64_t i = 0; i < nin; i++) raw[i] = 2.0f * dt_hash_uniform(7, (uint64_t)i) - 1.0f;
  for (int64_t i = 0; i < batch * k; i++) targets[i] = dt_hash_uniform(9, (uint64_t)i);
  for (int64_t b = 0; b < batch; b++) labels[b] = (int32_t)(dt_hash64((uint64_t)b) % (uint64_t)k);
  side *sides[2] = {&c, &g};
  double loss[2];
  float *dx[2];
  for (int i = 0; i < 2; i++) {
    side *sd = sides[i];
    dt_backend *be = sd->be;
    /* inputs in backend memory, as train.c uploads them */
    float *draw = be->alloc(be, (size_t)nin * sizeof(float)), *dtargets = be->alloc(be, (size_t)(batch * k) * 4);
    int32_t *dlabels = (int32_t *)be->alloc(be, (size_t)batch * sizeof(int32_t));
    uint64_t *seed = (uint64_t *)be->alloc(be, sizeof(uint64_t));
    double *sums = (double *)be->alloc(be, 2 * sizeof(double));
    const uint64_t seed_h = 11;
    be->upload(be, draw, raw, (size_t)nin * sizeof(float));
    be->upload(be, dtargets, targets, (size_t)(batch * k) * sizeof(float));
    be->upload(be, dlabels, labels, (size_t)batch * sizeof(int32_t));
    be->upload(be, seed, &seed_h, sizeof seed_h);
    model_input(&sd->m, draw, batch);
    dt_pass p = {.be = be,
                 .batch = batch,
                 .training = 1,
                 .global_targets = (double)batch,
                 .step_seed = seed,
                 .params = sd->m.params,
                 .grads = sd->m.grads,
                 .bufs = sd->m.bufs};
    model_forward(&sd->m, &p);
    model_loss(&sd->m, &p, dlabels, dtargets, sums);
    dx[i] = be->alloc(be, (size_t)nin * sizeof(float));
    seq_backward(&sd->m.top, &p, sd->m.input_x, dx[i]);
    double host[2];
    be->to_host(be, host, sums, sizeof host);
    loss[i] = host[0];
    be->free(be, draw);
    be->free(be, dtargets);
    be->free(be, dlabels);
    be->free(be, seed);
    be->free(be, sums);
  }
  if (fabs(loss[0] - loss[1]) > 1e-5 * fabs(loss[0]))
    fail_msg("%s: loss %.9g (CPU) vs %.9g (CUDA)", model_yaml, loss[0], loss[1]);
  compare("logits", cpu, model_logits(&c.m), gpu, model_logits(&g.m), batch * k, model_yaml);
  compare("parameter gradients", cpu, c.m.grads, gpu, g.m.grads, c.m.n_params, model_yaml);
  compare("input gradient", cpu, dx[0], gpu, dx[1], nin, model_yaml);
  if (c.m.n_bufs) compare("batchnorm running statistics", cpu, c.m.bufs, gpu, g.m.bufs, c.m.n_bufs, model_yaml);
  /* one SGD (momentum, Nesterov) and one AdamW step over the flat buffers, from the same
   * gradients on both (just compared): a gradient that is zero in exact arithmetic (a conv bias
   * before batchnorm) is rounding noise of about 1e-8, of different sign on each backend, and
   * AdamW's first step moves a parameter by about lr * sign(grad) whatever its size */
  gpu->to_device(gpu, g.m.grads, c.m.grads, (size_t)c.m.n_params * sizeof(float));
  for (int opt = 0; opt < 2; opt++) {
    dt_optim o[2];
    dt_config_values v = c.cfg.v;
    v.optim = optim_index(opt ? "adamw" : "sgd");
    v.nesterov = 1;
    v.weight_decay = 0.01;
    for (int i = 0; i < 2; i++) {
      optim_init(&o[i], &v, sides[i]->be, c.m.n_params, 0, c.m.n_params, 10);
      optim_step(&o[i], sides[i]->be, sides[i]->m.params, sides[i]->m.grads, 0.05);
      optim_free(&o[i], sides[i]->be);
    }
    compare(opt ? "parameters after AdamW" : "parameters after SGD", cpu, c.m.params, gpu, g.m.params, c.m.n_params,
            model_yaml);
  }
  cpu->free(cpu, dx[0]);
  gpu->free(gpu, dx[1]);
  free(raw);
  free(targets);
  free(labels);
  model_free(&c.m);
  model_free(&g.m);
  config_free(&c.cfg);
  config_free(&g.cfg);
  cpu->destroy(cpu);
  gpu->destroy(gpu);
}

static int have_gpu(void) {
  char why[256];
  return gpu_count(why, sizeof why) > 0;
}

#define GPU_TEST(name, body)       \
  static void name(void **state) { \
    (void)state;                   \
    if (!have_gpu()) skip();       \
    body;                          \
  }

GPU_TEST(
    cuda_conv_batchnorm_pool_linear,
    check_model("  input: [3, 8, 8]\n  layers: [{conv2d: {out: 8, kernel: 3, pad: 1, bias: false}}, {batchnorm: {}},"
                " relu, {maxpool: {kernel: 2}}, {conv2d: {out: 4, kernel: 3, stride: 2, pad: 1}}, flatten,"
                " {linear: {out: 5}}]\n",
                6))
GPU_TEST(
    cuda_activations_dropout_avgpool,
    check_model("  input: [2, 6, 6]\n  layers: [{avgpool: {kernel: 2}}, flatten, {linear: {out: 16}}, gelu,"
                " {linear: {out: 16}}, tanh, {dropout: {p: 0.3}}, {linear: {out: 8}}, sigmoid, {linear: {out: 3}}]\n"
                "  loss: {cross_entropy: {label_smoothing: 0.1}}\n",
                5))
GPU_TEST(
    cuda_residual_global_pool_mse,
    check_model("  input: [4, 6, 6]\n  layers:\n    - residual:\n        body: [{conv2d: {out: 8, kernel: 3, stride: 2,"
                " pad: 1}}, {batchnorm: {}}, relu]\n        shortcut: [{conv2d: {out: 8, kernel: 1, stride: 2}}]\n"
                "    - relu\n    - global_avgpool\n    - {batchnorm: {}}\n    - {linear: {out: 2}}\n  loss: mse\n",
                7))

/* ---- op by op ------------------------------------------------------------------------------
 * Every op of dt_op_type runs on both backends with the same random inputs; outputs must agree
 * to a relative error of 1e-5 (norm-wise) and host outputs (loss sums, hits, sums of squares,
 * non-finite counts) too. Each op runs on a normal batch, on an uneven one (buffers allocated for
 * 7 rows, the op run on 5: the last, partial batch of an epoch) and on zero rows: elements past
 * the rows the op was given, and parameter gradients that are added into when there are no rows,
 * must keep their initial values on both backends. */

enum { OT_F32, OT_F64, OT_I32 };

/* One buffer on both backends, [0] the CPU and [1] CUDA, with a host copy of its initial contents. */
typedef struct {
  void *p[2];
  void *init;
  int64_t n;
  int type;
} dbuf;

enum { OT_MAX_BUFS = 512 };
static struct {
  dt_backend *be[2];
  dbuf bufs[OT_MAX_BUFS];
  int n_bufs;
  uint64_t seed;
  dt_op_type op;
  char kase[160];
  int precision; /* the CUDA backend's train.precision */
  double tol;    /* ot_check's relative error for floats */
} ot;
static int ot_covered[DT_OP_COUNT];

static size_t ot_size(int type) {
  return type == OT_F64 ? sizeof(double) : type == OT_I32 ? sizeof(int32_t) : sizeof(float);
}

static void ot_end(void) {
  for (int i = 0; i < ot.n_bufs; i++) {
    for (int s = 0; s < 2; s++) ot.be[s]->free(ot.be[s], ot.bufs[i].p[s]);
    free(ot.bufs[i].init);
  }
  for (int s = 0; s < 2; s++)
    if (ot.be[s]) ot.be[s]->destroy(ot.be[s]);
  memset(&ot, 0, sizeof ot);
}

/* The CPU backend against CUDA under train.precision `precision`, compared to a relative `tol`. */
static void ot_begin_precision(int precision, double tol) {
  if (ot.be[0]) ot_end(); /* what a failed test left behind */
  ot.be[0] = backend_cpu_create(1);
  ot.be[1] = backend_cuda_create(0, precision);
  ot.seed = 1000;
  ot.precision = precision;
  ot.tol = tol;
}

static void ot_begin(void) {
  ot_begin_precision(DT_PREC_FP32, 1e-5);
}

/* Names the op and case that the following checks report. */
static void ot_case(dt_op_type op, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void ot_case(dt_op_type op, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ot.kase, sizeof ot.kase, fmt, ap);
  va_end(ap);
  ot.op = op;
  ot_covered[op] = 1;
}

/* A buffer of n elements on both backends holding `host` (copied; NULL: zeros). */
static dbuf ot_buf(int type, const void *host, int64_t n) {
  size_t bytes = (size_t)n * ot_size(type);
  if (ot.n_bufs == OT_MAX_BUFS) fail_msg("op tests: more than %d buffers in one test", OT_MAX_BUFS);
  dbuf b = {.init = calloc(1, bytes + 8), .n = n, .type = type};
  if (host) memcpy(b.init, host, bytes);
  for (int s = 0; s < 2; s++) {
    b.p[s] = ot.be[s]->alloc(ot.be[s], bytes);
    ot.be[s]->to_device(ot.be[s], b.p[s], b.init, bytes);
  }
  ot.bufs[ot.n_bufs++] = b;
  return b;
}

/* n random floats in [lo, hi), a fresh stream per call; the caller frees the array. */
static float *ot_host_rand(int64_t n, float lo, float hi) {
  float *h = calloc((size_t)n + 1, sizeof(float));
  uint64_t seed = ot.seed++;
  for (int64_t i = 0; i < n; i++) h[i] = lo + (hi - lo) * dt_hash_uniform(seed, (uint64_t)i);
  return h;
}

static dbuf ot_rand(int64_t n, float lo, float hi) {
  float *h = ot_host_rand(n, lo, hi);
  dbuf b = ot_buf(OT_F32, h, n);
  free(h);
  return b;
}

static dbuf ot_rand_d(int64_t n, double lo, double hi) {
  double *h = calloc((size_t)n + 1, sizeof(double));
  uint64_t seed = ot.seed++;
  for (int64_t i = 0; i < n; i++) h[i] = lo + (hi - lo) * (double)dt_hash_uniform(seed, (uint64_t)i);
  dbuf b = ot_buf(OT_F64, h, n);
  free(h);
  return b;
}

/* A buffer's contents on one side (0: CPU, 1: CUDA), in a fresh host array. */
static void *ot_fetch(dbuf b, int side) {
  size_t bytes = (size_t)b.n * ot_size(b.type);
  void *h = malloc(bytes + 8);
  ot.be[side]->to_host(ot.be[side], h, b.p[side], bytes);
  return h;
}

static double ot_elem(int type, const void *p, int64_t i) {
  return type == OT_F64 ? ((const double *)p)[i] : type == OT_I32 ? ((const int32_t *)p)[i] : ((const float *)p)[i];
}

/* Compares buffer b of both backends: CPU and CUDA agree (relative error <= ot.tol, 1e-5, norm-wise for
 * floats, exactly for int32), and elements [written, n) still hold their initial values on both. */
static void ot_check(const char *what, dbuf b, int64_t written) {
  size_t es = ot_size(b.type), bytes = (size_t)b.n * es;
  void *h[2];
  for (int s = 0; s < 2; s++) {
    h[s] = malloc(bytes + 8);
    ot.be[s]->to_host(ot.be[s], h[s], b.p[s], bytes);
  }
  const char *op = dt_op_names[ot.op];
  double d = 0, na = 0, worst = -1;
  int64_t at = -1;
  for (int64_t i = 0; i < b.n; i++) {
    double c = ot_elem(b.type, h[0], i), g = ot_elem(b.type, h[1], i), e = fabs(c - g);
    d += (c - g) * (c - g);
    na += c * c;
    if (!(e <= worst)) worst = e, at = i; /* NaN counts as the worst */
  }
  double err = sqrt(d) / (sqrt(na) > 1e-6 ? sqrt(na) : 1e-6);
  double tol = b.type == OT_I32 ? 0.0 : ot.tol;
  char first[200] = "";
  if (at >= 0)
    snprintf(first, sizeof first, "; largest difference at element %lld of %lld: CPU %.9g, CUDA %.9g", (long long)at,
             (long long)b.n, ot_elem(b.type, h[0], at), ot_elem(b.type, h[1], at));
  if (!(err <= tol)) {
    free(h[0]);
    free(h[1]);
    fail_msg("op %s [%s]: %s differs between CUDA and CPU: relative error %.3g%s", op, ot.kase, what, err, first);
  }
  for (int s = 0; s < 2; s++)
    for (int64_t i = written < 0 ? 0 : written; i < b.n; i++)
      if (memcmp((char *)h[s] + i * es, (char *)b.init + i * es, es)) {
        double was = ot_elem(b.type, b.init, i), now = ot_elem(b.type, h[s], i);
        free(h[0]);
        free(h[1]);
        fail_msg("op %s [%s]: %s element %lld changed on %s (%.9g -> %.9g), past the %lld elements the op was given",
                 op, ot.kase, what, (long long)i, s ? "CUDA" : "CPU", was, now, (long long)written);
      }
  free(h[0]);
  free(h[1]);
}

/* The ops of one case run on both backends: BOTH { dt_op op = ...; F(buf) ...; RUN(op); } */
#define BOTH for (int s_ = 0; s_ < 2; s_++)
#define F(b) ((float *)(b).p[s_])
#define D(b) ((double *)(b).p[s_])
#define I(b) ((int32_t *)(b).p[s_])
#define RUN(op) backend_run(ot.be[s_], &(op))

/* The batch cases: buffers for `cap` rows, the op run on `rows`. */
static const struct {
  const char *name;
  int64_t cap, rows;
} ot_rows[] = {{"normal, 6 rows", 6, 6}, {"uneven, 5 of 7 rows", 7, 5}, {"zero rows of 7", 7, 0}};
enum { OT_N_ROWS = sizeof ot_rows / sizeof *ot_rows };

#define FOR_ROWS(r)                               \
  for (int r##_i = 0; r##_i < OT_N_ROWS; r##_i++) \
    for (int64_t cap = ot_rows[r##_i].cap, rows = ot_rows[r##_i].rows, r = 1; r; r = 0)
#define ROWS_NAME(r) ot_rows[r##_i].name

/* GEMM as the linear layer uses it (forward, weight gradient with k = batch, input gradient), as
 * global average pooling uses it, and with alpha, beta and every transpose combination. */
static void ops_gemm(void) {
  const int64_t in = 9, out = 4, C = 3, HW = 5;
  FOR_ROWS(r) {
    dbuf x = ot_rand(cap * in, -1, 1), w = ot_rand(out * in, -1, 1), y = ot_rand(cap * out, -1, 1);
    dbuf dy = ot_rand(cap * out, -1, 1), dw = ot_rand(out * in, -1, 1), dx = ot_rand(cap * in, -1, 1);
    ot_case(DT_OP_GEMM, "linear forward, %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                      .trans_b = 1,
                                      .m = rows,
                                      .n = out,
                                      .k = in,
                                      .alpha = 1.0f,
                                      .beta = 0.0f,
                                      .a = F(x),
                                      .b = F(w),
                                      .c = F(y)};
      RUN(op);
    }
    ot_check("y", y, rows * out);
    ot_case(DT_OP_GEMM, "linear forward with its bias, %s", ROWS_NAME(r));
    dbuf bias = ot_rand(out, -1, 1);
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                      .trans_b = 1,
                                      .m = rows,
                                      .n = out,
                                      .k = in,
                                      .alpha = 1.0f,
                                      .beta = 0.0f,
                                      .a = F(x),
                                      .b = F(w),
                                      .c = F(y),
                                      .bias = F(bias)};
      RUN(op);
    }
    ot_check("y", y, rows * out);
    ot_check("bias", bias, 0);
    ot_case(DT_OP_GEMM, "linear weight gradient (k = batch), %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 1,
                                      .trans_b = 0,
                                      .m = out,
                                      .n = in,
                                      .k = rows,
                                      .alpha = 1.0f,
                                      .beta = 1.0f,
                                      .a = F(dy),
                                      .b = F(x),
                                      .c = F(dw)};
      RUN(op);
    }
    ot_check("dw (added into)", dw, rows ? dw.n : 0);
    ot_case(DT_OP_GEMM, "linear input gradient, %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                      .trans_b = 0,
                                      .m = rows,
                                      .n = in,
                                      .k = out,
                                      .alpha = 1.0f,
                                      .beta = 0.0f,
                                      .a = F(dy),
                                      .b = F(w),
                                      .c = F(dx)};
      RUN(op);
    }
    ot_check("dx", dx, rows * in);
    /* k = batch with beta 0.5: no rows leaves C = beta C */
    ot_case(DT_OP_GEMM, "weight gradient with beta 0.5 (k = batch), %s", ROWS_NAME(r));
    dbuf c2 = ot_rand(out * in, -1, 1);
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 1,
                                      .trans_b = 0,
                                      .m = out,
                                      .n = in,
                                      .k = rows,
                                      .alpha = 0.5f,
                                      .beta = 0.5f,
                                      .a = F(dy),
                                      .b = F(x),
                                      .c = F(c2)};
      RUN(op);
    }
    ot_check("C", c2, c2.n);
    if (!rows) {
      float *h = malloc((size_t)c2.n * sizeof(float));
      ot.be[1]->to_host(ot.be[1], h, c2.p[1], (size_t)c2.n * sizeof(float));
      for (int64_t i = 0; i < c2.n; i++)
        if (h[i] != 0.5f * ((float *)c2.init)[i]) {
          double got = h[i], want = 0.5f * ((float *)c2.init)[i];
          free(h);
          fail_msg("op gemm [%s]: C[%lld] = %.9g on CUDA, expected beta*C = %.9g", ot.kase, (long long)i, got, want);
        }
      free(h);
    }
    /* global average pooling: y(B*C, 1) = x(B*C, HW) ones(HW, 1); dx(B*C, HW) = dy(B*C, 1) ones(1, HW) */
    dbuf px = ot_rand(cap * C * HW, -1, 1), ones = ot_rand(HW, 0.2f, 0.2f), py = ot_rand(cap * C, -1, 1);
    dbuf pdx = ot_rand(cap * C * HW, -1, 1);
    ot_case(DT_OP_GEMM, "global average pool forward and backward (n = 1, k = 1), %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                      .trans_b = 0,
                                      .m = rows * C,
                                      .n = 1,
                                      .k = HW,
                                      .alpha = 1.0f,
                                      .beta = 0.0f,
                                      .a = F(px),
                                      .b = F(ones),
                                      .c = F(py)};
      RUN(op);
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                      .trans_b = 0,
                                      .m = rows * C,
                                      .n = HW,
                                      .k = 1,
                                      .alpha = 1.0f,
                                      .beta = 0.0f,
                                      .a = F(py),
                                      .b = F(ones),
                                      .c = F(pdx)};
      RUN(op);
    }
    ot_check("y", py, rows * C);
    ot_check("dx", pdx, rows * C * HW);
    /* alpha 0.7, beta 0.3, every transpose combination; m = batch */
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++) {
        const int64_t k = 6, n = 5;
        dbuf a = ot_rand(cap * k, -1, 1), b = ot_rand(k * n, -1, 1), c = ot_rand(cap * n, -1, 1);
        ot_case(DT_OP_GEMM, "trans_a %d, trans_b %d, alpha 0.7, beta 0.3, %s", ta, tb, ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_GEMM};
          op.p.gemm = (typeof(op.p.gemm)){.trans_a = ta,
                                          .trans_b = tb,
                                          .m = rows,
                                          .n = n,
                                          .k = k,
                                          .alpha = 0.7f,
                                          .beta = 0.3f,
                                          .a = F(a),
                                          .b = F(b),
                                          .c = F(c)};
          RUN(op);
        }
        ot_check("C", c, rows * n);
      }
  }
}

static void ops_bias(void) {
  const int64_t C = 5;
  const int64_t spatial[] = {1, 6};
  FOR_ROWS(r) {
    for (int si = 0; si < 2; si++) {
      int64_t S = spatial[si];
      dbuf y = ot_rand(cap * C * S, -1, 1), bias = ot_rand(C, -1, 1), dy = ot_rand(cap * C * S, -1, 1);
      dbuf db = ot_rand(C, -1, 1);
      ot_case(DT_OP_BIAS_ADD, "spatial %lld, %s", (long long)S, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_BIAS_ADD};
        op.p.bias_add = (typeof(op.p.bias_add)){.b = rows, .c = C, .s = S, .y = F(y), .bias = F(bias)};
        RUN(op);
      }
      ot_check("y", y, rows * C * S);
      ot_case(DT_OP_BIAS_GRAD, "spatial %lld, %s", (long long)S, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_BIAS_GRAD};
        op.p.bias_grad = (typeof(op.p.bias_grad)){.b = rows, .c = C, .s = S, .dy = F(dy), .db = F(db)};
        RUN(op);
      }
      ot_check("db (added into)", db, rows ? C : 0);
    }
  }
  // a dense layer's (rows, c): several blocks of 8 channels, the last one partial, and every one of the
  // 128 row lanes summing rows four at a time and one at a time
  const int64_t rows = 128 * 9 + 77, wide = 37;
  dbuf dy = ot_rand(rows * wide, -1, 1), db = ot_rand(wide, -1, 1);
  ot_case(DT_OP_BIAS_GRAD, "dense (%lld, %lld)", (long long)rows, (long long)wide);
  BOTH {
    dt_op op = {.type = DT_OP_BIAS_GRAD};
    op.p.bias_grad = (typeof(op.p.bias_grad)){.b = rows, .c = wide, .s = 1, .dy = F(dy), .db = F(db)};
    RUN(op);
  }
  ot_check("db (added into)", db, wide);
}

static dt_conv_geom conv_geom(int64_t b, int64_t c, int64_t h, int64_t w, int64_t o, int64_t k, int64_t stride,
                              int64_t pad) {
  return (dt_conv_geom){b, c, h, w, o, k, stride, pad, (h + 2 * pad - k) / stride + 1, (w + 2 * pad - k) / stride + 1};
}

/* The 16-bit NHWC operands (backend.h's x16, y16, dy16) in the CUDA backend's format: bf16 or fp16. */
static int ot_format16(void) {
  return ot.precision == DT_PREC_BF16 ? DT_F16_BF16 : DT_F16_HALF;
}

/* n 16-bit values on both backends (as int32 pairs), random in [lo, hi) and rounded; (B, S, C) to the ops. */
static dbuf ot_rand16(int64_t n, float lo, float hi) {
  float *h = ot_host_rand(n, lo, hi);
  uint16_t *v = calloc((size_t)n + 2, sizeof *v);
  for (int64_t i = 0; i < n; i++) v[i] = dt_to_16(h[i], ot_format16());
  dbuf b = ot_buf(OT_I32, v, (n + 1) / 2);
  free(h);
  free(v);
  return b;
}

/* Compares 16-bit buffer b (n values) of both backends as widened values: a relative error of at most one
 * unit in the last place of the format (both round a FP32 result whose sums may differ in their order),
 * and the values [written, n) unchanged on both. With ld > 0 the values are rows of ld, of which the first
 * k are the row's (the 16-bit row layout, dt_ld16): the padding is unchanged too. */
static void ot_check16_rows(const char *what, dbuf b, int64_t n, int64_t written, int64_t k, int64_t ld) {
  uint16_t *h[2];
  for (int s = 0; s < 2; s++) {
    h[s] = malloc((size_t)b.n * 4 + 8);
    ot.be[s]->to_host(ot.be[s], h[s], b.p[s], (size_t)b.n * 4);
  }
  double d = 0, na = 0;
  int64_t changed = -1, side = 0;
  for (int64_t i = 0; i < n; i++) {
    if (i < written && (!ld || i % ld < k)) {
      double c = dt_from_16(h[0][i], ot_format16()), g = dt_from_16(h[1][i], ot_format16());
      d += (c - g) * (c - g), na += c * c;
    } else {
      for (int s = 0; s < 2 && changed < 0; s++)
        if (h[s][i] != ((const uint16_t *)b.init)[i]) changed = i, side = s;
    }
  }
  const double err = sqrt(d) / (sqrt(na) > 1e-6 ? sqrt(na) : 1e-6),
               ulp = ot_format16() == DT_F16_BF16 ? 0x1p-7 : 0x1p-10;
  free(h[0]);
  free(h[1]);
  if (!(err <= ulp))
    fail_msg("op %s [%s]: 16-bit %s differs between CUDA and CPU: relative error %.3g", dt_op_names[ot.op], ot.kase,
             what, err);
  if (changed >= 0)
    fail_msg("op %s [%s]: 16-bit %s value %lld changed on %s, past the values the op was given", dt_op_names[ot.op],
             ot.kase, what, (long long)changed, side ? "CUDA" : "CPU");
}

static void ot_check16(const char *what, dbuf b, int64_t n, int64_t written) {
  ot_check16_rows(what, b, n, written, 0, 0);
}

/* ot_check16 of n values where `is16` (a format), else ot_check. */
static void ot_check_in(int is16, const char *what, dbuf b, int64_t n, int64_t written) {
  if (is16)
    ot_check16(what, b, n, written);
  else
    ot_check(what, b, written);
}

/* y written and dy read in FP32 (B, O, Ho, Wo) (f16 0), or (f16: half.h's format, the CUDA backend's) as
 * 16-bit NHWC (y16, dy16), as a batchnorm after the convolution takes them (the CPU rounds its FP32 y);
 * and x read and dx written so too where in16 (a batchnorm before it). */
static void ops_conv_in(int f16, int in16) {
  /* (c, h, w, o, k, stride, pad) */
  /* the last: channels and positions past a 32 x 32 tile of the 16-bit copies' transposes */
  const int64_t geoms[][7] = {
      {3, 8, 8, 4, 3, 2, 1}, {2, 7, 6, 3, 3, 1, 1}, {3, 6, 6, 5, 1, 2, 0}, {40, 7, 6, 36, 1, 1, 0}};
  FOR_ROWS(r) {
    for (size_t gi = 0; gi < sizeof geoms / sizeof *geoms; gi++) {
      const int64_t *q = geoms[gi];
      dt_conv_geom g = conv_geom(rows, q[0], q[1], q[2], q[3], q[4], q[5], q[6]);
      int64_t xs = g.c * g.h * g.w, ys = g.o * g.ho * g.wo, ws = g.o * g.c * g.k * g.k;
      dbuf x = in16 ? ot_rand16(cap * xs, -1, 1) : ot_rand(cap * xs, -1, 1), w = ot_rand(ws, -1, 1);
      dbuf dx = in16 ? ot_rand16(cap * xs, -1, 1) : ot_rand(cap * xs, -1, 1), dw = ot_rand(ws, -1, 1);
      dbuf y = f16 ? ot_rand16(cap * ys, -1, 1) : ot_rand(cap * ys, -1, 1);
      dbuf dy = f16 ? ot_rand16(cap * ys, -1, 1) : ot_rand(cap * ys, -1, 1);
      char geo[96];
      snprintf(geo, sizeof geo, "%s%s(%lld,%lld,%lld) by %lldx%lld to %lld, stride %lld, pad %lld",
               in16 ? "16-bit NHWC x and dx, " : "", f16 ? "16-bit NHWC y and dy, " : "", (long long)g.c,
               (long long)g.h, (long long)g.w, (long long)g.k, (long long)g.k, (long long)g.o, (long long)g.stride,
               (long long)g.pad);
      ot_case(DT_OP_CONV_FWD, "%s, %s", geo, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_CONV_FWD};
        op.p.conv_fwd = (typeof(op.p.conv_fwd)){.g = g, .x = F(x), .w = F(w), .y = F(y), .y16 = f16, .in16 = in16};
        RUN(op);
      }
      ot_check_in(f16, "y", y, cap * ys, rows * ys);
      ot_case(DT_OP_CONV_BWD_DATA, "%s, %s", geo, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_CONV_BWD_DATA};
        op.p.conv_bwd_data =
            (typeof(op.p.conv_bwd_data)){.g = g, .dy = F(dy), .w = F(w), .dx = F(dx), .dy16 = f16, .in16 = in16};
        RUN(op);
      }
      ot_check_in(in16, "dx", dx, cap * xs, rows * xs);
      ot_case(DT_OP_CONV_BWD_FILTER, "%s, %s", geo, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_CONV_BWD_FILTER};
        op.p.conv_bwd_filter =
            (typeof(op.p.conv_bwd_filter)){.g = g, .x = F(x), .dy = F(dy), .dw = F(dw), .dy16 = f16, .in16 = in16};
        RUN(op);
      }
      ot_check("dw (added into)", dw, rows ? ws : 0);
    }
  }
}

/* Buffer b holds the same bits on the CPU and on CUDA. */
static void ot_check_bits(const char *what, dbuf b) {
  void *h[2] = {ot_fetch(b, 0), ot_fetch(b, 1)};
  int same = !memcmp(h[0], h[1], (size_t)b.n * ot_size(b.type));
  free(h[0]);
  free(h[1]);
  if (!same) fail_msg("op %s [%s]: %s: not the same bits on CUDA as on the CPU", dt_op_names[ot.op], ot.kase, what);
}

/* The first n elements of a and b on CUDA are the same bits. */
static void ot_check_same_on_cuda(const char *what, dbuf a, dbuf b, int64_t n) {
  void *h[2] = {ot_fetch(a, 1), ot_fetch(b, 1)};
  const int same = !memcmp(h[0], h[1], (size_t)n * ot_size(a.type));
  free(h[0]);
  free(h[1]);
  if (!same) fail_msg("op %s [%s]: %s: CUDA's results differ", dt_op_names[ot.op], ot.kase, what);
}

/* The weights16 op (model.c's pick_weights16) in the backend's format, over a table of a dense weight (5, 21)
 * in bfloat16 rows of 24, a filter (4, 3, 3, 3) as (4, 3, 3, 3) (O, K, K, C) and a dense weight (17, 40) (rows
 * longer than a warp's lanes): the
 * same bits on both backends, each value the rounding of its weight where the test's own indexing puts it,
 * the padding and the gaps between copies as they were. Then its readers: on CUDA, a convolution's forward and
 * backward data reading the filter's copy (w16) and a GEMM's forward and input gradient reading the dense
 * copy (b16, bfloat16 only) give the bits of the same ops copying the FP32 weights themselves, and the CPU,
 * which widens the copies, agrees within the precision's tolerance. */
static void ops_weights16(void) {
  const int f16 = ot_format16();
  dt_weight16 table[3] = {
      {.src = 3, .dst = 0, .rows = 5, .cols = 21, .inner = 1, .ld = 24, .row0 = 0, .format = DT_F16_BF16},
      {.src = 115, .dst = 128, .rows = 4, .cols = 3, .inner = 9, .ld = 3, .row0 = 5, .format = f16},
      {.src = 224, .dst = 256, .rows = 17, .cols = 40, .inner = 1, .ld = 40, .row0 = 9, .format = DT_F16_BF16}};
  const int64_t n_params = 224 + 17 * 40 + 5, n16 = 256 + 17 * 40 + 8;
  dbuf params = ot_rand(n_params, -2, 2), w16 = ot_rand16(n16, -1, 1);
  dbuf entries = ot_buf(OT_I32, table, (int64_t)(sizeof table / 4));
  ot_case(DT_OP_WEIGHTS16, "a dense weight, a filter, a dense weight");
  BOTH {
    dt_op op = {.type = DT_OP_WEIGHTS16};
    op.p.weights16 = (typeof(op.p.weights16)){
        .params = F(params), .w16 = (uint16_t *)F(w16), .table = (const dt_weight16 *)F(entries), .n = 3, .rows = 26};
    RUN(op);
  }
  ot_check_bits("the copies", w16);
  float *hp = ot_fetch(params, 0);
  uint16_t *got = ot_fetch(w16, 0), *want = malloc((size_t)w16.n * 4 + 8);
  memcpy(want, w16.init, (size_t)w16.n * 4);
  for (int e = 0; e < 3; e++) {
    const dt_weight16 *t = &table[e];
    for (int64_t o = 0; o < t->rows; o++)
      for (int64_t c = 0; c < t->cols; c++)
        for (int64_t k = 0; k < t->inner; k++) /* dense: (o, c) at o * ld + c; filter: (o, c, k) at (o, k, c) */
          want[t->dst + o * t->inner * t->ld + k * t->ld + c] =
              dt_to_16(hp[t->src + o * t->cols * t->inner + c * t->inner + k], t->format);
  }
  for (int64_t i = 0; i < n16; i++)
    if (got[i] != want[i]) fail_msg("weights16: 16-bit value %lld is %#x, expected %#x", (long long)i, got[i], want[i]);
  free(hp);
  free(got);
  free(want);

  FOR_ROWS(r) {
    const dt_conv_geom g = conv_geom(rows, 3, 8, 8, 4, 3, 1, 1);
    const int64_t xs = g.c * g.h * g.w, ys = g.o * g.ho * g.wo;
    dbuf x = ot_rand(cap * xs, -1, 1), dy = ot_rand(cap * ys, -1, 1);
    dbuf y[2] = {ot_rand(cap * ys, -1, 1), ot_rand(cap * ys, -1, 1)};
    dbuf dx[2] = {ot_rand(cap * xs, -1, 1), ot_rand(cap * xs, -1, 1)};
    ot_case(DT_OP_CONV_FWD, "its filter's 16-bit copy, %s", ROWS_NAME(r));
    for (int copy = 0; copy < 2; copy++) /* the FP32 filter, then its copy */
      BOTH {
        const float *w = copy ? (const float *)((uint16_t *)F(w16) + 128) : F(params) + 115;
        dt_op op = {.type = DT_OP_CONV_FWD};
        op.p.conv_fwd = (typeof(op.p.conv_fwd)){.g = g, .x = F(x), .w = w, .y = F(y[copy]), .w16 = copy ? f16 : 0};
        RUN(op);
        op = (dt_op){.type = DT_OP_CONV_BWD_DATA};
        op.p.conv_bwd_data =
            (typeof(op.p.conv_bwd_data)){.g = g, .dy = F(dy), .w = w, .dx = F(dx[copy]), .w16 = copy ? f16 : 0};
        RUN(op);
      }
    ot_check("y", y[1], rows * ys);
    ot_check_same_on_cuda("y", y[0], y[1], rows * ys);
    ot_case(DT_OP_CONV_BWD_DATA, "its filter's 16-bit copy, %s", ROWS_NAME(r));
    ot_check("dx", dx[1], rows * xs);
    ot_check_same_on_cuda("dx", dx[0], dx[1], rows * xs);
  }
  if (f16 != DT_F16_BF16) return;
  const int64_t rows = 18, in = 40, out = 17; /* every dimension at least DT_GEMM16_MIN_DIM: bfloat16 operands */
  dbuf x = ot_rand(rows * in, -1, 1), dy = ot_rand(rows * out, -1, 1);
  dbuf y[2] = {ot_rand(rows * out, -1, 1), ot_rand(rows * out, -1, 1)};
  dbuf dx[2] = {ot_rand(rows * in, -1, 1), ot_rand(rows * in, -1, 1)};
  ot_case(DT_OP_GEMM, "a dense weight's bfloat16 copy (b16): forward and input gradient");
  for (int copy = 0; copy < 2; copy++) BOTH {
      const float *w = copy ? (const float *)((uint16_t *)F(w16) + 256) : F(params) + 224;
      dt_op op = dense_gemm(DENSE_FWD, rows, in, out);
      op.p.gemm.a = F(x), op.p.gemm.b = w, op.p.gemm.c = F(y[copy]), op.p.gemm.b16 = copy ? DT_F16_BF16 : 0;
      RUN(op);
      op = dense_gemm(DENSE_DX, rows, in, out);
      op.p.gemm.a = F(dy), op.p.gemm.b = w, op.p.gemm.c = F(dx[copy]), op.p.gemm.b16 = copy ? DT_F16_BF16 : 0;
      RUN(op);
    }
  ot_check("y", y[1], rows * out);
  ot_check("dx", dx[1], rows * in);
  ot_check_same_on_cuda("y", y[0], y[1], rows * out);
  ot_check_same_on_cuda("dx", dx[0], dx[1], rows * in);
}

/* The grads16 op over a table of a dense weight (no grad), a filter (4, 3, 3, 3) and a 1x1 filter (5, 6, 1, 1)
 * with grad, and a dense weight (17, 40) (no grad): on both backends each 16-bit gradient widened and added where
 * the test's own indexing puts it, the rest of the gradients as they were; the same over the table's last two
 * entries alone (its rows numbered from their first's row0). Then its writer: a convolution's backward filter
 * leaving the (4, 3, 3, 3) filter's gradient in 16 bits (dw16) and the op adding it give, on CUDA, the bits of the
 * same backward filter adding into dw itself (no rows: it adds zeros), and the CPU agrees within the tolerance;
 * neither writes past the filter's 16-bit values. */
static void ops_grads16(void) {
  const int f16 = ot_format16();
  dt_weight16 table[4] = {
      {.src = 0, .dst = 0, .rows = 5, .cols = 21, .inner = 1, .ld = 24, .row0 = 0, .format = DT_F16_BF16},
      {.src = 105, .dst = 128, .rows = 4, .cols = 3, .inner = 9, .ld = 3, .row0 = 5, .format = f16, .grad = 1},
      {.src = 213, .dst = 256, .rows = 5, .cols = 6, .inner = 1, .ld = 6, .row0 = 9, .format = f16, .grad = 1},
      {.src = 243, .dst = 384, .rows = 17, .cols = 40, .inner = 1, .ld = 40, .row0 = 14, .format = DT_F16_BF16}};
  const int64_t n_params = 243 + 17 * 40 + 3, n16 = 384 + 17 * 40 + 8;
  dbuf g16 = ot_rand16(n16, -1, 1), entries = ot_buf(OT_I32, table, (int64_t)(sizeof table / 4));
  dbuf grads[2] = {ot_rand(n_params, -2, 2), ot_rand(n_params, -2, 2)};
  ot_case(DT_OP_GRADS16, "a dense weight, a filter, a 1x1 filter, a dense weight; the last two");
  BOTH {
    const dt_weight16 *t = (const dt_weight16 *)I(entries);
    for (int part = 0; part < 2; part++) {
      dt_op op = {.type = DT_OP_GRADS16};
      op.p.grads16 = (typeof(op.p.grads16)){.grads = F(grads[part]),
                                            .g16 = (const uint16_t *)F(g16),
                                            .table = part ? t + 2 : t,
                                            .n = part ? 2 : 4,
                                            .rows = part ? 22 : 31};
      RUN(op);
    }
  }
  const uint16_t *h16 = g16.init;
  for (int part = 0; part < 2; part++) {
    ot_check_bits("the gradients", grads[part]);
    float *got = ot_fetch(grads[part], 0), *want = malloc((size_t)n_params * sizeof *want);
    memcpy(want, grads[part].init, (size_t)n_params * sizeof *want);
    for (int e = part ? 2 : 0; e < 4; e++) {
      const dt_weight16 *t = &table[e];
      for (int64_t o = 0; t->grad && o < t->rows; o++)
        for (int64_t c = 0; c < t->cols; c++)
          for (int64_t k = 0; k < t->inner; k++) /* (o, c, k) from (o, k, c) */
            want[t->src + (o * t->cols + c) * t->inner + k] +=
                dt_from_16(h16[t->dst + (o * t->inner + k) * t->ld + c], t->format);
    }
    for (int64_t i = 0; i < n_params; i++)
      if (got[i] != want[i])
        fail_msg("grads16 (part %d): gradient %lld is %g, expected %g", part, (long long)i, got[i], want[i]);
    free(got);
    free(want);
  }

  dt_weight16 filter = table[1]; /* the (4, 3, 3, 3) filter alone, its gradient's 16 bits at dst 0 */
  filter.src = filter.dst = filter.row0 = 0;
  dbuf filter_entry = ot_buf(OT_I32, &filter, (int64_t)(sizeof filter / 4));
  FOR_ROWS(r) {
    const dt_conv_geom g = conv_geom(rows, 3, 8, 8, 4, 3, 1, 1);
    const int64_t xs = g.c * g.h * g.w, ys = g.o * g.ho * g.wo, ws = g.o * g.c * g.k * g.k;
    dbuf x = ot_rand(cap * xs, -1, 1), dy = ot_rand(cap * ys, -1, 1), slot = ot_rand16(ws + 8, -1, 1);
    dbuf dw0 = ot_rand(ws, -1, 1), dw[2] = {dw0, ot_buf(OT_F32, dw0.init, ws)};
    ot_case(DT_OP_CONV_BWD_FILTER, "its 16-bit gradient (dw16) added by grads16, %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_CONV_BWD_FILTER};
      op.p.conv_bwd_filter = (typeof(op.p.conv_bwd_filter)){.g = g, .x = F(x), .dy = F(dy), .dw = F(dw[0])};
      RUN(op);
      op.p.conv_bwd_filter.dw = F(slot), op.p.conv_bwd_filter.dw16 = f16;
      RUN(op);
      op = (dt_op){.type = DT_OP_GRADS16};
      op.p.grads16 = (typeof(op.p.grads16)){.grads = F(dw[1]),
                                            .g16 = (const uint16_t *)F(slot),
                                            .table = (const dt_weight16 *)I(filter_entry),
                                            .n = 1,
                                            .rows = 4};
      RUN(op);
    }
    ot_check("dw (its 16 bits added)", dw[1], ws);
    ot_check_same_on_cuda("dw", dw[0], dw[1], ws);
    for (int s = 0; s < 2; s++) { /* the 16-bit filter and nothing past it written */
      uint16_t *after = ot_fetch(slot, s);
      if (memcmp(after + ws, (const uint16_t *)slot.init + ws, 8 * sizeof *after))
        fail_msg("conv_bwd_filter (dw16) wrote past the filter's %lld values on backend %d", (long long)ws, s);
      free(after);
    }
  }
}

/* Batchnorm on x (B, C, S) in FP32 (f16 0), or (f16: half.h's format, the CUDA backend's) on a convolution's
 * 16-bit NHWC output (x16: x and bwd_apply's dx (B, S, C) 16-bit; the CPU widens x and rounds dx); y16 (with
 * f16): y and dy 16-bit NHWC too, for a convolution after it. */
static void ops_batchnorm_in(int f16, int y16) {
  /* (C, S). 6001: 6 or 5 rows make 36006 or 30005 positions a channel, the sums' 3 or 2 chunks of at least
   * K_BN_CHUNK_MIN (of 5 rows: the last shorter); 16-bit x: 282 or 235 chunks of whole 32-position tiles, 5
   * or 4 tiers of K_BN_TIER for the last blocks to add. 2731: 6 rows make 129 16-bit chunks, tiers of 64, 64
   * and 1. 40 channels past a 32-channel tile, 49 positions crossing tiles and images. */
  const int64_t shapes[][2] = {{3, 4}, {3, 1}, {3, 6001}, {3, 2731}, {40, 49}};
  const char *in = y16 ? "16-bit NHWC x and y, " : f16 ? "16-bit NHWC x, " : "";
  FOR_ROWS(r) {
    for (int si = 0; si < 5; si++) {
      const int64_t C = shapes[si][0], S = shapes[si][1], n = cap * C * S;
      dbuf x = f16 ? ot_rand16(n, -2, 3) : ot_rand(n, -2, 3), dy = y16 ? ot_rand16(n, -1, 1) : ot_rand(n, -1, 1);
      dbuf y = y16 ? ot_rand16(n, -1, 1) : ot_rand(n, -1, 1);
      dbuf dx = f16 ? ot_rand16(n, -1, 1) : ot_rand(n, -1, 1);
      dbuf mean = ot_rand(C, -0.5f, 0.5f), invstd = ot_rand(C, 0.5f, 2.0f), gamma = ot_rand(C, 0.5f, 1.5f);
      dbuf beta = ot_rand(C, -0.5f, 0.5f);
      dbuf stats = ot_rand_d(2 * C + 1, -9, 9), gsum = ot_rand_d(2 * C, -9, 9);
      dbuf dgamma = ot_rand(C, -1, 1), dbeta = ot_rand(C, -1, 1);
      dbuf rmean = ot_rand(C, -0.5f, 0.5f), rvar = ot_rand(C, 0.5f, 2.0f), fmean = ot_rand(C, -1, 1),
           finv = ot_rand(C, -1, 1);
      ot_case(DT_OP_BN_STATS, "%s(C, S) (%lld, %lld), %s", in, (long long)C, (long long)S, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_BN_STATS,
                    .p.bn_stats = {.b = rows, .c = C, .s = S, .x = F(x), .x16 = f16, .sums = D(stats)}};
        RUN(op);
      }
      ot_check("sums and count", stats, 2 * C + 1);
      for (int training = 1; training >= 0; training--) {
        ot_case(DT_OP_BN_FINALIZE, "%s, %s(C, S) (%lld, %lld), %s", training ? "training" : "evaluation", in,
                (long long)C, (long long)S, ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_BN_FINALIZE,
                      .p.bn_finalize = {.c = C,
                                        .training = training,
                                        .momentum = 0.1f,
                                        .eps = 1e-5f,
                                        .sums = D(stats),
                                        .mean = F(fmean),
                                        .invstd = F(finv),
                                        .running_mean = F(rmean),
                                        .running_var = F(rvar)}};
          RUN(op);
        }
        ot_check("mean", fmean, C);
        ot_check("invstd", finv, C);
        ot_check("running_mean", rmean, C);
        ot_check("running_var", rvar, C);
      }
      /* the sums finalized by the op that adds them (training, local statistics: bn_stats.finalize), against
       * the CPU, and on each backend the same bits as the two ops from the same running statistics */
      float *run0[2] = {ot_host_rand(C, -0.5f, 0.5f), ot_host_rand(C, 0.5f, 2.0f)};
      dbuf out[2][5]; /* [fused, apart]: sums, mean, invstd, running mean, running var */
      for (int k = 0; k < 2; k++) {
        out[k][0] = ot_rand_d(2 * C + 1, -9, 9), out[k][1] = ot_rand(C, -1, 1), out[k][2] = ot_rand(C, -1, 1);
        out[k][3] = ot_buf(OT_F32, run0[0], C), out[k][4] = ot_buf(OT_F32, run0[1], C);
      }
      free(run0[0]), free(run0[1]);
      ot_case(DT_OP_BN_STATS, "with its finalize, %s(C, S) (%lld, %lld), %s", in, (long long)C, (long long)S,
              ROWS_NAME(r));
      BOTH {
        for (int k = 0; k < 2; k++) {
          const dt_bn_finalize_args fin = {.c = C,
                                           .training = 1,
                                           .momentum = 0.1f,
                                           .eps = 1e-5f,
                                           .sums = D(out[k][0]),
                                           .mean = F(out[k][1]),
                                           .invstd = F(out[k][2]),
                                           .running_mean = F(out[k][3]),
                                           .running_var = F(out[k][4])};
          dt_op op = {
              .type = DT_OP_BN_STATS,
              .p.bn_stats = {
                  .b = rows, .c = C, .s = S, .x = F(x), .x16 = f16, .sums = D(out[k][0]), .finalize = k ? NULL : &fin}};
          RUN(op);
          if (k) {
            dt_op f = {.type = DT_OP_BN_FINALIZE, .p.bn_finalize = fin};
            RUN(f);
          }
        }
      }
      static const char *const fin_names[5] = {"sums and count", "mean", "invstd", "running_mean", "running_var"};
      for (int v = 0; v < 5; v++) {
        ot_check(fin_names[v], out[0][v], v ? C : 2 * C + 1);
        for (int side = 0; side < 2; side++) {
          void *fused = ot_fetch(out[0][v], side), *apart = ot_fetch(out[1][v], side);
          const int same = !memcmp(fused, apart, (size_t)out[0][v].n * ot_size(out[0][v].type));
          free(fused), free(apart);
          if (!same)
            fail_msg("op bn_stats [%s]: %s on %s differs from the two ops'", ot.kase, fin_names[v],
                     side ? "CUDA" : "CPU");
        }
      }
      /* relu: the fused relu (model.fuse), which backward masks by recomputing z from x */
      for (int relu = 0; relu < 2; relu++) {
        const char *fused = relu ? ", fused relu" : "";
        ot_case(DT_OP_BN_APPLY, "%s(C, S) (%lld, %lld), %s%s", in, (long long)C, (long long)S, ROWS_NAME(r), fused);
        BOTH {
          dt_op op = {.type = DT_OP_BN_APPLY,
                      .p.bn_apply = {.b = rows,
                                     .c = C,
                                     .s = S,
                                     .relu = relu,
                                     .x = F(x),
                                     .x16 = f16,
                                     .y16 = y16,
                                     .mean = F(mean),
                                     .invstd = F(invstd),
                                     .gamma = F(gamma),
                                     .beta = F(beta),
                                     .y = F(y)}};
          RUN(op);
        }
        ot_check_in(y16, "y", y, n, rows * C * S);
        ot_case(DT_OP_BN_BWD_STATS, "%s(C, S) (%lld, %lld), %s%s", in, (long long)C, (long long)S, ROWS_NAME(r), fused);
        BOTH {
          dt_op op = {.type = DT_OP_BN_BWD_STATS,
                      .p.bn_bwd_stats = {.b = rows,
                                         .c = C,
                                         .s = S,
                                         .relu = relu,
                                         .x = F(x),
                                         .x16 = f16,
                                         .dy16 = y16,
                                         .dy = F(dy),
                                         .mean = F(mean),
                                         .invstd = F(invstd),
                                         .gamma = F(gamma),
                                         .beta = F(beta),
                                         .sums = D(gsum),
                                         .dgamma = F(dgamma),
                                         .dbeta = F(dbeta)}};
          RUN(op);
        }
        ot_check("sum_dy, sum_dy_xhat", gsum, 2 * C);
        ot_check("dgamma (added into)", dgamma, C);
        ot_check("dbeta (added into)", dbeta, C);
        /* the apply with a count (a forward's sums[2C]) of 2 * cap * S: global sums */
        double count_h = (double)(2 * cap * S);
        dbuf count = ot_buf(OT_F64, &count_h, 1), sums = ot_rand_d(2 * C, -3, 3);
        ot_case(DT_OP_BN_BWD_APPLY, "%s(C, S) (%lld, %lld), %s%s", in, (long long)C, (long long)S, ROWS_NAME(r), fused);
        BOTH {
          dt_op op = {.type = DT_OP_BN_BWD_APPLY,
                      .p.bn_bwd_apply = {.b = rows,
                                         .c = C,
                                         .s = S,
                                         .relu = relu,
                                         .count = D(count),
                                         .x = F(x),
                                         .x16 = f16,
                                         .dy16 = y16,
                                         .dy = F(dy),
                                         .mean = F(mean),
                                         .invstd = F(invstd),
                                         .gamma = F(gamma),
                                         .beta = F(beta),
                                         .sums = D(sums),
                                         .dx = F(dx)}};
          RUN(op);
        }
        ot_check_in(f16, "dx", dx, n, rows * C * S);
      }
    }
  }
}

static void ops_activation(void) {
  static const char *const kinds[] = {"relu", "gelu", "tanh", "sigmoid", "gelu_tanh"};
  const int64_t feat = 10;
  FOR_ROWS(r) {
    for (int kind = 0; kind < 5; kind++) {
      int64_t n = rows * feat;
      dbuf x = ot_rand(cap * feat, -3, 3), y = ot_rand(cap * feat, -1, 1), dy = ot_rand(cap * feat, -1, 1);
      dbuf yin = ot_rand(cap * feat, 0.05f, 0.95f), dx = ot_rand(cap * feat, -1, 1);
      ot_case(DT_OP_ACT_FWD, "%s, %s", kinds[kind], ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_ACT_FWD};
        op.p.act_fwd = (typeof(op.p.act_fwd)){.kind = kind, .n = n, .x = F(x), .y = F(y)};
        RUN(op);
      }
      ot_check("y", y, n);
      ot_case(DT_OP_ACT_BWD, "%s, %s", kinds[kind], ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_ACT_BWD};
        op.p.act_bwd = (typeof(op.p.act_bwd)){.kind = kind, .n = n, .x = F(x), .y = F(yin), .dy = F(dy), .dx = F(dx)};
        RUN(op);
      }
      ot_check("dx", dx, n);
    }
  }
  /* relu's backward selects, dx = x > 0 ? dy : +0, on both backends bit for bit (as the fused relus of a
   * batchnorm and a residual sum): not 0 * dy, whose NaN (a NaN or infinite dy) and -0 (a negative dy) where
   * x <= 0 would part from the CPU's */
  const float xs[8] = {-1.0f, 0.0f, -0.0f, 2.0f, -3.0f, 0.5f, -2.0f, NAN};
  const float dys[8] = {NAN, -1.5f, INFINITY, NAN, -INFINITY, -0.25f, -0.0f, 1.0f};
  const float want[8] = {0.0f, 0.0f, 0.0f, NAN, 0.0f, -0.25f, 0.0f, 0.0f};
  dbuf x = ot_buf(OT_F32, xs, 8), dy = ot_buf(OT_F32, dys, 8), dx = ot_rand(8, -1, 1);
  ot_case(DT_OP_ACT_BWD, "relu, dy NaN, infinite, negative or -0 where x <= 0 (NaN among them)");
  BOTH {
    dt_op op = {.type = DT_OP_ACT_BWD, .p.act_bwd = {.kind = DT_ACT_RELU, .n = 8, .x = F(x), .dy = F(dy), .dx = F(dx)}};
    RUN(op);
  }
  for (int s = 0; s < 2; s++) {
    float got[8];
    ot.be[s]->to_host(ot.be[s], got, dx.p[s], sizeof got);
    for (int i = 0; i < 8; i++)
      if (memcmp(&got[i], &want[i], sizeof got[i]) && !(isnan(got[i]) && isnan(want[i])))
        fail_msg("op act_bwd [%s]: dx[%d] = %g on %s (x %g, dy %g), expected %g", ot.kase, i, got[i],
                 s ? "CUDA" : "CPU", xs[i], dys[i], want[i]);
  }
}

/* f16 0: FP32 NCHW, max and average pooling; else (half.h's format, the CUDA backend's) max pooling of 16-bit
 * NHWC values (nhwc16: between a batchnorm's y16 and a convolution's in16), argmax (B, Ho, Wo, C). */
static void ops_pool_in(int f16) {
  /* (c, h, w, k, stride): disjoint windows (the kernel's own path), also with rows and columns past the
   * last whole window; overlapping windows with a cut-off edge, stride 1 */
  const int64_t geoms[][5] = {{2, 8, 8, 2, 2}, {2, 7, 9, 2, 2}, {1, 11, 7, 3, 3}, {3, 7, 6, 3, 2}, {1, 5, 5, 2, 1}};
  FOR_ROWS(r) {
    for (size_t gi = 0; gi < sizeof geoms / sizeof *geoms; gi++)
      for (int kind = DT_POOL_MAX; kind <= DT_POOL_AVG; kind++) {
        const int64_t *q = geoms[gi], c = q[0], h = q[1], w = q[2], k = q[3], st = q[4];
        int64_t ho = (h - k) / st + 1, wo = (w - k) / st + 1, xs = c * h * w, ys = c * ho * wo;
        if (f16 && kind != DT_POOL_MAX) continue;
        dbuf x = f16 ? ot_rand16(cap * xs, -1, 1) : ot_rand(cap * xs, -1, 1);
        dbuf y = f16 ? ot_rand16(cap * ys, -1, 1) : ot_rand(cap * ys, -1, 1);
        dbuf dy = f16 ? ot_rand16(cap * ys, -1, 1) : ot_rand(cap * ys, -1, 1);
        dbuf dx = f16 ? ot_rand16(cap * xs, -1, 1) : ot_rand(cap * xs, -1, 1);
        int32_t *am0 = malloc((size_t)(cap * ys + 1) * sizeof(int32_t));
        for (int64_t i = 0; i < cap * ys; i++) am0[i] = (int32_t)(1000 + i);
        dbuf am = ot_buf(OT_I32, am0, cap * ys);
        free(am0);
        const char *kn = kind == DT_POOL_MAX ? "max" : "avg";
        ot_case(DT_OP_POOL_FWD, "%s%s, (%lld,%lld,%lld) k %lld stride %lld, %s", kn, f16 ? ", 16-bit NHWC" : "",
                (long long)c, (long long)h, (long long)w, (long long)k, (long long)st, ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_POOL_FWD};
          op.p.pool_fwd = (typeof(op.p.pool_fwd)){.kind = kind,
                                                  .b = rows,
                                                  .c = c,
                                                  .h = h,
                                                  .w = w,
                                                  .k = k,
                                                  .stride = st,
                                                  .ho = ho,
                                                  .wo = wo,
                                                  .x = F(x),
                                                  .y = F(y),
                                                  .argmax = kind == DT_POOL_MAX ? I(am) : NULL,
                                                  .nhwc16 = f16};
          RUN(op);
        }
        ot_check_in(f16, "y", y, cap * ys, rows * ys);
        ot_check("argmax", am, kind == DT_POOL_MAX ? rows * ys : 0);
        ot_case(DT_OP_POOL_BWD, "%s%s, (%lld,%lld,%lld) k %lld stride %lld, %s", kn, f16 ? ", 16-bit NHWC" : "",
                (long long)c, (long long)h, (long long)w, (long long)k, (long long)st, ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_POOL_BWD};
          op.p.pool_bwd = (typeof(op.p.pool_bwd)){.kind = kind,
                                                  .b = rows,
                                                  .c = c,
                                                  .h = h,
                                                  .w = w,
                                                  .k = k,
                                                  .stride = st,
                                                  .ho = ho,
                                                  .wo = wo,
                                                  .dy = F(dy),
                                                  .argmax = kind == DT_POOL_MAX ? I(am) : NULL,
                                                  .dx = F(dx),
                                                  .nhwc16 = f16};
          RUN(op);
        }
        ot_check_in(f16, "dx", dx, cap * xs, rows * xs);
      }
  }
  /* max pooling of -inf everywhere (fp16's overflow): each window's argmax is its first element, where its
   * gradient goes, on both backends, for disjoint (2, 2) and overlapping (3, 2) windows */
  const int64_t c = 2, h = 7, w = 7, n = 2 * c * h * w;
  float *ninf = ot_host_rand(n, -1, 1);
  uint16_t *ninf16 = calloc((size_t)n + 2, sizeof *ninf16);
  for (int64_t i = 0; i < n; i++) ninf[i] = -INFINITY, ninf16[i] = dt_to_16(-INFINITY, f16 ? f16 : DT_F16_BF16);
  for (int64_t k = 2; k <= 3; k++) {
    const int64_t ho = (h - k) / 2 + 1, ys = 2 * c * ho * ho;
    dbuf x = f16 ? ot_buf(OT_I32, ninf16, (n + 1) / 2) : ot_buf(OT_F32, ninf, n);
    dbuf y = f16 ? ot_rand16(ys, -1, 1) : ot_rand(ys, -1, 1), dy = f16 ? ot_rand16(ys, -1, 1) : ot_rand(ys, -1, 1);
    dbuf dx = f16 ? ot_rand16(n, -1, 1) : ot_rand(n, -1, 1), am = ot_buf(OT_I32, NULL, ys);
    ot_case(DT_OP_POOL_BWD, "max%s of -inf, k %lld stride 2", f16 ? ", 16-bit NHWC" : "", (long long)k);
    BOTH {
      dt_pool_args a = {.kind = DT_POOL_MAX,
                        .b = 2,
                        .c = c,
                        .h = h,
                        .w = w,
                        .k = k,
                        .stride = 2,
                        .ho = ho,
                        .wo = ho,
                        .x = F(x),
                        .y = F(y),
                        .dy = F(dy),
                        .dx = F(dx),
                        .argmax = I(am),
                        .nhwc16 = f16};
      dt_op op = {.type = DT_OP_POOL_FWD, .p.pool_fwd = a};
      RUN(op);
      op = (dt_op){.type = DT_OP_POOL_BWD, .p.pool_bwd = a};
      RUN(op);
    }
    ot_check("argmax", am, ys);
    ot_check_in(f16, "dx", dx, n, n);
  }
  free(ninf);
  free(ninf16);
}

/* The masks must be identical: the same elements dropped on both. */
static void ot_check_mask(const char *what, dbuf b, int64_t n) {
  float *h[2];
  for (int s = 0; s < 2; s++) {
    h[s] = malloc((size_t)(b.n + 1) * sizeof(float));
    ot.be[s]->to_host(ot.be[s], h[s], b.p[s], (size_t)b.n * sizeof(float));
  }
  int64_t dropped = 0, bad = -1;
  for (int64_t i = 0; i < n; i++) {
    dropped += h[0][i] == 0.0f;
    if ((h[0][i] == 0.0f) != (h[1][i] == 0.0f) && bad < 0) bad = i;
  }
  free(h[0]);
  free(h[1]);
  if (bad >= 0)
    fail_msg("op %s [%s]: %s: the dropout masks differ at element %lld", dt_op_names[ot.op], ot.kase, what,
             (long long)bad);
  if (n >= 40 && (dropped == 0 || dropped == n))
    fail_msg("op %s [%s]: %s: %lld of %lld dropped (p = 0.3)", dt_op_names[ot.op], ot.kase, what, (long long)dropped,
             (long long)n);
}

static void ops_dropout(void) {
  const int64_t feat = 16;
  const uint64_t seeds[] = {11, 0xfedcba9876543210ull};
  FOR_ROWS(r) {
    for (int si = 0; si < 2; si++) {
      int64_t n = rows * feat;
      /* inputs away from zero, so that a zero output means a dropped element */
      dbuf x = ot_rand(cap * feat, 0.5f, 2.0f), y = ot_rand(cap * feat, -1, 1), dy = ot_rand(cap * feat, -2, -0.5f);
      dbuf dx = ot_rand(cap * feat, -1, 1);
      /* the layer's part of the seed in the op, the micro-batch's in backend memory */
      const uint64_t step_seed[1] = {0x1234567ull * (uint64_t)(si + 1)};
      dbuf ss = ot_buf(OT_F64, step_seed, 1); /* 8 bytes */
      ot_case(DT_OP_DROPOUT_FWD, "p 0.3, seed %#llx, %s", (unsigned long long)seeds[si], ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_DROPOUT_FWD};
        op.p.dropout_fwd = (typeof(op.p.dropout_fwd)){
            .n = n, .p = 0.3f, .seed = seeds[si], .step_seed = (const uint64_t *)ss.p[s_], .x = F(x), .y = F(y)};
        RUN(op);
      }
      ot_check("y", y, n);
      ot_check_mask("y", y, n);
      ot_case(DT_OP_DROPOUT_BWD, "p 0.3, seed %#llx, %s", (unsigned long long)seeds[si], ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_DROPOUT_BWD};
        op.p.dropout_bwd = (typeof(op.p.dropout_bwd)){
            .n = n, .p = 0.3f, .seed = seeds[si], .step_seed = (const uint64_t *)ss.p[s_], .dy = F(dy), .dx = F(dx)};
        RUN(op);
      }
      ot_check("dx", dx, n);
      ot_check_mask("dx", dx, n);
    }
  }
}

static void ops_elementwise(void) {
  const int64_t feat = 12;
  FOR_ROWS(r) {
    int64_t n = rows * feat;
    dbuf a = ot_rand(cap * feat, -1, 1), b = ot_rand(cap * feat, -1, 1), y = ot_rand(cap * feat, -1, 1);
    dbuf x = ot_rand(cap * feat, -1, 1);
    for (int relu = 0; relu < 2; relu++) { /* relu: a residual's fused relu (model.fuse) */
      ot_case(DT_OP_ADD, "%s%s", ROWS_NAME(r), relu ? ", relu" : "");
      BOTH {
        dt_op op = {.type = DT_OP_ADD};
        op.p.add = (typeof(op.p.add)){.n = n, .a = F(a), .b = F(b), .y = F(y), .relu = relu};
        RUN(op);
      }
      ot_check("y", y, n);
    }
    ot_case(DT_OP_SCALE, "alpha -0.37, %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_SCALE};
      op.p.scale = (typeof(op.p.scale)){.n = n, .alpha = -0.37f, .x = F(x)};
      RUN(op);
    }
    ot_check("x", x, n);
    for (int big = 0; big < 2; big++) { /* a norm above max_norm is scaled down, one below kept */
      dbuf g = ot_rand(cap * feat, -1, 1);
      const double sq = big ? 9.0 : 0.25;
      dbuf sumsq = ot_buf(OT_F64, &sq, 1);
      ot_case(DT_OP_CLIP, "norm %g, max_norm 1, %s", sqrt(sq), ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_CLIP, .p.clip = {.n = n, .max_norm = 1.0f, .sumsq = D(sumsq), .x = F(g)}};
        RUN(op);
      }
      ot_check("x", g, big ? n : 0);
    }
    dbuf ema = ot_rand(cap * feat, -1, 1);
    ot_case(DT_OP_EMA, "decay 0.9999, %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_EMA, .p.ema = {.n = n, .decay = 0.9999f, .x = F(a), .ema = F(ema)}};
      RUN(op);
    }
    ot_check("ema", ema, n);
  }
}

/* A buffer's values on one side (0: CPU, 1: CUDA), as doubles. */
static double ot_get(dbuf b, int side, int64_t i) {
  size_t es = ot_size(b.type);
  char h[8];
  ot.be[side]->to_host(ot.be[side], h, (char *)b.p[side] + (size_t)i * es, es);
  return ot_elem(b.type, h, 0);
}

static void ops_sumsq(void) {
  const int64_t feat = 12;
  FOR_ROWS(r) {
    int64_t n = rows * feat;
    float *h = ot_host_rand(cap * feat, -1, 1);
    if (n >= 4) h[1] = NAN, h[3] = INFINITY;
    if (n < cap * feat) h[n] = -INFINITY; /* past n: not counted */
    dbuf x = ot_buf(OT_F32, h, cap * feat);
    free(h);
    const double before[2] = {1.5, 2.0}; /* the op adds into out */
    dbuf out = ot_buf(OT_F64, before, 2);
    ot_case(DT_OP_SUMSQ, "a NaN and an Inf among the values, added into (1.5, 2), %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = n, .x = F(x), .out = D(out)}};
      RUN(op);
    }
    ot_check("sumsq and non-finite count", out, 2);
    if (ot_get(out, 1, 1) != 2.0 + (n ? 2 : 0))
      fail_msg("op sumsq [%s]: %g non-finite values counted, expected %d", ot.kase, ot_get(out, 1, 1) - 2.0, n ? 2 : 0);
  }
}

/* The loss over 5 classes, and over 1031 (more than one per thread of a row's block) with each row's
 * maximum at two indices (250 and 260: a later warp's thread and an earlier one's), where the first
 * counts as the prediction. */
static void ops_loss(void) {
  for (int wide = 0; wide < 2; wide++) {
    const int64_t K = wide ? 1031 : 5;
    FOR_ROWS(r) {
      for (int kind = DT_LOSS_CROSS_ENTROPY; kind <= DT_LOSS_MSE; kind++) {
        float *hz = ot_host_rand(cap * K, -2, 2);
        for (int64_t b = 0; wide && b < cap; b++) hz[b * K + 250] = hz[b * K + 260] = 3.0f;
        int32_t *labels = calloc((size_t)cap + 1, sizeof(int32_t));
        for (int64_t b = 0; b < cap; b++) { /* even rows predicted right, odd rows at random */
          int32_t arg = 0;
          for (int32_t j = 1; j < K; j++)
            if (hz[b * K + j] > hz[b * K + arg]) arg = j;
          labels[b] = b % 2 ? (int32_t)(dt_hash64((uint64_t)b + 77) % (uint64_t)K) : arg;
        }
        dbuf z = ot_buf(OT_F32, hz, cap * K), dz = ot_rand(cap * K, -1, 1), targets = ot_rand(cap * K, 0, 1);
        dbuf lab = ot_buf(OT_I32, labels, cap);
        const double before[2] = {0.25, 3}; /* the op adds into sums */
        dbuf sums = ot_buf(OT_F64, before, 2);
        free(hz);
        free(labels);
        const float scale = 1024.0f; /* fp16 loss scaling: dlogits carry it */
        dbuf grad_scale = ot_buf(OT_F32, &scale, 1), dz_scaled = ot_rand(cap * K, -1, 1);
        dbuf sums_scaled = ot_buf(OT_F64, before, 2);
        ot_case(DT_OP_LOSS, "%s, %lld classes, %s, and dlogits scaled by 1024",
                kind == DT_LOSS_MSE ? "mse" : "cross entropy, label smoothing 0.1", (long long)K, ROWS_NAME(r));
        if (rows == 0) continue; /* loss_run queues nothing for no rows */
        BOTH {
          dt_op op = {.type = DT_OP_LOSS,
                      .p.loss = {.kind = kind,
                                 .b = rows,
                                 .k = K,
                                 .label_smoothing = kind == DT_LOSS_MSE ? 0.0f : 0.1f,
                                 .weight = 1.0 / (double)(2 * cap),
                                 .logits = F(z),
                                 .labels = kind == DT_LOSS_MSE ? NULL : I(lab),
                                 .targets = kind == DT_LOSS_MSE ? F(targets) : NULL,
                                 .dlogits = F(dz),
                                 .sums = D(sums)}};
          RUN(op);
          op.p.loss.grad_scale = F(grad_scale);
          op.p.loss.dlogits = F(dz_scaled);
          op.p.loss.sums = D(sums_scaled);
          RUN(op);
        }
        ot_check("dlogits scaled", dz_scaled, rows * K);
        for (int64_t i = 0; i < rows * K; i++) /* a power of two: exactly 1024 times the unscaled ones */
          if (ot_get(dz_scaled, 0, i) != 1024.0 * ot_get(dz, 0, i))
            fail_msg("op loss [%s]: scaled dlogits[%lld] = %g, not 1024 x %g", ot.kase, (long long)i,
                     ot_get(dz_scaled, 0, i), ot_get(dz, 0, i));
        ot_check("loss sum and hits (added into)", sums, 2);
        double hits = ot_get(sums, 1, 1) - 3;
        if (kind == DT_LOSS_CROSS_ENTROPY && hits < (double)((rows + 1) / 2))
          fail_msg("op loss [%s]: %g correct, at least %lld expected", ot.kase, hits, (long long)((rows + 1) / 2));
        ot_check("dlogits", dz, rows * K);
        /* distillation: a teacher's logits mixed in by KL at T = 2.5 or by MSE, alpha 0.6; cross_entropy's
         * with the rows labelled as row 0 ignored */
        dbuf teacher = ot_rand(cap * K, -3, 3);
        for (int distill = DT_DISTILL_KL; distill <= DT_DISTILL_MSE; distill++) {
          ot_case(DT_OP_LOSS, "%s distilled by %s, %lld classes, %s",
                  kind == DT_LOSS_MSE ? "mse" : "cross entropy, rows ignored", distill == DT_DISTILL_KL ? "kl" : "mse",
                  (long long)K, ROWS_NAME(r));
          dbuf dz_d = ot_rand(cap * K, -1, 1), sums_d = ot_buf(OT_F64, before, 2);
          BOTH {
            dt_op op = {.type = DT_OP_LOSS,
                        .p.loss = {.kind = kind,
                                   .b = rows,
                                   .k = K,
                                   .ignore = kind == DT_LOSS_CROSS_ENTROPY,
                                   .ignore_index = (int32_t)ot_get(lab, 0, 0),
                                   .weight = 1.0 / (double)(2 * cap),
                                   .logits = F(z),
                                   .labels = kind == DT_LOSS_MSE ? NULL : I(lab),
                                   .targets = kind == DT_LOSS_MSE ? F(targets) : NULL,
                                   .dlogits = F(dz_d),
                                   .sums = D(sums_d),
                                   .distill = distill,
                                   .alpha = 0.6f,
                                   .temperature = 2.5f,
                                   .teacher = F(teacher)}};
            RUN(op);
          }
          ot_check("distilled dlogits", dz_d, rows * K);
          ot_check("distilled loss sum and hits", sums_d, 2);
          if (rows > 1 && ot_get(sums_d, 0, 0) == ot_get(sums, 0, 0))
            fail_msg("op loss [%s]: the teacher changed nothing", ot.kase);
        }
        if (kind != DT_LOSS_CROSS_ENTROPY) continue;
        const int32_t ignored_label = (int32_t)ot_get(lab, 0, 0); /* row 0's, so at least one row is ignored */
        ot_case(DT_OP_LOSS, "cross entropy, rows labelled %d ignored, %lld classes, %s", ignored_label, (long long)K,
                ROWS_NAME(r));
        dbuf dz_ignored = ot_rand(cap * K, -1, 1), sums_ignored = ot_buf(OT_F64, before, 2);
        BOTH {
          dt_op op = {.type = DT_OP_LOSS,
                      .p.loss = {.kind = kind,
                                 .b = rows,
                                 .k = K,
                                 .ignore = 1,
                                 .ignore_index = ignored_label,
                                 .weight = 1.0 / (double)(2 * cap),
                                 .logits = F(z),
                                 .labels = I(lab),
                                 .dlogits = F(dz_ignored),
                                 .sums = D(sums_ignored)}};
          RUN(op);
        }
        ot_check("dlogits with ignored rows", dz_ignored, rows * K);
        ot_check("loss sum and hits with ignored rows", sums_ignored, 2);
        int64_t ignored = 0;
        for (int64_t b = 0; b < rows; b++) {
          if (ot_get(lab, 0, b) != ignored_label) continue;
          ignored++;
          for (int64_t j = 0; j < K; j++)
            if (ot_get(dz_ignored, 0, b * K + j) != 0.0)
              fail_msg("op loss [%s]: ignored row %lld has dlogits[%lld] = %g", ot.kase, (long long)b, (long long)j,
                       ot_get(dz_ignored, 0, b * K + j));
        }
        if (rows > 0 && ignored == 0) fail_msg("op loss [%s]: no row is ignored; the case tests nothing", ot.kase);
        if (rows > 0 && !(ot_get(sums_ignored, 0, 0) < ot_get(sums, 0, 0)))
          fail_msg("op loss [%s]: ignoring rows did not lower the loss sum", ot.kase);
        /* confident rows, no smoothing: each label's logit 20 above the rest, so its gradient p - 1 is
         * about -(K - 1) e^-20, the largest in its row, and lost where p is rounded to a float (1.0f) */
        ot_case(DT_OP_LOSS, "cross entropy, confident rows, %lld classes, %s", (long long)K, ROWS_NAME(r));
        float *hc = ot_host_rand(cap * K, -0.5f, 0.5f);
        for (int64_t b = 0; b < cap; b++) hc[b * K + (int64_t)ot_get(lab, 0, b)] += 20.0f;
        dbuf zc = ot_buf(OT_F32, hc, cap * K), dz_c = ot_rand(cap * K, -1, 1), sums_c = ot_buf(OT_F64, before, 2);
        free(hc);
        BOTH {
          dt_op op = {.type = DT_OP_LOSS,
                      .p.loss = {.kind = kind,
                                 .b = rows,
                                 .k = K,
                                 .weight = 1.0,
                                 .logits = F(zc),
                                 .labels = I(lab),
                                 .dlogits = F(dz_c),
                                 .sums = D(sums_c)}};
          RUN(op);
        }
        ot_check("confident dlogits", dz_c, rows * K);
        ot_check("confident loss sum and hits", sums_c, 2);
      }
    }
  }
}

/* The optimizer ops run over a flat range: n is the "batch" (zero: nothing to update). */
static void ops_optim(void) {
  const int64_t sizes[][2] = {{300, 300}, {70, 50}, {70, 0}}; /* (allocated, n) */
  for (int zi = 0; zi < 3; zi++) {
    int64_t cap = sizes[zi][0], n = sizes[zi][1];
    const char *nm = zi == 0 ? "normal" : zi == 1 ? "uneven, 50 of 70" : "zero of 70";
    /* (momentum, nesterov, first) */
    const float sgd[][3] = {{0.9f, 0, 1}, {0.9f, 0, 0}, {0.9f, 1, 1}, {0.9f, 1, 0}, {0, 0, 1}};
    for (int si = 0; si < 5; si++) {
      float mom = sgd[si][0];
      int nesterov = (int)sgd[si][1], first = (int)sgd[si][2];
      dbuf p = ot_rand(cap, -1, 1), g = ot_rand(cap, -1, 1), m = ot_rand(cap, -1, 1);
      const float lr_first[2] = {0.1f, (float)first};
      dbuf hyper = ot_buf(OT_F32, lr_first, 2);
      ot_case(DT_OP_SGD, "momentum %g, nesterov %d, first %d, weight decay 0.01, %s", mom, nesterov, first, nm);
      BOTH {
        dt_op op = {.type = DT_OP_SGD};
        op.p.sgd = (typeof(op.p.sgd)){.n = n,
                                      .hyper = F(hyper),
                                      .momentum = mom,
                                      .weight_decay = 0.01f,
                                      .nesterov = nesterov,
                                      .param = F(p),
                                      .grad = F(g),
                                      .mom = mom > 0 ? F(m) : NULL};
        RUN(op);
      }
      ot_check("param", p, n);
      ot_check("momentum buffer", m, mom > 0 ? n : 0);
    }
    for (int64_t step = 1; step <= 3; step += 2) {
      dbuf p = ot_rand(cap, -1, 1), g = ot_rand(cap, -1, 1), m = ot_rand(cap, -0.1f, 0.1f);
      dbuf v = ot_rand(cap, 0, 0.01f);
      /* the host's values for this step, as optim_adamw.c computes them */
      double bc1 = 1.0 - pow(0.9f, (double)step), bc2 = 1.0 - pow(0.999f, (double)step);
      const float h[3] = {1e-3f, (float)(1e-3f / bc1), (float)sqrt(bc2)};
      dbuf hyper = ot_buf(OT_F32, h, 3);
      ot_case(DT_OP_ADAMW, "step %lld, weight decay 0.01, %s", (long long)step, nm);
      BOTH {
        dt_op op = {.type = DT_OP_ADAMW};
        op.p.adamw = (typeof(op.p.adamw)){.n = n,
                                          .beta1 = 0.9f,
                                          .beta2 = 0.999f,
                                          .eps = 1e-8f,
                                          .weight_decay = 0.01f,
                                          .hyper = F(hyper),
                                          .param = F(p),
                                          .grad = F(g),
                                          .m = F(m),
                                          .v = F(v)};
        RUN(op);
      }
      ot_check("param", p, n);
      ot_check("m", m, n);
      ot_check("v", v, n);
    }
  }
}

/* optim.no_decay's runs in one op: SGD (momentum, not the first step) and AdamW over 1.2M values, more than
 * CUDA's grid has threads (each passes runs as its values go on), in runs of 5, 995, 3, ~600k, 1 and ~500k
 * values and a last of 100k, with and without decay in turn: the two backends agree, and on each the op
 * gives the bits of one op a run (each run's weight decay, its values alone), as the optimizer ran it. */
static void ops_optim_runs(void) {
  const int64_t n = 1200000, starts[] = {0, 5, 1000, 1003, 600000, 600001, 1100000};
  enum { RUNS = sizeof starts / sizeof *starts };
  dt_decay_run table[RUNS];
  for (int r = 0; r < RUNS; r++) table[r] = (dt_decay_run){.start = starts[r], .weight_decay = r % 2 ? 0 : 0.5f};
  dbuf runs = ot_buf(OT_I32, table, (int64_t)(sizeof table / 4));
  for (int kind = 0; kind < 2; kind++) {
    const float h[3] = {0.1f, 0.9f, 0.99f}; /* SGD: lr, not the first step; AdamW: lr, lr / bc1, sqrt(bc2) */
    dbuf hyper = ot_buf(OT_F32, kind ? h : (const float[]){0.1f, 0.0f}, kind ? 3 : 2);
    dbuf p[2], g = ot_rand(n, -1, 1), m[2], v[2];
    p[0] = ot_rand(n, -1, 1), m[0] = ot_rand(n, -0.1f, 0.1f), v[0] = ot_rand(n, 0, 0.01f);
    p[1] = ot_buf(OT_F32, p[0].init, n), m[1] = ot_buf(OT_F32, m[0].init, n), v[1] = ot_buf(OT_F32, v[0].init, n);
    ot_case(kind ? DT_OP_ADAMW : DT_OP_SGD, "7 runs of weight decay 0.5 and 0 in one op, 1.2M values");
    BOTH {
      for (int each = 0; each < 2; each++) /* one op with the table, then one a run */
        for (int r = 0; r < (each ? RUNS : 1); r++) {
          const int64_t lo = each ? starts[r] : 0, len = (each && r + 1 < RUNS ? starts[r + 1] : n) - lo;
          const float wd = each ? table[r].weight_decay : 0.25f; /* the table's, not this */
          const dt_decay_run *t = each ? NULL : (const dt_decay_run *)I(runs);
          dt_op op = kind ? (dt_op){.type = DT_OP_ADAMW,
                                    .p.adamw = {.n = len,
                                                .beta1 = 0.9f,
                                                .beta2 = 0.999f,
                                                .eps = 1e-8f,
                                                .weight_decay = wd,
                                                .hyper = F(hyper),
                                                .param = F(p[each]) + lo,
                                                .grad = F(g) + lo,
                                                .m = F(m[each]) + lo,
                                                .v = F(v[each]) + lo,
                                                .runs = t,
                                                .n_runs = each ? 0 : RUNS}}
                          : (dt_op){.type = DT_OP_SGD,
                                    .p.sgd = {.n = len,
                                              .momentum = 0.9f,
                                              .weight_decay = wd,
                                              .hyper = F(hyper),
                                              .param = F(p[each]) + lo,
                                              .grad = F(g) + lo,
                                              .mom = F(m[each]) + lo,
                                              .runs = t,
                                              .n_runs = each ? 0 : RUNS}};
          RUN(op);
        }
    }
    ot_check("param", p[0], n);
    ot_check("first moment or momentum", m[0], n);
    for (int s = 0; s < 2; s++)
      for (int each = 0; each < 2; each++) { /* the same bits both ways, on each backend */
        float *a = ot_fetch(each ? m[0] : p[0], s), *b = ot_fetch(each ? m[1] : p[1], s);
        if (memcmp(a, b, (size_t)n * sizeof *a))
          fail_msg("op %s: backend %d: one op over the runs differs from one a run (%s)", dt_op_names[ot.op], s,
                   each ? "m" : "param");
        free(a);
        free(b);
      }
  }
}

/* A rank alone has its optimizer count the gradient's non-finite values: three (NaN, inf, -inf) spread
 * over a gradient that many blocks of the kernel share, added to what the count held, on both
 * backends; a finite gradient adds nothing, and the update around them is the one without a count. */
static void ops_optim_nonfinite(void) {
  const int64_t n = 300001, bad[3] = {7, 150000, 300000};
  float *h = ot_host_rand(n, -1, 1);
  dbuf g_finite = ot_buf(OT_F32, h, n);
  h[bad[0]] = NAN, h[bad[1]] = INFINITY, h[bad[2]] = -INFINITY;
  dbuf g_bad = ot_buf(OT_F32, h, n);
  free(h);
  const double start[2] = {2, 2};
  dbuf count = ot_buf(OT_F64, start, 2);
  const float h_sgd[2] = {0.1f, 0.0f}, h_adamw[3] = {0.1f, 0.1f, 1.0f};
  dbuf hyper_sgd = ot_buf(OT_F32, h_sgd, 2), hyper_adamw = ot_buf(OT_F32, h_adamw, 3);
  for (int kind = 0; kind < 2; kind++)
    for (int with_bad = 0; with_bad < 2; with_bad++) {
      const dbuf *g = with_bad ? &g_bad : &g_finite;
      dbuf p[2], m[2], v[2]; /* [1] the same values as [0]: stepped with and without a count */
      p[0] = ot_rand(n, -1, 1), m[0] = ot_rand(n, -1, 1), v[0] = ot_rand(n, 0, 0.01f);
      p[1] = ot_buf(OT_F32, p[0].init, n), m[1] = ot_buf(OT_F32, m[0].init, n), v[1] = ot_buf(OT_F32, v[0].init, n);
      ot_case(kind ? DT_OP_ADAMW : DT_OP_SGD, "%s gradient, counted",
              with_bad ? "three non-finite values in a" : "a finite");
      for (int counted = 0; counted < 2; counted++) BOTH {
          double *out = counted ? D(count) + kind : NULL;
          dt_op op = kind ? (dt_op){.type = DT_OP_ADAMW,
                                    .p.adamw = {.n = n,
                                                .beta1 = 0.9f,
                                                .beta2 = 0.999f,
                                                .eps = 1e-8f,
                                                .hyper = F(hyper_adamw),
                                                .nonfinite = out,
                                                .param = F(p[counted]),
                                                .grad = F(*g),
                                                .m = F(m[counted]),
                                                .v = F(v[counted])}}
                          : (dt_op){.type = DT_OP_SGD,
                                    .p.sgd = {.n = n,
                                              .hyper = F(hyper_sgd),
                                              .nonfinite = out,
                                              .momentum = 0.9f,
                                              .nesterov = 1,
                                              .param = F(p[counted]),
                                              .grad = F(*g),
                                              .mom = F(m[counted])}};
          RUN(op);
        }
      for (int side = 0; side < 2; side++) {
        const double want = 2 + 3 * with_bad;
        if (ot_get(count, side, kind) != want)
          fail_msg("%s on the %s counted %g non-finite gradient values, not %g", kind ? "AdamW" : "SGD",
                   side ? "GPU" : "CPU", ot_get(count, side, kind) - 2, want - 2);
        for (int64_t i = 0; i < n; i += 997) /* counting leaves the update as it was (none of bad[]) */
          if (ot_get(p[0], side, i) != ot_get(p[1], side, i))
            fail_msg("counting changed parameter %lld on the %s", (long long)i, side ? "GPU" : "CPU");
      }
      if (!with_bad) ot_check("param", p[1], n); /* the bad values' parameters are NaN on both sides */
    }
}

/* fp16 loss scaling: the update skipped on an overflow, the unscale, GradScaler's scale rules. */
static void ops_scaler(void) {
  const double overflow[2] = {0, 3};
  dbuf flags = ot_buf(OT_F64, overflow, 2);
  const int64_t n = 70;
  dbuf p = ot_rand(n, -1, 1), g = ot_rand(n, -1, 1), m = ot_rand(n, -1, 1), v = ot_rand(n, 0, 0.01f);
  double p0 = ot_get(p, 0, 5), m0 = ot_get(m, 0, 5);
  const float h[3] = {0.1f, 0.1f, 1.0f};
  dbuf hyper = ot_buf(OT_F32, h, 3);
  ot_case(DT_OP_SGD, "skipped: 3 overflowed values");
  BOTH {
    dt_op op = {.type = DT_OP_SGD,
                .p.sgd = {.n = n,
                          .hyper = F(hyper),
                          .skip = D(flags) + 1,
                          .momentum = 0.9f,
                          .param = F(p),
                          .grad = F(g),
                          .mom = F(m)}};
    RUN(op);
  }
  ot_case(DT_OP_ADAMW, "skipped: 3 overflowed values");
  BOTH {
    dt_op op = {.type = DT_OP_ADAMW,
                .p.adamw = {.n = n,
                            .beta1 = 0.9f,
                            .beta2 = 0.999f,
                            .eps = 1e-8f,
                            .hyper = F(hyper),
                            .skip = D(flags) + 1,
                            .param = F(p),
                            .grad = F(g),
                            .m = F(m),
                            .v = F(v)}};
    RUN(op);
  }
  for (int side = 0; side < 2; side++)
    if (ot_get(p, side, 5) != p0 || ot_get(m, side, 5) != m0)
      fail_msg("a skipped step changed the parameters or the state on the %s", side ? "GPU" : "CPU");
  ot_case(DT_OP_SGD, "not skipped: no overflow");
  BOTH {
    dt_op op = {
        .type = DT_OP_SGD,
        .p.sgd = {
            .n = n, .hyper = F(hyper), .skip = D(flags), .momentum = 0.9f, .param = F(p), .grad = F(g), .mom = F(m)}};
    RUN(op);
  }
  ot_check("param", p, n);
  if (ot_get(p, 0, 5) == p0) fail_msg("a step without overflow left the parameters as they were");

  const float sc[2] = {512.0f, 0.0f};
  dbuf scaler = ot_buf(OT_F32, sc, 2), x = ot_rand(n, -1000, 1000);
  double x5 = ot_get(x, 0, 5);
  ot_case(DT_OP_UNSCALE, "by 512");
  BOTH {
    dt_op op = {.type = DT_OP_UNSCALE, .p.unscale = {.n = n, .scaler = F(scaler), .x = F(x)}};
    RUN(op);
  }
  ot_check("unscaled", x, n);
  if (ot_get(x, 1, 5) != (double)(float)(x5 * (1.0 / 512.0)))
    fail_msg("unscale: %g / 512 gave %g", x5, ot_get(x, 1, 5));
  /* (scale, good steps) before, overflow, interval -> after: GradScaler's rules, by hand */
  const struct {
    float scale, good;
    int overflow;
    int64_t interval;
    float want_scale, want_good;
  } cases[] = {
      {512, 5, 0, 2000, 512, 6},    {512, 1999, 0, 2000, 1024, 0},
      {512, 1999, 1, 2000, 256, 0}, {65536, 0, 1, 2000, 32768, 0},
      {2, 0, 0, 1, 4, 0},           {3e38f, 1999, 0, 2000, 3e38f, 0}}; /* growth that would overflow: the scale stays */
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    const float before[2] = {cases[c].scale, cases[c].good};
    dbuf s = ot_buf(OT_F32, before, 2);
    ot_case(DT_OP_SCALER_UPDATE, "scale %g, %g good steps, overflow %d, interval %lld", cases[c].scale, cases[c].good,
            cases[c].overflow, (long long)cases[c].interval);
    BOTH {
      dt_op op = {.type = DT_OP_SCALER_UPDATE,
                  .p.scaler_update = {.overflow = D(flags) + cases[c].overflow,
                                      .growth_interval = cases[c].interval,
                                      .growth = 2.0f,
                                      .backoff = 0.5f,
                                      .scaler = F(s)}};
      RUN(op);
    }
    for (int side = 0; side < 2; side++)
      if (ot_get(s, side, 0) != cases[c].want_scale || ot_get(s, side, 1) != cases[c].want_good)
        fail_msg("op scaler_update [%s] on the %s: (%g, %g), expected (%g, %g)", ot.kase, side ? "GPU" : "CPU",
                 ot_get(s, side, 0), ot_get(s, side, 1), cases[c].want_scale, cases[c].want_good);
  }
}

/* data.cache device: rows of a uint8, float, double or int32 table, in any order and repeated,
 * widened to float (int32 copied); checked against the table by hand as well. */
static void ops_gather(void) {
  enum { N = 10, ROW = 7 };
  uint8_t u8[N * ROW + 4];
  float f32[N * ROW];
  double f64[N * ROW];
  int32_t i32[N];
  for (int i = 0; i < N * ROW; i++) {
    u8[i] = (uint8_t)(dt_hash64((uint64_t)i) % 256);
    f32[i] = (float)i * 0.25f - 3.0f;
    f64[i] = 1.0 / (i + 1.0);
  }
  for (int i = 0; i < N; i++) i32[i] = 100 + i;
  const int32_t rows[5] = {9, 0, 3, 3, 7};
  dbuf idx = ot_buf(OT_I32, rows, 5);
  dbuf src[4] = {ot_buf(OT_F32, u8, (N * ROW + 3) / 4), ot_buf(OT_F32, f32, N * ROW), ot_buf(OT_F64, f64, N * ROW),
                 ot_buf(OT_I32, i32, N)};
  for (int type = DT_GATHER_U8; type <= DT_GATHER_I32; type++) {
    const int64_t row = type == DT_GATHER_I32 ? 1 : ROW;
    for (int64_t n = 0; n <= 5; n += 5) {
      dbuf out = type == DT_GATHER_I32 ? ot_buf(OT_I32, NULL, 5) : ot_rand(5 * ROW, -1, 1);
      ot_case(DT_OP_GATHER, "%s rows 9, 0, 3, 3, 7 (%lld of them)",
              type == DT_GATHER_U8    ? "uint8"
              : type == DT_GATHER_F32 ? "float"
              : type == DT_GATHER_F64 ? "double"
                                      : "int32",
              (long long)n);
      BOTH {
        dt_op op = {
            .type = DT_OP_GATHER,
            .p.gather = {.n = n, .row = row, .type = type, .src = src[type].p[s_], .idx = I(idx), .out = out.p[s_]}};
        RUN(op);
      }
      ot_check("gathered", out, n * row);
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < row; j++) {
          int64_t k = rows[i] * row + j;
          double want = type == DT_GATHER_U8    ? u8[k]
                        : type == DT_GATHER_F32 ? f32[k]
                        : type == DT_GATHER_F64 ? (float)f64[k]
                                                : i32[k];
          if (ot_get(out, 1, i * row + j) != want)
            fail_msg("op gather [%s]: out[%lld][%lld] = %g, expected %g", ot.kase, (long long)i, (long long)j,
                     ot_get(out, 1, i * row + j), want);
        }
    }
  }
}

/* x as FP32 (B, C, S) (f16 0), or (f16: half.h's format, the CUDA backend's) as 16-bit NHWC (B, S, C), whose
 * values are checked against the FP32 op's, rounded, bit for bit on both backends. */
static void ops_input_in(int f16) {
  const int64_t S = 20;
  FOR_ROWS(r) {
    int64_t n = cap * 3 * S;
    float *raw_h = ot_host_rand(n, 0, 256);
    for (int64_t i = 0; i < n; i++) raw_h[i] = floorf(raw_h[i]);
    dbuf raw = ot_buf(OT_F32, raw_h, n);
    free(raw_h);
    const float norm[6] = {0.2860f, 0.4218f, 0.5071f, 0.3530f, 0.2420f, 0.2865f}; /* mean, then std */
    dbuf stats = ot_buf(OT_F32, norm, 6);
    dbuf x1 = ot_rand(n, -1, 1), x2 = ot_rand(n, -1, 1), x16 = ot_rand16(n, -1, 1);
    ot_case(DT_OP_INPUT, "mean and std (C = 3), and none%s, %s", f16 ? ", and 16-bit NHWC" : "", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_INPUT,
                  .p.input = {.b = rows,
                              .c = 3,
                              .s = S,
                              .scale = 1.0f / 255.0f,
                              .mean = F(stats),
                              .std = F(stats) + 3,
                              .raw = F(raw),
                              .x = F(x1)}};
      RUN(op);
      if (f16) {
        op.p.input.x = F(x16), op.p.input.x16 = f16;
        RUN(op);
        op.p.input.x16 = 0;
      }
      op.p.input.mean = op.p.input.std = NULL;
      op.p.input.x = F(x2);
      RUN(op);
    }
    ot_check("x (with mean and std)", x1, rows * 3 * S);
    ot_check("x (no mean and std)", x2, rows * 3 * S);
    if (!f16) continue;
    for (int side = 0; side < 2; side++) {
      float *fp32 = ot_fetch(x1, side);
      uint16_t *got = ot_fetch(x16, side);
      for (int64_t b = 0; b < rows; b++)
        for (int64_t c = 0; c < 3; c++)
          for (int64_t i = 0; i < S; i++) {
            const uint16_t want = dt_to_16(fp32[(b * 3 + c) * S + i], f16), at = got[(b * S + i) * 3 + c];
            if (at != want)
              fail_msg("op input [%s]: on %s the 16-bit x at (%lld, %lld, %lld) is %#x, the FP32 x's rounding %#x",
                       ot.kase, side ? "CUDA" : "the CPU", (long long)b, (long long)i, (long long)c, at, want);
          }
      for (int64_t i = rows * 3 * S; i < cap * 3 * S; i++)
        if (got[i] != ((const uint16_t *)x16.init)[i])
          fail_msg("op input [%s]: on %s 16-bit value %lld, past the rows, changed", ot.kase, side ? "CUDA" : "the CPU",
                   (long long)i);
      free(fp32);
      free(got);
    }
  }
}

/* upload() queues a copy whose source the caller may reuse at once: the values uploaded are the
 * ones at the call, though nothing has run yet (the stand-in runs queued work only at a sync). */
static __attribute__((noinline)) void upload_from_stack(dt_backend *be, float *dst, float base) {
  float v[64];
  for (int i = 0; i < 64; i++) v[i] = base + (float)i;
  be->upload(be, dst, v, sizeof v);
}

static __attribute__((noinline)) void scribble_stack(void) {
  volatile float junk[8192];
  for (int i = 0; i < 8192; i++) junk[i] = (float)(i % 3 ? -1e30 : NAN);
  (void)junk[0];
}

static int on_standin(void) {
  char device[512];
  size_t free_bytes = 0;
  gpu_describe(0, device, sizeof device, &free_bytes);
  return strstr(device, "stand-in") != NULL;
}

static void ops_upload_download(void) {
  dbuf a = ot_rand(64, -1, 1), b = ot_rand(64, -1, 1), c = ot_rand(70, -1, 1);
  ot_case(DT_OP_COPY, "uploads from a stack that is then overwritten, then a queued copy");
  for (int s = 0; s < 2; s++) {
    upload_from_stack(ot.be[s], a.p[s], 100);
    upload_from_stack(ot.be[s], b.p[s], 200);
    scribble_stack();
    backend_copy(ot.be[s], c.p[s], a.p[s], 64);
  }
  for (int s = 0; s < 2; s++)
    for (int i = 0; i < 64; i++)
      if (ot_get(a, s, i) != 100 + i || ot_get(b, s, i) != 200 + i || ot_get(c, s, i) != 100 + i)
        fail_msg("upload [%s]: element %d on %s: %g, %g, %g", ot.kase, i, s ? "CUDA" : "CPU", ot_get(a, s, i),
                 ot_get(b, s, i), ot_get(c, s, i));
  ot_check("copy destination", c, 64);
  /* a download into memory from alloc_host is valid once a mark after it is reached: two steps'
   * results, the second queued before the first is waited for, each into its own host memory from
   * the same device buffer; the second's mark, reached, covers the first's work too */
  for (int s = 0; s < 2; s++) {
    dt_backend *be = ot.be[s];
    double *host = be->alloc_host(be, 4 * sizeof(double));
    const double first[2] = {4.5, -2}, second[2] = {7.25, 3};
    double *dev = (double *)be->alloc(be, sizeof first);
    be->upload(be, dev, first, sizeof first);
    be->download(be, host, dev, sizeof first);
    be->mark(be, 1);
    be->upload(be, dev, second, sizeof second);
    be->download(be, host + 2, dev, sizeof second);
    be->mark(be, 0);
    int polls = 0;
    while (!be->reached(be, 1)) polls++;
    if (host[0] != 4.5 || host[1] != -2) fail_msg("download on %s: %g, %g", s ? "CUDA" : "CPU", host[0], host[1]);
    while (!be->reached(be, 0)) polls++;
    if (host[2] != 7.25 || host[3] != 3)
      fail_msg("second download on %s: %g, %g", s ? "CUDA" : "CPU", host[2], host[3]);
    if (s && polls == 0 && on_standin()) /* the stand-in is never done at the first query: a stub would be */
      fail_msg("the stand-in reached both marks at the first query");
    if (!be->reached(be, 1)) fail_msg("a reached mark is no longer reached on %s", s ? "CUDA" : "CPU");
    be->free(be, dev);
    be->free_host(be, host);
  }
  /* a capture that outgrows a scratch buffer (a batchnorm's partial sums) retires the old one (the work
   * queued before may use it); it is freed once a mark recorded after it is reached, though work queued
   * after that mark (the next step, queued ahead) has yet to run */
  {
    dt_backend *be = ot.be[1];
    const int64_t c = 64, s_big = 1 << 14;
    float *x = be->alloc(be, c * s_big * sizeof(float));
    double *sums = (double *)be->alloc(be, (2 * c + 1) * sizeof(double));
    double *host = be->alloc_host(be, sizeof(double));
    float *ones = malloc(c * s_big * sizeof(float));
    for (int64_t i = 0; i < c * s_big; i++) ones[i] = 1;
    be->upload(be, x, ones, c * s_big * sizeof(float));
    dt_op st = {.type = DT_OP_BN_STATS, .p.bn_stats = {.b = 1, .c = 1, .s = 16, .x = x, .sums = sums}};
    backend_run(be, &st); /* sizes the partial sums for one channel of 16 */
    be->sync(be);
    be->capture_begin(be);
    st.p.bn_stats.c = c, st.p.bn_stats.s = s_big;
    backend_run(be, &st); /* outgrows them */
    void *graph = be->capture_end(be);
    const size_t with_retired = be->mem_used;
    be->replay(be, graph);
    be->download(be, host, sums, sizeof(double));
    be->mark(be, 0);
    be->upload(be, x, ones, sizeof(float)); /* work after the mark: the stream is not idle at the mark */
    be->mark(be, 1);
    while (!be->reached(be, 0)) {
    }
    if (host[0] != (double)s_big) fail_msg("the captured batchnorm sum: %g (want %g)", host[0], (double)s_big);
    if (be->mem_used >= with_retired)
      fail_msg("the buffer retired during the capture is still held once its step's mark is reached (%zu bytes)",
               be->mem_used);
    while (!be->reached(be, 1)) {
    }
    be->graph_free(be, graph);
    be->free(be, x);
    be->free(be, sums);
    be->free_host(be, host);
    free(ones);
  }
  /* upload_ahead straight into a new buffer: the copy (CUDA: on the copy stream) must follow the
   * memset that cleared the buffer on the compute stream (the stand-in's hazard checker stops the
   * program otherwise, and a GPU could let the memset win) */
  for (int s = 0; s < 2; s++) {
    const float want[3] = {1.5f, -2.5f, 3.5f};
    float got[3] = {0};
    float *fresh = ot.be[s]->alloc(ot.be[s], sizeof want);
    ot.be[s]->upload_ahead(ot.be[s], fresh, want, sizeof want);
    ot.be[s]->to_host(ot.be[s], got, fresh, sizeof got);
    if (memcmp(got, want, sizeof want))
      fail_msg("upload_ahead into a new buffer on %s: %g", s ? "CUDA" : "CPU", got[0]);
    ot.be[s]->free(ot.be[s], fresh);
  }
}

/* The 16-bit value i of buffer b on one side (0: CPU, 1: CUDA), widened. */
static float ot_get16(dbuf b, int side, int64_t i) {
  uint16_t v;
  ot.be[side]->to_host(ot.be[side], &v, (uint16_t *)b.p[side] + i, sizeof v);
  return dt_from_16(v, ot_format16());
}

/* A residual's 16-bit NHWC ops (model.c's pick_trunk16) in the backend's format: the sum of its branches with
 * and without its relu, the relu's backward (in place, as the residual runs it, and not), and a global average
 * pool of its sums and that pool's backward. n values a row, a multiple of 8 (CUDA's 16-byte loads) and not
 * (a tail), from an aligned start and from one value past it (every value on its own). The same bits on both
 * backends, nothing written past n, and on the CPU the values worked by hand from the widened inputs. */
static void ops_residual16(void) {
  const int f16 = ot_format16();
  FOR_ROWS(r) {
    for (int shape = 0; shape < 3; shape++) {
      const int64_t feat = shape == 1 ? 37 : 40, off = shape == 2, n = rows * feat, all = cap * feat + 8;
      const char *how = shape == 0 ? "aligned" : shape == 1 ? "a tail" : "unaligned";
#define H16(b) ((float *)((uint16_t *)(b).p[s_] + off))
      dbuf a = ot_rand16(all, -1, 1), b = ot_rand16(all, -1, 1), y = ot_rand16(all, -1, 1);
      for (int relu = 0; relu < 2; relu++) {
        ot_case(DT_OP_ADD, "16-bit, %s%s, %s", how, relu ? ", relu" : "", ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_ADD};
          op.p.add = (typeof(op.p.add)){.n = n, .a = H16(a), .b = H16(b), .y = H16(y), .relu = relu, .h16 = f16};
          RUN(op);
        }
        ot_check16("y", y, all, off + n);
        ot_check_bits("y", y);
        for (int64_t i = 0; i < n; i++) {
          const float v = ot_get16(a, 0, off + i) + ot_get16(b, 0, off + i);
          const float want = dt_from_16(dt_to_16(relu && v < 0 ? 0.0f : v, f16), f16);
          if (ot_get16(y, 0, off + i) != want)
            fail_msg("op add [%s]: y[%lld] = %g, by hand %g", ot.kase, (long long)i, ot_get16(y, 0, off + i), want);
        }
      }
      /* the relu's backward where x is y of the sum above: zeros (relu), negatives and positives */
      for (int in_place = 0; in_place < 2; in_place++) {
        dbuf dy = ot_rand16(all, -1, 1), dx = ot_rand16(all, -1, 1);
        ot_case(DT_OP_ACT_BWD, "16-bit relu, %s%s, %s", how, in_place ? ", in place" : "", ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_ACT_BWD};
          op.p.act_bwd = (typeof(op.p.act_bwd)){.kind = DT_ACT_RELU,
                                                .n = n,
                                                .x = H16(a),
                                                .y = H16(a),
                                                .dy = H16(dy),
                                                .dx = in_place ? H16(dy) : H16(dx),
                                                .h16 = f16};
          RUN(op);
        }
        const dbuf out = in_place ? dy : dx;
        ot_check16("dx", out, all, off + n);
        ot_check_bits("dx", out);
        for (int64_t i = 0; i < n; i++) {
          const float x = ot_get16(a, 0, off + i);
          const uint16_t g = ((const uint16_t *)dy.init)[off + i];
          uint16_t got;
          ot.be[0]->to_host(ot.be[0], &got, (uint16_t *)out.p[0] + off + i, sizeof got);
          if (got != (x > 0 ? g : 0))
            fail_msg("op act_bwd [%s]: dx[%lld] = 0x%04x where x is %g and dy 0x%04x", ot.kase, (long long)i, got, x,
                     g);
        }
      }
#undef H16
    }
    /* global average pooling: (B, S, C) -> (B, C), C past a warp and not a multiple of 8 */
    const int64_t sp = 9, c = 37;
    dbuf x = ot_rand16(cap * sp * c, -2, 2), y = ot_rand(cap * c, -1, 1), dy = ot_rand(cap * c, -1, 1);
    dbuf dx = ot_rand16(cap * sp * c, -1, 1);
    ot_case(DT_OP_GAP16_FWD, "(9, 37), %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_GAP16_FWD};
      op.p.gap16_fwd = (typeof(op.p.gap16_fwd)){.b = rows, .s = sp, .c = c, .format = f16, .x = F(x), .y = F(y)};
      RUN(op);
    }
    ot_check("y", y, rows * c);
    ot_check_bits("y", y);
    for (int64_t i = 0; i < rows * c; i++) {
      double sum = 0;
      for (int64_t k = 0; k < sp; k++) sum += ot_get16(x, 0, (i / c * sp + k) * c + i % c);
      if (fabs(ot_get(y, 0, i) - sum / sp) > 1e-6 * (1 + fabs(sum / sp)))
        fail_msg("op gap16_fwd [%s]: y[%lld] = %g, by hand %g", ot.kase, (long long)i, ot_get(y, 0, i), sum / sp);
    }
    ot_case(DT_OP_GAP16_BWD, "(9, 37), %s", ROWS_NAME(r));
    BOTH {
      dt_op op = {.type = DT_OP_GAP16_BWD};
      op.p.gap16_bwd = (typeof(op.p.gap16_bwd)){.b = rows, .s = sp, .c = c, .format = f16, .dy = F(dy), .dx = F(dx)};
      RUN(op);
    }
    ot_check16("dx", dx, cap * sp * c, rows * sp * c);
    ot_check_bits("dx", dx);
    for (int64_t i = 0; i < rows * sp * c; i++) {
      const float want = dt_from_16(dt_to_16((float)ot_get(dy, 0, i / (sp * c) * c + i % c) / (float)sp, f16), f16);
      if (ot_get16(dx, 0, i) != want)
        fail_msg("op gap16_bwd [%s]: dx[%lld] = %g, by hand %g", ot.kase, (long long)i, ot_get16(dx, 0, i), want);
    }
  }
}

/* Strided batched GEMM (attention's scores and context): products at element strides with gaps
 * between them, or B shared by all (stride 0), every transpose combination, alpha and beta; the
 * gaps keep their values on both. Then no rows (m = 0): nothing written. */
static void ops_gemm_batched(void) {
  const int64_t m = 5, n = 7, k = 6;
  for (int batch = 2; batch <= 5; batch += 3)
    for (int shared_b = 0; shared_b < 2; shared_b++)
      for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
          const int64_t sa = m * k + 3, sb = shared_b ? 0 : k * n + 1, sc = m * n + 2;
          dbuf a = ot_rand(batch * sa, -1, 1), b = ot_rand(batch * (k * n + 1), -1, 1), c = ot_rand(batch * sc, -1, 1);
          ot_case(DT_OP_GEMM, "batched: %d products, trans_a %d, trans_b %d, %s, alpha 0.7, beta 0.3", batch, ta, tb,
                  shared_b ? "B shared (stride 0)" : "strides with gaps");
          BOTH {
            dt_op op = {.type = DT_OP_GEMM,
                        .p.gemm = {.trans_a = ta,
                                   .trans_b = tb,
                                   .m = m,
                                   .n = n,
                                   .k = k,
                                   .alpha = 0.7f,
                                   .beta = 0.3f,
                                   .a = F(a),
                                   .b = F(b),
                                   .c = F(c),
                                   .batch = batch,
                                   .stride_a = sa,
                                   .stride_b = sb,
                                   .stride_c = sc}};
            RUN(op);
          }
          ot_check("C", c, c.n);
          for (int side = 0; side < 2; side++) {
            float *h = ot_fetch(c, side);
            for (int64_t i = 0; i < c.n; i++)
              if (i % sc >= m * n && h[i] != ((float *)c.init)[i]) {
                free(h);
                fail_msg("op gemm [%s]: C[%lld], between products, changed on %s", ot.kase, (long long)i,
                         side ? "CUDA" : "CPU");
              }
            free(h);
          }
        }
  dbuf a = ot_rand(4 * 12, -1, 1), b = ot_rand(4 * 12, -1, 1), c = ot_rand(4 * 12, -1, 1);
  ot_case(DT_OP_GEMM, "batched: 4 products of no rows");
  BOTH {
    dt_op op = {.type = DT_OP_GEMM,
                .p.gemm = {.m = 0,
                           .n = 4,
                           .k = 3,
                           .alpha = 1.0f,
                           .a = F(a),
                           .b = F(b),
                           .c = F(c),
                           .batch = 4,
                           .stride_a = 12,
                           .stride_b = 12,
                           .stride_c = 12}};
    RUN(op);
  }
  ot_check("C", c, 0);
}

/* n tokens (as floats) in [0, vocab), every third one the same token. */
static dbuf ot_tokens(int64_t n, int64_t vocab) {
  float *h = calloc((size_t)n + 1, sizeof(float));
  uint64_t seed = ot.seed++;
  for (int64_t i = 0; i < n; i++) h[i] = (float)(i % 3 ? dt_hash64(seed ^ (uint64_t)i) % (uint64_t)vocab : 1);
  dbuf b = ot_buf(OT_F32, h, n);
  free(h);
  return b;
}

/* Token and position embeddings: (B, T = 5) tokens with repeats, D = 37 (not a multiple of 32) and
 * D = 300 (several column blocks), vocabularies below and above the 32 token ranges; with and
 * without positions. The backward adds rows in the CPU's order: the same bits on both. */
static void ops_embed(void) {
  const int64_t T = 5, shapes[][2] = {{37, 11}, {300, 70}}; /* D, vocab */
  FOR_ROWS(r) {
    for (int si = 0; si < 2; si++)
      for (int pos = 1; pos >= 0; pos--) {
        const int64_t D = shapes[si][0], V = shapes[si][1], n = rows * T, ncap = cap * T;
        dbuf tok = ot_tokens(ncap, V), wte = ot_rand(V * D, -1, 1), wpe = ot_rand(T * D, -1, 1);
        dbuf y = ot_rand(ncap * D, -1, 1), dy = ot_rand(ncap * D, -1, 1), dwte = ot_rand(V * D, -1, 1);
        dbuf dwpe = ot_rand(T * D, -1, 1);
        ot_case(DT_OP_EMBED_FWD, "D %lld, vocab %lld, %s, %s", (long long)D, (long long)V,
                pos ? "positions" : "no positions", ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_EMBED_FWD,
                      .p.embed_fwd = {.n = n,
                                      .t = T,
                                      .d = D,
                                      .vocab = V,
                                      .tokens = F(tok),
                                      .wte = F(wte),
                                      .wpe = pos ? F(wpe) : NULL,
                                      .y = F(y)}};
          RUN(op);
        }
        ot_check("y", y, n * D);
        ot_case(DT_OP_EMBED_BWD, "D %lld, vocab %lld, %s, %s", (long long)D, (long long)V,
                pos ? "positions" : "no positions", ROWS_NAME(r));
        BOTH {
          dt_op op = {.type = DT_OP_EMBED_BWD,
                      .p.embed_bwd = {.n = n,
                                      .t = T,
                                      .d = D,
                                      .vocab = V,
                                      .tokens = F(tok),
                                      .dy = F(dy),
                                      .dwte = F(dwte),
                                      .dwpe = pos ? F(dwpe) : NULL}};
          RUN(op);
        }
        ot_check("dwte (added into)", dwte, n ? dwte.n : 0);
        ot_check("dwpe (added into)", dwpe, n && pos ? dwpe.n : 0);
        ot_check_bits("dwte", dwte);
        ot_check_bits("dwpe", dwpe);
      }
  }
}

/* Layernorm over D = 37 and D = 300 (more than a block's threads), rows of (B, T = 5), and 130
 * rows (more than K_LN_CHUNKS chunks of dgamma, dbeta): y, mean, rstd; dx overwritten, dgamma
 * and dbeta added into. */
static dt_op ln_fwd_op(int64_t n, int64_t d, const float *x, const float *gamma, const float *beta, float *y,
                       float *mean, float *rstd) {
  return (dt_op){.type = DT_OP_LN_FWD,
                 .p.ln_fwd = {
                     .n = n, .d = d, .eps = 1e-5f, .x = x, .gamma = gamma, .beta = beta, .y = y, .mean = mean, .rstd = rstd}};
}

static dt_op ln_bwd_op(int64_t n, int64_t d, const float *x, const float *dy, const float *gamma, const float *mean,
                       const float *rstd, float *dx, const float *dx_add, float *dgamma, float *dbeta) {
  return (dt_op){.type = DT_OP_LN_BWD,
                 .p.ln_bwd = {.n = n,
                              .d = d,
                              .x = x,
                              .dy = dy,
                              .gamma = gamma,
                              .mean = mean,
                              .rstd = rstd,
                              .dx = dx,
                              .dx_add = dx_add,
                              .dgamma = dgamma,
                              .dbeta = dbeta}};
}

static void ln_case(int64_t D, int64_t cap, int64_t n, const char *rows_name) {
  dbuf x = ot_rand(cap * D, -2, 3), gamma = ot_rand(D, 0.5f, 1.5f), beta = ot_rand(D, -0.5f, 0.5f);
  dbuf y = ot_rand(cap * D, -1, 1), mean = ot_rand(cap, -1, 1), rstd = ot_rand(cap, -1, 1);
  dbuf dy = ot_rand(cap * D, -1, 1), dx = ot_rand(cap * D, -1, 1), dgamma = ot_rand(D, -1, 1);
  dbuf dbeta = ot_rand(D, -1, 1);
  ot_case(DT_OP_LN_FWD, "D %lld, %s", (long long)D, rows_name);
  BOTH {
    dt_op op = ln_fwd_op(n, D, F(x), F(gamma), F(beta), F(y), F(mean), F(rstd));
    RUN(op);
  }
  ot_check("y", y, n * D);
  ot_check("mean", mean, n);
  ot_check("rstd", rstd, n);
  ot_case(DT_OP_LN_BWD, "D %lld, %s", (long long)D, rows_name);
  BOTH {
    dt_op op = ln_bwd_op(n, D, F(x), F(dy), F(gamma), F(mean), F(rstd), F(dx), NULL, F(dgamma), F(dbeta));
    RUN(op);
  }
  ot_check("dx", dx, n * D);
  ot_check("dgamma (added into)", dgamma, n ? D : 0);
  ot_check("dbeta (added into)", dbeta, n ? D : 0);
  ot_case(DT_OP_LN_BWD, "D %lld, no dx (the first layer's), %s", (long long)D, rows_name);
  BOTH {
    dt_op op = ln_bwd_op(n, D, F(x), F(dy), F(gamma), F(mean), F(rstd), NULL, NULL, F(dgamma), F(dbeta));
    RUN(op);
  }
  ot_check("dgamma (added into twice)", dgamma, n ? D : 0);
  ot_check("dbeta (added into twice)", dbeta, n ? D : 0);
  /* a residual's gradient added to dx as it is written (dx_add): on each backend the bits of the op without
   * it followed by the add op, as the residual adds it apart (model.fuse false) */
  dbuf add = ot_rand(cap * D, -1, 1), fused = ot_rand(cap * D, -1, 1), apart = ot_buf(OT_F32, fused.init, cap * D);
  ot_case(DT_OP_LN_BWD, "D %lld, dx_add, %s", (long long)D, rows_name);
  for (int sep = 0; sep < 2; sep++) BOTH {
      dt_op op = ln_bwd_op(n, D, F(x), F(dy), F(gamma), F(mean), F(rstd), sep ? F(apart) : F(fused),
                           sep ? NULL : F(add), F(dgamma), F(dbeta));
      RUN(op);
      if (sep) {
        dt_op sum = {.type = DT_OP_ADD, .p.add = {.n = n * D, .a = F(apart), .b = F(add), .y = F(apart)}};
        RUN(sum);
      }
    }
  ot_check("dx plus dx_add", fused, n * D);
  for (int side = 0; side < 2; side++)
    for (int64_t i = 0; i < n * D; i++)
      if (ot_get(fused, side, i) != ot_get(apart, side, i))
        fail_msg("op ln_bwd [%s]: dx[%lld] on the %s is %.9g with dx_add, %.9g with the add op after", ot.kase,
                 (long long)i, side ? "GPU" : "CPU", ot_get(fused, side, i), ot_get(apart, side, i));
}

static void ops_layernorm(void) {
  const int64_t T = 5;
  FOR_ROWS(r) {
    ln_case(37, cap * T, rows * T, ROWS_NAME(r));
    ln_case(300, cap * T, rows * T, ROWS_NAME(r));
  }
  ln_case(37, 130, 130, "130 rows");
}

/* A layernorm before a linear or attention layer under bf16 (model.c's pick_norm16): y written in bfloat16 rows
 * (y16: rounded once from the FP32 value), dy read from them (dy16), with dx_add, and without dx; D 40, 37 (rows
 * padded to 40: the padding never written) and 264. */
static void ops_layernorm_bf16(void) {
  const int64_t T = 5, dims[] = {40, 37, 264};
  for (int di = 0; di < 3; di++) FOR_ROWS(r) {
      const int64_t D = dims[di], ld = dt_ld16(D), n = rows * T, c = cap * T;
      dbuf x = ot_rand(c * D, -2, 3), gamma = ot_rand(D, 0.5f, 1.5f), beta = ot_rand(D, -0.5f, 0.5f);
      dbuf y = ot_rand16(c * ld, -1, 1), mean = ot_rand(c, -1, 1), rstd = ot_rand(c, -1, 1);
      ot_case(DT_OP_LN_FWD, "y in bfloat16 rows (y16), D %lld, %s", (long long)D, ROWS_NAME(r));
      BOTH {
        dt_op op = ln_fwd_op(n, D, F(x), F(gamma), F(beta), F(y), F(mean), F(rstd));
        op.p.ln_fwd.y16 = DT_F16_BF16;
        RUN(op);
      }
      ot_check16_rows("y", y, c * ld, n * ld, D, ld);
      ot_check("mean", mean, n);
      ot_check("rstd", rstd, n);
      dbuf dy = ot_rand16(c * ld, -1, 1), dx = ot_rand(c * D, -1, 1), add = ot_rand(c * D, -1, 1);
      dbuf dgamma = ot_rand(D, -1, 1), dbeta = ot_rand(D, -1, 1);
      ot_case(DT_OP_LN_BWD, "dy in bfloat16 rows (dy16), dx_add, then no dx, D %lld, %s", (long long)D, ROWS_NAME(r));
      for (int with_dx = 1; with_dx >= 0; with_dx--) BOTH {
          dt_op op = ln_bwd_op(n, D, F(x), F(dy), F(gamma), F(mean), F(rstd), with_dx ? F(dx) : NULL,
                               with_dx ? F(add) : NULL, F(dgamma), F(dbeta));
          op.p.ln_bwd.dy16 = DT_F16_BF16;
          RUN(op);
        }
      ot_check("dx plus dx_add", dx, n * D);
      ot_check("dgamma (added into twice)", dgamma, n ? D : 0);
      ot_check("dbeta (added into twice)", dbeta, n ? D : 0);
    }
}

/* Softmax over rows of (B, H, T, T) scores, causal (row r: columns j <= r % T) and not, scale
 * 1/sqrt(8): T = 5 and 33 (a partial warp), then T = 300 (more than a block's threads). Every
 * seventh row is shifted by 250 (exp(scale * x) overflows a float unless the max is taken out). */
static void softmax_case(int64_t T, int64_t cap_rows, int64_t rows, const char *rows_name) {
  for (int causal = 0; causal < 2; causal++) {
    float *xh = ot_host_rand(cap_rows * T, -4, 4);
    for (int64_t i = 0; i < cap_rows * T; i++) xh[i] += (i / T) % 7 == 3 ? 250.0f : 0.0f;
    dbuf x = ot_buf(OT_F32, xh, cap_rows * T);
    free(xh);
    dbuf y = ot_rand(cap_rows * T, -1, 1), dy = ot_rand(cap_rows * T, -1, 1);
    dbuf dx = ot_rand(cap_rows * T, -1, 1);
    ot_case(DT_OP_SOFTMAX_FWD, "T %lld, %s, %s", (long long)T, causal ? "causal" : "not causal", rows_name);
    BOTH {
      dt_op op = {
          .type = DT_OP_SOFTMAX_FWD,
          .p.softmax_fwd = {.rows = rows, .t = T, .causal = causal, .scale = 0.35355339f, .x = F(x), .y = F(y)}};
      RUN(op);
    }
    ot_check("y", y, rows * T);
    ot_case(DT_OP_SOFTMAX_BWD, "T %lld, %s, %s", (long long)T, causal ? "causal" : "not causal", rows_name);
    BOTH {
      dt_op op = {
          .type = DT_OP_SOFTMAX_BWD,
          .p.softmax_bwd = {
              .rows = rows, .t = T, .causal = causal, .scale = 0.35355339f, .y = F(y), .dy = F(dy), .dx = F(dx)}};
      RUN(op);
    }
    ot_check("dx", dx, rows * T);
  }
}

static void ops_softmax(void) {
  const int64_t H = 2;
  FOR_ROWS(r) {
    softmax_case(5, cap * H * 5, rows * H * 5, ROWS_NAME(r));
    softmax_case(33, cap * H * 33, rows * H * 33, ROWS_NAME(r));
  }
  softmax_case(300, 2 * 300, 2 * 300, "(1, 2, 300, 300)");
}

/* The fused attention ops over the layer's layout: q, k, v in qkv (B, T, 3, H, hd), o in (B, T, H, hd). */
static dt_op attention_fwd_op(dt_attention_geom g, const float *qkv, float *o, float *lse) {
  const int64_t c = g.h * g.hd;
  return (dt_op){.type = DT_OP_ATTENTION_FWD,
                 .p.attention_fwd = {.g = g, .q = qkv, .k = qkv + c, .v = qkv + 2 * c, .o = o, .lse = lse}};
}

static dt_op attention_bwd_op(dt_attention_geom g, const float *qkv, const float *o, const float *lse,
                              const float *dout, float *delta, float *dqkv) {
  const int64_t c = g.h * g.hd;
  return (dt_op){.type = DT_OP_ATTENTION_BWD,
                 .p.attention_bwd = {.g = g,
                                     .q = qkv,
                                     .k = qkv + c,
                                     .v = qkv + 2 * c,
                                     .o = o,
                                     .lse = lse,
                                     .dout = dout,
                                     .delta = delta,
                                     .dq = dqkv,
                                     .dk = dqkv + c,
                                     .dv = dqkv + 2 * c}};
}

/* f rounded to the nearest bfloat16, ties to even (finite f). */
static float round_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* GEMM under bf16: A and B of every dimension at least 16 are copied to bfloat16 (rounded to nearest
 * even, rows padded to 8 values) and multiplied with FP32 sums, so CUDA on the FP32 operands matches
 * the CPU on operands rounded to bfloat16 to float rounding (1e-5); a GEMM on FP32 operands under
 * _FAST_16BF misses that by about 1e-3. Every transpose (n and k odd: padded rows), a linear layer's
 * forward with its bias, and alpha and beta. */
static void ops_gemm_bf16(void) {
  static const struct {
    int ta, tb, bias;
    int64_t m, n, k;
    float alpha, beta;
  } cases[] = {{0, 1, 1, 40, 21, 27, 1.0f, 0.0f},
               {1, 0, 0, 21, 27, 40, 1.0f, 1.0f},
               {0, 0, 0, 40, 27, 21, 1.0f, 0.0f},
               {1, 1, 0, 17, 19, 33, 0.5f, 0.25f}};
  size_t held16 = 0, held_ws = 0; /* the CUDA backend's h16 and workspace (cuBLASLt's), as the estimate says */
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const int64_t m = cases[i].m, n = cases[i].n, k = cases[i].k;
    float *ha = ot_host_rand(m * k, -1, 1), *hb = ot_host_rand(k * n, -1, 1);
    dbuf a = ot_buf(OT_F32, ha, m * k), b = ot_buf(OT_F32, hb, k * n);
    for (int64_t j = 0; j < m * k; j++) ha[j] = round_bf16(ha[j]);
    for (int64_t j = 0; j < k * n; j++) hb[j] = round_bf16(hb[j]);
    dbuf a16 = ot_buf(OT_F32, ha, m * k), b16 = ot_buf(OT_F32, hb, k * n);
    dbuf c = ot_rand(m * n, -1, 1), bias = ot_rand(n, -1, 1);
    free(ha);
    free(hb);
    ot_case(DT_OP_GEMM, "bf16 operands, trans_a %d trans_b %d, (%lld, %lld, %lld)%s", cases[i].ta, cases[i].tb,
            (long long)m, (long long)n, (long long)k, cases[i].bias ? ", bias" : "");
    const size_t used = ot.be[1]->mem_used;
    size_t scratch = 0, ws = 0;
    BOTH {
      dt_op op = {.type = DT_OP_GEMM};
      op.p.gemm = (typeof(op.p.gemm)){.trans_a = cases[i].ta,
                                      .trans_b = cases[i].tb,
                                      .m = m,
                                      .n = n,
                                      .k = k,
                                      .alpha = cases[i].alpha,
                                      .beta = cases[i].beta,
                                      .a = s_ ? F(a) : F(a16), /* the CPU: operands rounded beforehand */
                                      .b = s_ ? F(b) : F(b16),
                                      .c = F(c),
                                      .bias = cases[i].bias ? F(bias) : NULL};
      if (s_) {
        dt_op unbiased = op;
        unbiased.p.gemm.bias = NULL;
        scratch = ot.be[1]->scratch(ot.be[1], &unbiased, 1);
        ws = ot.be[1]->scratch(ot.be[1], &op, 1) - scratch;
      }
      RUN(op);
    }
    /* the memory estimate's size for the copies (and a bias's cuBLASLt workspace) is what they took:
     * each buffer grew from the last case's */
    const size_t grew = ot.be[1]->mem_used - used,
                 want = (scratch > held16 ? scratch - held16 : 0) + (ws > held_ws ? ws - held_ws : 0);
    if (grew != want)
      fail_msg("op gemm [%s]: the 16-bit operands and workspace took %zu more bytes, the estimate says %zu (of %zu)",
               ot.kase, grew, want, scratch + ws);
    if (!scratch) fail_msg("op gemm [%s]: no bfloat16 copies under bf16", ot.kase);
    if (cases[i].bias && !ws) fail_msg("op gemm [%s]: no cuBLASLt workspace for the bias's epilogue", ot.kase);
    held16 = scratch > held16 ? scratch : held16;
    held_ws = ws > held_ws ? ws : held_ws;
    ot_check("C", c, c.n);
    ot_check("A", a, 0);
    ot_check("B", b, 0);
  }
  /* no copies for a dimension under 16, nor for attention's batched products (even one of them) */
  dt_op small = {.type = DT_OP_GEMM, .p.gemm = {.trans_b = 1, .m = 40, .n = 15, .k = 27}};
  dt_op batched = {.type = DT_OP_GEMM, .p.gemm = {.m = 40, .n = 21, .k = 27, .batch = 1}};
  assert_int_equal(ot.be[1]->scratch(ot.be[1], &small, 1), 0);
  assert_int_equal(ot.be[1]->scratch(ot.be[1], &batched, 1), 0);
}

/* A dense layer's weight gradient and its bias gradient in one GEMM op (a_col_sums): under bf16 CUDA sums dy's
 * columns as it copies dy to bfloat16 (chunks of 64 rows by 32 columns, then each column's chunks in order),
 * else its bias-gradient kernel runs first. db against the CPU's sums of the FP32 dy, dW against the CPU's
 * product of dy and x (rounded to bfloat16 beforehand under bf16), and the input gradient after it, which
 * takes the copy of dy the first made, likewise (but for a dimension under 16 under bf16, whose FP32 operands
 * cuBLAS rounds its own way). (rows, in, out): 5 chunks of 2 column groups, one cut-short group, the smallest
 * copied shape, a dimension under 16, no rows. */
static void ops_gemm_bias_sums(void) {
  const int64_t shapes[][3] = {{300, 24, 40}, {37, 20, 17}, {16, 16, 16}, {40, 15, 20}, {0, 24, 40}};
  const int bf16 = ot.precision == DT_PREC_BF16;
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
    const int64_t rows = shapes[i][0], in = shapes[i][1], out = shapes[i][2];
    float *host[3] = {ot_host_rand(rows * out, -1, 1), ot_host_rand(rows * in, -1, 1), ot_host_rand(out * in, -1, 1)};
    dbuf fp32[3], rounded[3]; /* dy, x, W */
    for (int t = 0; t < 3; t++) {
      const int64_t n = t == 0 ? rows * out : t == 1 ? rows * in : out * in;
      fp32[t] = ot_buf(OT_F32, host[t], n);
      for (int64_t j = 0; bf16 && j < n; j++) host[t][j] = round_bf16(host[t][j]);
      rounded[t] = ot_buf(OT_F32, host[t], n);
      free(host[t]);
    }
    dbuf dw = ot_rand(out * in, -1, 1), db = ot_rand(out, -1, 1), dx = ot_rand(rows * in + 1, -1, 1);
    ot_case(DT_OP_GEMM, "weight and bias gradients, (rows, in, out) (%lld, %lld, %lld)", (long long)rows, (long long)in,
            (long long)out);
    const int64_t copied = backend_cuda_col_sums_copied(ot.be[1]);
    BOTH {
      const int cpu_apart = !s_ && bf16; /* the CPU's sums of the FP32 dy, its product of the rounded one */
      if (cpu_apart) {
        dt_op sums = {.type = DT_OP_BIAS_GRAD,
                      .p.bias_grad = {.b = rows, .c = out, .s = 1, .dy = F(fp32[0]), .db = F(db)}};
        RUN(sums);
      }
      dt_op op = dense_gemm(DENSE_DW, rows, in, out);
      op.p.gemm.a = s_ ? F(fp32[0]) : F(rounded[0]), op.p.gemm.b = s_ ? F(fp32[1]) : F(rounded[1]);
      op.p.gemm.c = F(dw), op.p.gemm.a_col_sums = cpu_apart ? NULL : F(db);
      RUN(op);
      dt_op d = dense_gemm(DENSE_DX, rows, in, out);
      d.p.gemm.a = s_ ? F(fp32[0]) : F(rounded[0]), d.p.gemm.b = s_ ? F(fp32[2]) : F(rounded[2]), d.p.gemm.c = F(dx);
      RUN(d);
    }
    ot_check("db", db, db.n);
    const int copies = bf16 && rows >= DT_GEMM16_MIN_DIM && in >= DT_GEMM16_MIN_DIM && out >= DT_GEMM16_MIN_DIM;
    if (backend_cuda_col_sums_copied(ot.be[1]) - copied != copies)
      fail_msg("op gemm [%s]: %lld bias gradients summed as dy was copied, %d expected", ot.kase,
               (long long)(backend_cuda_col_sums_copied(ot.be[1]) - copied), copies);
    if (!bf16 || (in >= DT_GEMM16_MIN_DIM && out >= DT_GEMM16_MIN_DIM)) { /* else cuBLAS's own rounding */
      ot_check("dW", dw, dw.n);
      ot_check("dx", dx, rows * in);
    }
  }
}

/* A fused relu's backward in the weight gradient's GEMM op (relu_y): dy masked in place where the relu's output is
 * not positive (+0 there, a NaN dy included), then the bias gradient and the products of the masked dy; in FP32
 * CUDA masks and sums in one kernel (relu_bias_grad_rows_kernel), under bf16 it masks, then sums as it copies. On
 * each backend the op gives the bits of the relu's own op followed by the GEMM op without relu_y; against the
 * CPU: the masked dy exactly, db, and in FP32 dW and dx. With and without a bias; (rows, in, out) as
 * ops_gemm_bias_sums', and 1100 rows, which the kernel's lanes (128) read four at a time before the rest. */
static void ops_gemm_relu_mask(void) {
  const int64_t shapes[][3] = {{1100, 24, 40}, {300, 24, 40}, {37, 20, 17}, {16, 16, 16}, {40, 15, 20}, {0, 24, 40}};
  const int bf16 = ot.precision == DT_PREC_BF16;
  for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
    for (int bias = 0; bias < 2; bias++) {
      const int64_t rows = shapes[i][0], in = shapes[i][1], out = shapes[i][2];
      float *hdy = ot_host_rand(rows * out, -1, 1), *hy = ot_host_rand(rows * out, -1, 1);
      for (int64_t j = 0; j < rows * out; j++) { /* a relu's output: 0 or positive; a NaN where it is 0 */
        hy[j] = hy[j] > 0 ? hy[j] : 0.0f;
        if (j % 7 == 3) hy[j] = 0.0f, hdy[j] = NAN;
      }
      dbuf y = ot_buf(OT_F32, hy, rows * out), x = ot_rand(rows * in, -1, 1), w = ot_rand(out * in, -1, 1);
      dbuf dy[2] = {ot_buf(OT_F32, hdy, rows * out), ot_buf(OT_F32, hdy, rows * out)}; /* fused, apart */
      free(hdy);
      free(hy);
      dbuf dw[2], db[2], dx[2];
      dw[0] = ot_rand(out * in, -1, 1), db[0] = ot_rand(out, -1, 1), dx[0] = ot_rand(rows * in + 1, -1, 1);
      dw[1] = ot_buf(OT_F32, dw[0].init, dw[0].n), db[1] = ot_buf(OT_F32, db[0].init, out);
      dx[1] = ot_buf(OT_F32, dx[0].init, dx[0].n);
      ot_case(DT_OP_GEMM, "a relu's mask, %s bias, (rows, in, out) (%lld, %lld, %lld)", bias ? "a" : "no",
              (long long)rows, (long long)in, (long long)out);
      for (int apart = 0; apart < 2; apart++) BOTH {
          if (apart) {
            dt_op mask = {.type = DT_OP_ACT_BWD};
            mask.p.act_bwd = (typeof(mask.p.act_bwd)){
                .kind = DT_ACT_RELU, .n = rows * out, .x = F(y), .y = F(y), .dy = F(dy[1]), .dx = F(dy[1])};
            RUN(mask);
          }
          dt_op op = dense_gemm(DENSE_DW, rows, in, out);
          op.p.gemm.a = F(dy[apart]), op.p.gemm.b = F(x), op.p.gemm.c = F(dw[apart]);
          op.p.gemm.a_col_sums = bias ? F(db[apart]) : NULL, op.p.gemm.relu_y = apart ? NULL : F(y);
          RUN(op);
          dt_op d = dense_gemm(DENSE_DX, rows, in, out);
          d.p.gemm.a = F(dy[apart]), d.p.gemm.b = F(w), d.p.gemm.c = F(dx[apart]);
          RUN(d);
        }
      for (int side = 0; side < 2; side++) {
        const dbuf *pairs[4][2] = {{&dy[0], &dy[1]}, {&db[0], &db[1]}, {&dw[0], &dw[1]}, {&dx[0], &dx[1]}};
        static const char *names[4] = {"dy", "db", "dW", "dx"};
        for (int t = 0; t < 4; t++) {
          const dbuf *a = pairs[t][0], *b = pairs[t][1];
          for (int64_t j = 0; j < (t == 3 ? rows * in : a->n); j++) {
            const float fa = (float)ot_get(*a, side, j), fb = (float)ot_get(*b, side, j);
            if (memcmp(&fa, &fb, sizeof fa))
              fail_msg("op gemm [%s]: %s[%lld] on the %s is %.9g with relu_y, %.9g with the relu's own op", ot.kase,
                       names[t], (long long)j, side ? "GPU" : "CPU", fa, fb);
          }
        }
      }
      ot_check("masked dy", dy[0], dy[0].n);
      for (int64_t j = 3; j < rows * out; j += 7)
        if (ot_get(dy[0], 1, j) != 0.0f || signbit(ot_get(dy[0], 1, j)))
          fail_msg("op gemm [%s]: a NaN dy where the relu gave 0 became %g, not +0", ot.kase, ot_get(dy[0], 1, j));
      if (bias) ot_check("db", db[0], out);
      if (!bf16) {
        ot_check("dW", dw[0], dw[0].n);
        ot_check("dx", dx[0], rows * in);
      }
    }
}

/* The classifier under bf16 (model.c's pick_logits16): the forward GEMM writing bfloat16 logits rows (c16),
 * the loss on such rows (logits16: cross-entropy with label smoothing and ignored rows, distilled from FP32
 * teacher logits by KL, and mse on FP32 targets) writing dlogits so, and the two gradient GEMMs reading them
 * (a16) with no copy; K = 21 and 1031 classes (rows of 24 and 1032: padding never written), 40 inputs. The CPU
 * widens, runs its FP32 op and rounds; its GEMM operands are rounded beforehand, as CUDA's copies round them. */
static void ops_classifier_rows16(void) {
  const int64_t in = 40, ks[] = {21, 1031};
  for (int ki = 0; ki < 2; ki++) {
    const int64_t K = ks[ki], ld = dt_ld16(K);
    FOR_ROWS(r) {
      float *hx = ot_host_rand(cap * in, -1, 1), *hw = ot_host_rand(K * in, -1, 1);
      dbuf x = ot_buf(OT_F32, hx, cap * in), w = ot_buf(OT_F32, hw, K * in);
      for (int64_t j = 0; j < cap * in; j++) hx[j] = round_bf16(hx[j]);
      for (int64_t j = 0; j < K * in; j++) hw[j] = round_bf16(hw[j]);
      dbuf xr = ot_buf(OT_F32, hx, cap * in), wr = ot_buf(OT_F32, hw, K * in);
      free(hx);
      free(hw);
      dbuf logits = ot_rand16(cap * ld, -1, 1);
      ot_case(DT_OP_GEMM, "bfloat16 logits rows (c16), %lld classes, %s", (long long)K, ROWS_NAME(r));
      BOTH {
        dt_op op = dense_gemm(DENSE_FWD, rows, in, K);
        op.p.gemm.a = s_ ? F(x) : F(xr), op.p.gemm.b = s_ ? F(w) : F(wr), op.p.gemm.c = F(logits);
        op.p.gemm.c16 = DT_F16_BF16;
        RUN(op);
      }
      ot_check16_rows("logits", logits, cap * ld, rows * ld, K, ld);

      /* the loss on rows both sides hold alike: even rows labelled with their argmax, odd ones at random */
      dbuf z = ot_rand16(cap * ld, -3, 3);
      const uint16_t *zh = (const uint16_t *)z.init;
      int32_t *labels = calloc((size_t)cap + 1, sizeof(int32_t));
      for (int64_t b = 0; b < cap; b++) {
        int32_t arg = 0;
        for (int32_t j = 1; j < K; j++)
          if (dt_from_bf16(zh[b * ld + j]) > dt_from_bf16(zh[b * ld + arg])) arg = j;
        labels[b] = b % 2 ? (int32_t)(dt_hash64((uint64_t)b + 5) % (uint64_t)K) : arg;
      }
      dbuf lab = ot_buf(OT_I32, labels, cap), targets = ot_rand(cap * K, -1, 1), teacher = ot_rand(cap * K, -3, 3);
      static const char *const kinds[] = {"cross entropy, label smoothing 0.1, rows labelled as row 1 ignored",
                                          "cross entropy distilled by kl at T = 2.5, alpha 0.6", "mse"};
      for (int kind = 0; kind < 3; kind++) {
        const double before[2] = {0.5, 2};
        dbuf dz = ot_rand16(cap * ld, -1, 1), sums = ot_buf(OT_F64, before, 2);
        ot_case(DT_OP_LOSS, "bfloat16 logits rows (logits16), %s, %lld classes, %s", kinds[kind], (long long)K,
                ROWS_NAME(r));
        if (rows == 0) continue; /* loss_run queues nothing for no rows */
        BOTH {
          dt_op op = {.type = DT_OP_LOSS,
                      .p.loss = {.kind = kind == 2 ? DT_LOSS_MSE : DT_LOSS_CROSS_ENTROPY,
                                 .b = rows,
                                 .k = K,
                                 .label_smoothing = kind == 0 ? 0.1f : 0.0f,
                                 .ignore = kind == 0,
                                 .ignore_index = labels[1],
                                 .weight = 1.0 / (double)(3 * cap),
                                 .logits = F(z),
                                 .labels = kind == 2 ? NULL : I(lab),
                                 .targets = kind == 2 ? F(targets) : NULL,
                                 .dlogits = F(dz),
                                 .sums = D(sums),
                                 .distill = kind == 1 ? DT_DISTILL_KL : DT_DISTILL_NONE,
                                 .alpha = 0.6f,
                                 .temperature = 2.5f,
                                 .teacher = kind == 1 ? F(teacher) : NULL,
                                 .logits16 = DT_F16_BF16}};
          RUN(op);
        }
        ot_check("loss sum and hits (added into)", sums, 2);
        ot_check16_rows("dlogits", dz, cap * ld, rows * ld, K, ld);
      }
      free(labels);

      /* the gradients from 16-bit dlogits: dW (K, in) += dy^T x, dx (rows, in) = dy W, and so through the
       * derivative of a tanh gelu before the classifier (DGELU's epilogue) */
      dbuf dy = ot_rand16(cap * ld, -1, 1), dw = ot_rand(K * in, -1, 1), dx = ot_rand(cap * in, -1, 1);
      dbuf gelu_x = ot_rand(cap * in, -3, 3), dgelu = ot_rand(cap * in, -1, 1);
      ot_case(DT_OP_GEMM, "bfloat16 dlogits rows read as they are (a16), %lld classes, %s", (long long)K, ROWS_NAME(r));
      size_t scratch = 0;
      BOTH {
        dt_op op = dense_gemm(DENSE_DW, rows, in, K);
        op.p.gemm.a = F(dy), op.p.gemm.b = s_ ? F(x) : F(xr), op.p.gemm.c = F(dw), op.p.gemm.a16 = DT_F16_BF16;
        RUN(op);
        op = dense_gemm(DENSE_DX, rows, in, K);
        op.p.gemm.a = F(dy), op.p.gemm.b = s_ ? F(w) : F(wr), op.p.gemm.c = F(dx), op.p.gemm.a16 = DT_F16_BF16;
        RUN(op);
        if (s_) scratch = ot.be[1]->scratch(ot.be[1], &op, 1);
        op.p.gemm.c = F(dgelu), op.p.gemm.epilogue = DT_GEMM_DGELU_TANH, op.p.gemm.aux = F(gelu_x);
        RUN(op);
      }
      ot_check("dW (added into)", dw, K * in);
      ot_check("dx", dx, rows * in);
      ot_check("dx through the gelu's derivative", dgelu, rows * in);
      /* the memory estimate: W's bfloat16 copy (K rows of dt_ld16(in) values), none of dy */
      if (rows && scratch != (size_t)((K * dt_ld16(in) * 2 + 255) / 256 * 256))
        fail_msg("op gemm [%s]: the estimate gives the 16-bit operands %zu bytes, not W's copy alone (%lld)", ot.kase,
                 scratch, (long long)(K * dt_ld16(in) * 2));
    }
  }
}

#define ALIGN256(bytes) ((size_t)((bytes) + 255) / 256 * 256)

/* A dense buffer of n FP32 values and its copy rounded to bfloat16 (the CPU's operand where CUDA copies). */
static void ot_rand_rounded(int64_t n, float lo, float hi, dbuf *fp32, dbuf *rounded) {
  float *h = ot_host_rand(n, lo, hi);
  *fp32 = ot_buf(OT_F32, h, n);
  for (int64_t j = 0; j < n; j++) h[j] = round_bf16(h[j]);
  *rounded = ot_buf(OT_F32, h, n);
  free(h);
}

/* A transformer's MLP under bf16 (model.c's pick_gelu16), each GEMM on the same inputs on both sides: the first
 * linear's forward writing the gelu's input and output in bfloat16 rows with its bias (c16, bias rounded to
 * bfloat16 first: GELU_AUX_BIAS's epilogue), the second's reading x so (a16), its weight gradient reading x so
 * (b16, no copy) and its input gradient written so through the gelu's derivative at the 16-bit input (c16,
 * DGELU), and the first's gradients from its 16-bit dy (a16) with the bias gradient summed from those values.
 * With no_lt (the stand-in's GPUSIM_CUBLASLT=none) the 16-bit epilogues run as kernels after cublasGemmEx, a
 * rounding more (within the same bfloat16 tolerance). (in, hidden, out) (40, 64, 24) and (21, 20, 19): rows
 * padded to 24 for 21, 20 and 19; the CPU's operands are rounded beforehand, as CUDA's copies round them. The
 * memory estimate's 16-bit bytes are the copies each GEMM makes: none of a 16-bit operand. */
static void ops_gelu_mlp_rows16(int no_lt) {
  const int64_t shapes[][3] = {{40, 64, 24}, {21, 20, 19}};
  const int lt = !(no_lt && on_standin());
  for (int si = 0; si < 2; si++) {
    const int64_t in = shapes[si][0], hid = shapes[si][1], out = shapes[si][2], ld = dt_ld16(hid);
    FOR_ROWS(r) {
      dbuf x, xr, w1, w1r, w2, w2r, dy2, dy2r;
      ot_rand_rounded(cap * in, -1, 1, &x, &xr);
      ot_rand_rounded(hid * in, -0.5f, 0.5f, &w1, &w1r);
      ot_rand_rounded(out * hid, -0.5f, 0.5f, &w2, &w2r);
      ot_rand_rounded(cap * out, -1, 1, &dy2, &dy2r);
      dbuf b1 = ot_rand(hid, -1, 1), b2 = ot_rand(out, -1, 1);
      dbuf pre = ot_rand16(cap * ld, -1, 1), act = ot_rand16(cap * ld, -1, 1);
      ot_case(DT_OP_GEMM, "first linear: the gelu's input and output in bfloat16 rows (c16), bias, (%lld, %lld), %s",
              (long long)in, (long long)hid, ROWS_NAME(r));
      int64_t fused = backend_cuda_gemm_epilogues(ot.be[1]);
      size_t scratch[3] = {0}; /* the op's, without its bias, and without the epilogue too: copies and workspace */
      BOTH {
        dt_op op = dense_gemm(DENSE_FWD, rows, in, hid);
        op.p.gemm.a = s_ ? F(x) : F(xr), op.p.gemm.b = s_ ? F(w1) : F(w1r), op.p.gemm.bias = F(b1);
        op.p.gemm.c = F(act), op.p.gemm.epilogue = DT_GEMM_GELU_TANH, op.p.gemm.aux = F(pre);
        op.p.gemm.c16 = DT_F16_BF16;
        if (s_) {
          dt_op variant = op;
          scratch[0] = ot.be[1]->scratch(ot.be[1], &op, 1);
          variant.p.gemm.bias = NULL;
          scratch[1] = ot.be[1]->scratch(ot.be[1], &variant, 1);
          variant.p.gemm.epilogue = DT_GEMM_PLAIN, variant.p.gemm.aux = NULL;
          scratch[2] = ot.be[1]->scratch(ot.be[1], &variant, 1);
        }
        RUN(op);
      }
      ot_check16_rows("the gelu's input", pre, cap * ld, rows * ld, hid, ld);
      ot_check16_rows("the gelu's output", act, cap * ld, rows * ld, hid, ld);
      if (backend_cuda_gemm_epilogues(ot.be[1]) - fused != (lt && rows > 1))
        fail_msg("op gemm [%s]: %lld cuBLASLt epilogues", ot.kase,
                 (long long)(backend_cuda_gemm_epilogues(ot.be[1]) - fused));
      /* x's and W's copies; under c16 the bias's too */
      if (rows && (scratch[2] != ALIGN256(rows * dt_ld16(in) * 2) + ALIGN256(hid * dt_ld16(in) * 2) ||
                   scratch[0] - scratch[1] != ALIGN256(hid * 2)))
        fail_msg("op gemm [%s]: the estimate gives the operands' copies %zu bytes, the bias's %zu", ot.kase, scratch[2],
                 scratch[0] - scratch[1]);

      /* the second linear on 16-bit x: its forward, then its gradients (dx through the gelu's derivative) */
      dbuf x16 = ot_rand16(cap * ld, -2, 2), aux16 = ot_rand16(cap * ld, -3, 3), y2 = ot_rand(cap * out, -1, 1);
      dbuf dw2 = ot_rand(out * hid, -1, 1), dx16 = ot_rand16(cap * ld, -1, 1);
      ot_case(DT_OP_GEMM, "second linear: x in bfloat16 rows (a16, b16), dx through the gelu's derivative (c16), %s",
              ROWS_NAME(r));
      fused = backend_cuda_gemm_epilogues(ot.be[1]);
      size_t scratch_dw = 0;
      BOTH {
        dt_op op = dense_gemm(DENSE_FWD, rows, hid, out);
        op.p.gemm.a = F(x16), op.p.gemm.b = s_ ? F(w2) : F(w2r), op.p.gemm.c = F(y2), op.p.gemm.bias = F(b2);
        op.p.gemm.a16 = DT_F16_BF16;
        RUN(op);
        op = dense_gemm(DENSE_DW, rows, hid, out);
        op.p.gemm.a = s_ ? F(dy2) : F(dy2r), op.p.gemm.b = F(x16), op.p.gemm.c = F(dw2), op.p.gemm.b16 = DT_F16_BF16;
        if (s_) scratch_dw = ot.be[1]->scratch(ot.be[1], &op, 1);
        RUN(op);
        op = dense_gemm(DENSE_DX, rows, hid, out);
        op.p.gemm.a = s_ ? F(dy2) : F(dy2r), op.p.gemm.b = s_ ? F(w2) : F(w2r), op.p.gemm.c = F(dx16);
        op.p.gemm.epilogue = DT_GEMM_DGELU_TANH, op.p.gemm.aux = F(aux16), op.p.gemm.c16 = DT_F16_BF16;
        RUN(op);
      }
      ot_check("y", y2, rows * out);
      ot_check("dW (added into)", dw2, dw2.n);
      ot_check16_rows("dx through the gelu's derivative", dx16, cap * ld, rows * ld, hid, ld);
      ot_check16_rows("the gelu's input (read)", aux16, cap * ld, 0, hid, ld);
      /* the forward's bias, and the derivative when rows > 1 (the weight gradient has no epilogue) */
      if (backend_cuda_gemm_epilogues(ot.be[1]) - fused != (lt && rows > 1 ? 2 : 0))
        fail_msg("op gemm [%s]: %lld cuBLASLt epilogues", ot.kase,
                 (long long)(backend_cuda_gemm_epilogues(ot.be[1]) - fused));
      if (rows && scratch_dw != ALIGN256(rows * dt_ld16(out) * 2))
        fail_msg("op gemm [%s]: the weight gradient's 16-bit bytes are %zu, not dy's copy alone", ot.kase, scratch_dw);

      /* the first linear's gradients from its 16-bit dy: the bias gradient from the bfloat16 values */
      dbuf dy1 = ot_rand16(cap * ld, -1, 1), dw1 = ot_rand(hid * in, -1, 1), db1 = ot_rand(hid, -1, 1);
      dbuf dx1 = ot_rand(cap * in + 1, -1, 1);
      ot_case(DT_OP_GEMM, "first linear's gradients from its bfloat16 dy (a16), the bias's summed from it, %s",
              ROWS_NAME(r));
      BOTH {
        dt_op op = dense_gemm(DENSE_DW, rows, in, hid);
        op.p.gemm.a = F(dy1), op.p.gemm.b = s_ ? F(x) : F(xr), op.p.gemm.c = F(dw1), op.p.gemm.a16 = DT_F16_BF16;
        op.p.gemm.a_col_sums = F(db1);
        RUN(op);
        op = dense_gemm(DENSE_DX, rows, in, hid);
        op.p.gemm.a = F(dy1), op.p.gemm.b = s_ ? F(w1) : F(w1r), op.p.gemm.c = F(dx1), op.p.gemm.a16 = DT_F16_BF16;
        RUN(op);
      }
      ot_check("db (added into)", db1, hid);
      ot_check("dW (added into)", dw1, dw1.n);
      ot_check("dx", dx1, rows * in);
    }
  }
}

/* Fused attention over H heads of `rows` samples (buffers for `cap`), in the attention layer's layout:
 * q, k, v in one (cap, T, 3, H, hd) buffer, o in (cap, T, H, hd); the scores scaled by 1/sqrt(hd), q of
 * every third head (h = 1, 4, ...) times 8 (scores of hundreds: exp overflows unless the running maximum
 * is taken out). T = 5 and 70 (a partial tile, two tiles) with hd 8 and 24 (a partial column group),
 * T = 130 (three tiles) with hd 64, T = 33 with hd 128 (the widest), hd 6 (not whole float4s: the tiles'
 * scalar loads); causal and not, dropout 0 and 0.25 (the dropout op's masks). */
/* The ops' geometry over the layer's layout for rows samples of H heads of hd over T positions, causal or not,
 * with dropout 0.25 or none. */
static dt_attention_geom case_geom(int64_t rows, int64_t H, int64_t T, int64_t hd, int causal, int drop) {
  return (dt_attention_geom){.b = rows,
                             .h = H,
                             .t = T,
                             .hd = hd,
                             .ld_qkv = 3 * H * hd,
                             .ld_o = H * hd,
                             .causal = causal,
                             .scale = 1.0f / sqrtf((float)hd),
                             .p = drop ? 0.25f : 0.0f,
                             .seed = 77};
}

static void attention_case(int64_t T, int64_t hd, int64_t H, int64_t cap, int64_t rows, const char *rows_name) {
  const int64_t c = H * hd, n = cap * T * 3 * c, no = cap * T * c, written = rows * T * 3 * c;
  const int tc = ot.precision == DT_PREC_BF16;
  float *qkvh = ot_host_rand(n, -2, 2), *douth = ot_host_rand(no, -1, 1);
  for (int64_t i = 0; i < n; i++) { /* (row, 3, H, hd): the q third's heads h = 1 mod 3 */
    qkvh[i] *= !tc && i % (3 * c) < c && (i % c) / hd % 3 == 1 ? 8.0f : 1.0f;
    if (tc) qkvh[i] = round_bf16(qkvh[i]);
  }
  for (int64_t i = 0; tc && i < no; i++) douth[i] = round_bf16(douth[i]);
  dbuf qkv = ot_buf(OT_F32, qkvh, n), dout = ot_buf(OT_F32, douth, no);
  free(qkvh);
  free(douth);
  const uint64_t step_seed_h = 0x1234567u;
  dbuf step_seed = ot_buf(OT_F64, &step_seed_h, 1);
  for (int causal = 0; causal < 2; causal++)
    for (int drop = 0; drop < 2; drop++) {
      dbuf o = ot_rand(no, -1, 1), lse = ot_rand(cap * H * T, -1, 1), delta = ot_rand(cap * H * T, -1, 1);
      dbuf dqkv = ot_rand(n, -1, 1);
      dt_attention_geom g = case_geom(rows, H, T, hd, causal, drop);
      ot_case(DT_OP_ATTENTION_FWD, "T %lld, hd %lld, H %lld, %s, dropout %g, %s", (long long)T, (long long)hd,
              (long long)H, causal ? "causal" : "not causal", g.p, rows_name);
      BOTH {
        g.step_seed = (const uint64_t *)D(step_seed);
        dt_op op = attention_fwd_op(g, F(qkv), F(o), F(lse));
        RUN(op);
      }
      ot_check("o", o, rows * T * c);
      ot_check("lse", lse, rows * H * T);
      ot_case(DT_OP_ATTENTION_BWD, "T %lld, hd %lld, H %lld, %s, dropout %g, %s", (long long)T, (long long)hd,
              (long long)H, causal ? "causal" : "not causal", g.p, rows_name);
      BOTH {
        g.step_seed = (const uint64_t *)D(step_seed);
        dt_op op = attention_bwd_op(g, F(qkv), F(o), F(lse), F(dout), F(delta), F(dqkv));
        RUN(op);
      }
      ot_check("delta", delta, rows * H * T);
      ot_check("dq, dk, dv", dqkv, written);
    }
}

/* The fused backward twice from the same values: the same bits (dk, dv per key tile and dq per query
 * tile, no atomics; the stand-in runs blocks in another order at each launch). T = 150, hd 32, 3 heads,
 * causal, dropout 0.1. */
static void attention_same_bits(void) {
  const int64_t T = 150, hd = 32, H = 3, B = 2, c = H * hd, n = B * T * 3 * c, no = B * T * c;
  const uint64_t step_seed_h = 5;
  dbuf qkv = ot_rand(n, -2, 2), o = ot_rand(no, -1, 1), dout = ot_rand(no, -1, 1), lse = ot_rand(B * H * T, 0, 1);
  dbuf step_seed = ot_buf(OT_F64, &step_seed_h, 1), delta = ot_rand(B * H * T, -1, 1);
  dbuf d[2] = {ot_rand(n, -1, 1), ot_rand(n, -1, 1)};
  dt_attention_geom g = {.b = B,
                         .h = H,
                         .t = T,
                         .hd = hd,
                         .ld_qkv = 3 * c,
                         .ld_o = c,
                         .causal = 1,
                         .scale = 0.17677669f,
                         .p = 0.1f,
                         .seed = 3};
  for (int run = 0; run < 3; run++) {
    ot_case(DT_OP_ATTENTION_FWD, "T 150, hd 32, 3 heads, run %d", run);
    BOTH {
      g.step_seed = (const uint64_t *)D(step_seed);
      if (run == 0) { /* o and lse of these inputs, so that the backward's probabilities sum to 1 */
        dt_op f = attention_fwd_op(g, F(qkv), F(o), F(lse));
        RUN(f);
        continue;
      }
      dt_op op = attention_bwd_op(g, F(qkv), F(o), F(lse), F(dout), F(delta), F(d[run - 1]));
      RUN(op);
    }
  }
  ot_check("dq, dk, dv", d[0], n);
  float *a = ot_fetch(d[0], 1), *b = ot_fetch(d[1], 1);
  int same = !memcmp(a, b, (size_t)n * sizeof(float));
  free(a);
  free(b);
  if (!same) fail_msg("attention_bwd: two runs on CUDA gave different bits");
}

static void ops_attention(void) {
  FOR_ROWS(r) {
    attention_case(5, 8, 2, cap, rows, ROWS_NAME(r));
    attention_case(70, 24, 2, cap, rows, ROWS_NAME(r));
  }
  attention_case(130, 64, 3, 1, 1, "1 row, 3 heads");
  attention_case(33, 128, 1, 1, 1, "1 row, 1 head");
  attention_case(70, 6, 3, 1, 1, "1 row, 3 heads of 6 (rows of 6 floats: loaded a float at a time)");
  attention_same_bits();
}

/* The tensor-core kernels (train.precision bf16, compute capability 8.0 and later) against the CPU's
 * FP32 op, on inputs that bfloat16 holds exactly (so only the probabilities and ds are rounded, to
 * bfloat16) and without the scaled-up heads (the bfloat16 rounding of a score in the hundreds moves
 * its probability by a factor, on a GPU as in PyTorch): a relative error of 1e-2 norm-wise. hd 48
 * leaves some warps one piece of a (64, 48) product and others two. Their shared memory fits
 * wherever the FP32 kernels' does on an 8.0+ GPU (99, 163, 227 KiB a block), so the pick need not
 * know the precision (attention_geom.h). */
static void ops_attention_tensor_cores(void) {
  for (int64_t hd = 1; hd <= DT_ATTENTION_MAX_HD; hd++)
    for (int i = 0; i < 3; i++) {
      const size_t shared = (size_t)(int[]){99, 163, 227}[i] << 10;
      for (int kernel = DT_ATTENTION_FWD_KERNEL; kernel <= DT_ATTENTION_BWD_Q_KERNEL; kernel++)
        if (dt_attention_fits(hd, shared) && dt_attention_shared_tc(kernel, hd) > shared)
          fail_msg("hd %lld: tensor-core kernel %d takes %zu bytes of shared memory, over %zu where the FP32 ones fit",
                   (long long)hd, kernel, dt_attention_shared_tc(kernel, hd), shared);
    }
  FOR_ROWS(r) {
    attention_case(5, 8, 2, cap, rows, ROWS_NAME(r));
    attention_case(70, 24, 2, cap, rows, ROWS_NAME(r));
  }
  attention_case(70, 48, 2, 1, 1, "1 row, 2 heads");
  attention_case(130, 64, 3, 1, 1, "1 row, 3 heads");
  attention_case(33, 128, 1, 1, 1, "1 row, 1 head");
  attention_case(70, 6, 3, 1, 1, "1 row, 3 heads of 6 (rows of 6 floats: loaded a float at a time)");
  attention_same_bits();
}

/* Value i of a 16-bit buffer, as the ops' float pointers carry it. */
#define F16_AT(b, i) ((float *)((uint16_t *)(b).p[s_] + (i)))

/* Whether CUDA's 16-bit values b16 (n of them, bfloat16) are its FP32 values b32 rounded, bit for bit. */
static void same_rounded_bits(const char *what, dbuf b16, dbuf b32, int64_t n) {
  uint16_t *h = ot_fetch(b16, 1);
  float *f = ot_fetch(b32, 1);
  for (int64_t i = 0; i < n; i++)
    if (h[i] != dt_to_bf16(f[i])) {
      const float got = dt_from_bf16(h[i]), want = f[i];
      free(h), free(f);
      fail_msg("op %s [%s]: %s[%lld] is %.9g with bfloat16 heads, %.9g rounded with FP32 ones", dt_op_names[ot.op],
               ot.kase, what, (long long)i, got, want);
    }
  free(h), free(f);
}

/* The fused ops on bfloat16 heads (io16: the attention layer's heads16): q, k, v, o, dout and dq, dk, dv
 * bfloat16 where they lie, lse and delta FP32. On CUDA they are the FP32 heads' results rounded, bit for bit,
 * given the same values (the kernels widen what they load and round what they store, nothing else); under
 * bf16 (the tensor-core kernels) that is the check, and in FP32 the CPU's widen-run-round too (one bfloat16
 * unit). Causal or not, dropout or not; hd 6 (loaded a value at a time) and 24 and 64 (4 values a load). */
static void attention16_case(int64_t T, int64_t hd, int64_t H, int64_t cap, int64_t rows, const char *rows_name) {
  const int64_t c = H * hd, n = cap * T * 3 * c, no = cap * T * c;
  const int tc = ot.precision == DT_PREC_BF16;
  dbuf qkv16 = ot_rand16(n, -2, 2), dout16 = ot_rand16(no, -1, 1), o_in16 = ot_rand16(no, -1, 1);
  float *wide[3] = {calloc((size_t)n + 1, 4), calloc((size_t)no + 1, 4), calloc((size_t)no + 1, 4)};
  const dbuf *from[3] = {&qkv16, &dout16, &o_in16};
  for (int b = 0; b < 3; b++)
    for (int64_t i = 0; i < (b ? no : n); i++) wide[b][i] = dt_from_bf16(((const uint16_t *)from[b]->init)[i]);
  dbuf qkv = ot_buf(OT_F32, wide[0], n), dout = ot_buf(OT_F32, wide[1], no), o_in = ot_buf(OT_F32, wide[2], no);
  for (int b = 0; b < 3; b++) free(wide[b]);
  const uint64_t step_seed_h = 0x1234567u;
  dbuf step_seed = ot_buf(OT_F64, &step_seed_h, 1);
  for (int causal = 0; causal < 2; causal++)
    for (int drop = 0; drop < 2; drop++) {
      dbuf o16 = ot_rand16(no, -1, 1), o = ot_rand(no, -1, 1), lse16 = ot_rand(cap * H * T, -1, 1);
      dbuf lse = ot_buf(OT_F32, lse16.init, cap * H * T), delta16 = ot_rand(cap * H * T, -1, 1);
      dbuf delta = ot_buf(OT_F32, delta16.init, cap * H * T), dqkv16 = ot_rand16(n, -1, 1), dqkv = ot_rand(n, -1, 1);
      dt_attention_geom g = case_geom(rows, H, T, hd, causal, drop);
      ot_case(DT_OP_ATTENTION_FWD, "bfloat16 heads (io16), T %lld, hd %lld, H %lld, %s, dropout %g, %s", (long long)T,
              (long long)hd, (long long)H, causal ? "causal" : "not causal", g.p, rows_name);
      BOTH {
        g.step_seed = (const uint64_t *)D(step_seed);
        dt_attention_geom g16 = g;
        g16.io16 = DT_F16_BF16;
        dt_op op = attention_fwd_op(g16, F(qkv16), F(o16), F(lse16));
        op.p.attention_fwd.k = F16_AT(qkv16, c), op.p.attention_fwd.v = F16_AT(qkv16, 2 * c);
        RUN(op);
        if (s_) { /* the FP32 heads, on CUDA only */
          dt_op f = attention_fwd_op(g, F(qkv), F(o), F(lse));
          RUN(f);
        }
      }
      same_rounded_bits("o", o16, o, rows * T * c);
      float *l16 = ot_fetch(lse16, 1), *l32 = ot_fetch(lse, 1);
      if (memcmp(l16, l32, (size_t)(rows * H * T) * sizeof(float))) fail_msg("lse differs with bfloat16 heads");
      free(l16), free(l32);
      if (!tc) {
        ot_check16("o", o16, no, rows * T * c);
        ot_check("lse", lse16, rows * H * T);
      }
      ot_case(DT_OP_ATTENTION_BWD, "bfloat16 heads (io16), T %lld, hd %lld, H %lld, %s, dropout %g, %s", (long long)T,
              (long long)hd, (long long)H, causal ? "causal" : "not causal", g.p, rows_name);
      BOTH {
        g.step_seed = (const uint64_t *)D(step_seed);
        dt_attention_geom g16 = g;
        g16.io16 = DT_F16_BF16;
        dt_op op = attention_bwd_op(g16, F(qkv16), F(o_in16), F(lse16), F(dout16), F(delta16), F(dqkv16));
        op.p.attention_bwd.k = F16_AT(qkv16, c), op.p.attention_bwd.v = F16_AT(qkv16, 2 * c);
        op.p.attention_bwd.dk = F16_AT(dqkv16, c), op.p.attention_bwd.dv = F16_AT(dqkv16, 2 * c);
        RUN(op);
        if (s_) {
          dt_op f = attention_bwd_op(g, F(qkv), F(o_in), F(lse16), F(dout), F(delta), F(dqkv));
          RUN(f);
        }
      }
      same_rounded_bits("dq, dk, dv", dqkv16, dqkv, rows * T * 3 * c);
      float *d16 = ot_fetch(delta16, 1), *d32 = ot_fetch(delta, 1);
      if (memcmp(d16, d32, (size_t)(rows * H * T) * sizeof(float))) fail_msg("delta differs with bfloat16 heads");
      free(d16), free(d32);
      if (!tc) {
        ot_check("delta", delta16, rows * H * T);
        ot_check16("dq, dk, dv", dqkv16, n, rows * T * 3 * c);
      }
    }
}

static void ops_attention16(void) {
  FOR_ROWS(r) attention16_case(70, 24, 2, cap, rows, ROWS_NAME(r));
  attention16_case(130, 64, 3, 1, 1, "1 row, 3 heads");
  attention16_case(33, 6, 2, 1, 1, "1 row, 2 heads of 6 (a value at a time)");
}

/* Permutes with the batch as x's first dim: (B, T, H, hd) to (B, H, T, hd), the attention's
 * (B, T, 3, H, hd) to (3, B, H, T, hd), a 3-d and a 2-d transpose. */
static void ops_permute(void) {
  FOR_ROWS(r) {
    const struct {
      int ndim;
      int64_t dims[5];
      int perm[5];
      int64_t per_row; /* elements per batch row */
    } cases[] = {{4, {rows, 5, 3, 4}, {0, 2, 1, 3}, 5 * 3 * 4},
                 {5, {rows, 5, 3, 2, 4}, {2, 0, 3, 1, 4}, 5 * 3 * 2 * 4},
                 {3, {rows, 5, 37}, {0, 2, 1}, 5 * 37},
                 {2, {rows * 5, 37}, {1, 0}, 5 * 37}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
      int64_t per_row = cases[k].per_row, total = rows * per_row;
      dbuf x = ot_rand(cap * per_row, -1, 1), y = ot_rand(cap * per_row, -1, 1);
      ot_case(DT_OP_PERMUTE, "%d dims, case %zu, %s", cases[k].ndim, k, ROWS_NAME(r));
      BOTH {
        dt_op op = {.type = DT_OP_PERMUTE, .p.permute = {.ndim = cases[k].ndim, .x = F(x), .y = F(y)}};
        memcpy(op.p.permute.dims, cases[k].dims, sizeof op.p.permute.dims);
        memcpy(op.p.permute.perm, cases[k].perm, sizeof op.p.permute.perm);
        RUN(op);
      }
      ot_check("y", y, total);
      ot_check_bits("y", y);
    }
  }
}

/* The gradients that sum over rows (embedding: repeated tokens; layernorm: dgamma, dbeta) come
 * out with the same bits launch after launch (the stand-in changes its block order with every
 * launch), and the embedding gradient with the CPU's bits. */
static void transformer_grads_same_bits(void) {
  const int64_t T = 5, D = 37, V = 3, n = 4 * T;
  dbuf tok = ot_tokens(n, V), dy = ot_rand(n * D, -1, 1), x = ot_rand(n * D, -2, 2), mean = ot_rand(n, -0.1f, 0.1f);
  dbuf rstd = ot_rand(n, 0.5f, 2), gamma = ot_rand(D, 0.5f, 1.5f), dx = ot_rand(n * D, -1, 1);
  dbuf g[2][4]; /* two runs of dwte, dwpe, dgamma, dbeta, from the same values */
  float *init[4] = {ot_host_rand(V * D, -1, 1), ot_host_rand(T * D, -1, 1), ot_host_rand(D, -1, 1),
                    ot_host_rand(D, -1, 1)};
  const int64_t len[4] = {V * D, T * D, D, D};
  for (int run = 0; run < 2; run++)
    for (int i = 0; i < 4; i++) g[run][i] = ot_buf(OT_F32, init[i], len[i]);
  for (int i = 0; i < 4; i++) free(init[i]);
  for (int run = 0; run < 2; run++) {
    ot_case(DT_OP_EMBED_BWD, "repeated tokens (vocab 3), D 37, T 5, run %d", run);
    BOTH {
      dt_op op = {.type = DT_OP_EMBED_BWD,
                  .p.embed_bwd = {.n = n,
                                  .t = T,
                                  .d = D,
                                  .vocab = V,
                                  .tokens = F(tok),
                                  .dy = F(dy),
                                  .dwte = F(g[run][0]),
                                  .dwpe = F(g[run][1])}};
      RUN(op);
      RUN(op); /* twice: added into */
    }
    ot_check_bits("dwte", g[run][0]);
    ot_check_bits("dwpe", g[run][1]);
    ot_case(DT_OP_LN_BWD, "D 37, 20 rows, run %d", run);
    BOTH {
      dt_op op = {.type = DT_OP_LN_BWD,
                  .p.ln_bwd = {.n = n,
                               .d = D,
                               .x = F(x),
                               .dy = F(dy),
                               .gamma = F(gamma),
                               .mean = F(mean),
                               .rstd = F(rstd),
                               .dx = F(dx),
                               .dgamma = F(g[run][2]),
                               .dbeta = F(g[run][3])}};
      RUN(op);
    }
  }
  for (int i = 0; i < 4; i++) {
    float *a = ot_fetch(g[0][i], 1), *b = ot_fetch(g[1][i], 1);
    int same = !memcmp(a, b, (size_t)len[i] * sizeof(float));
    free(a);
    free(b);
    if (!same)
      fail_msg("%s: two runs on CUDA gave different bits", (const char *[]){"dwte", "dwpe", "dgamma", "dbeta"}[i]);
  }
}

/* Under bf16 a backward data right after the backward filter of the same dy takes the 16-bit copy of
 * dy that the first packed, once; a copy or another op between them, here one that changes dy (a new
 * dy copied in, dy doubled by a scale or by a GEMM on FP32 operands), or a backward data of another dy,
 * makes it pack again. Either way dx has the bits of a backend that packs dy itself. So too where the
 * backward data reads the model's 16-bit copy of its filter (w16), whose scratch has no filter in it. */
static void conv16_reuses_dy_only_back_to_back(void) {
  dt_conv_geom g = conv_geom(2, 8, 6, 6, 16, 3, 1, 1);
  const int64_t nx = g.b * g.c * g.h * g.w, nw = g.o * g.c * g.k * g.k, ny = g.b * g.o * g.ho * g.wo;
  dt_backend *fast = backend_cuda_create(0, DT_PREC_BF16), *ref = backend_cuda_create(0, DT_PREC_BF16);
  float *hx = ot_host_rand(nx, -1, 1), *hw = ot_host_rand(nw, -1, 1),
        *hdy[3] = {ot_host_rand(ny, -1, 1), ot_host_rand(ny, -1, 1), NULL};
  hdy[2] = calloc((size_t)ny, 4);
  for (int64_t i = 0; i < ny; i++) hdy[2][i] = 2 * hdy[0][i];
  float *x = fast->alloc(fast, (size_t)nx * 4), *w = fast->alloc(fast, (size_t)nw * 4);
  float *dy = fast->alloc(fast, (size_t)ny * 4), *dw = fast->alloc(fast, (size_t)nw * 4);
  float *dx = fast->alloc(fast, (size_t)nx * 4), *rw = ref->alloc(ref, (size_t)nw * 4);
  float *other_dy = fast->alloc(fast, (size_t)ny * 4);
  float *rdy = ref->alloc(ref, (size_t)ny * 4), *rdx = ref->alloc(ref, (size_t)nx * 4);
  float *got = calloc((size_t)nx, 4), *want = calloc((size_t)nx, 4);
  fast->to_device(fast, x, hx, (size_t)nx * 4);
  fast->to_device(fast, w, hw, (size_t)nw * 4);
  ref->to_device(ref, rw, hw, (size_t)nw * 4);
  fast->to_device(fast, other_dy, hdy[1], (size_t)ny * 4);
  uint16_t *hw16 = calloc((size_t)nw, sizeof *hw16); /* the filter (O, C, K, K) as (O, K, K, C) in bfloat16 */
  for (int64_t o = 0; o < g.o; o++)
    for (int64_t c = 0; c < g.c; c++)
      for (int64_t k = 0; k < g.k * g.k; k++)
        hw16[(o * g.k * g.k + k) * g.c + c] = dt_to_bf16(hw[(o * g.c + c) * g.k * g.k + k]);
  float *w16 = fast->alloc(fast, (size_t)nw * 2);
  fast->to_device(fast, w16, hw16, (size_t)nw * 2);
  static const char *how[] = {"the same", "a copied", "a doubled", "after another's backward data, the same",
                              "a GEMM-doubled"};
  for (int run = 0; run < 10; run++) {
    const int changed = run % 5, copy = run / 5; /* copy: the backward data reads w16 */
    fast->to_device(fast, dy, hdy[0], (size_t)ny * 4);
    dt_op k = {.type = DT_OP_CONV_BWD_FILTER, .p.conv_bwd_filter = {.g = g, .x = x, .dy = dy, .dw = dw}};
    backend_run(fast, &k);
    if (changed == 1) fast->to_device(fast, dy, hdy[1], (size_t)ny * 4);
    if (changed == 2) backend_run(fast, &(dt_op){.type = DT_OP_SCALE, .p.scale = {.n = ny, .alpha = 2, .x = dy}});
    if (changed == 3)
      backend_run(fast,
                  &(dt_op){.type = DT_OP_CONV_BWD_DATA, .p.conv_bwd_data = {.g = g, .dy = other_dy, .w = w, .dx = dx}});
    if (changed == 4) /* dy = 0 x w + 2 dy as (2, ny / 2): too small for bfloat16 operands */
      backend_run(fast,
                  &(dt_op){.type = DT_OP_GEMM,
                           .p.gemm = {.m = 2, .n = ny / 2, .k = 1, .alpha = 0, .beta = 2, .a = x, .b = w, .c = dy}});
    int64_t reuses = backend_cuda_dy16_reuses(fast);
    dt_op d = {.type = DT_OP_CONV_BWD_DATA,
               .p.conv_bwd_data = {.g = g, .dy = dy, .w = copy ? w16 : w, .dx = dx, .w16 = copy ? DT_F16_BF16 : 0}};
    backend_run(fast, &d);
    ref->to_device(ref, rdy, hdy[changed == 3 ? 0 : changed == 4 ? 2 : changed], (size_t)ny * 4);
    dt_op r = {.type = DT_OP_CONV_BWD_DATA, .p.conv_bwd_data = {.g = g, .dy = rdy, .w = rw, .dx = rdx}};
    backend_run(ref, &r);
    fast->to_host(fast, got, dx, (size_t)nx * 4);
    ref->to_host(ref, want, rdx, (size_t)nx * 4);
    const char *filter = copy ? ", the filter's copy" : "";
    if (backend_cuda_dy16_reuses(fast) - reuses != !changed)
      fail_msg("%s dy%s: %lld packs of dy skipped", how[changed], filter,
               (long long)(backend_cuda_dy16_reuses(fast) - reuses));
    for (int64_t i = 0; i < nx; i++)
      if (memcmp(&got[i], &want[i], 4))
        fail_msg("%s dy%s: dx[%lld] = %.9g, packed afresh %.9g", how[changed], filter, (long long)i, got[i], want[i]);
  }
  free(hx), free(hw), free(hw16), free(hdy[0]), free(hdy[1]), free(hdy[2]), free(got), free(want);
  float *mine[] = {x, w, w16, dy, dw, dx, other_dy};
  for (size_t i = 0; i < sizeof mine / sizeof *mine; i++) fast->free(fast, mine[i]);
  ref->free(ref, rw), ref->free(ref, rdy), ref->free(ref, rdx);
  fast->destroy(fast);
  ref->destroy(ref);
}

/* Under bf16 and fp16 a convolution's forward leaves its 16-bit copy of x where the op says (x16: the
 * layer keeps it) and its backward filter reads that copy rather than x: here x changes in between,
 * and dw still has the bits of a backend that packs the first x itself (and not those of the second);
 * the forward's y has the bits of one without x16. */
static void conv16_backward_filter_reads_the_forwards_x16(void) {
  dt_conv_geom g = conv_geom(2, 8, 6, 6, 16, 3, 1, 1);
  const int64_t nx = g.b * g.c * g.h * g.w, nw = g.o * g.c * g.k * g.k, ny = g.b * g.o * g.ho * g.wo;
  for (int precision = DT_PREC_BF16; precision <= DT_PREC_FP16; precision++) {
    dt_backend *be = backend_cuda_create(0, precision);
    float *hx[2] = {ot_host_rand(nx, -1, 1), ot_host_rand(nx, -1, 1)}, *hw = ot_host_rand(nw, -1, 1),
          *hdy = ot_host_rand(ny, -1, 1);
    float *x = be->alloc(be, (size_t)nx * 4), *w = be->alloc(be, (size_t)nw * 4), *dy = be->alloc(be, (size_t)ny * 4);
    float *y[2] = {be->alloc(be, (size_t)ny * 4), be->alloc(be, (size_t)ny * 4)};
    float *dw[3] = {be->alloc(be, (size_t)nw * 4), be->alloc(be, (size_t)nw * 4), be->alloc(be, (size_t)nw * 4)};
    void *x16 = be->alloc(be, (size_t)nx * 2);
    be->to_device(be, w, hw, (size_t)nw * 4);
    be->to_device(be, dy, hdy, (size_t)ny * 4);
    /* y[0], dw[0]: x16 kept across x's change; y[1]: no x16; dw[1], dw[2]: x packed afresh, first and second x */
    be->to_device(be, x, hx[0], (size_t)nx * 4);
    backend_run(be, &(dt_op){.type = DT_OP_CONV_FWD, .p.conv_fwd = {.g = g, .x = x, .w = w, .y = y[0], .x16 = x16}});
    backend_run(be, &(dt_op){.type = DT_OP_CONV_FWD, .p.conv_fwd = {.g = g, .x = x, .w = w, .y = y[1]}});
    backend_run(be,
                &(dt_op){.type = DT_OP_CONV_BWD_FILTER, .p.conv_bwd_filter = {.g = g, .x = x, .dy = dy, .dw = dw[1]}});
    be->to_device(be, x, hx[1], (size_t)nx * 4);
    backend_run(be, &(dt_op){.type = DT_OP_CONV_BWD_FILTER,
                             .p.conv_bwd_filter = {.g = g, .x = x, .dy = dy, .dw = dw[0], .x16 = x16}});
    backend_run(be,
                &(dt_op){.type = DT_OP_CONV_BWD_FILTER, .p.conv_bwd_filter = {.g = g, .x = x, .dy = dy, .dw = dw[2]}});
    float *h[5];
    for (int i = 0; i < 5; i++) {
      const int64_t n = i < 2 ? ny : nw;
      h[i] = malloc((size_t)n * 4);
      be->to_host(be, h[i], i < 2 ? y[i] : dw[i - 2], (size_t)n * 4);
    }
    if (memcmp(h[0], h[1], (size_t)ny * 4)) fail_msg("precision %d: y differs with x16", precision);
    if (memcmp(h[2], h[3], (size_t)nw * 4)) fail_msg("precision %d: dw is not that of the forward's x", precision);
    if (!memcmp(h[2], h[4], (size_t)nw * 4)) fail_msg("precision %d: the two x give the same dw", precision);
    for (int i = 0; i < 5; i++) free(h[i]);
    free(hx[0]), free(hx[1]), free(hw), free(hdy);
    float *mine[] = {x, w, dy, y[0], y[1], dw[0], dw[1], dw[2], x16};
    for (size_t i = 0; i < sizeof mine / sizeof *mine; i++) be->free(be, mine[i]);
    be->destroy(be);
  }
}

/* Under bf16 a dense layer's input gradient right after its weight gradient takes the bfloat16 copy of
 * dy that the first GEMM made; a copy or another op between them (a new dy copied in, dy doubled, the
 * input gradient of another dy) makes it copy again, and so does a backend whose 16-bit buffer had to
 * grow for the second GEMM (on a GPU the new buffer may start where the old one did; the stand-in never
 * hands out an address twice). Either way dx has the bits of a backend that copies dy itself. in and
 * out are not multiples of 8: padded rows. */
static void gemm16_reuses_dy_only_back_to_back(void) {
  dt_backend *ref = backend_cuda_create(0, DT_PREC_BF16);
  static const char *how[] = {"the same", "a copied", "a doubled", "after another's input gradient, the same",
                              "on a backend whose buffer grew, the same"};
  for (int changed = 0; changed < 5; changed++) {
    /* case 4: the input gradient's W (out, in) needs more than the weight gradient's x (rows, in) */
    const int64_t rows = 40, in = 21, out = changed == 4 ? 300 : 35;
    dt_backend *fast = backend_cuda_create(0, DT_PREC_BF16);
    float *hx = ot_host_rand(rows * in, -1, 1), *hw = ot_host_rand(out * in, -1, 1),
          *hdy = ot_host_rand(rows * out, -1, 1), *hdy2 = ot_host_rand(rows * out, -1, 1);
    float *x = fast->alloc(fast, (size_t)(rows * in) * 4), *w = fast->alloc(fast, (size_t)(out * in) * 4);
    float *dy = fast->alloc(fast, (size_t)(rows * out) * 4), *dw = fast->alloc(fast, (size_t)(out * in) * 4);
    float *dx = fast->alloc(fast, (size_t)(rows * in) * 4), *other_dy = fast->alloc(fast, (size_t)(rows * out) * 4);
    float *rw = ref->alloc(ref, (size_t)(out * in) * 4), *rdy = ref->alloc(ref, (size_t)(rows * out) * 4);
    float *rdx = ref->alloc(ref, (size_t)(rows * in) * 4);
    float *got = calloc((size_t)(rows * in), 4), *want = calloc((size_t)(rows * in), 4);
    fast->to_device(fast, x, hx, (size_t)(rows * in) * 4);
    fast->to_device(fast, w, hw, (size_t)(out * in) * 4);
    fast->to_device(fast, dy, hdy, (size_t)(rows * out) * 4);
    fast->to_device(fast, other_dy, hdy2, (size_t)(rows * out) * 4);
    ref->to_device(ref, rw, hw, (size_t)(out * in) * 4);
    if (changed != 4) { /* h16 at its largest first, as the training loop's first step leaves it */
      dt_op warm = dense_gemm(DENSE_DX, rows, in, out);
      warm.p.gemm.a = other_dy, warm.p.gemm.b = w, warm.p.gemm.c = dx;
      backend_run(fast, &warm);
    }
    dt_op k = dense_gemm(DENSE_DW, rows, in, out);
    k.p.gemm.a = dy, k.p.gemm.b = x, k.p.gemm.c = dw;
    backend_run(fast, &k);
    if (changed == 1) {
      memcpy(hdy, hdy2, (size_t)(rows * out) * 4);
      fast->to_device(fast, dy, hdy, (size_t)(rows * out) * 4);
    }
    if (changed == 2) {
      backend_run(fast, &(dt_op){.type = DT_OP_SCALE, .p.scale = {.n = rows * out, .alpha = 2, .x = dy}});
      for (int64_t i = 0; i < rows * out; i++) hdy[i] *= 2;
    }
    if (changed == 3) {
      dt_op other = dense_gemm(DENSE_DX, rows, in, out);
      other.p.gemm.a = other_dy, other.p.gemm.b = w, other.p.gemm.c = dx;
      backend_run(fast, &other);
    }
    int64_t reuses = backend_cuda_dy16_reuses(fast);
    dt_op d = dense_gemm(DENSE_DX, rows, in, out);
    d.p.gemm.a = dy, d.p.gemm.b = w, d.p.gemm.c = dx;
    backend_run(fast, &d);
    ref->to_device(ref, rdy, hdy, (size_t)(rows * out) * 4);
    dt_op r = dense_gemm(DENSE_DX, rows, in, out);
    r.p.gemm.a = rdy, r.p.gemm.b = rw, r.p.gemm.c = rdx;
    backend_run(ref, &r);
    fast->to_host(fast, got, dx, (size_t)(rows * in) * 4);
    ref->to_host(ref, want, rdx, (size_t)(rows * in) * 4);
    if (backend_cuda_dy16_reuses(fast) - reuses != !changed)
      fail_msg("%s dy: %lld copies of dy skipped", how[changed], (long long)(backend_cuda_dy16_reuses(fast) - reuses));
    for (int64_t i = 0; i < rows * in; i++)
      if (memcmp(&got[i], &want[i], 4))
        fail_msg("%s dy: dx[%lld] = %.9g, copied afresh %.9g", how[changed], (long long)i, got[i], want[i]);
    free(hx), free(hw), free(hdy), free(hdy2), free(got), free(want);
    float *mine[] = {x, w, dy, dw, dx, other_dy};
    for (size_t i = 0; i < sizeof mine / sizeof *mine; i++) fast->free(fast, mine[i]);
    ref->free(ref, rw), ref->free(ref, rdy), ref->free(ref, rdx);
    fast->destroy(fast);
  }
  ref->destroy(ref);
}

/* A linear layer's GEMM applying the tanh gelu after it (aux: the gelu's input; with and without a
 * bias), or the relu after it, and the next linear's input gradient through the gelu's derivative at aux (in place of
 * the gelu's own backward): cuBLASLt's epilogues where the gelu's rows are a multiple of 8 values (16 and 24), the GEMM
 * and the gelu's kernel otherwise (12 and 20), against the CPU's GEMM and gelu ops. */
static void ops_gemm_gelu(void) {
  const int64_t outs[] = {16, 12}, ins[] = {24, 20};
  for (int o = 0; o < 2; o++) {
    const int64_t out = outs[o], in = ins[o];
    FOR_ROWS(r) {
      dbuf x = ot_rand(cap * in, -1, 1), w = ot_rand(out * in, -1, 1), bias = ot_rand(out, -1, 1);
      dbuf pre = ot_rand(cap * out, -1, 1), y = ot_rand(cap * out, -1, 1);
      /* the gelu after it, or a relu instead (no aux, whatever the width: cuBLASLt's RELU epilogues need no
       * gelu input) */
      for (int relu = 0; relu < 2; relu++)
        for (int with_bias = 1; with_bias >= 0; with_bias--) {
          ot_case(DT_OP_GEMM, "linear forward, %s epilogue, out %lld%s, %s", relu ? "relu" : "gelu", (long long)out,
                  with_bias ? ", bias" : "", ROWS_NAME(r));
          const int64_t fused = backend_cuda_gemm_epilogues(ot.be[1]);
          BOTH {
            dt_op op = dense_gemm(DENSE_FWD, rows, in, out);
            op.p.gemm.a = F(x), op.p.gemm.b = F(w), op.p.gemm.c = F(y), op.p.gemm.bias = with_bias ? F(bias) : NULL;
            op.p.gemm.epilogue = relu ? DT_GEMM_RELU : DT_GEMM_GELU_TANH, op.p.gemm.aux = relu ? NULL : F(pre);
            RUN(op);
          }
          ot_check("y", y, rows * out);
          if (!relu) ot_check("aux (the gelu's input)", pre, rows * out);
          float *got = ot_fetch(y, 1);
          int64_t zeros = 0;
          for (int64_t i = 0; i < rows * out; i++) zeros += got[i] == 0.0f;
          free(got);
          if (relu && rows && !(zeros > 0 && zeros < rows * out)) /* about half: the relu clipped, and not all */
            fail_msg("op gemm [%s]: %lld of %lld values are 0", ot.kase, (long long)zeros, (long long)(rows * out));
          if (backend_cuda_gemm_epilogues(ot.be[1]) - fused != (rows && (relu || out % 8 == 0)))
            fail_msg("op gemm [%s]: %lld cuBLASLt epilogues", ot.kase,
                     (long long)(backend_cuda_gemm_epilogues(ot.be[1]) - fused));
        }
      /* the next linear (in -> out) after a gelu of `in` values: dx = (dy W) gelu'(pre) */
      dbuf dy = ot_rand(cap * out, -1, 1), gin = ot_rand(cap * in, -2, 2), dx = ot_rand(cap * in, -1, 1);
      ot_case(DT_OP_GEMM, "input gradient through the gelu's derivative, in %lld, %s", (long long)in, ROWS_NAME(r));
      const int64_t fused = backend_cuda_gemm_epilogues(ot.be[1]);
      BOTH {
        dt_op op = dense_gemm(DENSE_DX, rows, in, out);
        op.p.gemm.a = F(dy), op.p.gemm.b = F(w), op.p.gemm.c = F(dx);
        op.p.gemm.epilogue = DT_GEMM_DGELU_TANH, op.p.gemm.aux = F(gin);
        RUN(op);
      }
      ot_check("dx", dx, rows * in);
      ot_check("aux (read)", gin, 0);
      if (backend_cuda_gemm_epilogues(ot.be[1]) - fused != (rows && in % 8 == 0))
        fail_msg("op gemm [%s]: %lld cuBLASLt epilogues", ot.kase,
                 (long long)(backend_cuda_gemm_epilogues(ot.be[1]) - fused));
    }
  }
}

/* A GEMM with a bias (a linear layer's forward) runs as one cuBLASLt matmul whose epilogue adds the
 * bias, with no kernel filling C first, whatever the alignment of x, W and y (the heuristic is told
 * each pointer's); a bias that is not 16-byte aligned, a single row (PyTorch keeps a dimension of 1
 * from cuBLASLt too), or a problem cuBLASLt has no algorithm for (the stand-in's GPUSIM_CUBLASLT=none)
 * fills C and adds the product to it instead. Each result against a double-precision product on the
 * host (of bfloat16-rounded operands under bf16). */
static void gemm_bias_in_cublaslt_epilogue(void) {
  static const struct {
    const char *what;
    int precision;
    int64_t off_x, off_w, off_y, off_bias; /* floats past each buffer's 256-byte aligned start */
    int no_algorithm;
    double tol;
    int64_t rows;
  } cases[] = {
      {"fp32, aligned", DT_PREC_FP32, 0, 0, 0, 0, 0, 1e-5, 37},
      {"fp32, x, W and y 4-byte aligned", DT_PREC_FP32, 1, 3, 1, 0, 0, 1e-5, 37},
      {"fp32, the bias 4-byte aligned", DT_PREC_FP32, 0, 0, 0, 1, 0, 1e-5, 37},
      {"fp32, the bias 16-byte aligned", DT_PREC_FP32, 0, 0, 0, 4, 0, 1e-5, 37},
      {"tf32, aligned", DT_PREC_TF32, 0, 0, 0, 0, 0, 2e-3, 37},
      {"bf16, x and y 4-byte aligned", DT_PREC_BF16, 1, 0, 1, 0, 0, 1e-5, 37},
      {"bf16, the bias 8-byte aligned", DT_PREC_BF16, 0, 0, 0, 2, 0, 1e-5, 37},
      {"fp32, no cuBLASLt algorithm", DT_PREC_FP32, 0, 0, 0, 0, 1, 1e-5, 37},
      {"fp32, one row", DT_PREC_FP32, 0, 0, 0, 0, 0, 1e-5, 1},
  };
  const int64_t in = 40, out = 24;
  const int standin = on_standin(); /* where GPUSIM_CUBLASLT applies */
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    const int64_t rows = cases[c].rows;
    if (cases[c].no_algorithm) setenv("GPUSIM_CUBLASLT", "none", 1);
    dt_backend *be = backend_cuda_create(0, cases[c].precision);
    float *hx = ot_host_rand(rows * in, -1, 1), *hw = ot_host_rand(out * in, -1, 1), *hb = ot_host_rand(out, -1, 1);
    float *got = calloc((size_t)(rows * out), 4);
    float *x = be->alloc(be, (size_t)(rows * in + 8) * 4), *w = be->alloc(be, (size_t)(out * in + 8) * 4);
    float *y = be->alloc(be, (size_t)(rows * out + 8) * 4), *bias = be->alloc(be, (size_t)(out + 8) * 4);
    be->to_device(be, x + cases[c].off_x, hx, (size_t)(rows * in) * 4);
    be->to_device(be, w + cases[c].off_w, hw, (size_t)(out * in) * 4);
    be->to_device(be, bias + cases[c].off_bias, hb, (size_t)out * 4);
    const int64_t fused = backend_cuda_gemm_epilogues(be);
    dense_forward(be, rows, in, out, x + cases[c].off_x, w + cases[c].off_w, NULL, bias + cases[c].off_bias,
                  y + cases[c].off_y, NULL, 0, 0, 0);
    be->to_host(be, got, y + cases[c].off_y, (size_t)(rows * out) * 4);
    const int want_fused = cases[c].off_bias % 4 == 0 && !(cases[c].no_algorithm && standin) && rows > 1;
    if (backend_cuda_gemm_epilogues(be) - fused != want_fused)
      fail_msg("%s: %lld GEMMs added the bias in cuBLASLt's epilogue, expected %d", cases[c].what,
               (long long)(backend_cuda_gemm_epilogues(be) - fused), want_fused);
    const int round = cases[c].precision == DT_PREC_BF16;
    for (int64_t i = 0; i < rows; i++)
      for (int64_t o = 0; o < out; o++) {
        double want = hb[o], mag = fabs(hb[o]);
        for (int64_t k = 0; k < in; k++) {
          const double p = (double)(round ? round_bf16(hx[i * in + k]) : hx[i * in + k]) *
                           (round ? round_bf16(hw[o * in + k]) : hw[o * in + k]);
          want += p, mag += fabs(p);
        }
        if (fabs(got[i * out + o] - want) > cases[c].tol * mag)
          fail_msg("%s: y[%lld, %lld] = %.9g, want %.9g", cases[c].what, (long long)i, (long long)o, got[i * out + o],
                   want);
      }
    be->free(be, x), be->free(be, w), be->free(be, y), be->free(be, bias);
    be->destroy(be);
    free(hx), free(hw), free(hb), free(got);
    unsetenv("GPUSIM_CUBLASLT");
  }
}

GPU_TEST(cuda_op_gemm, (ot_begin(), ops_gemm(), ot_end()))
GPU_TEST(cuda_op_gemm_gelu, (ot_begin(), ops_gemm_gelu(), ot_end()))
GPU_TEST(cuda_gemm_bias_in_cublaslt_epilogue, gemm_bias_in_cublaslt_epilogue())
GPU_TEST(cuda_op_gemm_batched, (ot_begin(), ops_gemm_batched(), ot_end()))
GPU_TEST(cuda_op_gemm_bf16, (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_gemm_bf16(), ot_end()))
GPU_TEST(cuda_op_gemm_bias_sums, (ot_begin(), ops_gemm_bias_sums(), ot_end(), ot_begin_precision(DT_PREC_BF16, 1e-5),
                                  ops_gemm_bias_sums(), ot_end()))
GPU_TEST(cuda_op_gemm_relu_mask, (ot_begin(), ops_gemm_relu_mask(), ot_end(), ot_begin_precision(DT_PREC_BF16, 1e-5),
                                  ops_gemm_relu_mask(), ot_end()))
GPU_TEST(cuda_op_classifier_bf16_rows, (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_classifier_rows16(), ot_end()))
GPU_TEST(cuda_op_gelu_mlp_bf16_rows, (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_gelu_mlp_rows16(0), ot_end()))
GPU_TEST(cuda_op_gelu_mlp_bf16_rows_without_cublaslt,
         (setenv("GPUSIM_CUBLASLT", "none", 1), ot_begin_precision(DT_PREC_BF16, 1e-5), ops_gelu_mlp_rows16(1),
          ot_end(), unsetenv("GPUSIM_CUBLASLT")))
GPU_TEST(cuda_op_embed, (ot_begin(), ops_embed(), ot_end()))
GPU_TEST(cuda_op_layernorm, (ot_begin(), ops_layernorm(), ot_end()))
GPU_TEST(cuda_op_layernorm_bf16_rows, (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_layernorm_bf16(), ot_end()))
GPU_TEST(cuda_op_softmax, (ot_begin(), ops_softmax(), ot_end()))
GPU_TEST(cuda_op_permute, (ot_begin(), ops_permute(), ot_end()))
GPU_TEST(cuda_op_attention, (ot_begin(), ops_attention(), ot_end()))
GPU_TEST(cuda_op_attention_tensor_cores,
         (ot_begin_precision(DT_PREC_BF16, 1e-2), ops_attention_tensor_cores(), ot_end()))
GPU_TEST(cuda_op_attention_bf16_heads,
         (ot_begin(), ops_attention16(), ot_end(), ot_begin_precision(DT_PREC_BF16, 1e-2), ops_attention16(), ot_end()))
GPU_TEST(cuda_transformer_grads_same_bits_every_run, (ot_begin(), transformer_grads_same_bits(), ot_end()))
GPU_TEST(cuda_op_bias, (ot_begin(), ops_bias(), ot_end()))
GPU_TEST(cuda_op_conv, (ot_begin(), ops_conv_in(0, 0), ot_end()))
/* 16 bits: the operands' NHWC copies (kernels/convert.cu) and cuDNN on them, against FP32 on the CPU */
GPU_TEST(cuda_op_conv_bf16, (ot_begin_precision(DT_PREC_BF16, 1e-2), ops_conv_in(0, 0), ot_end()))
GPU_TEST(cuda_op_conv_fp16, (ot_begin_precision(DT_PREC_FP16, 2e-3), ops_conv_in(0, 0), ot_end()))
GPU_TEST(cuda_op_weights16, (ot_begin_precision(DT_PREC_BF16, 1e-2), ops_weights16(), ot_end(),
                             ot_begin_precision(DT_PREC_FP16, 2e-3), ops_weights16(), ot_end()))
GPU_TEST(cuda_op_grads16, (ot_begin_precision(DT_PREC_BF16, 1e-2), ops_grads16(), ot_end(),
                           ot_begin_precision(DT_PREC_FP16, 2e-3), ops_grads16(), ot_end()))
GPU_TEST(cuda_conv16_reuses_dy_only_back_to_back, conv16_reuses_dy_only_back_to_back())
GPU_TEST(cuda_conv16_backward_filter_reads_the_forwards_x16, conv16_backward_filter_reads_the_forwards_x16())
GPU_TEST(cuda_gemm16_reuses_dy_only_back_to_back, gemm16_reuses_dy_only_back_to_back())
GPU_TEST(cuda_op_batchnorm, (ot_begin(), ops_batchnorm_in(0, 0), ot_end()))
/* each in a session of its own (OT_MAX_BUFS) */
GPU_TEST(cuda_op_batchnorm_16bit_nhwc,
         (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_batchnorm_in(DT_F16_BF16, 0), ot_end(),
          ot_begin_precision(DT_PREC_BF16, 1e-5), ops_batchnorm_in(DT_F16_BF16, DT_F16_BF16), ot_end(),
          ot_begin_precision(DT_PREC_FP16, 1e-5), ops_batchnorm_in(DT_F16_HALF, 0), ot_end(),
          ot_begin_precision(DT_PREC_FP16, 1e-5), ops_batchnorm_in(DT_F16_HALF, DT_F16_HALF), ot_end()))
GPU_TEST(cuda_op_conv_16bit_nhwc,
         (ot_begin_precision(DT_PREC_BF16, 1e-2), ops_conv_in(DT_F16_BF16, 0), ops_conv_in(DT_F16_BF16, DT_F16_BF16),
          ot_end(), ot_begin_precision(DT_PREC_FP16, 2e-3), ops_conv_in(DT_F16_HALF, 0),
          ops_conv_in(DT_F16_HALF, DT_F16_HALF), ot_end()))
GPU_TEST(cuda_op_activation, (ot_begin(), ops_activation(), ot_end()))
GPU_TEST(cuda_op_pool, (ot_begin(), ops_pool_in(0), ot_end()))
GPU_TEST(cuda_op_pool_16bit_nhwc, (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_pool_in(DT_F16_BF16), ot_end(),
                                   ot_begin_precision(DT_PREC_FP16, 1e-5), ops_pool_in(DT_F16_HALF), ot_end()))
GPU_TEST(cuda_op_residual_16bit_nhwc, (ot_begin_precision(DT_PREC_BF16, 1e-5), ops_residual16(), ot_end(),
                                       ot_begin_precision(DT_PREC_FP16, 1e-5), ops_residual16(), ot_end()))
GPU_TEST(cuda_op_dropout, (ot_begin(), ops_dropout(), ot_end()))
GPU_TEST(cuda_op_add_scale, (ot_begin(), ops_elementwise(), ot_end()))
GPU_TEST(cuda_op_loss, (ot_begin(), ops_loss(), ot_end()))
GPU_TEST(cuda_op_sgd_adamw, (ot_begin(), ops_optim(), ot_end()))
GPU_TEST(cuda_op_optim_runs, (ot_begin(), ops_optim_runs(), ot_end()))
GPU_TEST(cuda_op_sumsq, (ot_begin(), ops_sumsq(), ot_end()))
GPU_TEST(cuda_op_input,
         (ot_begin(), ops_input_in(0), ot_end(), ot_begin_precision(DT_PREC_BF16, 1e-5), ops_input_in(DT_F16_BF16),
          ot_end(), ot_begin_precision(DT_PREC_FP16, 1e-5), ops_input_in(DT_F16_HALF), ot_end()))
GPU_TEST(cuda_op_loss_scaling, (ot_begin(), ops_scaler(), ot_end()))
GPU_TEST(cuda_op_optimizer_counts_nonfinite_gradients, (ot_begin(), ops_optim_nonfinite(), ot_end()))
GPU_TEST(cuda_op_gather, (ot_begin(), ops_gather(), ot_end()))
GPU_TEST(cuda_upload_download_copy, (ot_begin(), ops_upload_download(), ot_end()))

/* The sums the host reads back (sum of squares, loss sums) come out with the same bits every time:
 * run after run on a GPU, launch after launch on the stand-in, whose block order changes with each
 * launch. Accumulating them with atomics in whatever order blocks finish would not. */
static void sums_are_the_same_bits_every_time(void) {
  dt_backend *be = backend_cuda_create(0, DT_PREC_FP32);
  enum { N = 300000, B = 512, K = 10 };
  float *h = malloc(N * sizeof(float));
  int32_t labels[B];
  for (int i = 0; i < N; i++) h[i] = (dt_hash_uniform(21, (uint64_t)i) - 0.5f) * 1e3f;
  for (int i = 0; i < B; i++) labels[i] = (int32_t)(dt_hash64((uint64_t)i) % K);
  float *x = be->alloc(be, N * sizeof(float)), *dlogits = be->alloc(be, B * K * sizeof(float));
  be->to_device(be, x, h, N * sizeof(float));
  int32_t *dlabels = (int32_t *)be->alloc(be, sizeof labels);
  be->to_device(be, dlabels, labels, sizeof labels);
  double *sums = (double *)be->alloc(be, 4 * sizeof(double));
  double first[4] = {0};
  for (int run = 0; run < 6; run++) {
    be->zero(be, sums, 4 * sizeof(double));
    dt_op op = {.type = DT_OP_SUMSQ, .p.sumsq = {.n = N, .x = x, .out = sums}};
    backend_run(be, &op);
    dt_op lo = {.type = DT_OP_LOSS,
                .p.loss = {.kind = DT_LOSS_CROSS_ENTROPY,
                           .b = B,
                           .k = K,
                           .label_smoothing = 0.0f,
                           .weight = 1.0 / B,
                           .logits = x,
                           .labels = dlabels,
                           .targets = NULL,
                           .dlogits = dlogits,
                           .sums = sums + 2}};
    backend_run(be, &lo);
    double got[4];
    be->to_host(be, got, sums, sizeof got);
    if (run == 0) memcpy(first, got, sizeof got);
    if (memcmp(got, first, sizeof got))
      fail_msg("run %d: sum of squares %.17g (first %.17g), loss sum %.17g (first %.17g)", run, got[0], first[0],
               got[2], first[2]);
  }
  be->free(be, dlabels);
  be->free(be, sums);
  be->free(be, x);
  be->free(be, dlogits);
  be->destroy(be);
  free(h);
}
GPU_TEST(cuda_sums_are_the_same_bits_every_time, sums_are_the_same_bits_every_time())

/* Every op of dt_op_type has been through the tests above (run after them). A run of some tests only
 * (main's PATTERN) cannot tell: it skips. */
static int ran_filtered;
static void every_op_covered(void) {
  if (ran_filtered) skip();
  for (int i = 0; i < DT_OP_COUNT; i++)
    if (!ot_covered[i]) fail_msg("op %s has no op-level CUDA test (or its test stopped before it)", dt_op_names[i]);
}
GPU_TEST(cuda_op_every_op_tested, every_op_covered())

/* test_gpu [--list | PATTERN]: every test, their names (one a line), or those PATTERN matches (cmocka's
 * filter: * and ? wildcards). scripts/gpu_check.sh runs the tests a fault cut off one a process. */
int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(cuda_conv_batchnorm_pool_linear),
      cmocka_unit_test(cuda_activations_dropout_avgpool),
      cmocka_unit_test(cuda_residual_global_pool_mse),
      cmocka_unit_test(cuda_op_gemm),
      cmocka_unit_test(cuda_op_gemm_gelu),
      cmocka_unit_test(cuda_gemm_bias_in_cublaslt_epilogue),
      cmocka_unit_test(cuda_op_gemm_batched),
      cmocka_unit_test(cuda_op_gemm_bf16),
      cmocka_unit_test(cuda_op_gemm_bias_sums),
      cmocka_unit_test(cuda_op_gemm_relu_mask),
      cmocka_unit_test(cuda_op_classifier_bf16_rows),
      cmocka_unit_test(cuda_op_gelu_mlp_bf16_rows),
      cmocka_unit_test(cuda_op_gelu_mlp_bf16_rows_without_cublaslt),
      cmocka_unit_test(cuda_op_embed),
      cmocka_unit_test(cuda_op_layernorm),
      cmocka_unit_test(cuda_op_layernorm_bf16_rows),
      cmocka_unit_test(cuda_op_softmax),
      cmocka_unit_test(cuda_op_permute),
      cmocka_unit_test(cuda_op_attention),
      cmocka_unit_test(cuda_op_attention_tensor_cores),
      cmocka_unit_test(cuda_op_attention_bf16_heads),
      cmocka_unit_test(cuda_transformer_grads_same_bits_every_run),
      cmocka_unit_test(cuda_op_bias),
      cmocka_unit_test(cuda_op_conv),
      cmocka_unit_test(cuda_op_conv_bf16),
      cmocka_unit_test(cuda_op_conv_fp16),
      cmocka_unit_test(cuda_op_weights16),
      cmocka_unit_test(cuda_op_grads16),
      cmocka_unit_test(cuda_conv16_reuses_dy_only_back_to_back),
      cmocka_unit_test(cuda_conv16_backward_filter_reads_the_forwards_x16),
      cmocka_unit_test(cuda_gemm16_reuses_dy_only_back_to_back),
      cmocka_unit_test(cuda_op_batchnorm),
      cmocka_unit_test(cuda_op_batchnorm_16bit_nhwc),
      cmocka_unit_test(cuda_op_conv_16bit_nhwc),
      cmocka_unit_test(cuda_op_activation),
      cmocka_unit_test(cuda_op_pool),
      cmocka_unit_test(cuda_op_pool_16bit_nhwc),
      cmocka_unit_test(cuda_op_residual_16bit_nhwc),
      cmocka_unit_test(cuda_op_dropout),
      cmocka_unit_test(cuda_op_add_scale),
      cmocka_unit_test(cuda_op_loss),
      cmocka_unit_test(cuda_op_sgd_adamw),
      cmocka_unit_test(cuda_op_optim_runs),
      cmocka_unit_test(cuda_op_sumsq),
      cmocka_unit_test(cuda_op_input),
      cmocka_unit_test(cuda_op_optimizer_counts_nonfinite_gradients),
      cmocka_unit_test(cuda_op_loss_scaling),
      cmocka_unit_test(cuda_op_gather),
      cmocka_unit_test(cuda_upload_download_copy),
      cmocka_unit_test(cuda_op_every_op_tested),
      cmocka_unit_test(cuda_sums_are_the_same_bits_every_time),
  };
  if (argc > 2 || (argc == 2 && !argv[1][0])) {
    fprintf(stderr, "usage: %s [--list | PATTERN]\n", argv[0]);
    return 2;
  }
  if (argc == 2 && !strcmp(argv[1], "--list")) {
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) printf("%s\n", tests[i].name);
    return 0;
  }
  if (argc == 2) {
    cmocka_set_test_filter(argv[1]);
    ran_filtered = 1;
  }
  return cmocka_run_group_tests_name("gpu", tests, NULL, NULL);
}
