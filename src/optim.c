#include "optim.h"

#include <math.h>
#include <string.h>

static double cos_anneal(double start, double end, double pct) {
  return end + (start - end) / 2.0 * (cos(M_PI * pct) + 1.0);
}

double schedule_lr(const dt_config_values *c, int64_t t, int64_t total) {
  double lr = c->lr;
  switch (c->schedule) {
    case DT_SCHED_CONSTANT: return lr;
    case DT_SCHED_STEP: {
      for (int i = 0; i < c->milestones.n; i++)
        if (t >= (int64_t)c->milestones.v[i]) lr *= c->gamma;
      return lr;
    }
    case DT_SCHED_COSINE: {
      int64_t w = c->warmup_steps;
      if (t < w) return lr * (double)(t + 1) / (double)w;
      int64_t span = total - w;
      double pct = span > 0 ? (double)(t - w) / (double)span : 1.0;
      if (pct > 1) pct = 1;
      return cos_anneal(lr, c->min_lr, pct);
    }
    case DT_SCHED_ONECYCLE: {
      /* torch.optim.lr_scheduler.OneCycleLR: div_factor 25, final_div_factor 1e4, cos anneal */
      double initial = lr / 25.0, final_lr = initial / 1e4;
      double end1 = c->pct_start * (double)total - 1.0, end2 = (double)total - 1.0;
      if (t <= end1) return cos_anneal(initial, lr, end1 > 0 ? (double)t / end1 : 1.0);
      double pct = end2 > end1 ? ((double)t - end1) / (end2 - end1) : 1.0;
      if (pct > 1) pct = 1;
      return cos_anneal(lr, final_lr, pct);
    }
  }
  return lr;
}

void optim_init(dt_optim *o, const dt_config_values *cfg, dt_backend *be, int64_t n, int64_t total_steps) {
  memset(o, 0, sizeof *o);
  o->cfg = cfg;
  o->n = n;
  o->total_steps = total_steps;
  size_t bytes = (size_t)(n ? n : 1) * sizeof(float);
  if (cfg->optim == DT_OPTIM_SGD) {
    if (cfg->momentum > 0) o->mom = be->alloc(be, bytes);
  } else {
    o->m = be->alloc(be, bytes);
    o->v = be->alloc(be, bytes);
  }
}

void optim_free(dt_optim *o, dt_backend *be) {
  if (o->mom) be->free(be, o->mom);
  if (o->m) be->free(be, o->m);
  if (o->v) be->free(be, o->v);
  memset(o, 0, sizeof *o);
}

void optim_step(dt_optim *o, dt_backend *be, float *params, const float *grads, double lr) {
  const dt_config_values *c = o->cfg;
  dt_op op;
  memset(&op, 0, sizeof op);
  if (c->optim == DT_OPTIM_SGD) {
    op.type = DT_OP_SGD;
    op.p.sgd = (typeof(op.p.sgd)){
        o->n, (float)lr, (float)c->momentum, (float)c->weight_decay, c->nesterov, o->step == 0, params, grads, o->mom};
  } else {
    op.type = DT_OP_ADAMW;
    op.p.adamw = (typeof(op.p.adamw)){o->n,
                                      (float)lr,
                                      (float)c->betas.v[0],
                                      (float)c->betas.v[1],
                                      (float)c->eps,
                                      (float)c->weight_decay,
                                      o->step + 1,
                                      params,
                                      grads,
                                      o->m,
                                      o->v};
  }
  backend_run(be, &op);
  o->step++;
}
