/* tokenize_ids: the binary's tokenizer (src/tokenizer.c) from the command line, for test_text.py.
 *   tokenize_ids DATA.h5 VOCAB_SIZE encode < lines   each line (JSON-escaped by the caller: \n, \\)
 *                                                    as its token ids, one line of ids per line
 *   tokenize_ids DATA.h5 VOCAB_SIZE decode < ids     each line of ids as bytes, then a NUL byte
 * Exit 2 with ddp_train's message where the tokenizer refuses a line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

/* Undoes the caller's escapes: "\n" -> newline, "\\" -> backslash. */
static void unescape(char *s) {
  char *o = s;
  for (char *p = s; *p; p++) {
    if (*p == '\\' && p[1] == 'n')
      *o++ = '\n', p++;
    else if (*p == '\\' && p[1] == '\\')
      *o++ = '\\', p++;
    else
      *o++ = *p;
  }
  *o = 0;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: tokenize_ids DATA.h5 VOCAB_SIZE encode|decode\n");
    return 2;
  }
  dt_status st = {0};
  dt_vocab v;
  int rc = vocab_read(&v, argv[1], atoll(argv[2]), &st);
  if (rc) {
    fprintf(stderr, "tokenize_ids: %s\n", rc == 1 ? "no /vocab" : st.msg);
    return 2;
  }
  char *line = NULL;
  size_t cap = 0;
  ssize_t got;
  while ((got = getline(&line, &cap, stdin)) > 0) {
    if (line[got - 1] == '\n') line[got - 1] = 0;
    if (!strcmp(argv[3], "encode")) {
      unescape(line);
      int32_t *ids;
      int64_t n;
      if (vocab_encode(&v, line, &ids, &n, &st)) {
        printf("error: %s\n", st.msg);
        st = (dt_status){0};
        continue;
      }
      for (int64_t i = 0; i < n; i++) printf("%s%d", i ? " " : "", ids[i]);
      printf("\n");
      free(ids);
    } else {
      for (char *p = line, *end; *p; p = end) {
        long id = strtol(p, &end, 10);
        if (end == p) break;
        vocab_write(&v, (int32_t)id, stdout);
      }
      fputc(0, stdout);
    }
  }
  free(line);
  vocab_free(&v);
  return 0;
}
