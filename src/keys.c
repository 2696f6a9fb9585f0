#include "keys.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *article(const char *noun) {
  return strchr("aeiou", noun[0]) ? "an" : "a";
}

const char *keys_type_name(const dt_key *key) {
  switch (key->type) {
    case DT_KEY_INT: return key->choices ? "integer or auto" : "integer";
    case DT_KEY_FLOAT: return "number";
    case DT_KEY_BOOL: return "boolean";
    case DT_KEY_STRING: return "string";
    case DT_KEY_ENUM: return key->choices;
    case DT_KEY_INTS: return "list of integers";
    case DT_KEY_FLOATS: return "list of numbers";
    case DT_KEY_DURATION: return "duration";
    case DT_KEY_NODE: return "YAML";
  }
  return "?";
}

int keys_edit_distance(const char *a, const char *b) {
  int la = (int)strlen(a), lb = (int)strlen(b);
  int *row = dt_malloc((size_t)(lb + 1) * sizeof(int));
  for (int j = 0; j <= lb; j++) row[j] = j;
  for (int i = 1; i <= la; i++) {
    int diag = row[0];
    row[0] = i;
    for (int j = 1; j <= lb; j++) {
      int up = row[j];
      int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      int best = diag + cost;
      if (row[j] + 1 < best) best = row[j] + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      row[j] = best;
      diag = up;
    }
  }
  int d = row[lb];
  free(row);
  return d;
}

/* "learning_rate" -> "lr": the initials of '_'-separated words. */
static void initials(const char *s, char *out, size_t cap) {
  size_t k = 0;
  int start = 1;
  for (; *s && k + 1 < cap; s++) {
    if (*s == '_' || *s == '.') {
      start = 1;
      continue;
    }
    if (start) out[k++] = *s;
    start = 0;
  }
  out[k] = 0;
}

static const char *last_part(const char *path) {
  const char *dot = strrchr(path, '.');
  return dot ? dot + 1 : path;
}

const char *keys_suggest(const char *unknown, const char *const *candidates, int n) {
  const char *best = NULL;
  int best_d = 1 << 30;
  char ini_u[64], ini_c[64];
  initials(last_part(unknown), ini_u, sizeof ini_u);
  for (int i = 0; i < n; i++) {
    int d = keys_edit_distance(unknown, candidates[i]);
    initials(last_part(candidates[i]), ini_c, sizeof ini_c);
    /* An abbreviation (lr for learning_rate) counts as a near miss. */
    if (strcmp(ini_u, last_part(candidates[i])) == 0 || strcmp(ini_c, last_part(unknown)) == 0) d = d < 2 ? d : 2;
    if (d < best_d) {
      best_d = d;
      best = candidates[i];
    }
  }
  int limit = (int)strlen(last_part(unknown)) / 2;
  if (limit < 2) limit = 2;
  return best_d <= limit ? best : NULL;
}

/* An integer as YAML 1.2's core schema reads one: decimal with an optional sign, leading zeros
 * included (010 is ten, not YAML 1.1's octal eight), 0o octal, 0x hexadecimal. */
static int parse_int(const char *s, int64_t *v) {
  int base = 10;
  const char *digits = s;
  if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
    base = 16, digits = s + 2;
  else if (s[0] == '0' && s[1] == 'o')
    base = 8, digits = s + 2;
  if (!isalnum((unsigned char)digits[0]) && !(base == 10 && (digits[0] == '-' || digits[0] == '+'))) return 0;
  char *end;
  errno = 0;
  long long x = strtoll(digits, &end, base);
  if (errno || end == digits || *end) return 0;
  *v = (int64_t)x;
  return 1;
}

static int parse_float(const char *s, double *v) {
  char *end;
  errno = 0;
  double x = strtod(s, &end);
  if (errno || end == s || *end || !isfinite(x)) return 0;
  *v = x;
  return 1;
}

static int parse_bool(const char *s, int *v) {
  static const char *yes[] = {"true", "True", "TRUE", "yes", "on", "1"};
  static const char *no[] = {"false", "False", "FALSE", "no", "off", "0"};
  for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
    if (!strcmp(s, yes[i])) return *v = 1, 1;
  for (size_t i = 0; i < sizeof no / sizeof *no; i++)
    if (!strcmp(s, no[i])) return *v = 0, 1;
  return 0;
}

