/* test_ops: a finite-difference gradient check of every layer and loss on the CPU backend.
 * For a tiny model around the layer, the analytic gradients of the loss with respect to the
 * parameters and to the input (backward's dx) are compared with central differences. */
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
}

static dt_pass make_pass(fixture *f) {
  return (dt_pass){.be = f->be,
                   .batch = f->batch,
                   .training = 1,
                   .global_count = (double)f->batch,
                   .step_seed = &f->step_seed,
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

static void grad_check(const char *model_yaml, int64_t batch) {
  fixture f;
  setup(&f, model_yaml, batch);
  int64_t nin = batch * shape_size(f.m.input);
  float *dx = calloc((size_t)nin, sizeof(float));
  memset(f.m.grads, 0, (size_t)f.m.n_params * sizeof(float));
  dt_pass p = make_pass(&f);
  model_forward(&f.m, &p);
  double sums[2] = {0, 0};
  model_loss(&f.m, &p, f.labels, f.targets, sums);
  seq_backward(&f.m.top, &p, f.m.input_x, dx);
  float *grads = malloc((size_t)(f.m.n_params + 1) * sizeof(float));
  memcpy(grads, f.m.grads, (size_t)f.m.n_params * sizeof(float));
  for (int t = 0; t < f.m.n_tensors; t++) {
    dt_tensor *tt = &f.m.tensors[t];
    if (tt->is_buffer) continue;
    double err = check_buffer(&f, f.m.params + tt->offset, grads + tt->offset, tt->count, 1e-3);
    if (err > 1e-2) fail_msg("%s: gradient of %s off by %.3g (relative)", model_yaml, tt->name, err);
  }
  double err = check_buffer(&f, f.m.input_x, dx, nin, 1e-3);
  if (err > 1e-2) fail_msg("%s: input gradient off by %.3g (relative)", model_yaml, err);
  free(grads);
  free(dx);
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
}

static void activation_grads(void **s) {
  (void)s;
  const char *acts[] = {"relu", "gelu", "tanh", "sigmoid"};
  for (int i = 0; i < 4; i++) {
    char y[256];
    snprintf(y, sizeof y, "  input: [7]\n  layers: [{linear: {out: 6}}, %s]\n  loss: mse\n", acts[i]);
    grad_check(y, 3);
  }
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
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(linear_grads),     cmocka_unit_test(conv2d_grads),  cmocka_unit_test(batchnorm_grads),
      cmocka_unit_test(activation_grads), cmocka_unit_test(pooling_grads), cmocka_unit_test(dropout_and_flatten_grads),
      cmocka_unit_test(residual_grads),   cmocka_unit_test(loss_grads),    cmocka_unit_test(loss_values_by_hand),
  };
  return cmocka_run_group_tests_name("ops", tests, NULL, NULL);
}
