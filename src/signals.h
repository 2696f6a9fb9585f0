/* signals.h: SIGUSR1 and SIGTERM only set a flag; the training loop reads it at each step
 * boundary and all ranks agree to stop at the same step (train_step.c step_agree). Installed
 * first thing in a training run, so a signal during start-up stops the run after step 1; the
 * other modes (--dry-run, --info, --predict, --sample) keep the default actions.
 * The flag is the one process-wide variable of ddp_train: a signal handler has nowhere else to
 * write. */
#ifndef DT_SIGNALS_H
#define DT_SIGNALS_H

void signals_install(void);
/* The signal number caught since start-up, or 0. */
int signals_caught(void);

#endif
