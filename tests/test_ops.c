/* test_ops: a finite-difference gradient check of every layer and loss on the CPU backend.
 * For a tiny model around the layer, the analytic gradients of the loss with respect to the
 * parameters and to the input (backward's dx) are compared with central differences. The
 * transformer ops (embedding, layernorm, softmax, fused attention, GELU tanh, permute, batched GEMM)
 * are also checked op by op, forward against independent references. */
#include <math.h>

#include "dt_test.h"

#include "config.h"
#include "layers.h"
#include "model.h"

typedef struct {
  dt_config cfg;
  dt_model m;
  dt_backend *be;
  int64_t batch;
  int32_t *labels;
  float *targets;
  float *teacher;     /* (batch, K) distillation's teacher logits, or NULL */
  uint64_t step_seed; /* the dropout seed (backend memory: host on the CPU) */
} fixture;

static void setup(fixture *f, const char *model_yaml, int64_t batch) {
  char text[4096];
  snprintf(text, sizeof text, "model:\n%sdata: {path: x.h5}\ntrain: {batch_size: 4}\n", model_yaml);
  char *path = write_tmp(text);
  dt_status st = {0};
  memset(f, 0, sizeof *f);
  if (config_load(&f->cfg, path, NULL, 0, &st) || model_build(&f->m, &f->cfg, &st)) fail_msg("%s", st.msg);
  unlink(path);
  free(path);
  f->be = backend_cpu_create(1);
  f->batch = batch;
  f->step_seed = 99;
  model_alloc(&f->m, f->be, batch, 7);
  /* random inputs, targets and batchnorm affine parameters (not their 1/0 init) */
  int64_t nin = batch * shape_size(f->m.input);
  for (int64_t i = 0; i < nin; i++) f->m.input_x[i] = 2.0f * dt_hash_uniform(11, (uint64_t)i) - 1.0f;
  for (int t = 0; t < f->m.n_tensors; t++) {
    dt_tensor *tt = &f->m.tensors[t];
    if (strstr(tt->name, "body") || tt->is_buffer || tt->ndim != 1) continue;
    for (int64_t i = 0; i < tt->count; i++)
      f->m.params[tt->offset + i] += 0.5f * (dt_hash_uniform(13 + (uint64_t)t, (uint64_t)i) - 0.5f);
  }
  f->labels = calloc((size_t)batch, sizeof(int32_t));
  f->targets = calloc((size_t)(batch * f->m.n_outputs), sizeof(float));
  for (int64_t b = 0; b < batch; b++) f->labels[b] = (int32_t)(dt_hash64((uint64_t)b) % (uint64_t)f->m.n_outputs);
  for (int64_t i = 0; i < batch * f->m.n_outputs; i++) f->targets[i] = dt_hash_uniform(17, (uint64_t)i);
}

static void teardown(fixture *f) {
  model_free(&f->m);
  f->be->destroy(f->be);
  config_free(&f->cfg);
  free(f->labels);
  free(f->targets);
  free(f->teacher);
}

static dt_pass make_pass(fixture *f) {
  return (dt_pass){.be = f->be,
                   .batch = f->batch,
                   .training = 1,
                   .global_targets = (double)f->batch,
                   .step_seed = &f->step_seed,
                   .teacher_logits = f->teacher,
                   .params = f->m.params,
                   .grads = f->m.grads,
                   .bufs = f->m.bufs};
}

static double loss_of(fixture *f) {
  dt_pass p = make_pass(f);
  model_forward(&f->m, &p);
  double sums[2] = {0, 0}; /* the CPU backend's memory is host memory */
  model_loss(&f->m, &p, f->labels, f->targets, sums);
  return sums[0] / (double)f->batch;
}

/* Returns the relative error ||analytic - numeric|| / max(||analytic||, ||numeric||) over up
 * to 64 entries of a buffer, with norms below 1e-3 counted as 1e-3. */
static double check_buffer(fixture *f, float *values, const float *analytic, int64_t n, double h) {
  double diff = 0, na = 0, nn = 0;
  int64_t stride = n > 64 ? n / 64 : 1;
  for (int64_t i = 0; i < n; i += stride) {
    float save = values[i];
    values[i] = save + (float)h;
    double up = loss_of(f);
    values[i] = save - (float)h;
    double down = loss_of(f);
    values[i] = save;
    double num = (up - down) / (2 * h);
    diff += (analytic[i] - num) * (analytic[i] - num);
    na += (double)analytic[i] * analytic[i];
    nn += num * num;
  }
  /* a floor: a gradient that is exactly zero (a conv bias before batchnorm) compares noise to noise */
  double scale = sqrt(na > nn ? na : nn);
  return sqrt(diff) / (scale > 1e-3 ? scale : 1e-3);
}

/* Checks every parameter's gradient and the input's of a set-up fixture against central differences;
 * what names the case in messages. */
static void grad_check_fixture(fixture *f, const char *what) {
  int64_t nin = f->batch * shape_size(f->m.input);
  float *dx = calloc((size_t)nin, sizeof(float));
  memset(f->m.grads, 0, (size_t)f->m.n_params * sizeof(float));
  dt_pass p = make_pass(f);
  model_forward(&f->m, &p);
  double sums[2] = {0, 0};
  model_loss(&f->m, &p, f->labels, f->targets, sums);
  seq_backward(&f->m.top, &p, f->m.input_x, dx);
  float *grads = malloc((size_t)(f->m.n_params + 1) * sizeof(float));
  memcpy(grads, f->m.grads, (size_t)f->m.n_params * sizeof(float));
  for (int t = 0; t < f->m.n_tensors; t++) {
    dt_tensor *tt = &f->m.tensors[t];
    if (tt->is_buffer) continue;
    double err = check_buffer(f, f->m.params + tt->offset, grads + tt->offset, tt->count, 1e-3);
    if (err > 1e-2) fail_msg("%s: gradient of %s off by %.3g (relative)", what, tt->name, err);
  }
  double err = check_buffer(f, f->m.input_x, dx, nin, 1e-3);
  if (err > 1e-2) fail_msg("%s: input gradient off by %.3g (relative)", what, err);
  free(grads);
  free(dx);
}

static void grad_check(const char *model_yaml, int64_t batch) {
  fixture f;
  setup(&f, model_yaml, batch);
  grad_check_fixture(&f, model_yaml);
  teardown(&f);
}

static void linear_grads(void **s) {
  (void)s;
  grad_check("  input: [5]\n  layers: [{linear: {out: 4}}]\n  loss: mse\n", 3);
  grad_check("  input: [5]\n  layers: [{linear: {out: 4, bias: false}}]\n  loss: mse\n", 3);
}

static void conv2d_grads(void **s) {
  (void)s;
  grad_check("  input: [2, 5, 5]\n  layers: [{conv2d: {out: 3, kernel: 3, pad: 1}}, flatten]\n  loss: mse\n", 2);
  grad_check(
      "  input: [2, 6, 5]\n  layers: [{conv2d: {out: 3, kernel: 3, stride: 2, pad: 1, bias: false}}, flatten]\n"
      "  loss: mse\n",
      2);
  grad_check("  input: [1, 5, 5]\n  layers: [{conv2d: {out: 2, kernel: 2, stride: 1}}, flatten]\n  loss: mse\n", 3);
}

static void batchnorm_grads(void **s) {
  (void)s;
  grad_check("  input: [3, 4, 4]\n  layers: [{batchnorm: {}}, flatten]\n  loss: mse\n", 4);
  grad_check("  input: [6]\n  layers: [{batchnorm: {eps: 0.001}}]\n  loss: mse\n", 5);
  /* followed by a relu: fused into the batchnorm (model.fuse's default), and apart */
  grad_check("  input: [3, 4, 4]\n  layers: [{batchnorm: {}}, relu, flatten]\n  loss: mse\n", 4);
  grad_check("  input: [6]\n  layers: [{batchnorm: {eps: 0.001}}, relu]\n  loss: mse\n", 5);
  grad_check("  fuse: false\n  input: [3, 4, 4]\n  layers: [{batchnorm: {}}, relu, flatten]\n  loss: mse\n", 4);
}

