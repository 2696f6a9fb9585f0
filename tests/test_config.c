/* test_config: the config reader's values, defaults, --set, and one test per error class,
 * each checking the message and its FILE:LINE:COL location. */
#include "dt_test.h"

#include "config.h"
#include "model.h"

#define BASE                  \
  "model:\n"                  \
  "  input: [1, 4, 4]\n"      \
  "  layers:\n"               \
  "    - flatten: {}\n"       \
  "    - linear: {out: 3}\n"  \
  "data:\n"                   \
  "  path: /nonexistent.h5\n" \
  "train:\n"                  \
  "  batch_size: 8\n"

/* Loads text (+ sets); returns the status code and leaves the message in st. */
static int load(const char *text, char *const *sets, int n_sets, dt_config *cfg, dt_status *st) {
  char *path = write_tmp(text);
  memset(st, 0, sizeof *st);
  int rc = config_load(cfg, path, sets, n_sets, st);
  unlink(path);
  free(path);
  return rc;
}

static int load_err(const char *text, char *const *sets, int n_sets, dt_status *st) {
  dt_config cfg;
  int rc = load(text, sets, n_sets, &cfg, st);
  config_free(&cfg);
  return rc;
}

static void valid_config_has_values_and_defaults(void **state) {
  (void)state;
  dt_config cfg;
  dt_status st;
  assert_int_equal(load(BASE "optim:\n  lr: 0.25\n  betas: [0.8, 0.9]\n", NULL, 0, &cfg, &st), 0);
  assert_int_equal(cfg.v.input.n, 3);
  assert_int_equal((int)cfg.v.input.v[1], 4);
  assert_true(cfg.v.lr == 0.25);
  assert_true(cfg.v.betas.v[0] == 0.8);
  assert_int_equal(cfg.v.epochs, 1); /* default */
  assert_int_equal(cfg.v.sharding, DT_SHARD_GLOBAL);
  assert_string_equal(cfg.v.train_x, "/train/images");
  assert_true(cfg.v.bucket_mb == 25);
  assert_int_equal(cfg.v.layers->n, 2);
  assert_non_null(strstr(cfg.effective, "optim.lr: 0.25\n"));
  config_free(&cfg);
}

static void set_overrides_and_creates_keys(void **state) {
  (void)state;
  dt_config cfg;
  dt_status st;
  char *sets[] = {"train.epochs=7", "optim.lr=0.5", "optim.schedule.name=cosine", "model.input=[1, 4, 4]"};
  assert_int_equal(load(BASE, sets, 4, &cfg, &st), 0);
  assert_int_equal(cfg.v.epochs, 7);
  assert_true(cfg.v.lr == 0.5);
  assert_int_equal(cfg.v.schedule, DT_SCHED_COSINE);
  uint64_t h1 = cfg.hash;
  config_free(&cfg);
  char *sets2[] = {"train.epochs=8"};
  assert_int_equal(load(BASE, sets2, 1, &cfg, &st), 0);
  assert_true(cfg.hash != h1); /* the effective config decides the hash */
  config_free(&cfg);
}

