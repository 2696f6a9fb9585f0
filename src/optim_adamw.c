/* optim_adamw.c: torch.optim.AdamW (decoupled weight decay, bias-corrected moments). States:
 * exp_avg and exp_avg_sq. */
#include "optim.h"

static int adamw_states(const dt_config_values *c) {
  (void)c;
  return 2;
}

static void adamw_step(const dt_config_values *c, dt_backend *be, int64_t n, int64_t t, double lr, float *params,
                       const float *grads, float *const *states) {
  dt_op op = {.type = DT_OP_ADAMW,
              .p.adamw = {.n = n,
                          .lr = (float)lr,
                          .beta1 = (float)c->betas.v[0],
                          .beta2 = (float)c->betas.v[1],
                          .eps = (float)c->eps,
                          .weight_decay = (float)c->weight_decay,
                          .step = t + 1,
                          .param = params,
                          .grad = grads,
                          .m = states[0],
                          .v = states[1]}};
  backend_run(be, &op);
}

const dt_optim_ops dt_optim_adamw = {
    .name = "adamw", .state_names = {"exp_avg", "exp_avg_sq"}, .n_states = adamw_states, .step = adamw_step};
