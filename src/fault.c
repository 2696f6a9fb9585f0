#include "fault.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

int fault_parse(dt_fault *f, const char *text, dt_status *st) {
  memset(f, 0, sizeof *f);
  if (!text || !*text) return 0;
  static const char *names[] = {"none", "crash", "hang", "nan", "signal", "exit", "overflow"};
  char kind[32];
  int rank;
  long long step;
  char tail;
  if (sscanf(text, "%31[a-z]@%d:%lld%c", kind, &rank, &step, &tail) != 3 || rank < 0 || step < 1)
    return dt_fail(st, DT_EXIT_INPUT, "DDP_TRAIN_FAULT=%s: expected kind@rank:step, e.g. crash@1:5", text);
  for (int k = 1; k < 7; k++)
    if (!strcmp(kind, names[k])) {
      f->kind = (dt_fault_kind)k;
      f->rank = rank;
      f->step = step;
      return 0;
    }
  return dt_fail(st, DT_EXIT_INPUT, "DDP_TRAIN_FAULT=%s: unknown kind '%s' (crash, hang, nan, signal, exit, overflow)",
                 text, kind);
}

int fault_fire(const dt_fault *f, int rank, int64_t step) {
  if (f->kind == DT_FAULT_NONE || f->rank != rank || f->step != step) return 0;
  fprintf(stderr, "ddp_train: fault injection: rank %d step %lld\n", rank, (long long)step);
  fflush(stderr);
  switch (f->kind) {
    case DT_FAULT_CRASH: {
      struct rlimit none = {0, 0};
      setrlimit(RLIMIT_CORE, &none);
      signal(SIGSEGV, SIG_DFL);
      raise(SIGSEGV);
      break;
    }
    case DT_FAULT_HANG:
      for (;;) pause();
    case DT_FAULT_SIGNAL: raise(SIGUSR1); break;
    case DT_FAULT_EXIT: _exit(1);
    case DT_FAULT_NAN:
    case DT_FAULT_OVERFLOW: return f->kind;
    case DT_FAULT_NONE: break;
  }
  return 0;
}