static void unknown_key_suggests_nearest(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err(BASE "optim:\n  learning_rate: 0.1\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":11:3: unknown key 'optim.learning_rate'; did you mean 'optim.lr'?");
  assert_int_equal(load_err(BASE "  epoch: 3\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":10:3: unknown key 'train.epoch'; did you mean 'train.epochs'?");
  assert_int_equal(load_err(BASE "trian:\n  seed: 1\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "unknown key 'trian'; did you mean 'train'?");
  assert_int_equal(load_err(BASE "  early_stopping: {metric: val_acc, patiense: 2}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "did you mean 'train.early_stopping.patience'?");
}

static void wrong_type_names_key_and_location(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err(BASE "  epochs: three\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":10:11: train.epochs: expected an integer >= 1, got 'three'");
  assert_int_equal(load_err(BASE "  epochs: [1]\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "train.epochs: expected an integer, got a list");
  assert_int_equal(load_err(BASE "data2: 1\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "unknown key 'data2'; did you mean 'data'?");
}

static void out_of_range_names_bounds(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err(BASE "optim:\n  momentum: 1.5\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":11:13: optim.momentum: expected a number in [0, 1], got '1.5'");
  assert_int_equal(load_err(BASE "  epochs: 0\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "train.epochs: expected an integer >= 1, got '0'");
}

static void enum_and_bool_list_choices(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err(BASE "  early_stopping: {metric: accuracy}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(
      st.msg,
      "train.early_stopping.metric: expected one of none|val_loss|val_acc|ema_val_loss|ema_val_acc, got 'accuracy'");
  assert_int_equal(load_err(BASE "  seed: 1\noptim: {nesterov: maybe, momentum: 0.9}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "optim.nesterov: expected true or false, got 'maybe'");
}

static void list_items_are_checked(void **state) {
  (void)state;
  dt_status st;
  const char *text = "model:\n  input: [1, x, 4]\n  layers: [flatten]\ndata: {path: a.h5}\ntrain: {batch_size: 2}\n";
  assert_int_equal(load_err(text, NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":2:14: model.input[1]: expected an integer in [1, 1e+09], got x");
  text = "model:\n  input: 5\n  layers: [flatten]\ndata: {path: a.h5}\ntrain: {batch_size: 2}\n";
  assert_int_equal(load_err(text, NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "model.input: expected a list of integers, got 5");
}

static void missing_required_key(void **state) {
  (void)state;
  dt_status st;
  const char *text = "model:\n  input: [3]\n  layers: [{linear: {out: 2}}]\ntrain: {batch_size: 2}\n";
  assert_int_equal(load_err(text, NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "missing required key 'data.path'");
}

static void batch_size_rules(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err(BASE "  global_batch_size: 16\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "train.batch_size and train.global_batch_size are both set");
  const char *text = "model:\n  input: [3]\n  layers: [{linear: {out: 2}}]\ndata: {path: a.h5}\n";
  assert_int_equal(load_err(text, NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "set train.batch_size (per rank) or train.global_batch_size (total)");
}

static void cross_key_checks(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err(BASE "optim: {nesterov: true}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "optim.nesterov needs optim.momentum > 0");
  assert_int_equal(load_err(BASE "  seed: 0\ndata2: {}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_int_equal(load_err(BASE "optim: {schedule: {name: step, milestones: [5, 3]}}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "optim.schedule.milestones must increase");
  assert_int_equal(load_err(BASE "optim: {betas: [0.9]}\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "optim.betas: expected two numbers");
}

static void yaml_syntax_and_duplicates(void **state) {
  (void)state;
  dt_status st;
  assert_int_equal(load_err("model:\n  input: [1, 2\n  layers: []\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "YAML syntax error");
  assert_contains(st.msg, ":3:");
  assert_int_equal(load_err(BASE "  batch_size: 4\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, ":10:3: duplicate key 'batch_size'");
  assert_int_equal(load_err("- a\n- b\n", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "the config must be a map of sections");
}

/* The tree is walked recursively: DT_YAML_MAX_DEPTH levels parse, one more is refused with its place. */
static void yaml_depth_is_bounded(void **state) {
  (void)state;
  enum { N = DT_YAML_MAX_DEPTH + 1 };
  char text[2 * N + 1];
  for (int levels = N - 1; levels <= N; levels++) {
    memset(text, '[', (size_t)levels);
    memset(text + levels, ']', (size_t)levels);
    text[2 * levels] = 0;
    dt_status st = {0};
    dt_node *tree = yaml_tree_parse(text, strlen(text), "deep", &st);
    if (levels < N) {
      assert_non_null(tree);
    } else {
      assert_null(tree);
      assert_int_equal(st.code, DT_EXIT_INPUT);
      assert_contains(st.msg, "deep:1:257: YAML nested more than 256 levels deep");
    }
    yaml_tree_free(tree);
  }
}

static void set_errors_name_the_option(void **state) {
  (void)state;
  dt_status st;
  char *bad_value[] = {"train.epochs=abc"};
  assert_int_equal(load_err(BASE, bad_value, 1, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "--set train.epochs: train.epochs: expected an integer >= 1, got 'abc'");
  char *typo[] = {"optim.learning_rate=0.1"};
  assert_int_equal(load_err(BASE, typo, 1, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "unknown key 'optim.learning_rate'; did you mean 'optim.lr'?");
  char *no_eq[] = {"train.epochs"};
  assert_int_equal(load_err(BASE, no_eq, 1, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "--set train.epochs: expected KEY=VALUE");
  char *not_section[] = {"train.epochs.x=1"};
  assert_int_equal(load_err(BASE, not_section, 1, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "--set train.epochs.x: train.epochs: expected an integer, got a map");
}

/* YAML 1.2, not 1.1: a leading zero is decimal (010 is ten), 0o is octal and 0x hexadecimal. */
static void integers_are_yaml_1_2(void **state) {
  (void)state;
  dt_config cfg;
  dt_status st;
  char *sets[] = {"train.epochs=010", "train.seed=08", "train.max_steps=0o17", "train.eval_every_steps=0x1F",
                  "checkpoint.keep=+007"};
  assert_int_equal(load(BASE, sets, 5, &cfg, &st), 0);
  assert_int_equal(cfg.v.epochs, 10);
  assert_int_equal(cfg.v.seed, 8);
  assert_int_equal(cfg.v.max_steps, 15);
  assert_int_equal(cfg.v.eval_every_steps, 31);
  assert_int_equal(cfg.v.ckpt_keep, 7);
  assert_int_equal(cfg.v.input.n, 3);
  config_free(&cfg);
  assert_int_equal(load("model:\n  input: [01, 010, 4]\n  layers: [flatten]\ndata: {path: x.h5}\n"
                        "train: {batch_size: 010}\n",
                        NULL, 0, &cfg, &st),
                   0);
  assert_int_equal(cfg.v.batch_size, 10);
  assert_int_equal((int)cfg.v.input.v[1], 10);
  config_free(&cfg);
  char *bad[] = {"train.epochs=0x"};
  assert_int_equal(load_err(BASE, bad, 1, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "train.epochs: expected an integer >= 1, got '0x'");
  char *bad_octal[] = {"train.epochs=0o8"};
  assert_int_equal(load_err(BASE, bad_octal, 1, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "got '0o8'");
}

static void missing_file(void **state) {
  (void)state;
  dt_config cfg;
  dt_status st = {0};
  assert_int_equal(config_load(&cfg, "/nonexistent/cfg.yaml", NULL, 0, &st), DT_EXIT_INPUT);
  assert_contains(st.msg, "/nonexistent/cfg.yaml: cannot open config: No such file or directory");
  config_free(&cfg);
}

static void edit_distance_and_suggestions(void **state) {
  (void)state;
  assert_int_equal(keys_edit_distance("kitten", "sitting"), 3);
  assert_int_equal(keys_edit_distance("", "abc"), 3);
  const char *c[] = {"train.epochs", "train.seed", "optim.lr"};
  assert_string_equal(keys_suggest("train.epoch", c, 3), "train.epochs");
  assert_string_equal(keys_suggest("optim.learning_rate", c, 3), "optim.lr");
  assert_null(keys_suggest("completely.different", c, 3));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(valid_config_has_values_and_defaults),
      cmocka_unit_test(set_overrides_and_creates_keys),
      cmocka_unit_test(unknown_key_suggests_nearest),
      cmocka_unit_test(wrong_type_names_key_and_location),
      cmocka_unit_test(out_of_range_names_bounds),
      cmocka_unit_test(enum_and_bool_list_choices),
      cmocka_unit_test(list_items_are_checked),
      cmocka_unit_test(missing_required_key),
      cmocka_unit_test(batch_size_rules),
      cmocka_unit_test(cross_key_checks),
      cmocka_unit_test(yaml_syntax_and_duplicates),
      cmocka_unit_test(yaml_depth_is_bounded),
      cmocka_unit_test(set_errors_name_the_option),
      cmocka_unit_test(integers_are_yaml_1_2),
      cmocka_unit_test(missing_file),
      cmocka_unit_test(edit_distance_and_suggestions),
  };
  return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
