#include "optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sampler.h"

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

const dt_optim_ops *const dt_optim_kinds[] = {&dt_optim_sgd, &dt_optim_adamw};
const int dt_n_optim_kinds = (int)(sizeof dt_optim_kinds / sizeof dt_optim_kinds[0]);

int optim_index(const char *name) {
  for (int i = 0; i < dt_n_optim_kinds; i++)
    if (!strcmp(dt_optim_kinds[i]->name, name)) return i;
  return -1;
}

void optim_slice(const dt_config_values *cfg, int64_t n, int world, int rank, int64_t *lo, int64_t *hi) {
  *lo = cfg->zero ? split_lo(n, world, rank) : 0;
  *hi = cfg->zero ? split_lo(n, world, rank + 1) : n;
}

void optim_init(dt_optim *o, const dt_config_values *cfg, dt_backend *be, int64_t n, int64_t lo, int64_t hi,
                int64_t total_steps) {
  DT_ASSERT(0 <= lo && lo <= hi && hi <= n);
  memset(o, 0, sizeof *o);
  DT_ASSERT(cfg->optim >= 0 && cfg->optim < dt_n_optim_kinds);
  o->ops = dt_optim_kinds[cfg->optim];
  o->cfg = cfg;
  o->n = n;
  o->lo = lo;
  o->hi = hi;
  o->total_steps = total_steps;
  o->n_states = o->ops->n_states(cfg);
  for (int i = 0; i < o->n_states; i++) o->states[i] = be->alloc(be, (size_t)(hi > lo ? hi - lo : 1) * sizeof(float));
  o->hyper = be->alloc(be, DT_OPTIM_HYPER * sizeof(float));
}

void optim_set_runs(dt_optim *o, dt_backend *be, int n, const dt_decay_run *all) {
  dt_decay_run *runs = dt_calloc((size_t)(n ? n : 1), sizeof *runs); /* its padding uploaded as zeros */
  int k = 0;
  for (int i = 0; i < n; i++) {
    const int64_t end = i + 1 < n ? all[i + 1].start : o->n;
    const int64_t a = all[i].start > o->lo ? all[i].start : o->lo, b = end < o->hi ? end : o->hi;
    if (a < b) runs[k++] = (dt_decay_run){.start = a - o->lo, .weight_decay = all[i].weight_decay};
  }
  DT_ASSERT(!o->runs && (!k || runs[0].start == 0));
  if (k) {
    o->runs = (dt_decay_run *)be->alloc(be, (size_t)k * sizeof *runs);
    be->to_device(be, o->runs, runs, (size_t)k * sizeof *runs);
    o->n_runs = k;
  }
  free(runs);
}

void optim_free(dt_optim *o, dt_backend *be) {
  if (o->runs) be->free(be, o->runs);
  for (int i = 0; i < o->n_states; i++) be->free(be, o->states[i]);
  if (o->hyper) be->free(be, o->hyper);
  memset(o, 0, sizeof *o);
}

void optim_prepare(dt_optim *o, dt_backend *be, double lr) {
  float h[DT_OPTIM_HYPER] = {0};
  o->ops->hyper(o->cfg, o->step, lr, h);
  be->upload(be, o->hyper, h, sizeof h);
}

void optim_apply(dt_optim *o, dt_backend *be, float *params, const float *grads) {
  if (o->hi > o->lo) /* the slice [lo, hi) this rank steps, in one op */
    o->ops->step(o->cfg, be, o->hi - o->lo, o->step, o->hyper, o->skip, o->nonfinite, (float)o->cfg->weight_decay,
                 o->runs, o->n_runs, params + o->lo, grads + o->lo, o->states);
  o->step++;
}

void optim_advance(dt_optim *o) {
  o->step++;
}

void optim_skipped(dt_optim *o) {
  DT_ASSERT(o->step > 0);
  o->step--;
}

void optim_step(dt_optim *o, dt_backend *be, float *params, const float *grads, double lr) {
  optim_prepare(o, be, lr);
  optim_apply(o, be, params, grads);
}
