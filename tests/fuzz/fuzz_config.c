/* fuzz_config: the YAML config reader, --set values and layer parameters (libFuzzer).
 * Input: YAML text, optionally followed by a line "#--set" and then one KEY=VALUE per line (at
 * most 8), applied as --set options. Every input must parse and build a model, or give an exit-2
 * error whose message names the place (the config file's FILE:LINE:COL, or --set KEY); none may
 * crash, hang, leak or trip a sanitizer. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config.h"
#include "model.h"

enum { MAX_SETS = 8 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  memcpy(text, data, size);
  text[size] = 0;
  char *sets[MAX_SETS];
  int n_sets = 0;
  char *marker = strstr(text, "\n#--set\n");
  if (marker) {
    *marker = 0;
    for (char *p = marker + 8; p && *p && n_sets < MAX_SETS;) {
      char *nl = strchr(p, '\n');
      if (nl) *nl = 0;
      sets[n_sets++] = p;
      p = nl ? nl + 1 : NULL;
    }
  }
  int fd = memfd_create("config.yaml", 0);
  if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) abort();
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  dt_config cfg;
  memset(&cfg, 0, sizeof cfg);
  dt_model m;
  memset(&m, 0, sizeof m);
  dt_status st = {0};
  if (!config_load(&cfg, path, sets, n_sets, &st)) model_build(&m, &cfg, &st);
  if (st.code && (st.code != DT_EXIT_INPUT || (!strstr(st.msg, path) && !strstr(st.msg, "--set")))) {
    fprintf(stderr, "fuzz_config: an error without exit code 2 or a place: code %d: %s\n", st.code, st.msg);
    abort();
  }
  model_free(&m);
  config_free(&cfg);
  close(fd);
  free(text);
  return 0;
}