/* "3h50m", "90s", "1h30m15s", "45" (seconds). */
static int parse_duration(const char *s, double *v) {
  double total = 0, num;
  if (parse_float(s, &num) && num >= 0) return *v = num, 1;
  const char *p = s;
  int parts = 0;
  while (*p) {
    char *end;
    errno = 0;
    num = strtod(p, &end);
    if (end == p || errno || num < 0) return 0;
    double unit = 0;
    switch (*end) {
      case 'd': unit = 86400; break;
      case 'h': unit = 3600; break;
      case 'm': unit = 60; break;
      case 's': unit = 1; break;
      default: return 0;
    }
    total += num * unit;
    p = end + 1;
    parts++;
  }
  if (!parts) return 0;
  *v = total;
  return 1;
}

static int enum_index(const char *choices, const char *s) {
  int idx = 0;
  size_t n = strlen(s);
  for (const char *c = choices;; idx++) {
    const char *bar = strchr(c, '|');
    size_t len = bar ? (size_t)(bar - c) : strlen(c);
    if (len == n && !strncmp(c, s, n)) return idx;
    if (!bar) return -1;
    c = bar + 1;
  }
}

static void enum_name(const char *choices, int idx, char *out, size_t cap) {
  const char *c = choices;
  for (int i = 0; i < idx; i++) c = strchr(c, '|') + 1;
  const char *bar = strchr(c, '|');
  size_t len = bar ? (size_t)(bar - c) : strlen(c);
  if (len >= cap) len = cap - 1;
  memcpy(out, c, len);
  out[len] = 0;
}

static int bounded(const dt_key *k) {
  return k->min <= k->max;
}

void keys_bounds_text(const dt_key *k, char *buf, size_t cap) {
  if (!bounded(k))
    buf[0] = 0;
  else if (k->max >= 1e300)
    snprintf(buf, cap, " >= %g", k->min);
  else
    snprintf(buf, cap, " in [%g, %g]", k->min, k->max);
}

static int set_value(const dt_key *k, void *dst, const dt_node *node, const char *prefix, dt_status *st) {
  char where[512], bt[96];
  char *field = (char *)dst + k->offset;
  keys_bounds_text(k, bt, sizeof bt);
  if (node)
    yaml_where(node, where, sizeof where);
  else
    snprintf(where, sizeof where, "default");
  if (k->type == DT_KEY_NODE) {
    *(const dt_node **)field = node;
    return 0;
  }
  if (k->type == DT_KEY_INTS || k->type == DT_KEY_FLOATS) {
    dt_list *list = (dt_list *)field;
    list->n = 0;
    if (!node) return 0;
    if (node->kind != DT_NODE_SEQ)
      return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected %s %s, got %s", where, prefix, k->path,
                     article(keys_type_name(k)), keys_type_name(k), node->kind == DT_NODE_MAP ? "a map" : node->scalar);
    if (node->n > DT_MAX_LIST)
      return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: at most %d items", where, prefix, k->path, DT_MAX_LIST);
    for (int i = 0; i < node->n; i++) {
      const dt_node *it = node->items[i];
      double v;
      int64_t iv;
      int ok =
          it->kind == DT_NODE_SCALAR && (k->type == DT_KEY_INTS ? (parse_int(it->scalar, &iv) && ((v = (double)iv), 1))
                                                                : parse_float(it->scalar, &v));
      if (ok && bounded(k) && (v < k->min || v > k->max)) ok = 0;
      if (!ok) {
        char w2[512];
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s[%d]: expected %s%s, got %s", yaml_where(it, w2, sizeof w2), prefix,
                       k->path, i, k->type == DT_KEY_INTS ? "an integer" : "a number", bt,
                       it->kind == DT_NODE_SCALAR ? it->scalar : "a collection");
      }
      list->v[list->n++] = v;
    }
    return 0;
  }
  if (!node) return 0;
  if (node->kind != DT_NODE_SCALAR)
    return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected %s %s, got a %s", where, prefix, k->path,
                   article(keys_type_name(k)), keys_type_name(k), node->kind == DT_NODE_MAP ? "map" : "list");
  const char *s = node->scalar;
  switch (k->type) {
    case DT_KEY_INT: {
      int64_t v;
      if (k->choices && !strcmp(s, "auto")) {
        *(int64_t *)field = -1;
        return 0;
      }
      if (!parse_int(s, &v) || (bounded(k) && (v < k->min || v > k->max)))
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected an integer%s%s, got '%s'", where, prefix, k->path, bt,
                       k->choices ? " or auto" : "", s);
      *(int64_t *)field = v;
      return 0;
    }
    case DT_KEY_FLOAT: {
      double v;
      if (!parse_float(s, &v) || (bounded(k) && (v < k->min || v > k->max)))
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected a number%s, got '%s'", where, prefix, k->path, bt, s);
      *(double *)field = v;
      return 0;
    }
    case DT_KEY_DURATION: {
      double v;
      if (!parse_duration(s, &v))
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected a duration such as 3h50m, 90m or 45s, got '%s'", where,
                       prefix, k->path, s);
      *(double *)field = v;
      return 0;
    }
    case DT_KEY_BOOL: {
      int v;
      if (!parse_bool(s, &v))
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected true or false, got '%s'", where, prefix, k->path, s);
      *(int *)field = v;
      return 0;
    }
    case DT_KEY_STRING:
      free(*(char **)field);
      *(char **)field = dt_strdup(s);
      return 0;
    case DT_KEY_ENUM: {
      int idx = enum_index(k->choices, s);
      if (idx < 0)
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected one of %s, got '%s'", where, prefix, k->path, k->choices,
                       s);
      *(int *)field = idx;
      return 0;
    }
    default: DT_ASSERT(0);
  }
  return 0;
}

