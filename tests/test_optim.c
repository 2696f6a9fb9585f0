/* test_optim: optimizer steps and learning-rate schedules against values worked out by hand
 * (the arithmetic is in the comments). */
#include <math.h>

#include "dt_test.h"

#include "optim.h"

static dt_config_values base(void) {
  dt_config_values c;
  memset(&c, 0, sizeof c);
  c.lr = 0.1;
  c.betas.n = 2;
  c.betas.v[0] = 0.9;
  c.betas.v[1] = 0.999;
  c.eps = 1e-8;
  c.gamma = 0.1;
  c.pct_start = 0.3;
  return c;
}

#define assert_near(a, b, tol)                                   \
  do {                                                           \
    double a_ = (a), b_ = (b);                                   \
    if (fabs(a_ - b_) > (tol)) fail_msg("%.9g != %.9g", a_, b_); \
  } while (0)

static void sgd_nesterov_with_weight_decay(void **s) {
  (void)s;
  dt_config_values c = base();
  c.optim = optim_index("sgd");
  c.momentum = 0.9;
  c.nesterov = 1;
  c.weight_decay = 0.01;
  dt_backend *be = backend_cpu_create(1);
  dt_optim o;
  optim_init(&o, &c, be, 1, 0, 1, 10);
  float p = 1.0f, g = 0.5f;
  /* step 1: g' = 0.5 + 0.01*1 = 0.51; buf = 0.51; g'' = 0.51 + 0.9*0.51 = 0.969; p = 1 - 0.0969 */
  optim_step(&o, be, &p, &g, 0.1);
  assert_near(p, 0.9031, 1e-6);
  /* step 2: g' = 0.5 + 0.009031 = 0.509031; buf = 0.459 + 0.509031 = 0.968031;
   * g'' = 0.509031 + 0.8712279 = 1.3802589; p = 0.9031 - 0.13802589 = 0.76507411 */
  optim_step(&o, be, &p, &g, 0.1);
  assert_near(p, 0.76507411, 1e-6);
  optim_free(&o, be);
  be->destroy(be);
}

static void sgd_plain_and_heavy_ball(void **s) {
  (void)s;
  dt_config_values c = base();
  dt_backend *be = backend_cpu_create(1);
  dt_optim o;
  optim_init(&o, &c, be, 1, 0, 1, 10);
  float p = 1.0f, g = 2.0f;
  optim_step(&o, be, &p, &g, 0.1); /* p = 1 - 0.2 */
  assert_near(p, 0.8, 1e-7);
  optim_free(&o, be);
  c.momentum = 0.5;
  optim_init(&o, &c, be, 1, 0, 1, 10);
  p = 1.0f;
  optim_step(&o, be, &p, &g, 0.1); /* buf = 2; p = 0.8 */
  optim_step(&o, be, &p, &g, 0.1); /* buf = 1 + 2 = 3; p = 0.8 - 0.3 = 0.5 */
  assert_near(p, 0.5, 1e-7);
  optim_free(&o, be);
  be->destroy(be);
}

static void adamw_two_steps(void **s) {
  (void)s;
  dt_config_values c = base();
  c.optim = optim_index("adamw");
  c.weight_decay = 0.01;
  dt_backend *be = backend_cpu_create(1);
  dt_optim o;
  optim_init(&o, &c, be, 1, 0, 1, 10);
  float p = 1.0f, g = 0.5f;
  /* step 1: p = 1*(1 - 0.1*0.01) = 0.999; m = 0.05, v = 0.00025; mhat = 0.5, vhat = 0.25;
   * p -= 0.1 * 0.5 / (0.5 + 1e-8) -> 0.899 */
  optim_step(&o, be, &p, &g, 0.1);
  assert_near(p, 0.899, 1e-6);
  /* step 2: p = 0.899*0.999 = 0.898101; m = 0.045 + 0.05 = 0.095; v = 0.00024975 + 0.00025 = 0.00049975;
   * mhat = 0.095/0.19 = 0.5; vhat = 0.00049975/0.001999 = 0.25; p -= 0.1 -> 0.798101 */
  optim_step(&o, be, &p, &g, 0.1);
  assert_near(p, 0.798101, 1e-6);
  optim_free(&o, be);
  be->destroy(be);
}