/* model.fuse: a batchnorm, a residual or a linear (its GEMM's epilogue) applies the relu after it (and the
 * relu borrows its buffers), with
 * the same logits, parameter gradients, input gradient and running statistics, bit for bit, as the two
 * layers apart; a relu after anything else, a batchnorm followed by another layer, or a residual's relu
 * that ends a residual's branch (the residual masks the relu's gradient in place, and a branch's end
 * shares its dy with the residual around it; so a linear's) is left alone. */
static void relu_fused_equals_apart(void **s) {
  (void)s;
  const char *model =
      "  input: [3, 5, 5]\n  layers: [{conv2d: {out: 4, kernel: 3, pad: 1}}, {batchnorm: {}}, relu,"
      " {residual: {body: [{conv2d: {out: 4, kernel: 3, pad: 1}}, {batchnorm: {}}]}}, relu,"
      " {residual: {body: [{residual: {body: [{conv2d: {out: 4, kernel: 1}}]}}, relu]}},"
      " {conv2d: {out: 4, kernel: 3}}, relu, {batchnorm: {}}, flatten, {linear: {out: 5}}, relu,"
      " {residual: {body: [{linear: {out: 5}}, relu]}}, {linear: {out: 6}}, {batchnorm: {}}, relu,"
      " {linear: {out: 3}}]\n  loss: cross_entropy\n";
  char apart_yaml[1024];
  snprintf(apart_yaml, sizeof apart_yaml, "  fuse: false\n%s", model);
  fixture f[2];
  setup(&f[0], model, 6);
  setup(&f[1], apart_yaml, 6);
  static const int fused_bn[] = {0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0};
  for (int i = 0; i < f[0].m.top.n; i++) {
    const dt_layer *l = f[0].m.top.layers[i], *a = f[1].m.top.layers[i];
    if (l->fused_relu != fused_bn[i] || (i > 0 && (l->fused_into != NULL) != fused_bn[i - 1]))
      fail_msg("layer %d (%s): fused_relu %d, fused into %p", i, l->ops->kind, l->fused_relu, (void *)l->fused_into);
    if (a->fused_relu || a->fused_into) fail_msg("layer %d fused with model.fuse false", i);
  }
  for (int i = 2; i <= 11; i += i < 4 ? 2 : 7)
    if (f[0].m.top.layers[i]->y != f[0].m.top.layers[i - 1]->y ||
        f[0].m.top.layers[i]->dy != f[0].m.top.layers[i - 1]->dy)
      fail_msg("the fused relu %d does not borrow its layer's buffers", i);
  for (int i = 5; i <= 12; i += 7) { /* an inner residual's relu, and a linear's, end the branch */
    const dt_seq *outer = &f[0].m.top.layers[i]->body;
    if (outer->layers[0]->fused_relu || outer->layers[1]->fused_into) fail_msg("a branch-ending relu was fused");
  }
  int64_t nin = 6 * shape_size(f[0].m.input);
  float *dx[2];
  for (int k = 0; k < 2; k++) {
    dx[k] = calloc((size_t)nin, sizeof(float));
    memset(f[k].m.grads, 0, (size_t)f[k].m.n_params * sizeof(float));
    dt_pass p = make_pass(&f[k]);
    model_forward(&f[k].m, &p);
    double sums[2] = {0, 0};
    model_loss(&f[k].m, &p, f[k].labels, f[k].targets, sums);
    seq_backward(&f[k].m.top, &p, f[k].m.input_x, dx[k]);
  }
  if (memcmp(model_logits(&f[0].m), model_logits(&f[1].m), 6 * 3 * sizeof(float)))
    fail_msg("fused logits differ from apart");
  if (memcmp(f[0].m.grads, f[1].m.grads, (size_t)f[0].m.n_params * sizeof(float)))
    fail_msg("fused parameter gradients differ from apart");
  if (memcmp(f[0].m.bufs, f[1].m.bufs, (size_t)f[0].m.n_bufs * sizeof(float)))
    fail_msg("fused running statistics differ from apart");
  if (memcmp(dx[0], dx[1], (size_t)nin * sizeof(float))) fail_msg("fused input gradient differs from apart");
  double g = 0;
  for (int64_t i = 0; i < f[0].m.n_params; i++) g += fabs(f[0].m.grads[i]);
  if (!(g > 0)) fail_msg("no gradient at all");
  for (int k = 0; k < 2; k++) {
    free(dx[k]);
    teardown(&f[k]);
  }
}

static void activation_grads(void **s) {
  (void)s;
  const char *acts[] = {"relu", "gelu", "tanh", "sigmoid"};
  for (int i = 0; i < 4; i++) {
    char y[256];
    snprintf(y, sizeof y, "  input: [7]\n  layers: [{linear: {out: 6}}, %s]\n  loss: mse\n", acts[i]);
    grad_check(y, 3);
  }
  /* a relu between two linears: applied by the first's GEMM (model.fuse), its gradient masked in place */
  grad_check("  input: [7]\n  layers: [{linear: {out: 6}}, relu, {linear: {out: 4}}]\n  loss: mse\n", 3);
  grad_check("  input: [7]\n  layers: [{linear: {out: 6, bias: false}}, relu, {linear: {out: 4}}]\n  loss: mse\n", 3);
}

static void pooling_grads(void **s) {
  (void)s;
  grad_check("  input: [2, 6, 6]\n  layers: [{maxpool: {kernel: 2}}, flatten]\n  loss: mse\n", 2);
  grad_check("  input: [2, 7, 7]\n  layers: [{maxpool: {kernel: 3, stride: 2}}, flatten]\n  loss: mse\n", 2);
  grad_check("  input: [2, 6, 6]\n  layers: [{avgpool: {kernel: 2}}, flatten]\n  loss: mse\n", 2);
  grad_check("  input: [3, 4, 5]\n  layers: [global_avgpool]\n  loss: mse\n", 2);
}

static void dropout_and_flatten_grads(void **s) {
  (void)s;
  grad_check("  input: [8]\n  layers: [{linear: {out: 16}}, {dropout: {p: 0.3}}]\n  loss: mse\n", 4);
  grad_check("  input: [2, 3, 3]\n  layers: [flatten, {linear: {out: 3}}]\n  loss: mse\n", 2);
}

static void residual_grads(void **s) {
  (void)s;
  /* followed by a relu: fused into the residual's sum (model.fuse's default), its gradient masked in place */
  grad_check(
      "  input: [2, 4, 4]\n  layers:\n    - residual: {body: [{conv2d: {out: 2, kernel: 3, pad: 1}}]}\n"
      "    - relu\n    - flatten\n  loss: mse\n",
      2);
  grad_check(
      "  input: [2, 4, 4]\n  layers:\n"
      "    - residual: {body: [{conv2d: {out: 2, kernel: 3, pad: 1, bias: false}}, {batchnorm: {}}, relu]}\n"
      "    - flatten\n  loss: mse\n",
      3);
  grad_check(
      "  input: [2, 4, 4]\n  layers:\n"
      "    - residual:\n"
      "        body: [{conv2d: {out: 3, kernel: 3, stride: 2, pad: 1}}, tanh]\n"
      "        shortcut: [{conv2d: {out: 3, kernel: 1, stride: 2}}]\n"
      "    - flatten\n  loss: mse\n",
      2);
}

static void loss_grads(void **s) {
  (void)s;
  grad_check("  input: [5]\n  layers: [{linear: {out: 4}}]\n  loss: cross_entropy\n", 6);
  grad_check("  input: [5]\n  layers: [{linear: {out: 4}}]\n  loss: {cross_entropy: {label_smoothing: 0.2}}\n", 6);
  grad_check("  input: [5]\n  layers: [{linear: {out: 1}}]\n  loss: mse\n", 6);
}

/* (n) teacher logits in [-1.5, 1.5), from a fixed stream (caller frees). */
static float *rand_teacher(int64_t n) {
  float *t = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) t[i] = 3.0f * dt_hash_uniform(23, (uint64_t)i) - 1.5f;
  return t;
}

/* Distillation's loss (distill.loss kl or mse, mixed with the model's own by alpha): the gradient
 * by central differences, with temperatures below, at and above 1, and rows that cross_entropy
 * ignores (label 2 here), which must add neither term. */
