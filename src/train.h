/* train.h: the one training loop, for every backend and world size.
 * Borrows everything: config, model (allocated), data, communicator, backend. */
#ifndef DT_TRAIN_H
#define DT_TRAIN_H

#include "comm.h"
#include "config.h"
#include "data.h"
#include "model.h"

typedef struct {
  double best_val_acc, final_val_acc, final_val_loss;
  int64_t steps;
  double wall_s;
} dt_train_result;

/* Runs training to the end (epochs, max_steps or early stopping); returns 0 or an exit code
 * agreed by all ranks, with the message printed once. */
int train_run(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, dt_train_result *res);

/* Evaluates the whole validation split across ranks: mean loss and accuracy (-1 for mse). */
void train_evaluate(const dt_config *cfg, dt_model *m, dt_data *d, dt_comm *comm, double *loss, double *acc,
                    dt_status *st);

#endif
