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
  c.optim = DT_OPTIM_SGD;
  c.momentum = 0.9;
  c.nesterov = 1;
  c.weight_decay = 0.01;
  dt_backend *be = backend_cpu_create(1);
  dt_optim o;
  optim_init(&o, &c, be, 1, 10);
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
  optim_init(&o, &c, be, 1, 10);
  float p = 1.0f, g = 2.0f;
  optim_step(&o, be, &p, &g, 0.1); /* p = 1 - 0.2 */
  assert_near(p, 0.8, 1e-7);
  optim_free(&o, be);
  c.momentum = 0.5;
  optim_init(&o, &c, be, 1, 10);
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
  c.optim = DT_OPTIM_ADAMW;
  c.weight_decay = 0.01;
  dt_backend *be = backend_cpu_create(1);
  dt_optim o;
  optim_init(&o, &c, be, 1, 10);
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sgd_nesterov_with_weight_decay),
      cmocka_unit_test(sgd_plain_and_heavy_ball),
      cmocka_unit_test(adamw_two_steps),
      cmocka_unit_test(schedules),
  };
  return cmocka_run_group_tests_name("optim", tests, NULL, NULL);
}