static void distill_grads_case(const char *loss, int distill, double alpha, double temperature, int ignore) {
  char yaml[256];
  snprintf(yaml, sizeof yaml, "  input: [5]\n  layers: [{linear: {out: 4}}]\n  loss: %s\n", loss);
  fixture f;
  setup(&f, yaml, 6);
  f.m.loss.distill = distill, f.m.loss.alpha = alpha, f.m.loss.temperature = temperature;
  if (ignore) f.m.loss.ignore_index_set = 1, f.m.loss.ignore_index = 2;
  f.teacher = rand_teacher(6 * 4);
  char what[512];
  snprintf(what, sizeof what, "%s, distill %d, alpha %g, T %g", loss, distill, alpha, temperature);
  grad_check_fixture(&f, what);
  if (ignore) {
    int64_t ignored = 0;
    for (int64_t b = 0; b < 6; b++) ignored += f.labels[b] == 2;
    if (!ignored) fail_msg("no row is labelled 2: the ignore case tests nothing");
  }
  teardown(&f);
}

static void distill_loss_grads(void **s) {
  (void)s;
  distill_grads_case("cross_entropy", DT_DISTILL_KL, 0.5, 1.0, 0);
  distill_grads_case("cross_entropy", DT_DISTILL_KL, 0.7, 4.0, 0);
  distill_grads_case("cross_entropy", DT_DISTILL_KL, 0.3, 0.5, 1);
  distill_grads_case("{cross_entropy: {label_smoothing: 0.1}}", DT_DISTILL_MSE, 0.4, 1.0, 0);
  distill_grads_case("mse", DT_DISTILL_MSE, 0.6, 1.0, 0);
  distill_grads_case("mse", DT_DISTILL_KL, 1.0, 2.0, 0);
}

/* Hand-worked values: the loss itself, not only its gradient. */
static void loss_values_by_hand(void **s) {
  (void)s;
  fixture f;
  setup(&f,
        "  input: [2]\n  layers: [{linear: {out: 2, bias: false}}]\n  loss: {cross_entropy: {label_smoothing: 0.1}}\n",
        1);
  /* W = I, x = (1, 0): logits (1, 0); label 0 */
  f.m.params[0] = 1, f.m.params[1] = 0, f.m.params[2] = 0, f.m.params[3] = 1;
  f.m.input_x[0] = 1, f.m.input_x[1] = 0;
  f.labels[0] = 0;
  double lse = log(exp(1.0) + 1.0);
  double want = 0.95 * (lse - 1.0) + 0.05 * lse; /* targets (0.95, 0.05) */
  assert_true(fabs(loss_of(&f) - want) < 1e-6);
  teardown(&f);
  setup(&f, "  input: [2]\n  layers: [{linear: {out: 2, bias: false}}]\n  loss: mse\n", 1);
  f.m.params[0] = 2, f.m.params[1] = 0, f.m.params[2] = 0, f.m.params[3] = 1;
  f.m.input_x[0] = 1, f.m.input_x[1] = 1;
  f.targets[0] = 0, f.targets[1] = 3; /* errors (2, -2): mean of squares 4 */
  assert_true(fabs(loss_of(&f) - 4.0) < 1e-6);
  teardown(&f);
  /* distillation, T = 2, alpha 0.25: student logits (2, 0), teacher (0, 2), label 0. At T = 2,
   * p_s = (e, 1) / (e + 1) and p_t = (1, e) / (e + 1), so log p_t - log p_s = (-1, 1) and
   * KL(p_t || p_s) = -p_t0 + p_t1; loss = 0.75 CE + 0.25 * T^2 * KL */
  setup(&f, "  input: [2]\n  layers: [{linear: {out: 2, bias: false}}]\n  loss: cross_entropy\n", 1);
  f.m.params[0] = 2, f.m.params[1] = 0, f.m.params[2] = 0, f.m.params[3] = 0;
  f.m.input_x[0] = 1, f.m.input_x[1] = 0;
  f.labels[0] = 0;
  f.m.loss.distill = DT_DISTILL_KL, f.m.loss.alpha = 0.25, f.m.loss.temperature = 2;
  f.teacher = malloc(2 * sizeof(float));
  f.teacher[0] = 0, f.teacher[1] = 2;
  const double e = exp(1.0), pt0 = 1 / (e + 1), pt1 = e / (e + 1);
  const double kl = pt0 * -1.0 + pt1 * 1.0, ce = log(exp(2.0) + 1.0) - 2.0;
  want = 0.75 * ce + 0.25 * 4.0 * kl;
  if (fabs(loss_of(&f) - want) > 1e-6) fail_msg("distillation loss %.9g, by hand %.9g", loss_of(&f), want);
  teardown(&f);
}

/* ---- transformer ops, op by op on the CPU backend ------------------------------------------
 * Each forward is checked against an independent reference (a naive loop, in double where it
 * sums), each backward against central differences of L = sum_i w_i y_i (so dy = w), with
 * gradients that are added into starting from nonzero values. Two threads, so the parallel
 * loops split their work. */

static float *rand_floats(uint64_t seed, int64_t n, float lo, float hi) {
  float *h = malloc((size_t)(n + 1) * sizeof(float));
  for (int64_t i = 0; i < n; i++) h[i] = lo + (hi - lo) * dt_hash_uniform(seed, (uint64_t)i);
  return h;
}

static float *copy_floats(const float *x, int64_t n) {
  float *h = malloc((size_t)(n + 1) * sizeof(float));
  memcpy(h, x, (size_t)n * sizeof(float));
  return h;
}

static double dot_d(const float *a, const float *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
  return s;
}

/* The scalar L(values) that an op test differentiates; ctx is the test's state. */
typedef double (*loss_fn)(void *ctx);

/* Relative error (norm-wise, as check_buffer) of analytic against central differences of L over
 * up to 64 entries of values. */
static double fd_error(loss_fn loss, void *ctx, float *values, const float *analytic, int64_t n, double h) {
  double diff = 0, na = 0, nn = 0;
  int64_t stride = n > 64 ? n / 64 : 1;
  for (int64_t i = 0; i < n; i += stride) {
    float save = values[i];
    values[i] = save + (float)h;
    double up = loss(ctx);
    values[i] = save - (float)h;
    double down = loss(ctx);
    values[i] = save;
    double num = (up - down) / (2 * h);
    diff += (analytic[i] - num) * (analytic[i] - num);
    na += (double)analytic[i] * analytic[i];
    nn += num * num;
  }
  double scale = sqrt(na > nn ? na : nn);
  return sqrt(diff) / (scale > 1e-3 ? scale : 1e-3);
}

#define FD_EXPECT(what, err, tol)                                                    \
  do {                                                                               \
    double e_ = (err);                                                               \
    if (!(e_ <= (tol))) fail_msg("%s: gradient off by %.3g (relative)", (what), e_); \
  } while (0)

/* after - before: what a backward added into a gradient that started at `before` */
static float *added(const float *after, const float *before, int64_t n) {
  float *d = malloc((size_t)(n + 1) * sizeof(float));
  for (int64_t i = 0; i < n; i++) d[i] = after[i] - before[i];
  return d;
}

typedef struct {
  dt_backend *be;
  int64_t n, t, d, vocab;
  float *tokens, *wte, *wpe, *y, *w;
} embed_ctx;

static double embed_loss(void *p) {
  embed_ctx *c = p;
  dt_op op = {.type = DT_OP_EMBED_FWD,
              .p.embed_fwd = {.n = c->n,
                              .t = c->t,
                              .d = c->d,
                              .vocab = c->vocab,
                              .tokens = c->tokens,
                              .wte = c->wte,
                              .wpe = c->wpe,
                              .y = c->y}};
  backend_run(c->be, &op);
  return dot_d(c->y, c->w, c->n * c->d);
}

/* Forward against a naive loop (exactly); wte and wpe gradients against central differences
 * (repeated tokens, two sequences); the backward against rows added in turn, n = 0, 1, ...
 * (bit for bit: the order the spec fixes), and without positions. */