static void schedules(void **s) {
  (void)s;
  dt_config_values c = base();
  c.schedule = DT_SCHED_CONSTANT;
  assert_near(schedule_lr(&c, 7, 10), 0.1, 1e-12);
  c.schedule = DT_SCHED_STEP;
  c.milestones.n = 2;
  c.milestones.v[0] = 2;
  c.milestones.v[1] = 4;
  assert_near(schedule_lr(&c, 1, 10), 0.1, 1e-12);
  assert_near(schedule_lr(&c, 2, 10), 0.01, 1e-12);
  assert_near(schedule_lr(&c, 5, 10), 0.001, 1e-12);
  c.schedule = DT_SCHED_COSINE;
  c.warmup_steps = 2;
  c.min_lr = 0.0;
  assert_near(schedule_lr(&c, 0, 10), 0.05, 1e-12); /* warm-up: lr*(t+1)/2 */
  assert_near(schedule_lr(&c, 2, 10), 0.1, 1e-12);  /* cosine starts at lr */
  assert_near(schedule_lr(&c, 6, 10), 0.05, 1e-12); /* half way: (1+cos(pi/2))/2 */
  assert_near(schedule_lr(&c, 10, 10), 0.0, 1e-12);
  c.schedule = DT_SCHED_ONECYCLE;
  c.pct_start = 0.25;
  /* total 9: phase ends at 0.25*9-1 = 1.25 and 8; initial lr/25, final lr/25/1e4 */
  assert_near(schedule_lr(&c, 0, 9), 0.004, 1e-12);
  assert_near(schedule_lr(&c, 8, 9), 0.004 / 1e4, 1e-12);
  /* t=1: pct 0.8: 0.1 + (0.004-0.1)/2*(cos(0.8 pi)+1) */
  assert_near(schedule_lr(&c, 1, 9), 0.1 + (0.004 - 0.1) / 2 * (cos(0.8 * M_PI) + 1), 1e-12);
}

/* optim.name's values index the descriptors; a descriptor's states are what checkpoints name */
static void optimizer_names_and_states(void **s) {
  (void)s;
  const char *names[] = {"sgd", "adamw"};
  for (int i = 0; i < 2; i++) {
    char text[256];
    snprintf(text, sizeof text,
             "model: {input: [4], layers: [{linear: {out: 2}}]}\ndata: {path: x.h5}\n"
             "train: {batch_size: 2}\noptim: {name: %s}\n",
             names[i]);
    char *path = write_tmp(text);
    dt_config cfg;
    dt_status st = {0};
    assert_int_equal(config_load(&cfg, path, NULL, 0, &st), 0);
    assert_int_equal(cfg.v.optim, optim_index(names[i]));
    assert_string_equal(dt_optim_kinds[cfg.v.optim]->name, names[i]);
    config_free(&cfg);
    unlink(path);
    free(path);
  }
  assert_int_equal(optim_index("adam"), -1);
  dt_config_values c = base();
  assert_int_equal(dt_optim_sgd.n_states(&c), 0);
  c.momentum = 0.9;
  assert_int_equal(dt_optim_sgd.n_states(&c), 1);
  assert_string_equal(dt_optim_sgd.state_names[0], "momentum_buffer");
  assert_int_equal(dt_optim_adamw.n_states(&c), 2);
  assert_string_equal(dt_optim_adamw.state_names[0], "exp_avg");
  assert_string_equal(dt_optim_adamw.state_names[1], "exp_avg_sq");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sgd_nesterov_with_weight_decay),
      cmocka_unit_test(sgd_plain_and_heavy_ball),
      cmocka_unit_test(adamw_two_steps),
      cmocka_unit_test(schedules),
      cmocka_unit_test(optimizer_names_and_states),
  };
  return cmocka_run_group_tests_name("optim", tests, NULL, NULL);
}
