/* memory.c: the measured peak of a rank's run (memory.h). */
#include "memory.h"

#include <stdio.h>
#include <string.h>

/* VmRSS and VmHWM of this process in bytes; 0 when /proc/self/status cannot be read. */
static int read_status(size_t *rss, size_t *hwm) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kib;
  int found = 0;
  while (fgets(line, sizeof line, f)) {
    if (sscanf(line, "VmRSS: %llu kB", &kib) == 1) *rss = (size_t)kib << 10, found |= 1;
    if (sscanf(line, "VmHWM: %llu kB", &kib) == 1) *hwm = (size_t)kib << 10, found |= 2;
  }
  fclose(f);
  return found == 3;
}

void memory_watch_start(dt_memory_watch *w) {
  memset(w, 0, sizeof *w);
  size_t rss = 0, hwm = 0;
  /* "5" resets the peak resident set to the current one (Linux 4.0 and later; proc(5)) */
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (f) {
    w->reset = fputs("5", f) >= 0;
    w->reset = fclose(f) == 0 && w->reset;
  }
  w->ok = read_status(&rss, &hwm);
  w->rss_base = rss;
}

size_t memory_watch_peak(const dt_memory_watch *w, const dt_backend *be) {
  if (!be->host_memory) return be->mem_peak;
  size_t rss = 0, hwm = 0;
  if (!w->ok || !read_status(&rss, &hwm)) return 0;
  return hwm > w->rss_base ? hwm - w->rss_base : 0;
}

const char *memory_watch_kind(const dt_backend *be) {
  return be->host_memory ? "host RSS" : "device";
}
