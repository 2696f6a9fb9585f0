/* optim_sgd.c: torch.optim.SGD with momentum, dampening 0, Nesterov and L2 weight decay. State:
 * momentum_buffer (only with momentum > 0), which starts as the first gradient. */
#include "optim.h"

static int sgd_states(const dt_config_values *c) {
  return c->momentum > 0 ? 1 : 0;
}

static void sgd_hyper(const dt_config_values *c, int64_t t, double lr, float *out) {
  (void)c;
  out[0] = (float)lr;
  out[1] = t == 0 ? 1.0f : 0.0f; /* the momentum buffer starts as the first gradient */
}

static void sgd_step(const dt_config_values *c, dt_backend *be, int64_t n, int64_t t, const float *hyper,
                     const double *skip, double *nonfinite, float weight_decay, const dt_decay_run *runs, int n_runs,
                     float *params, const float *grads, float *const *states) {
  (void)t;
  dt_op op = {.type = DT_OP_SGD,
              .p.sgd = {.n = n,
                        .hyper = hyper,
                        .skip = skip,
                        .nonfinite = nonfinite,
                        .momentum = (float)c->momentum,
                        .weight_decay = weight_decay,
                        .nesterov = c->nesterov,
                        .param = params,
                        .grad = grads,
                        .mom = c->momentum > 0 ? states[0] : NULL,
                        .runs = runs,
                        .n_runs = n_runs}};
  backend_run(be, &op);
}

const dt_optim_ops dt_optim_sgd = {
    .name = "sgd", .state_names = {"momentum_buffer"}, .n_states = sgd_states, .hyper = sgd_hyper, .step = sgd_step};
