/* test_model: shape inference, parameter counts and names (PyTorch's), FLOPs, and the model
 * errors: unknown layers and parameters, shape mismatches naming the layer and both shapes; the memory
 * estimate; when the host's wait on a step stops sleeping between polls. */
#include "dt_test.h"

#include "config.h"
#include "memory.h"
#include "model.h"
#include "train_step.h"

static int build(const char *model_yaml, dt_config *cfg, dt_model *m, dt_status *st) {
  char text[4096];
  snprintf(text, sizeof text, "model:\n%sdata: {path: x.h5}\ntrain: {batch_size: 4}\n", model_yaml);
  char *path = write_tmp(text);
  memset(st, 0, sizeof *st);
  memset(m, 0, sizeof *m);
  int rc = config_load(cfg, path, NULL, 0, st);
  if (!rc) rc = model_build(m, cfg, st);
  unlink(path);
  free(path);
  return rc;
}

static int build_err(const char *model_yaml, dt_status *st) {
  dt_config cfg;
  dt_model m;
  int rc = build(model_yaml, &cfg, &m, st);
  model_free(&m);
  config_free(&cfg);
  return rc;
}

static void default_cnn_has_870826_parameters(void **state) {
  (void)state;
  dt_config cfg;
  dt_status st = {0};
  dt_model m;
  memset(&m, 0, sizeof m);
  assert_int_equal(config_load(&cfg, "configs/model.yaml", NULL, 0, &st), 0);
  assert_int_equal(model_build(&m, &cfg, &st), 0);
  assert_int_equal(m.n_params, 870826);
  assert_int_equal(m.n_bufs, 2 * (32 + 32 + 64 + 64));
  assert_int_equal(m.n_all, 19);
  dt_shape s = m.all[6]->out; /* maxpool */
  assert_int_equal(s.c, 32);
  assert_int_equal(s.h, 14);
  assert_int_equal(m.all[14]->out.c, 3136); /* flatten */
  assert_int_equal(m.n_outputs, 10);
  /* FLOPs by hand: convs 2*O*C*9*H*W, linears 2*in*out + out, bn 4/elem, relu 1/elem, pool k*k/out */
  int64_t conv = 2 * (32 * 1 * 9 * 784 + 32 * 32 * 9 * 784 + 64 * 32 * 9 * 196 + 64 * 64 * 9 * 196);
  int64_t lin = 2 * 3136 * 256 + 256 + 2 * 256 * 10 + 10;
  int64_t bn = 4 * (2 * 32 * 784 + 2 * 64 * 196), relu = 2 * 32 * 784 + 2 * 64 * 196 + 256;
  int64_t pool = 4 * (32 * 196 + 64 * 49), dropout = 256;
  assert_int_equal(model_flops(&m), conv + lin + bn + relu + pool + dropout);
  model_free(&m);
  config_free(&cfg);
}

static void tensors_use_pytorch_names_layouts_and_order(void **state) {
  (void)state;
  dt_config cfg;
  dt_model m;
  dt_status st;
  const char *yaml =
      "  input: [3, 8, 8]\n"
      "  layers:\n"
      "    - conv2d: {out: 4, kernel: 3, pad: 1}\n"
      "    - residual:\n"
      "        body: [{conv2d: {out: 6, kernel: 3, stride: 2, pad: 1, bias: false}}, {batchnorm: {}}]\n"
      "        shortcut: [{conv2d: {out: 6, kernel: 1, stride: 2}}]\n"
      "    - global_avgpool: {}\n"
      "    - linear: {out: 5}\n";
  assert_int_equal(build(yaml, &cfg, &m, &st), 0);
  const char *names[] = {"0.weight",
                         "0.bias",
                         "1.body.0.weight",
                         "1.body.1.weight",
                         "1.body.1.bias",
                         "1.body.1.running_mean",
                         "1.body.1.running_var",
                         "1.shortcut.0.weight",
                         "1.shortcut.0.bias",
                         "3.weight",
                         "3.bias"};
  assert_int_equal(m.n_tensors, 11);
  for (int i = 0; i < 11; i++) assert_string_equal(m.tensors[i].name, names[i]);
  assert_int_equal(m.tensors[2].ndim, 4);
  assert_int_equal(m.tensors[2].dims[0], 6);
  assert_int_equal(m.tensors[2].dims[1], 4);
  assert_int_equal(m.tensors[9].dims[0], 5);
  assert_int_equal(m.tensors[9].dims[1], 6);
  /* parameters are contiguous in this order; buffers separate */
  int64_t off = 0;
  for (int i = 0; i < 11; i++)
    if (!m.tensors[i].is_buffer) {
      assert_int_equal(m.tensors[i].offset, off);
      off += m.tensors[i].count;
    }
  assert_int_equal(off, m.n_params);
  assert_int_equal(m.n_params, (4 * 27 + 4) + 6 * 4 * 9 + 12 + (6 * 4 + 6) + (5 * 6 + 5));
  dt_shape out = m.all[1]->out;
  assert_int_equal(out.c, 6);
  assert_int_equal(out.h, 4);
  model_free(&m);
  config_free(&cfg);
}

