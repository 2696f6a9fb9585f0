/* optim_adamw.c: torch.optim.AdamW (decoupled weight decay, bias-corrected moments). States:
 * exp_avg and exp_avg_sq. */
#include "optim.h"

#include <math.h>

static int adamw_states(const dt_config_values *c) {
  (void)c;
  return 2;
}

/* lr, the bias corrections of step t + 1 folded in as PyTorch does: step size lr / (1 - beta1^s)
 * and sqrt(1 - beta2^s) */
static void adamw_hyper(const dt_config_values *c, int64_t t, double lr, float *out) {
  double s = (double)(t + 1), bc1 = 1.0 - pow((float)c->betas.v[0], s), bc2 = 1.0 - pow((float)c->betas.v[1], s);
  out[0] = (float)lr;
  out[1] = (float)((double)out[0] / bc1);
  out[2] = (float)sqrt(bc2);
}

static void adamw_step(const dt_config_values *c, dt_backend *be, int64_t n, int64_t t, const float *hyper,
                       const double *skip, double *nonfinite, float weight_decay, const dt_decay_run *runs, int n_runs,
                       float *params, const float *grads, float *const *states) {
  (void)t;
  dt_op op = {.type = DT_OP_ADAMW,
              .p.adamw = {.n = n,
                          .beta1 = (float)c->betas.v[0],
                          .beta2 = (float)c->betas.v[1],
                          .eps = (float)c->eps,
                          .weight_decay = weight_decay,
                          .hyper = hyper,
                          .skip = skip,
                          .nonfinite = nonfinite,
                          .param = params,
                          .grad = grads,
                          .m = states[0],
                          .v = states[1],
                          .runs = runs,
                          .n_runs = n_runs}};
  backend_run(be, &op);
}

const dt_optim_ops dt_optim_adamw = {.name = "adamw",
                                     .state_names = {"exp_avg", "exp_avg_sq"},
                                     .n_states = adamw_states,
                                     .hyper = adamw_hyper,
                                     .step = adamw_step};
