/* fault.h: fault injection for tests. DDP_TRAIN_FAULT=kind@rank:step makes rank `rank` fail at
 * optimizer step `step` (counted from 1 as in the log); inert when unset. Kinds:
 *   crash   SIGSEGV (no core dump)     hang    sleep forever inside the step
 *   nan     a NaN in the input batch    signal  raise SIGUSR1 on that rank
 *   exit    exit(1) without MPI_Finalize
 *   overflow  an infinite gradient value on that rank (train.precision fp16 skips the step) */
#ifndef DT_FAULT_H
#define DT_FAULT_H

#include <stdint.h>

#include "common.h"

typedef enum {
  DT_FAULT_NONE,
  DT_FAULT_CRASH,
  DT_FAULT_HANG,
  DT_FAULT_NAN,
  DT_FAULT_SIGNAL,
  DT_FAULT_EXIT,
  DT_FAULT_OVERFLOW
} dt_fault_kind;

typedef struct dt_fault {
  dt_fault_kind kind;
  int rank;
  int64_t step;
} dt_fault;

/* Parses text (NULL or empty: no fault). Exit 2 naming DDP_TRAIN_FAULT on a bad value. */
int fault_parse(dt_fault *f, const char *text, dt_status *st);

/* Fires a crash, hang, signal or exit fault when (rank, step) match; returns DT_FAULT_NAN or
 * DT_FAULT_OVERFLOW when the caller must inject one, else DT_FAULT_NONE. */
int fault_fire(const dt_fault *f, int rank, int64_t step);

#endif
