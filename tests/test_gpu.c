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
  dt_backend *cpu = backend_cpu_create(1), *gpu = backend_cuda_create(0);
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
    dt_op in = {.type = DT_OP_INPUT};
    in.p.input = (typeof(in.p.input)){batch, 1, shape_size(sd->m.input), 1.0f, NULL, NULL, raw, sd->m.input_x};
    backend_run(sd->be, &in);
    dt_pass p = {.be = sd->be,
                 .batch = batch,
                 .training = 1,
                 .global_count = (double)batch,
                 .dropout_seed = 11,
                 .params = sd->m.params,
                 .grads = sd->m.grads,
                 .bufs = sd->m.bufs};
    model_forward(&sd->m, &p);
    double l = 0, hits = 0;
    loss_compute(&sd->m, &p, labels, targets, &l, &hits);
    loss[i] = l;
    dx[i] = sd->be->alloc(sd->be, (size_t)nin * sizeof(float));
    seq_backward(&sd->m.top, &p, sd->m.input_x, dx[i]);
  }
  if (fabs(loss[0] - loss[1]) > 1e-5 * fabs(loss[0]))
    fail_msg("%s: loss %.9g (CPU) vs %.9g (CUDA)", model_yaml, loss[0], loss[1]);
  compare("logits", cpu, model_logits(&c.m), gpu, model_logits(&g.m), batch * k, model_yaml);
  compare("parameter gradients", cpu, c.m.grads, gpu, g.m.grads, c.m.n_params, model_yaml);
  compare("input gradient", cpu, dx[0], gpu, dx[1], nin, model_yaml);
  if (c.m.n_bufs) compare("batchnorm running statistics", cpu, c.m.bufs, gpu, g.m.bufs, c.m.n_bufs, model_yaml);
  /* one SGD (momentum, Nesterov) and one AdamW step over the flat buffers */
  for (int opt = 0; opt < 2; opt++) {
    dt_optim o[2];
    dt_config_values v = c.cfg.v;
    v.optim = opt ? DT_OPTIM_ADAMW : DT_OPTIM_SGD;
    v.nesterov = 1;
    v.weight_decay = 0.01;
    for (int i = 0; i < 2; i++) {
      optim_init(&o[i], &v, sides[i]->be, c.m.n_params, 10);
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
                "    - global_avgpool\n    - {batchnorm: {}}\n    - {linear: {out: 2}}\n  loss: mse\n",
                7))

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(cuda_conv_batchnorm_pool_linear),
      cmocka_unit_test(cuda_activations_dropout_avgpool),
      cmocka_unit_test(cuda_residual_global_pool_mse),
  };
  return cmocka_run_group_tests_name("gpu", tests, NULL, NULL);
}