static void embed_forward_and_grads(void **s) {
  (void)s;
  embed_ctx c = {.be = backend_cpu_create(2), .n = 2 * 5, .t = 5, .d = 37, .vocab = 7};
  const float toks[10] = {3, 1, 3, 0, 6, 6, 2, 3, 1, 3};
  c.tokens = copy_floats(toks, c.n);
  c.wte = rand_floats(1, c.vocab * c.d, -1, 1);
  c.wpe = rand_floats(2, c.t * c.d, -1, 1);
  c.y = calloc((size_t)(c.n * c.d), sizeof(float));
  c.w = rand_floats(3, c.n * c.d, -1, 1);
  embed_loss(&c);
  for (int64_t r = 0; r < c.n; r++)
    for (int64_t j = 0; j < c.d; j++) {
      float want = c.wte[(int64_t)toks[r] * c.d + j] + c.wpe[(r % c.t) * c.d + j];
      if (c.y[r * c.d + j] != want)
        fail_msg("embed_fwd: y[%lld][%lld] = %g, expected %g", (long long)r, (long long)j, c.y[r * c.d + j], want);
    }
  float *dwte0 = rand_floats(4, c.vocab * c.d, -1, 1), *dwpe0 = rand_floats(5, c.t * c.d, -1, 1);
  float *dwte = copy_floats(dwte0, c.vocab * c.d), *dwpe = copy_floats(dwpe0, c.t * c.d);
  dt_op op = {
      .type = DT_OP_EMBED_BWD,
      .p.embed_bwd = {
          .n = c.n, .t = c.t, .d = c.d, .vocab = c.vocab, .tokens = c.tokens, .dy = c.w, .dwte = dwte, .dwpe = dwpe}};
  backend_run(c.be, &op);
  /* the reference: each row added in turn */
  float *ref_wte = copy_floats(dwte0, c.vocab * c.d), *ref_wpe = copy_floats(dwpe0, c.t * c.d);
  for (int64_t r = 0; r < c.n; r++)
    for (int64_t j = 0; j < c.d; j++) {
      ref_wte[(int64_t)toks[r] * c.d + j] += c.w[r * c.d + j];
      ref_wpe[(r % c.t) * c.d + j] += c.w[r * c.d + j];
    }
  if (memcmp(ref_wte, dwte, (size_t)(c.vocab * c.d) * sizeof(float)) ||
      memcmp(ref_wpe, dwpe, (size_t)(c.t * c.d) * sizeof(float)))
    fail_msg("embed_bwd: not the bits of rows added in increasing order");
  float *gwte = added(dwte, dwte0, c.vocab * c.d), *gwpe = added(dwpe, dwpe0, c.t * c.d);
  FD_EXPECT("embed wte", fd_error(embed_loss, &c, c.wte, gwte, c.vocab * c.d, 1e-2), 1e-5);
  FD_EXPECT("embed wpe", fd_error(embed_loss, &c, c.wpe, gwpe, c.t * c.d, 1e-2), 1e-5);
  /* no positions: y is the token row; dwpe NULL is left alone */
  float *wpe = c.wpe;
  c.wpe = NULL;
  embed_loss(&c);
  for (int64_t r = 0; r < c.n; r++)
    if (memcmp(c.y + r * c.d, c.wte + (int64_t)toks[r] * c.d, (size_t)c.d * sizeof(float)))
      fail_msg("embed_fwd without positions: row %lld is not its token's row", (long long)r);
  memcpy(dwte, dwte0, (size_t)(c.vocab * c.d) * sizeof(float));
  op.p.embed_bwd.dwpe = NULL;
  backend_run(c.be, &op);
  float *g2 = added(dwte, dwte0, c.vocab * c.d);
  FD_EXPECT("embed wte (no positions)", fd_error(embed_loss, &c, c.wte, g2, c.vocab * c.d, 1e-2), 1e-5);
  free(g2), free(gwte), free(gwpe), free(ref_wte), free(ref_wpe), free(dwte0), free(dwpe0), free(dwte), free(dwpe);
  free(c.tokens), free(c.wte), free(wpe), free(c.y), free(c.w);
  c.be->destroy(c.be);
}

typedef struct {
  dt_backend *be;
  int64_t n, d;
  float eps;
  float *x, *gamma, *beta, *y, *mean, *rstd, *w;
} ln_ctx;

static double ln_loss(void *p) {
  ln_ctx *c = p;
  dt_op op = {.type = DT_OP_LN_FWD,
              .p.ln_fwd = {.n = c->n,
                           .d = c->d,
                           .eps = c->eps,
                           .x = c->x,
                           .gamma = c->gamma,
                           .beta = c->beta,
                           .y = c->y,
                           .mean = c->mean,
                           .rstd = c->rstd}};
  backend_run(c->be, &op);
  return dot_d(c->y, c->w, c->n * c->d);
}

/* Forward, mean and rstd against a naive double computation (biased variance); dx, dgamma and
 * dbeta against central differences, dx overwritten, dgamma and dbeta added into. */
static void layernorm_forward_and_grads(void **s) {
  (void)s;
  const int64_t dims[][2] = {{6, 37}, {3, 5}};
  for (int k = 0; k < 2; k++) {
    ln_ctx c = {.be = backend_cpu_create(2), .n = dims[k][0], .d = dims[k][1], .eps = 1e-5f};
    int64_t nd = c.n * c.d;
    c.x = rand_floats(10, nd, -2, 3);
    for (int64_t i = 0; i < c.d; i++) c.x[i] = 1000.0f + c.x[i]; /* a row far from 0: two-pass variance */
    c.gamma = rand_floats(11, c.d, 0.5f, 1.5f), c.beta = rand_floats(12, c.d, -0.5f, 0.5f);
    c.y = calloc((size_t)nd, sizeof(float)), c.mean = calloc((size_t)c.n, 4), c.rstd = calloc((size_t)c.n, 4);
    c.w = rand_floats(13, nd, -1, 1);
    ln_loss(&c);
    for (int64_t r = 0; r < c.n; r++) {
      double mu = 0, var = 0;
      for (int64_t j = 0; j < c.d; j++) mu += c.x[r * c.d + j];
      mu /= (double)c.d;
      for (int64_t j = 0; j < c.d; j++) var += (c.x[r * c.d + j] - mu) * (c.x[r * c.d + j] - mu);
      double rs = 1.0 / sqrt(var / (double)c.d + c.eps);
      if (fabs(c.mean[r] - mu) > 1e-6 * (1 + fabs(mu)) || fabs(c.rstd[r] - rs) > 1e-6 * rs)
        fail_msg("ln_fwd row %lld: mean %.9g rstd %.9g, expected %.9g %.9g", (long long)r, c.mean[r], c.rstd[r], mu,
                 rs);
      for (int64_t j = 0; j < c.d; j++) {
        double want = (c.x[r * c.d + j] - mu) * rs * c.gamma[j] + c.beta[j];
        if (fabs(c.y[r * c.d + j] - want) > 2e-6 * (1 + fabs(want)))
          fail_msg("ln_fwd y[%lld][%lld] = %.9g, expected %.9g", (long long)r, (long long)j, c.y[r * c.d + j], want);
      }
    }
    for (int64_t i = 0; i < c.d; i++) c.x[i] -= 1000.0f; /* central differences need O(1) values */
    ln_loss(&c);
    float *dx = rand_floats(14, nd, -9, 9); /* overwritten */
    float *dg0 = rand_floats(15, c.d, -1, 1), *db0 = rand_floats(16, c.d, -1, 1);
    float *dg = copy_floats(dg0, c.d), *db = copy_floats(db0, c.d);
    dt_op op = {.type = DT_OP_LN_BWD,
                .p.ln_bwd = {.n = c.n,
                             .d = c.d,
                             .x = c.x,
                             .dy = c.w,
                             .gamma = c.gamma,
                             .mean = c.mean,
                             .rstd = c.rstd,
                             .dx = dx,
                             .dgamma = dg,
                             .dbeta = db}};
    backend_run(c.be, &op);
    float *gg = added(dg, dg0, c.d), *gb = added(db, db0, c.d);
    FD_EXPECT("layernorm dx", fd_error(ln_loss, &c, c.x, dx, nd, 1e-3), 2e-3);
    FD_EXPECT("layernorm dgamma", fd_error(ln_loss, &c, c.gamma, gg, c.d, 1e-3), 5e-4);
    FD_EXPECT("layernorm dbeta", fd_error(ln_loss, &c, c.beta, gb, c.d, 1e-3), 5e-4);
    free(dx), free(dg0), free(db0), free(dg), free(db), free(gg), free(gb);
    free(c.x), free(c.gamma), free(c.beta), free(c.y), free(c.mean), free(c.rstd), free(c.w);
    c.be->destroy(c.be);
  }
}

typedef struct {
  dt_backend *be;
  int64_t rows, t;
  int causal;
  float scale;
  float *x, *y, *w;
} softmax_ctx;

