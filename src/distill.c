/* distill.c: the frozen teacher of knowledge distillation (distill.h). */
#include "distill.h"

#include <stdio.h>
#include <string.h>

#include "checkpoint.h"

/* The first or last top-level layer of m, named with its config location, for a message. */
static void layer_text(const dt_model *m, int last, char *buf, size_t cap) {
  const dt_layer *l = m->top.layers[last ? m->top.n - 1 : 0];
  snprintf(buf, cap, "layer '%s' (%s, %s)", l->name, l->ops->kind, l->where);
}

static int check_fit(const dt_teacher *t, const dt_config *cfg, const dt_model *m, dt_status *st) {
  const dt_model *tm = &t->model;
  char a[64], b[64], la[768], lb[768];
  if (tm->input.rank != m->input.rank || tm->input.c != m->input.c || tm->input.h != m->input.h ||
      tm->input.w != m->input.w || !tm->tokens != !m->tokens) {
    shape_text(tm->input, a, sizeof a);
    shape_text(m->input, b, sizeof b);
    layer_text(tm, 0, la, sizeof la);
    layer_text(m, 0, lb, sizeof lb);
    return dt_fail(st, DT_EXIT_INPUT,
                   "distill.teacher: the teacher (%s) takes %s%s at %s, but the model (%s) takes %s%s at %s; a "
                   "teacher must take the model's input",
                   t->cfg.path, a, tm->tokens ? " token ids" : "", la, cfg->path, b, m->tokens ? " token ids" : "", lb);
  }
  if (tm->n_outputs != m->n_outputs || tm->n_labels != m->n_labels) {
    layer_text(tm, 1, la, sizeof la);
    layer_text(m, 1, lb, sizeof lb);
    return dt_fail(st, DT_EXIT_INPUT,
                   "distill.teacher: the teacher (%s) gives %lld outputs per sample at %s, but the model (%s) gives "
                   "%lld at %s; a teacher must give the model's output width",
                   t->cfg.path, (long long)tm->n_outputs, la, cfg->path, (long long)m->n_outputs, lb);
  }
  return 0;
}

int teacher_build(dt_teacher *t, const dt_config *cfg, dt_model *m, dt_status *st) {
  memset(t, 0, sizeof *t);
  const dt_config_values *v = &cfg->v;
  if (!v->distill_teacher[0]) return 0;
  dt_status mine = {0};
  if (config_load_model(&t->cfg, v->distill_teacher, &mine))
    return dt_fail(st, mine.code, "distill.teacher: %s", mine.msg);
  t->cfg.v.recompute = DT_RECOMPUTE_NONE; /* forward only: nothing is kept for a backward */
  if (model_build(&t->model, &t->cfg, &mine))
    return dt_fail(st, mine.code, "distill.teacher %s: %s", t->cfg.path, mine.msg);
  t->model.frozen = 1;
  t->on = 1;
  if (check_fit(t, cfg, m, st)) return st->code;
  m->teacher = &t->model;
  m->loss.distill = DT_DISTILL_KL + v->distill_loss;
  m->loss.alpha = v->distill_alpha;
  m->loss.temperature = v->distill_temperature;
  return 0;
}

int teacher_load(dt_teacher *t, const dt_config *cfg, dt_backend *be, int64_t max_batch, dt_comm *comm) {
  dt_model *tm = &t->model;
  model_alloc(tm, be, max_batch, 0);
  int code = ckpt_share_model(cfg->v.distill_weights, tm, 0, "distill.weights", comm);
  if (!code) model_weights16(tm, tm->params); /* its forwards' 16-bit copies, once: the weights never change */
  if (!code && comm->rank == 0)
    printf("distill: teacher %s (%lld parameters) from %s, frozen, in evaluation mode\n", t->cfg.path,
           (long long)tm->n_params, cfg->v.distill_weights);
  return code;
}

void teacher_forward(dt_model *teacher, const float *raw, int64_t rows) {
  model_input(teacher, raw, rows);
  dt_pass pass = {.be = teacher->be,
                  .batch = rows,
                  .training = 0, /* running statistics, no dropout */
                  .global_targets = 1,
                  .params = teacher->params,
                  .bufs = teacher->bufs};
  model_forward(teacher, &pass);
}

void teacher_free(dt_teacher *t) {
  if (!t->on && !t->cfg.path) return;
  model_free(&t->model);
  config_free(&t->cfg);
  memset(t, 0, sizeof *t);
}
