/* log.h: rank 0's console lines, progress bar and metrics.jsonl. Other ranks hold a disabled
 * logger. Owns: the metrics file. */
#ifndef DT_LOG_H
#define DT_LOG_H

#include <stdio.h>

#include "common.h"

typedef struct {
  int enabled;  /* rank 0 only */
  int progress; /* draw a progress bar (stdout is a terminal) */
  FILE *metrics;
  char path[1100];
  int bar_drawn;
  dt_status st; /* the first metrics line lost (exit 5): nothing is written after it */
} dt_log;

/* Opens dir/metrics.jsonl (creating dir; appending when resuming). Exit 5 naming the path on failure. */
int log_open(dt_log *lg, int enabled, const char *dir, int progress_mode, int append, dt_status *st);
/* Closes metrics.jsonl; returns 0, or sets st (exit 5 naming the path) when a line was lost before or
 * the close failed. */
int log_finish(dt_log *lg, dt_status *st);
/* Ends the progress bar's line, and closes metrics.jsonl if log_finish did not. */
void log_close(dt_log *lg);
/* mkdir -p; exit 5 naming the directory on failure. */
int log_mkdirs(const char *dir, dt_status *st);

/* Console line (clears the progress bar first); printf-style. */
void log_line(dt_log *lg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* One JSON object per line; the text is the object's members without braces. A line that cannot be
 * written (a full disk) sets lg->st, for the next agreement of the ranks. */
void log_metrics(dt_log *lg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_progress(dt_log *lg, int64_t step, int64_t total, double elapsed_s, double loss);

#endif