static double softmax_loss(void *p) {
  softmax_ctx *c = p;
  dt_op op = {
      .type = DT_OP_SOFTMAX_FWD,
      .p.softmax_fwd = {.rows = c->rows, .t = c->t, .causal = c->causal, .scale = c->scale, .x = c->x, .y = c->y}};
  backend_run(c->be, &op);
  return dot_d(c->y, c->w, c->rows * c->t);
}

/* Rows of (2 sequences, T = 5, T) scores: forward against a double softmax of scale * x over the
 * columns j <= r % T (causal; the rest exactly 0) or all; inputs up to 80 (exp would overflow
 * without the max); dx against central differences, overwritten (0 where masked). */
static void softmax_forward_and_grads(void **s) {
  (void)s;
  for (int causal = 0; causal < 2; causal++) {
    softmax_ctx c = {.be = backend_cpu_create(2), .rows = 2 * 5, .t = 5, .causal = causal, .scale = 0.37f};
    int64_t n = c.rows * c.t;
    c.x = rand_floats(20, n, -3, 3), c.y = calloc((size_t)n, sizeof(float)), c.w = rand_floats(21, n, -1, 1);
    for (int64_t j = 0; j < c.t; j++) c.x[3 * c.t + j] = 200.0f + 10.0f * (float)j; /* scale * x up to 88 */
    softmax_loss(&c);
    for (int64_t r = 0; r < c.rows; r++) {
      int64_t valid = causal ? r % c.t + 1 : c.t;
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < valid; j++) mx = fmax(mx, (double)(c.scale * c.x[r * c.t + j]));
      for (int64_t j = 0; j < valid; j++) sum += exp((double)(c.scale * c.x[r * c.t + j]) - mx);
      for (int64_t j = 0; j < c.t; j++) {
        double want = j < valid ? exp((double)(c.scale * c.x[r * c.t + j]) - mx) / sum : 0.0;
        float got = c.y[r * c.t + j];
        if (j >= valid ? got != 0.0f : !(fabs(got - want) <= 1e-6 * want + 1e-9))
          fail_msg("softmax_fwd (causal %d) y[%lld][%lld] = %.9g, expected %.9g", causal, (long long)r, (long long)j,
                   got, want);
      }
    }
    for (int64_t j = 0; j < c.t; j++) c.x[3 * c.t + j] = 0.1f * (float)j; /* central differences need O(1) values */
    softmax_loss(&c);
    float *dx = rand_floats(22, n, -9, 9);
    dt_op op = {
        .type = DT_OP_SOFTMAX_BWD,
        .p.softmax_bwd = {.rows = c.rows, .t = c.t, .causal = causal, .scale = c.scale, .y = c.y, .dy = c.w, .dx = dx}};
    backend_run(c.be, &op);
    for (int64_t r = 0; r < c.rows; r++)
      for (int64_t j = causal ? r % c.t + 1 : c.t; j < c.t; j++)
        if (dx[r * c.t + j] != 0.0f)
          fail_msg("softmax_bwd: masked dx[%lld][%lld] = %g", (long long)r, (long long)j, dx[r * c.t + j]);
    FD_EXPECT(causal ? "causal softmax dx" : "softmax dx", fd_error(softmax_loss, &c, c.x, dx, n, 1e-3), 2e-3);
    free(dx), free(c.x), free(c.y), free(c.w);
    c.be->destroy(c.be);
  }
}

typedef struct {
  dt_backend *be;
  int64_t bh, t, hd;
  int causal;
  float p;
  uint64_t step_seed;
  float *q, *k, *v, *o, *lse, *w;
} attn_ctx;

/* bh samples of one head each, (T, hd) apart: the compact layout (the layer's strided one is the
 * distillation test's, against PyTorch, and test_gpu's) */
static dt_attention_geom attn_geom(const attn_ctx *c) {
  return (dt_attention_geom){.b = c->bh,
                             .h = 1,
                             .t = c->t,
                             .hd = c->hd,
                             .ld_qkv = c->hd,
                             .ld_o = c->hd,
                             .causal = c->causal,
                             .scale = 1.0f / sqrtf((float)c->hd),
                             .p = c->p,
                             .seed = 5,
                             .step_seed = &c->step_seed};
}

static double attn_loss(void *ptr) {
  attn_ctx *c = ptr;
  dt_op op = {.type = DT_OP_ATTENTION_FWD,
              .p.attention_fwd = {.g = attn_geom(c), .q = c->q, .k = c->k, .v = c->v, .o = c->o, .lse = c->lse}};
  backend_run(c->be, &op);
  return dot_d(c->o, c->w, c->bh * c->t * c->hd);
}

/* The fused attention ops on (3 heads, T = 7, hd = 5), causal and not, dropout 0 and 0.3: o and lse
 * against softmax(scale q k^T) in double with the dropout op's masks (element (h T + i) T + j of
 * the probabilities, as the materialised path drops them), one head's q times 30 (scores up to
 * hundreds: exp overflows unless the running maximum is taken out); dq, dk, dv against central
 * differences (overwritten), and delta = dout . o. */
static void attention_fused_forward_and_grads(void **s) {
  (void)s;
  for (int causal = 0; causal < 2; causal++)
    for (int drop = 0; drop < 2; drop++) {
      attn_ctx c = {.be = backend_cpu_create(2), .bh = 3, .t = 7, .hd = 5, .causal = causal, .p = drop ? 0.3f : 0};
      c.step_seed = 99;
      const int64_t n = c.bh * c.t * c.hd, rows = c.bh * c.t;
      const float scale = 1.0f / sqrtf((float)c.hd);
      c.q = rand_floats(30, n, -1, 1), c.k = rand_floats(31, n, -1, 1), c.v = rand_floats(32, n, -1, 1);
      c.w = rand_floats(33, n, -1, 1), c.o = calloc((size_t)n, sizeof(float));
      c.lse = calloc((size_t)rows, sizeof(float));
      for (int64_t i = c.t * c.hd; i < 2 * c.t * c.hd; i++) c.q[i] *= 30.0f;
      attn_loss(&c);
      const uint64_t seed = dt_hash64(5 ^ c.step_seed);
      int dropped = 0;
      for (int64_t r = 0; r < rows; r++) {
        const int64_t h = r / c.t, i = r % c.t, valid = causal ? i + 1 : c.t;
        double sc[16], mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < valid; j++) {
          double d = 0;
          for (int64_t e = 0; e < c.hd; e++) d += (double)c.q[r * c.hd + e] * c.k[(h * c.t + j) * c.hd + e];
          sc[j] = scale * d;
          mx = fmax(mx, sc[j]);
        }
        for (int64_t j = 0; j < valid; j++) sum += exp(sc[j] - mx);
        double want_lse = mx + log(sum);
        if (!(fabs(c.lse[r] - want_lse) <= 1e-5 * fabs(want_lse) + 1e-6))
          fail_msg("attention_fwd lse[%lld] = %.9g, expected %.9g", (long long)r, c.lse[r], want_lse);
        for (int64_t e = 0; e < c.hd; e++) {
          double want = 0, mag = 0;
          for (int64_t j = 0; j < valid; j++) {
            double keep = 1;
            if (c.p > 0) keep = dt_hash_uniform(seed, (uint64_t)(r * c.t + j)) >= c.p ? 1.0 / (1.0 - c.p) : 0.0;
            dropped += keep == 0 && e == 0;
            double term = keep * exp(sc[j] - mx) / sum * c.v[(h * c.t + j) * c.hd + e];
            want += term, mag += fabs(term);
          }
          float got = c.o[r * c.hd + e];
          if (!(fabs(got - want) <= 1e-5 * mag + 1e-7))
            fail_msg("attention_fwd (causal %d, p %g) o[%lld][%lld] = %.9g, expected %.9g", causal, c.p, (long long)r,
                     (long long)e, got, want);
        }
      }
      if (drop && !dropped) fail_msg("attention_fwd: dropout 0.3 dropped nothing");
      for (int64_t i = c.t * c.hd; i < 2 * c.t * c.hd; i++) c.q[i] /= 30.0f; /* O(1) scores for differences */
      attn_loss(&c);
      float *dq = rand_floats(34, n, -9, 9), *dk = rand_floats(35, n, -9, 9), *dv = rand_floats(36, n, -9, 9);
      float *delta = rand_floats(37, rows, -9, 9);
      dt_op op = {.type = DT_OP_ATTENTION_BWD,
                  .p.attention_bwd = {.g = attn_geom(&c),
                                      .q = c.q,
                                      .k = c.k,
                                      .v = c.v,
                                      .o = c.o,
                                      .lse = c.lse,
                                      .dout = c.w,
                                      .delta = delta,
                                      .dq = dq,
                                      .dk = dk,
                                      .dv = dv}};
      backend_run(c.be, &op);
      for (int64_t r = 0; r < rows; r++) {
        double want = dot_d(c.w + r * c.hd, c.o + r * c.hd, c.hd);
        if (!(fabs(delta[r] - want) <= 1e-5 * fabs(want) + 1e-6))
          fail_msg("attention_bwd delta[%lld] = %.9g, expected %.9g", (long long)r, delta[r], want);
      }
      char what[64];
      snprintf(what, sizeof what, "attention (causal %d, p %g) dq", causal, c.p);
      FD_EXPECT(what, fd_error(attn_loss, &c, c.q, dq, n, 1e-3), 2e-3);
      what[strlen(what) - 1] = 'k';
      FD_EXPECT(what, fd_error(attn_loss, &c, c.k, dk, n, 1e-3), 2e-3);
      what[strlen(what) - 1] = 'v';
      FD_EXPECT(what, fd_error(attn_loss, &c, c.v, dv, n, 1e-3), 2e-3);
      free(dq), free(dk), free(dv), free(delta);
      free(c.q), free(c.k), free(c.v), free(c.w), free(c.o), free(c.lse);
      c.be->destroy(c.be);
    }
}