static const dt_key *find_key(const dt_key *table, int n, const char *path) {
  for (int i = 0; i < n; i++)
    if (!strcmp(table[i].path, path)) return &table[i];
  return NULL;
}

static int is_prefix_of_some(const dt_key *table, int n, const char *path) {
  size_t len = strlen(path);
  for (int i = 0; i < n; i++)
    if (!strncmp(table[i].path, path, len) && table[i].path[len] == '.') return 1;
  return 0;
}

/* Walks map at path prefix base; marks seen keys. */
static int walk(const dt_key *table, int n, void *dst, const dt_node *map, const char *base, const char *prefix,
                const char *what, int *seen, dt_status *st) {
  for (int i = 0; i < map->n; i++) {
    char path[256];
    snprintf(path, sizeof path, "%s%s%s", base, *base ? "." : "", map->keys[i]);
    const dt_key *k = find_key(table, n, path);
    const dt_node *v = map->items[i];
    if (k) {
      seen[k - table] = 1;
      if (set_value(k, dst, v, prefix, st)) return st->code;
      continue;
    }
    if (is_prefix_of_some(table, n, path)) {
      if (v->kind != DT_NODE_MAP) {
        char where[512];
        yaml_where(v, where, sizeof where);
        return dt_fail(st, DT_EXIT_INPUT, "%s: %s%s: expected a map of settings", where, prefix, path);
      }
      if (walk(table, n, dst, v, path, prefix, what, seen, st)) return st->code;
      continue;
    }
    /* candidates at the same depth under the same parent: keys, or section names */
    char(*cbuf)[256] = dt_calloc((size_t)n, sizeof *cbuf);
    const char **cands = dt_malloc((size_t)n * sizeof *cands);
    int nc = 0;
    size_t blen = strlen(base);
    for (int j = 0; j < n; j++) {
      const char *p = table[j].path;
      if (blen && (strncmp(p, base, blen) || p[blen] != '.')) continue;
      const char *rest = p + blen + (blen ? 1 : 0);
      const char *dot = strchr(rest, '.');
      size_t len = dot ? (size_t)(dot - p) : strlen(p);
      if (len >= sizeof cbuf[0]) continue;
      memcpy(cbuf[nc], p, len);
      cbuf[nc][len] = 0;
      int dup = 0;
      for (int q = 0; q < nc && !dup; q++) dup = !strcmp(cbuf[q], cbuf[nc]);
      if (!dup) cands[nc] = cbuf[nc], nc++;
    }
    const char *near = keys_suggest(path, cands, nc);
    char where[512];
    if (map->key_line[i] > 0)
      snprintf(where, sizeof where, "%s:%d:%d", map->origin, map->key_line[i], map->key_col[i]);
    else
      yaml_where(v, where, sizeof where);
    if (near)
      dt_fail(st, DT_EXIT_INPUT, "%s: unknown %s '%s%s'; did you mean '%s%s'?", where, what, prefix, path, prefix,
              near);
    else
      dt_fail(st, DT_EXIT_INPUT, "%s: unknown %s '%s%s'", where, what, prefix, path);
    free(cands);
    free(cbuf);
    return st->code;
  }
  return 0;
}

