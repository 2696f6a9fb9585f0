#include "signals.h"

#include <signal.h>
#include <string.h>

static volatile sig_atomic_t caught_signal;

static void on_signal(int sig) {
  caught_signal = sig;
}

void signals_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
}

int signals_caught(void) {
  return caught_signal;
}