typedef struct {
  dt_backend *be;
  int64_t n;
  float *x, *y, *w;
} act_ctx;

static double gelu_tanh_loss(void *p) {
  act_ctx *c = p;
  dt_op op = {.type = DT_OP_ACT_FWD, .p.act_fwd = {.kind = DT_ACT_GELU_TANH, .n = c->n, .x = c->x, .y = c->y}};
  backend_run(c->be, &op);
  return dot_d(c->y, c->w, c->n);
}

/* PyTorch's gelu(approximate='tanh'): against the formula in double, and its derivative against
 * central differences. */
static void gelu_tanh_forward_and_grads(void **s) {
  (void)s;
  act_ctx c = {.be = backend_cpu_create(2), .n = 64};
  c.x = rand_floats(30, c.n, -5, 5), c.y = calloc((size_t)c.n, sizeof(float)), c.w = rand_floats(31, c.n, -1, 1);
  c.x[0] = 1.0f, c.x[1] = -2.0f, c.x[2] = 0.0f;
  gelu_tanh_loss(&c);
  for (int64_t i = 0; i < c.n; i++) {
    double x = c.x[i], want = 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    if (fabs(c.y[i] - want) > 1e-6 * (1 + fabs(want)))
      fail_msg("gelu_tanh(%.9g) = %.9g, expected %.9g", x, c.y[i], want);
  }
  if (fabs(c.y[0] - 0.841191990607) > 1e-6) fail_msg("gelu_tanh(1) = %.9g", c.y[0]);
  float *dx = calloc((size_t)c.n, sizeof(float));
  dt_op op = {.type = DT_OP_ACT_BWD,
              .p.act_bwd = {.kind = DT_ACT_GELU_TANH, .n = c.n, .x = c.x, .y = c.y, .dy = c.w, .dx = dx}};
  backend_run(c.be, &op);
  FD_EXPECT("gelu_tanh", fd_error(gelu_tanh_loss, &c, c.x, dx, c.n, 1e-3), 1e-3);
  free(dx), free(c.x), free(c.y), free(c.w);
  c.be->destroy(c.be);
}

/* Against a naive loop over x's indices, for 2 to 5 dims (the attention head split among them). */
static void permute_matches_index_loop(void **s) {
  (void)s;
  dt_backend *be = backend_cpu_create(2);
  const struct {
    int ndim;
    int64_t dims[5];
    int perm[5];
  } cases[] = {{2, {7, 37}, {1, 0}},
               {3, {4, 3, 5}, {2, 0, 1}},
               {4, {2, 5, 3, 4}, {0, 2, 1, 3}},
               {4, {2, 3, 5, 4}, {0, 2, 1, 3}},
               {5, {2, 3, 2, 4, 3}, {2, 0, 3, 1, 4}},
               {3, {0, 3, 5}, {1, 0, 2}}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    int nd = cases[k].ndim;
    int64_t total = 1, ydims[5], ystride[5];
    for (int i = 0; i < nd; i++) total *= cases[k].dims[i];
    for (int i = 0; i < nd; i++) ydims[i] = cases[k].dims[cases[k].perm[i]];
    for (int i = nd - 1, st = 1; i >= 0; i--) ystride[i] = st, st *= (int)ydims[i];
    float *x = rand_floats(40 + k, total, -1, 1), *y = rand_floats(50, total + 1, -1, 1);
    dt_op op = {.type = DT_OP_PERMUTE, .p.permute = {.ndim = nd, .x = x, .y = y}};
    memcpy(op.p.permute.dims, cases[k].dims, sizeof op.p.permute.dims);
    memcpy(op.p.permute.perm, cases[k].perm, sizeof op.p.permute.perm);
    float guard = y[total];
    backend_run(be, &op);
    for (int64_t i = 0; i < total; i++) { /* x's element i lands at y's index with y's dim j = x's dim perm[j] */
      int64_t rest = i, idx[5], to = 0;
      for (int a = nd - 1; a >= 0; a--) idx[a] = rest % cases[k].dims[a], rest /= cases[k].dims[a];
      for (int j = 0; j < nd; j++) to += idx[cases[k].perm[j]] * ystride[j];
      if (y[to] != x[i])
        fail_msg("permute case %zu: y[%lld] = %g, expected x[%lld] = %g", k, (long long)to, y[to], (long long)i, x[i]);
    }
    if (y[total] != guard) fail_msg("permute case %zu wrote past its output", k);
    free(x), free(y);
  }
  be->destroy(be);
}

/* C_i = alpha op(A_i) op(B_i) + beta C_i for batch products at element strides (with gaps between
 * them, and B shared by all with stride 0): against a naive double product, and against the same
 * products run one by one; the gaps stay as they were. */
static void gemm_batched_matches_separate(void **s) {
  (void)s;
  dt_backend *be = backend_cpu_create(2);
  const int64_t m = 4, n = 5, k = 3;
  for (int batch = 1; batch <= 3; batch += 2)
    for (int shared_b = 0; shared_b < 2; shared_b++)
      for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
          const int64_t sa = m * k + 2, sb = shared_b ? 0 : k * n + 1, sc = m * n + 3;
          float *a = rand_floats(60, batch * sa, -1, 1), *b = rand_floats(61, batch * (k * n + 1), -1, 1);
          float *c0 = rand_floats(62, batch * sc, -1, 1);
          float *c = copy_floats(c0, batch * sc), *c1 = copy_floats(c0, batch * sc);
          dt_op op = {.type = DT_OP_GEMM,
                      .p.gemm = {.trans_a = ta,
                                 .trans_b = tb,
                                 .m = m,
                                 .n = n,
                                 .k = k,
                                 .alpha = 0.7f,
                                 .beta = 0.3f,
                                 .a = a,
                                 .b = b,
                                 .c = c,
                                 .batch = batch,
                                 .stride_a = sa,
                                 .stride_b = sb,
                                 .stride_c = sc}};
          backend_run(be, &op);
          for (int i = 0; i < batch; i++) {
            dt_op one = op;
            one.p.gemm.batch = 0;
            one.p.gemm.a = a + i * sa, one.p.gemm.b = b + i * sb, one.p.gemm.c = c1 + i * sc;
            backend_run(be, &one);
            for (int64_t r = 0; r < m; r++)
              for (int64_t col = 0; col < n; col++) {
                double acc = 0;
                for (int64_t p = 0; p < k; p++)
                  acc +=
                      (double)a[i * sa + (ta ? p * m + r : r * k + p)] * b[i * sb + (tb ? col * k + p : p * n + col)];
                double want = 0.7 * acc + 0.3 * c0[i * sc + r * n + col], got = c[i * sc + r * n + col];
                if (fabs(got - want) > 1e-5 * (1 + fabs(want)))
                  fail_msg(
                      "batched gemm (batch %d, ta %d, tb %d, shared B %d) product %d C[%lld][%lld] = %.9g, "
                      "expected %.9g",
                      batch, ta, tb, shared_b, i, (long long)r, (long long)col, got, want);
              }
          }
          for (int64_t i = 0; i < batch * sc; i++) {
            if (fabs(c[i] - c1[i]) > 1e-6 * (1 + fabs(c1[i])))
              fail_msg("batched gemm: C[%lld] = %.9g, %.9g one product at a time", (long long)i, c[i], c1[i]);
            if (i % sc >= m * n && c[i] != c0[i])
              fail_msg("batched gemm wrote C[%lld], between products", (long long)i);
          }
          free(a), free(b), free(c0), free(c), free(c1);
        }
  be->destroy(be);
}