int keys_read(const dt_key *table, int n, void *dst, const dt_node *map, const dt_node *at, const char *prefix,
              const char *what, dt_status *st) {
  int *seen = dt_calloc((size_t)n, sizeof(int));
  /* Defaults first, parsed from their YAML text with the same code as user values. */
  for (int i = 0; i < n && !st->code; i++) {
    const dt_key *k = &table[i];
    if (!k->deflt) continue;
    dt_node *d = yaml_tree_parse(k->deflt, strlen(k->deflt), "default", st);
    DT_ASSERT(d); /* a table default that does not parse is a bug */
    if (d->kind == DT_NODE_MAP && d->n == 0 && k->type != DT_KEY_NODE) {
      yaml_tree_free(d);
      continue;
    }
    if (k->type == DT_KEY_NODE) {
      *(const dt_node **)((char *)dst + k->offset) = NULL;
      yaml_tree_free(d);
      continue;
    }
    set_value(k, dst, d, prefix, st);
    yaml_tree_free(d);
    DT_ASSERT(!st->code);
  }
  if (map && map->kind != DT_NODE_MAP) {
    char where[512];
    free(seen);
    return dt_fail(st, DT_EXIT_INPUT, "%s: %s: expected a map of settings", yaml_where(map, where, sizeof where),
                   prefix[0] ? prefix : "config");
  }
  if (map && walk(table, n, dst, map, "", prefix, what, seen, st)) {
    free(seen);
    return st->code;
  }
  for (int i = 0; i < n; i++) {
    if (!table[i].deflt && !seen[i]) {
      char where[512] = "config";
      if (map || at) yaml_where(map ? map : at, where, sizeof where);
      free(seen);
      return dt_fail(st, DT_EXIT_INPUT, "%s: missing required %s '%s%s' (%s)", where, what, prefix, table[i].path,
                     table[i].doc);
    }
  }
  free(seen);
  return 0;
}

void keys_free(const dt_key *table, int n, void *dst) {
  for (int i = 0; i < n; i++) {
    if (table[i].type != DT_KEY_STRING) continue;
    char **f = (char **)((char *)dst + table[i].offset);
    free(*f);
    *f = NULL;
  }
}

void keys_dump(const dt_key *table, int n, const void *src, const char *prefix, char **out, size_t *len, size_t *cap) {
  for (int i = 0; i < n; i++) {
    const dt_key *k = &table[i];
    const char *field = (const char *)src + k->offset;
    char val[1024] = "";
    size_t vl = 0;
    switch (k->type) {
      case DT_KEY_INT:
        if (k->choices && *(const int64_t *)field == -1)
          snprintf(val, sizeof val, "auto");
        else
          snprintf(val, sizeof val, "%lld", (long long)*(const int64_t *)field);
        break;
      case DT_KEY_FLOAT:
      case DT_KEY_DURATION: snprintf(val, sizeof val, "%.17g", *(const double *)field); break;
      case DT_KEY_BOOL: snprintf(val, sizeof val, "%s", *(const int *)field ? "true" : "false"); break;
      case DT_KEY_STRING: {
        const char *s = *(char *const *)field;
        snprintf(val, sizeof val, "\"%s\"", s ? s : "");
        break;
      }
      case DT_KEY_ENUM: enum_name(k->choices, *(const int *)field, val, sizeof val); break;
      case DT_KEY_INTS:
      case DT_KEY_FLOATS: {
        const dt_list *l = (const dt_list *)field;
        vl += (size_t)snprintf(val + vl, sizeof val - vl, "[");
        for (int j = 0; j < l->n; j++)
          vl += (size_t)snprintf(val + vl, sizeof val - vl, "%s%.17g", j ? ", " : "", l->v[j]);
        snprintf(val + vl, sizeof val - vl, "]");
        break;
      }
      case DT_KEY_NODE: {
        const dt_node *node = *(const dt_node *const *)field;
        char *flow = NULL;
        size_t fl = 0, fc = 0;
        yaml_emit_flow(node, &flow, &fl, &fc);
        char line[256];
        snprintf(line, sizeof line, "%s%s: ", prefix, k->path);
        size_t need = strlen(line) + fl + 2;
        if (*len + need + 1 > *cap) {
          *cap = (*len + need + 1) * 2;
          *out = dt_realloc(*out, *cap);
        }
        *len += (size_t)snprintf(*out + *len, *cap - *len, "%s%s\n", line, flow);
        free(flow);
        continue;
      }
    }
    size_t need = strlen(prefix) + strlen(k->path) + strlen(val) + 4;
    if (*len + need + 1 > *cap) {
      *cap = (*len + need + 1) * 2;
      *out = dt_realloc(*out, *cap);
    }
    *len += (size_t)snprintf(*out + *len, *cap - *len, "%s%s: %s\n", prefix, k->path, val);
  }
}
