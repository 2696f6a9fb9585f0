/* distill.h: knowledge distillation (the distill section). A frozen teacher, built from its own
 * config (its model section and input normalisation) and weights, runs forward on every training
 * batch in evaluation mode (running batchnorm statistics, no dropout) and in the run's precision,
 * inside the captured step; its logits join the model's loss (loss.h, backend.h's loss op). It has
 * no gradients, optimizer state or EMA, and nothing writes its weights; checkpoints hold the model
 * being trained only. Owns the teacher's config and model; the student borrows the model
 * (dt_model.teacher). */
#ifndef DT_DISTILL_H
#define DT_DISTILL_H

#include "comm.h"
#include "config.h"
#include "model.h"

typedef struct {
  dt_config cfg; /* distill.teacher's */
  dt_model model;
  int on;
} dt_teacher;

/* Builds the teacher that cfg's distill section names and checks it against the student m: the
 * same input and the same output width, or exit 2 naming both configs and the layers. Then sets
 * m->teacher and m->loss's distillation fields. Nothing when distill.teacher is empty. Returns 0 or
 * st->code. */
int teacher_build(dt_teacher *t, const dt_config *cfg, dt_model *m, dt_status *st);

/* Collective: the teacher's buffers on be for max_batch rows, and its weights: rank 0 reads
 * distill.weights and every rank receives them. Returns the agreed exit code. */
int teacher_load(dt_teacher *t, const dt_config *cfg, dt_backend *be, int64_t max_batch, dt_comm *comm);

/* Queues the teacher's forward over `rows` rows of raw inputs (backend memory, as model_input
 * takes them); its logits end in model_logits(teacher). */
void teacher_forward(dt_model *teacher, const float *raw, int64_t rows);

void teacher_free(dt_teacher *t);

#endif