/* DT_OP_BIAS_GRAD on (b, c) rows (a linear layer's, s = 1, over more columns than one block of
 * the CPU's column-blocked sum) and on (b, c, s) planes: db += the sums, against a double loop. */
static void bias_grad_matches_sums(void **s) {
  (void)s;
  dt_backend *be = backend_cpu_create(2);
  const int64_t shapes[][3] = {{37, 300, 1}, {5, 7, 1}, {3, 4, 9}};
  for (int t = 0; t < 3; t++) {
    int64_t b = shapes[t][0], c = shapes[t][1], sp = shapes[t][2];
    float *dy = rand_floats(70 + (uint64_t)t, b * c * sp, -1, 1), *db = rand_floats(80 + (uint64_t)t, c, -1, 1);
    float *db0 = copy_floats(db, c);
    dt_op op = {.type = DT_OP_BIAS_GRAD, .p.bias_grad = {.b = b, .c = c, .s = sp, .dy = dy, .db = db}};
    backend_run(be, &op);
    for (int64_t j = 0; j < c; j++) {
      double want = 0;
      for (int64_t i = 0; i < b; i++)
        for (int64_t k = 0; k < sp; k++) want += dy[(i * c + j) * sp + k];
      want += db0[j];
      if (fabs(db[j] - want) > 1e-5 * (1 + fabs(want)))
        fail_msg("bias grad (%lld, %lld, %lld): db[%lld] = %.9g, expected %.9g", (long long)b, (long long)c,
                 (long long)sp, (long long)j, db[j], want);
    }
    free(dy), free(db), free(db0);
  }
  be->destroy(be);
}

/* Max pooling 2x2 stride 2 (the CPU's fast path) on odd sizes, with ties, NaN and -inf: the value
 * and the argmax of a row-major scan where the first maximum wins and NaN wins over numbers. */
static void max_pool_2x2_matches_scan(void **s) {
  (void)s;
  dt_backend *be = backend_cpu_create(2);
  const int64_t B = 2, C = 3, H = 7, W = 5, Ho = 3, Wo = 2;
  float *x = rand_floats(90, B * C * H * W, -1, 1);
  for (int64_t i = 0; i < B * C * H * W; i += 7) x[i] = x[i + 1 < B * C * H * W ? i + 1 : i]; /* ties */
  x[3] = NAN, x[W + 12] = -INFINITY, x[W * H + 1] = -INFINITY, x[W * H] = -INFINITY;
  x[W * H + W] = -INFINITY, x[W * H + W + 1] = -INFINITY;
  float *y = rand_floats(91, B * C * Ho * Wo, -1, 1);
  int32_t *am = calloc((size_t)(B * C * Ho * Wo), sizeof(int32_t));
  dt_op op = {.type = DT_OP_POOL_FWD,
              .p.pool_fwd = {.kind = DT_POOL_MAX, .b = B, .c = C, .h = H, .w = W, .ho = Ho, .wo = Wo, .k = 2,
                             .stride = 2, .x = x, .y = y, .argmax = am}};
  backend_run(be, &op);
  for (int64_t p = 0; p < B * C; p++)
    for (int64_t oh = 0; oh < Ho; oh++)
      for (int64_t ow = 0; ow < Wo; ow++) {
        int64_t best = (2 * oh) * W + 2 * ow;
        for (int i = 0; i < 2; i++)
          for (int j = 0; j < 2; j++) {
            int64_t at = (2 * oh + i) * W + 2 * ow + j;
            float v = x[p * H * W + at], b = x[p * H * W + best];
            if (v > b || (isnan(v) && !isnan(b))) best = at;
          }
        int64_t o = p * Ho * Wo + oh * Wo + ow;
        float want = x[p * H * W + best];
        if (am[o] != best || !(y[o] == want || (isnan(y[o]) && isnan(want))))
          fail_msg("max pool plane %lld (%lld, %lld): %g at %d, expected %g at %lld", (long long)p, (long long)oh,
                   (long long)ow, y[o], am[o], want, (long long)best);
      }
  free(x), free(y), free(am);
  be->destroy(be);
}

/* The convolutions through oneDNN, direct (the CPU backend's default) and with Winograd for 3x3
 * stride 1 (train.conv_algo auto), against im2col + GEMM (DT_CPU_CONV_IM2COL): forward, backward data
 * (overwrites dx) and backward filter (adds into dw), over strides, paddings, 1x1 and 3x3 kernels, one
 * input channel, and an odd size whose last row the stride leaves out. On an AVX-512 CPU the 3x3
 * stride-1 geometries with 16 or more channels must really run by Winograd. */
static void onednn_convolutions_match_im2col(void **s) {
  (void)s;
  const int64_t geo[][8] = {/* b, c, h, w, o, k, stride, pad (b 0: a rank with no rows) */
                            {3, 1, 9, 9, 8, 3, 1, 1},     {2, 5, 8, 8, 16, 3, 1, 1}, {2, 16, 9, 7, 17, 3, 2, 1},
                            {4, 8, 6, 6, 16, 1, 2, 0},    {1, 3, 7, 7, 4, 3, 2, 0},  {2, 32, 5, 5, 32, 3, 1, 1},
                            {3, 16, 11, 9, 32, 3, 1, 1}, {2, 64, 14, 14, 64, 3, 1, 1}, {0, 16, 5, 5, 16, 3, 1, 1}};
  const int n_geo = (int)(sizeof geo / sizeof geo[0]);
  for (int algo = DT_CPU_CONV_DIRECT; algo <= DT_CPU_CONV_WINOGRAD; algo++) {
    dt_backend *fast = backend_cpu_create_with(2, algo), *ref = backend_cpu_create_with(2, DT_CPU_CONV_IM2COL);
    for (int t = 0; t < n_geo; t++) {
      int64_t wino_before = backend_cpu_winograd_runs(fast);
      dt_conv_geom g = {.b = geo[t][0], .c = geo[t][1], .h = geo[t][2], .w = geo[t][3], .o = geo[t][4],
                        .k = geo[t][5], .stride = geo[t][6], .pad = geo[t][7]};
      g.ho = (g.h + 2 * g.pad - g.k) / g.stride + 1;
      g.wo = (g.w + 2 * g.pad - g.k) / g.stride + 1;
      int64_t nx = g.b * g.c * g.h * g.w, nw = g.o * g.c * g.k * g.k, ny = g.b * g.o * g.ho * g.wo;
      float *x = rand_floats(100 + t, nx, -1, 1), *w = rand_floats(110 + t, nw, -1, 1);
      float *dy = rand_floats(120 + t, ny, -1, 1);
      float *out[2][3];
      for (int which = 0; which < 2; which++) {
        dt_backend *be = which ? ref : fast;
        out[which][0] = rand_floats(130, ny, -1, 1); /* overwritten */
        out[which][1] = rand_floats(131, nx, -1, 1); /* overwritten */
        out[which][2] = rand_floats(132, nw, -1, 1); /* added into */
        dt_op f = {.type = DT_OP_CONV_FWD, .p.conv_fwd = {.g = g, .x = x, .w = w, .y = out[which][0]}};
        dt_op d = {.type = DT_OP_CONV_BWD_DATA, .p.conv_bwd_data = {.g = g, .dy = dy, .w = w, .dx = out[which][1]}};
        dt_op k = {.type = DT_OP_CONV_BWD_FILTER, .p.conv_bwd_filter = {.g = g, .x = x, .dy = dy, .dw = out[which][2]}};
        backend_run(be, &f), backend_run(be, &d), backend_run(be, &k);
      }
      if (backend_cpu_onednn_runs(fast) != 3 * (int64_t)(t + 1) || backend_cpu_onednn_runs(ref) != 0)
        fail_msg("oneDNN ran %lld convolutions, expected %lld (and the reference none: %lld)",
                 (long long)backend_cpu_onednn_runs(fast), 3 * (long long)(t + 1),
                 (long long)backend_cpu_onednn_runs(ref));
      /* sums of c*k*k (forward, dw: b*ho*wo) products of numbers in [-1, 1]: errors grow with the count */
      const int64_t n[3] = {ny, nx, nw};
      static const char *what[3] = {"forward y", "backward dx", "backward dw"};
      for (int o = 0; o < 3; o++)
        for (int64_t i = 0; i < n[o]; i++)
          if (fabs(out[0][o][i] - out[1][o][i]) > 1e-4 * (1 + fabs(out[1][o][i])))
            fail_msg("%s conv b%lld c%lld %lldx%lld o%lld k%lld s%lld p%lld: %s[%lld] = %.7g with oneDNN, %.7g with "
                     "im2col",
                     algo == DT_CPU_CONV_WINOGRAD ? "Winograd" : "direct", (long long)g.b, (long long)g.c,
                     (long long)g.h, (long long)g.w, (long long)g.o, (long long)g.k, (long long)g.stride,
                     (long long)g.pad, what[o], (long long)i, out[0][o][i], out[1][o][i]);
      /* never for direct or other kernels; always where oneDNN's AVX-512 kernels take 16-channel blocks */
      int64_t wino = backend_cpu_winograd_runs(fast) - wino_before;
      int eligible = algo == DT_CPU_CONV_WINOGRAD && g.k == 3 && g.stride == 1 && g.c % 16 == 0 && g.o % 16 == 0 &&
                     g.b > 0;
      if (!eligible && wino != 0)
        fail_msg("geometry %d ran %lld convolutions by Winograd, expected none", t, (long long)wino);
      if (eligible && __builtin_cpu_supports("avx512f") && wino != 3)
        fail_msg("geometry %d ran %lld convolutions by Winograd on an AVX-512 CPU, expected 3", t, (long long)wino);
      for (int which = 0; which < 2; which++)
        for (int o = 0; o < 3; o++) free(out[which][o]);
      free(x), free(w), free(dy);
    }
    fast->destroy(fast);
    ref->destroy(ref);
  }
}