static void shape_errors_name_layer_and_shapes(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers: [{linear: {out: 3}}]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "layer 0 linear: expects a vector input, got (1, 4, 4) (add flatten before it)");
  assert_int_equal(build_err("  input: [16]\n  layers: [{conv2d: {out: 3, kernel: 3}}]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "layer 0 conv2d: expects a (C, H, W) input, got (16)");
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers: [{conv2d: {out: 3, kernel: 5}}, flatten]\n", &st),
                   DT_EXIT_INPUT);
  assert_contains(st.msg, "kernel 5 does not fit input (1, 4, 4)");
  assert_int_equal(build_err("  input: [2, 4, 4]\n  layers:\n    - residual: {body: [{conv2d: {out: 3, kernel: 1}}]}\n"
                             "    - flatten\n",
                             &st),
                   DT_EXIT_INPUT);
  assert_contains(st.msg, "layer 0 residual: body gives (3, 4, 4) but the shortcut gives (2, 4, 4)");
  assert_contains(st.msg, ":4:7:");
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers: [{maxpool: {kernel: 8}}, flatten]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "kernel 8 is larger than the input (1, 4, 4)");
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers: [relu]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "the last layer outputs (1, 4, 4); the loss needs a vector");
  assert_int_equal(build_err("  input: [4]\n  layers: [{linear: {out: 1}}]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "cross_entropy needs at least 2 outputs");
  /* sizes past 2^40 elements, refused before any product of them can overflow (found by fuzz_config) */
  assert_int_equal(build_err("  input: [1000000000, 1000000000, 1000000000]\n  layers: [flatten]\n", &st),
                   DT_EXIT_INPUT);
  assert_contains(st.msg, "model.input: more than 2^40 elements per sample");
  assert_int_equal(build_err("  input: [1000000]\n  layers: [{linear: {out: 1000000000}}]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "layer 0 linear: a tensor would have more than 2^40 elements");
  assert_int_equal(
      build_err("  input: [1, 1048576, 1048576]\n  layers: [{conv2d: {out: 2, kernel: 1}}, flatten]\n", &st),
      DT_EXIT_INPUT);
  assert_contains(st.msg, "layer 0 conv2d: output per sample would have more than 2^40 elements");
}

static void unknown_layers_and_parameters_suggest(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers:\n    - conv2: {out: 3, kernel: 3}\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":4:7: model.layers[0]: unknown layer 'conv2'; did you mean 'conv2d'?");
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers:\n    - conv2d: {out: 3, kernal: 3}\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg,
                  "unknown parameter 'model.layers[0] conv2d: kernal'; did you mean 'model.layers[0] conv2d: kernel'?");
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers:\n    - conv2d: {kernel: 3}\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "missing required parameter 'model.layers[0] conv2d: out'");
  /* a bare layer name has no map of parameters: the place is the name's (found by fuzz_config) */
  assert_int_equal(build_err("  input: [1, 4, 4]\n  layers:\n    - relu\n    - conv2d\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":5:7: missing required parameter 'model.layers[1] conv2d: out'");
  assert_int_equal(build_err("  input: [4]\n  layers:\n    - dropout: {p: 1.0}\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "model.layers[0] dropout: p: expected a number in [0, 0.999], got '1.0'");
  assert_int_equal(build_err("  input: [4]\n  layers: [{linear: {out: 2}}]\n  loss: crossentropy\n", &st),
                   DT_EXIT_INPUT);
  assert_contains(st.msg, "unknown loss 'crossentropy'; did you mean 'cross_entropy'?");
  assert_int_equal(build_err("  input: [4]\n  layers: [{linear: {out: 2}, relu: {}}]\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "a layer is a one-key map");
  assert_int_equal(build_err("  input: [4]\n  layers: []\n", &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "model.layers: expected a non-empty list of layers");
}

static void losses_parse(void **state) {
  (void)state;
  dt_config cfg;
  dt_model m;
  dt_status st;
  assert_int_equal(
      build("  input: [4]\n  layers: [{linear: {out: 3}}]\n  loss: {cross_entropy: {label_smoothing: 0.1}}\n", &cfg, &m,
            &st),
      0);
  assert_int_equal(m.loss.kind, DT_LOSS_CROSS_ENTROPY);
  assert_true(m.loss.label_smoothing == 0.1);
  model_free(&m);
  config_free(&cfg);
  assert_int_equal(build("  input: [4]\n  layers: [{linear: {out: 1}}]\n  loss: mse\n", &cfg, &m, &st), 0);
  assert_int_equal(m.loss.kind, DT_LOSS_MSE);
  model_free(&m);
  config_free(&cfg);
}

/* model_memory by hand: input (1,4,4), conv2d 2x3x3 pad 1 -> (2,4,4), maxpool 2 -> (2,2,2),
 * flatten -> 8, linear 3; 5 rows, 2 threads, one optimizer state. */
static void memory_estimate_by_hand(void **state) {
  (void)state;
  dt_config cfg;
  dt_model m;
  dt_status st;
  assert_int_equal(build("  input: [1, 4, 4]\n  layers: [{conv2d: {out: 2, kernel: 3, pad: 1}}, {maxpool: {kernel: 2}},"
                         " flatten, {linear: {out: 3}}]\n",
                         &cfg, &m, &st),
                   0);
  dt_memory mem = model_memory(&m, 5, 1, 2);
  /* parameters: conv 2*9 + 2, linear 8*3 + 3: 47 floats */
  assert_int_equal(mem.params, 47 * 4);
  assert_int_equal(mem.grads, 47 * 4);
  assert_int_equal(mem.optim, 47 * 4);
  /* per row: input 16, y and dy of conv (32), pool (8), flatten (8), linear (3): 118 floats;
   * plus the pool's argmax, 8 int32 per row */
  assert_int_equal(mem.activations, 118 * 5 * 4 + 8 * 5 * 4);
  /* a convolution's scratch is the backend's (im2col columns, oneDNN's blocked copies, cuDNN's
   * workspace): device_check_memory asks the backend (tests/test_memory.py) */
  assert_int_equal(mem.workspace, 0);
  assert_int_equal(mem.total, 3 * 47 * 4 + 118 * 5 * 4 + 8 * 5 * 4);
  model_free(&m);
  config_free(&cfg);
}

/* model.attention: auto picks the fused ops on a GPU whose blocks take their shared memory (a head of 64
 * values: 98 KiB in dk/dv's kernel), the materialised ones on the CPU and on a GPU with less (a T4's 64 KiB);
 * fused and materialized are taken as said, except that a head wider than the kernels take stays
 * materialised on CUDA. The activation memory follows, by hand: per attention layer the materialised path
 * keeps 16 (B, T, C) buffers and 3 (B, H, T, T) ones, the fused one 8 and 2 (B, H, T). */
static void attention_picks_by_device_and_shared_memory(void **state) {
  (void)state;
  const int64_t B = 3, T = 8, C = 128, H = 2;
  const size_t seq = B * T * C * 4, square = B * H * T * T * 4, rows = B * H * T * 4;
  const char *gpt = "  input: [8]\n  layers: [{embedding: {vocab: 10, dim: 128}}, {attention: {heads: 2}},"
                    " {linear: {out: 10}}]\n";
  const struct {
    const char *mode;
    int cuda;
    size_t shared;
    int fused;
  } cases[] = {{"auto", 0, 0, 0},         {"auto", 1, 227 << 10, 1}, {"auto", 1, 99 << 10, 1},
               {"auto", 1, 64 << 10, 0},  {"fused", 0, 0, 1},        {"fused", 1, 227 << 10, 1},
               {"fused", 1, 64 << 10, 0}, {"materialized", 1, 227 << 10, 0}};
  size_t materialized = 0;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char yaml[512];
    snprintf(yaml, sizeof yaml, "%s  attention: %s\n", gpt, cases[i].mode);
    dt_config cfg;
    dt_model m;
    dt_status st;
    assert_int_equal(build(yaml, &cfg, &m, &st), 0);
    if (cases[i].cuda) model_pick_ops(&m, 1, cases[i].shared);
    if (m.all[1]->fused_attention != cases[i].fused)
      fail_msg("model.attention %s, %s with %zu bytes a block: fused %d, expected %d", cases[i].mode,
               cases[i].cuda ? "CUDA" : "CPU", cases[i].shared, m.all[1]->fused_attention, cases[i].fused);
    size_t act = model_memory(&m, B, 1, 1).activations;
    if (i == 0) materialized = act;
    size_t want = cases[i].fused ? materialized - (16 * seq + 3 * square) + (8 * seq + 2 * rows) : materialized;
    if (act != want) fail_msg("model.attention %s: activations %zu bytes, expected %zu", cases[i].mode, act, want);
    model_free(&m);
    config_free(&cfg);
  }
  /* a head of 256 values: fused on the CPU, materialised on CUDA */
  dt_config cfg;
  dt_model m;
  dt_status st;
  assert_int_equal(build("  input: [8]\n  layers: [{embedding: {vocab: 10, dim: 256}}, {attention: {heads: 1}},"
                         " {linear: {out: 10}}]\n  attention: fused\n",
                         &cfg, &m, &st),
                   0);
  assert_int_equal(m.all[1]->fused_attention, 1);
  model_pick_ops(&m, 1, 227 << 10);
  assert_int_equal(m.all[1]->fused_attention, 0);
  model_free(&m);
  config_free(&cfg);
}

/* The ops memory_run_parts asks a backend's scratch about, recorded in its impl. */
typedef struct {
  dt_op ops[64];
  int n;
} scratch_asked;

static size_t record_scratch(dt_backend *be, const dt_op *ops, int n) {
  scratch_asked *asked = be->impl;
  for (int i = 0; i < n && asked->n < 64; i++) asked->ops[asked->n++] = ops[i];
  return 0;
}

/* The estimate asks the backend about every GEMM dense_forward and dense_backward run (CUDA's bf16
 * copies of their operands are scratch): for an attention layer's two projections and a linear
 * layer, the forward (rows, out, in), the weight gradient (out, in, rows, A transposed) and the input
 * gradient (rows, in, out), by hand for 3 sequences of 8 tokens of 128 values; then evaluation's
 * forwards of 5 sequences. */
/* model.c's pick_input16: under bf16 and fp16 with model.fuse on CUDA, a first layer that is a convolution reads
 * the input as the input op writes it, 16-bit NHWC, and keeps no 16-bit copy of it (2 bytes a value of its input
 * fewer in the estimate); on the CPU, in FP32, without model.fuse, or where the first layer is not a
 * convolution, nothing changes. */
static void first_convolution_reads_the_input_op_in_16_bits(void **state) {
  (void)state;
  const char *conv =
      "  input: [3, 8, 8]\n  layers: [{conv2d: {out: 4, kernel: 3, pad: 1, bias: false}}, {batchnorm: {}},"
      " {relu: {}}, {flatten: {}}, {linear: {out: 5}}]\n";
  const char *res =
      "  input: [4, 8, 8]\n  layers: [{residual: {body: [{conv2d: {out: 4, kernel: 3, pad: 1}}]}},"
      " {flatten: {}}, {linear: {out: 5}}]\n";
  const struct {
    const char *yaml;
    int cuda, precision, fuse, want;
  } cases[] = {{conv, 1, DT_PREC_BF16, 1, DT_F16_BF16}, {conv, 1, DT_PREC_FP16, 1, DT_F16_HALF},
               {conv, 1, DT_PREC_BF16, 0, DT_F16_NONE}, {conv, 1, DT_PREC_FP32, 1, DT_F16_NONE},
               {conv, 0, DT_PREC_BF16, 1, DT_F16_NONE}, {res, 1, DT_PREC_BF16, 1, DT_F16_NONE}};
  const int64_t B = 6;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    dt_config cfg;
    dt_model m;
    dt_status st;
    assert_int_equal(build(cases[i].yaml, &cfg, &m, &st), 0);
    m.precision = cases[i].precision, m.fuse = cases[i].fuse;
    model_pick_ops(&m, cases[i].cuda, 227 << 10);
    dt_layer *first = m.top.layers[0];
    const int conv_first = first->ops->traits & DT_LAYER_CONV;
    const int keeps = cases[i].cuda && cases[i].precision != DT_PREC_FP32 && !cases[i].want;
    if (m.input16 != cases[i].want || (conv_first && (first->in16 != cases[i].want || first->keeps_x16 != keeps)))
      fail_msg("case %zu: input16 %d, the first layer's in16 %d and keeps_x16 %d; expected %d, %d, %d", i, m.input16,
               first->in16, first->keeps_x16, cases[i].want, cases[i].want, keeps);
    if (i == 0) { /* against model.fuse false's estimate, whose convolution keeps the copy */
      const size_t fused = model_memory(&m, B, 1, 1).activations;
      m.fuse = 0;
      model_pick_ops(&m, 1, 227 << 10);
      assert_int_equal(model_memory(&m, B, 1, 1).activations - fused, (size_t)(B * 3 * 8 * 8 * 2));
    }
    model_free(&m);
    config_free(&cfg);
  }
}

static void memory_estimate_asks_about_each_gemm(void **state) {
  (void)state;
  dt_config cfg;
  dt_model m;
  dt_status st;
  assert_int_equal(build("  input: [8]\n  layers: [{embedding: {vocab: 10, dim: 128}}, {attention: {heads: 2}},"
                         " {linear: {out: 10}}]\n",
                         &cfg, &m, &st),
                   0);
  scratch_asked asked = {.n = 0};
  dt_backend be = {.scratch = record_scratch, .impl = &asked};
  dt_run_memory parts;
  assert_true(cfg.v.val_x[0]); /* validation data by default: evaluation's forward, of the buffers' 5 rows */
  memory_run_parts(&cfg.v, &m, NULL, &be, 1, 3, 5, &parts);
  const int64_t want[][5] = {/* trans_a, trans_b, m, n, k */
                             {0, 1, 24, 384, 128}, {1, 0, 384, 128, 24}, {0, 0, 24, 128, 384}, {0, 1, 24, 128, 128},
                             {1, 0, 128, 128, 24}, {0, 0, 24, 128, 128}, {0, 1, 24, 10, 128},  {1, 0, 10, 128, 24},
                             {0, 0, 24, 128, 10},  {0, 1, 40, 384, 128}, {0, 1, 40, 128, 128}, {0, 1, 40, 10, 128}};
  const int n_want = sizeof want / sizeof *want;
  int n = 0;
  for (int i = 0; i < asked.n; i++) {
    if (asked.ops[i].type != DT_OP_GEMM) continue;
    const typeof(asked.ops[i].p.gemm) *q = &asked.ops[i].p.gemm;
    if (n >= n_want) fail_msg("GEMM %d asked about, past the %d expected", n, n_want);
    const int64_t got[5] = {q->trans_a, q->trans_b, q->m, q->n, q->k};
    for (int j = 0; j < 5; j++)
      if (got[j] != want[n][j])
        fail_msg("GEMM %d: (%lld %lld %lld %lld %lld), expected (%lld %lld %lld %lld %lld)", n, (long long)got[0],
                 (long long)got[1], (long long)got[2], (long long)got[3], (long long)got[4], (long long)want[n][0],
                 (long long)want[n][1], (long long)want[n][2], (long long)want[n][3], (long long)want[n][4]);
    n++;
  }
  assert_int_equal(n, n_want);
  model_free(&m);
  config_free(&cfg);
}

/* Hand-worked: the window either side of the last wait's end is 10% of it plus 100 us, at most 2 ms; a
 * first step (no last wait) sleeps between polls throughout, and so does a step past the window. */
static void step_waits_spin_only_near_the_last_ones_end(void **state) {
  (void)state;
  static const struct {
    double waited, last;
    int spins;
  } cases[] = {
      {0, 0, 0},           {10, 0, 0},                               /* no last wait */
      {0, 250e-6, 0},      {124e-6, 250e-6, 0}, {126e-6, 250e-6, 1}, /* window 125 us */
      {370e-6, 250e-6, 1}, {380e-6, 250e-6, 0}, {1, 250e-6, 0},      /* late, later */
      {8.85e-3, 10e-3, 0}, {8.95e-3, 10e-3, 1},                      /* window 1.1 ms */
      {77.9e-3, 80e-3, 0}, {78.1e-3, 80e-3, 1},                      /* window 2 ms, not 8.1 */
      {81.9e-3, 80e-3, 1}, {82.1e-3, 80e-3, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    if (step_wait_spins(cases[i].waited, cases[i].last) != cases[i].spins)
      fail_msg("waited %g s of a last %g s: spins %d, expected %d", cases[i].waited, cases[i].last,
               step_wait_spins(cases[i].waited, cases[i].last), cases[i].spins);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(default_cnn_has_870826_parameters),
      cmocka_unit_test(tensors_use_pytorch_names_layouts_and_order),
      cmocka_unit_test(shape_errors_name_layer_and_shapes),
      cmocka_unit_test(unknown_layers_and_parameters_suggest),
      cmocka_unit_test(losses_parse),
      cmocka_unit_test(memory_estimate_by_hand),
      cmocka_unit_test(attention_picks_by_device_and_shared_memory),
      cmocka_unit_test(first_convolution_reads_the_input_op_in_16_bits),
      cmocka_unit_test(memory_estimate_asks_about_each_gemm),
      cmocka_unit_test(step_waits_spin_only_near_the_last_ones_end),
  };
  return cmocka_run_group_tests_name("model", tests, NULL, NULL);
}
