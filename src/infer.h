/* infer.h: the model run forward only: validation over the ranks, predictions to a file, and
 * sampling text from a token model. Collective over the ranks; each returns or sets the exit code
 * all ranks agreed on. Borrows the model (allocated, parameters loaded), the data and the
 * communicator. */
#ifndef DT_INFER_H
#define DT_INFER_H

#include "comm.h"
#include "config.h"
#include "data.h"
#include "model.h"

/* Evaluates the whole validation split across ranks with params and bufs (backend memory, laid
 * out as the model's; NULL: the model's own): mean loss and accuracy (-1 for mse), per target. */
void infer_evaluate(dt_model *m, const float *params, const float *bufs, dt_data *d, dt_comm *comm, double *loss,
                    double *acc, dt_status *st);

/* At the start of training: exit 2 (agreed) when the validation split has no target to score
 * (every one is loss.ignore_index), which would make a metric of 0/0. */
int infer_check_val(const dt_model *m, const dt_data *d, dt_comm *comm, dt_status *st);

/* --predict: writes the logits of the whole validation split (gathered to rank 0, in file order)
 * to path: (N, K), or (N, T x V) for a token model; and the labels (N,) of a classifier (a token
 * model's targets are its data, shifted: none are written). Returns the agreed exit code. */
int infer_predict(dt_model *m, dt_data *d, dt_comm *comm, const char *path);

/* --sample: continues `prompt` (bytes for a vocab-256 model, else token ids separated by spaces)
 * by n tokens drawn from the model's softmax at `temperature` (0: the most likely) among the top_k
 * (0: all), from a stream seeded by train.seed; rank 0 prints them (bytes, or ids) to stdout.
 * Returns 0 or an exit code, agreed on all ranks. */
int infer_sample(const dt_config *cfg, dt_model *m, dt_comm *comm, int64_t n, const char *prompt, double temperature,
                 int64_t top_k);

#endif
