/* optim.h: learning-rate schedules and the optimizer step over the flat parameter buffer.
 * Schedules are functions of the optimizer step t in [0, total) (PyTorch's order: step t uses
 * lr(t), then the scheduler advances). Owns: the optimizer state buffers (backend memory). */
#ifndef DT_OPTIM_H
#define DT_OPTIM_H

#include "backend.h"
#include "config.h"

typedef struct {
  const dt_config_values *cfg; /* borrowed */
  int64_t total_steps;
  int64_t n;
  float *mom;   /* SGD momentum (n) */
  float *m, *v; /* AdamW moments (n) */
  int64_t step; /* optimizer steps taken */
} dt_optim;

double schedule_lr(const dt_config_values *cfg, int64_t t, int64_t total);

void optim_init(dt_optim *o, const dt_config_values *cfg, dt_backend *be, int64_t n, int64_t total_steps);
void optim_free(dt_optim *o, dt_backend *be);
/* One step at lr over params with grads; advances o->step. */
void optim_step(dt_optim *o, dt_backend *be, float *params, const float *grads, double lr);

#endif
