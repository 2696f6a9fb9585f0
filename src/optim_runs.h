/* optim_runs.h: a run of the flat parameters stepped with one weight decay (optim.no_decay), as the
 * optimizer ops (backend.h's sgd and adamw) read their table of them on either backend. */
#ifndef DT_OPTIM_RUNS_H
#define DT_OPTIM_RUNS_H

#include <stdint.h>

typedef struct {
  int64_t start;      /* its first value, from the op's param[0]; it ends where the next run starts */
  float weight_decay; /* optim.weight_decay, or 0 for the tensors optim.no_decay names */
} dt_decay_run;

#endif
