#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"

static int mkdirs(const char *dir) {
  char buf[1024];
  dt_strlcpy(buf, dir, sizeof buf);
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = 0;
    if (mkdir(buf, 0775) && errno != EEXIST) return -1;
    *p = '/';
  }
  if (mkdir(buf, 0775) && errno != EEXIST) return -1;
  return 0;
}

int log_mkdirs(const char *dir, dt_status *st) {
  if (mkdirs(dir)) return dt_fail(st, DT_EXIT_IO, "%s: cannot create directory: %s", dir, strerror(errno));
  return 0;
}

int log_open(dt_log *lg, int enabled, const char *dir, int progress_mode, int append, dt_status *st) {
  memset(lg, 0, sizeof *lg);
  lg->enabled = enabled;
  if (!enabled) return 0;
  /* mpirun gives every rank a pty whatever its own stdout is (a file, a Slurm log), so auto
   * draws the bar only for a terminal outside a launcher */
  int launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("SLURM_JOB_ID");
  lg->progress =
      progress_mode == DT_PROGRESS_ON || (progress_mode == DT_PROGRESS_AUTO && isatty(STDOUT_FILENO) && !launched);
  if (!dir[0]) return 0;
  snprintf(lg->path, sizeof lg->path, "%s/metrics.jsonl", dir);
  if (log_mkdirs(dir, st)) return st->code;
  lg->metrics = fopen(lg->path, append ? "a" : "w");
  if (!lg->metrics) return dt_fail(st, DT_EXIT_IO, "%s: cannot open for writing: %s", lg->path, strerror(errno));
  return 0;
}

static void lost(dt_log *lg, int err) {
  dt_fail(&lg->st, DT_EXIT_IO, "%s: writing metrics failed: %s; the log misses lines from here on", lg->path,
          strerror(err ? err : EIO));
}

int log_finish(dt_log *lg, dt_status *st) {
  if (lg->metrics) {
    errno = 0;
    if (fclose(lg->metrics) != 0) lost(lg, errno);
    lg->metrics = NULL;
  }
  if (lg->st.code && !st->code) *st = lg->st;
  return st->code;
}

void log_close(dt_log *lg) {
  if (lg->bar_drawn) fputc('\n', stdout);
  if (lg->metrics) fclose(lg->metrics);
  lg->metrics = NULL;
}

static void clear_bar(dt_log *lg) {
  if (lg->bar_drawn) {
    fputs("\r\033[K", stdout);
    lg->bar_drawn = 0;
  }
}

void log_line(dt_log *lg, const char *fmt, ...) {
  if (!lg->enabled) return;
  clear_bar(lg);
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stdout, fmt, ap);
  va_end(ap);
  fputc('\n', stdout);
  fflush(stdout);
}

void log_metrics(dt_log *lg, const char *fmt, ...) {
  if (!lg->enabled || !lg->metrics || lg->st.code) return;
  errno = 0;
  int bad = fputc('{', lg->metrics) == EOF;
  va_list ap;
  va_start(ap, fmt);
  bad |= vfprintf(lg->metrics, fmt, ap) < 0;
  va_end(ap);
  bad |= fputs("}\n", lg->metrics) == EOF;
  bad |= fflush(lg->metrics) != 0;
  if (bad) lost(lg, errno);
}

void log_progress(dt_log *lg, int64_t step, int64_t total, double elapsed_s, double loss) {
  if (!lg->enabled || !lg->progress) return;
  int width = 30, fill = total > 0 ? (int)(width * step / total) : 0;
  double eta = step > 0 ? elapsed_s * (double)(total - step) / (double)step : 0;
  char bar[64];
  for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
  bar[width] = 0;
  fprintf(stdout, "\r[%s] %lld/%lld loss %.4f ETA %dm%02ds", bar, (long long)step, (long long)total, loss,
          (int)(eta / 60), (int)eta % 60);
  fflush(stdout);
  lg->bar_drawn = 1;
}