/* A backward-data right after the backward-filter of the same dy reuses the blocked copy of dy the
 * first made; any other op or copy between them, here a copy that changes dy, makes it reorder again,
 * and dx follows the new dy (im2col's is the reference). */
static void onednn_reuses_dy_only_back_to_back(void **s) {
  (void)s;
  dt_backend *fast = backend_cpu_create_with(2, DT_CPU_CONV_DIRECT), *ref = backend_cpu_create_with(2, DT_CPU_CONV_IM2COL);
  dt_conv_geom g = {.b = 2, .c = 32, .h = 8, .w = 8, .o = 32, .k = 3, .stride = 1, .pad = 1, .ho = 8, .wo = 8};
  int64_t nx = g.b * g.c * g.h * g.w, nw = g.o * g.c * 9, ny = g.b * g.o * g.ho * g.wo;
  float *x = rand_floats(200, nx, -1, 1), *w = rand_floats(201, nw, -1, 1), *dy = rand_floats(202, ny, -1, 1);
  float *dy2 = rand_floats(203, ny, -1, 1), *dw = rand_floats(204, nw, -1, 1), *dx = rand_floats(205, nx, -1, 1);
  float *want = rand_floats(206, nx, -1, 1);
  for (int changed = 0; changed < 2; changed++) {
    dt_op k = {.type = DT_OP_CONV_BWD_FILTER, .p.conv_bwd_filter = {.g = g, .x = x, .dy = dy, .dw = dw}};
    backend_run(fast, &k);
    if (changed) fast->to_device(fast, dy, dy2, (size_t)ny * sizeof(float));
    int64_t saved = backend_cpu_reorders_saved(fast);
    dt_op d = {.type = DT_OP_CONV_BWD_DATA, .p.conv_bwd_data = {.g = g, .dy = dy, .w = w, .dx = dx}};
    backend_run(fast, &d);
    dt_op r = {.type = DT_OP_CONV_BWD_DATA, .p.conv_bwd_data = {.g = g, .dy = dy, .w = w, .dx = want}};
    backend_run(ref, &r);
    if (backend_cpu_reorders_saved(fast) - saved != (changed ? 0 : 1))
      fail_msg("%s dy: %lld reorders saved", changed ? "a changed" : "the same",
               (long long)(backend_cpu_reorders_saved(fast) - saved));
    for (int64_t i = 0; i < nx; i++)
      if (fabs(dx[i] - want[i]) > 1e-4 * (1 + fabs(want[i])))
        fail_msg("%s dy: dx[%lld] = %.7g, im2col %.7g", changed ? "a changed" : "the same", (long long)i, dx[i],
                 want[i]);
  }
  free(x), free(w), free(dy), free(dy2), free(dw), free(dx), free(want);
  fast->destroy(fast);
  ref->destroy(ref);
}

/* The CPU's tanh (a polynomial GCC vectorises, for tanh and GELU tanh): every 61st float in
 * [1e-30, 12] and its negative, within 2 ulp of tanh in double; odd, and saturating to +-1. */
static int64_t ordered(float f) {
  int32_t i;
  memcpy(&i, &f, sizeof i);
  return i < 0 ? -(int64_t)(i & 0x7fffffff) : (int64_t)i;
}

static void tanh_within_2_ulp(void **s) {
  (void)s;
  dt_backend *be = backend_cpu_create(2);
  int32_t lo, hi;
  float flo = 1e-30f, fhi = 12.0f;
  memcpy(&lo, &flo, sizeof lo), memcpy(&hi, &fhi, sizeof hi);
  int64_t n = 2 * ((int64_t)(hi - lo) / 61 + 1) + 4, i = 0;
  float *x = malloc((size_t)n * sizeof(float)), *y = malloc((size_t)n * sizeof(float));
  for (int32_t b = lo; b <= hi; b += 61) {
    float v;
    memcpy(&v, &b, sizeof v);
    x[i++] = v, x[i++] = -v;
  }
  x[i++] = 0.0f, x[i++] = 50.0f, x[i++] = -1e30f, x[i++] = INFINITY;
  dt_op op = {.type = DT_OP_ACT_FWD, .p.act_fwd = {.kind = DT_ACT_TANH, .n = i, .x = x, .y = y}};
  backend_run(be, &op);
  for (int64_t j = 0; j < i; j++) {
    float want = (float)tanh((double)x[j]);
    if (llabs(ordered(y[j]) - ordered(want)) > 2)
      fail_msg("tanh(%.9g) = %.9g, tanh in double rounds to %.9g", x[j], y[j], want);
  }
  free(x), free(y);
  be->destroy(be);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(linear_grads),
      cmocka_unit_test(conv2d_grads),
      cmocka_unit_test(batchnorm_grads),
      cmocka_unit_test(relu_fused_equals_apart),
      cmocka_unit_test(activation_grads),
      cmocka_unit_test(pooling_grads),
      cmocka_unit_test(dropout_and_flatten_grads),
      cmocka_unit_test(residual_grads),
      cmocka_unit_test(loss_grads),
      cmocka_unit_test(loss_values_by_hand),
      cmocka_unit_test(distill_loss_grads),
      cmocka_unit_test(embed_forward_and_grads),
      cmocka_unit_test(layernorm_forward_and_grads),
      cmocka_unit_test(softmax_forward_and_grads),
      cmocka_unit_test(attention_fused_forward_and_grads),
      cmocka_unit_test(gelu_tanh_forward_and_grads),
      cmocka_unit_test(permute_matches_index_loop),
      cmocka_unit_test(gemm_batched_matches_separate),
      cmocka_unit_test(bias_grad_matches_sums),
      cmocka_unit_test(max_pool_2x2_matches_scan),
      cmocka_unit_test(onednn_convolutions_match_im2col),
      cmocka_unit_test(onednn_reuses_dy_only_back_to_back),
      cmocka_unit_test(tanh_within_2_ulp),
  };
  return cmocka_run_group_tests_name("ops", tests, NULL, NULL);
}
