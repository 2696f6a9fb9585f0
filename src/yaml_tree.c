#include "yaml_tree.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

static dt_node *node_new(dt_node_kind kind, const char *origin, const yaml_mark_t *mark) {
  dt_node *n = dt_calloc(1, sizeof *n);
  n->kind = kind;
  n->origin = origin;
  if (mark) {
    n->line = (int)mark->line + 1;
    n->col = (int)mark->column + 1;
  }
  return n;
}

dt_node *yaml_new_map(const char *origin) {
  return node_new(DT_NODE_MAP, origin, NULL);
}

void yaml_tree_free(dt_node *node) {
  if (!node) return;
  for (int i = 0; i < node->n; i++) {
    yaml_tree_free(node->items[i]);
    if (node->keys) free(node->keys[i]);
  }
  free(node->items);
  free(node->keys);
  free(node->key_line);
  free(node->key_col);
  free(node->scalar);
  free(node);
}

const char *yaml_where(const dt_node *node, char *buf, size_t cap) {
  if (node->line > 0)
    snprintf(buf, cap, "%s:%d:%d", node->origin, node->line, node->col);
  else
    snprintf(buf, cap, "%s", node->origin);
  return buf;
}

dt_node *yaml_map_get(const dt_node *map, const char *key) {
  if (!map || map->kind != DT_NODE_MAP) return NULL;
  for (int i = 0; i < map->n; i++)
    if (strcmp(map->keys[i], key) == 0) return map->items[i];
  return NULL;
}

static void map_push(dt_node *map, char *key, int line, int col, dt_node *value) {
  map->items = dt_realloc(map->items, (size_t)(map->n + 1) * sizeof *map->items);
  map->keys = dt_realloc(map->keys, (size_t)(map->n + 1) * sizeof *map->keys);
  map->key_line = dt_realloc(map->key_line, (size_t)(map->n + 1) * sizeof(int));
  map->key_col = dt_realloc(map->key_col, (size_t)(map->n + 1) * sizeof(int));
  map->items[map->n] = value;
  map->keys[map->n] = key;
  map->key_line[map->n] = line;
  map->key_col[map->n] = col;
  map->n++;
}

void yaml_map_set(dt_node *map, const char *key, dt_node *value) {
  DT_ASSERT(map->kind == DT_NODE_MAP);
  for (int i = 0; i < map->n; i++) {
    if (strcmp(map->keys[i], key) == 0) {
      yaml_tree_free(map->items[i]);
      map->items[i] = value;
      return;
    }
  }
  map_push(map, dt_strdup(key), value->line, value->col, value);
}

/* Recursive descent over libyaml events, depth levels deep (the document's top node: 1). Returns
 * NULL with st set on error. */
static dt_node *parse_node(yaml_parser_t *p, yaml_event_t *ev, const char *origin, int depth, dt_status *st);

static int next_event(yaml_parser_t *p, yaml_event_t *ev, const char *origin, dt_status *st) {
  if (yaml_parser_parse(p, ev)) return 1;
  dt_fail(st, DT_EXIT_INPUT, "%s:%zu:%zu: YAML syntax error: %s%s%s", origin, p->problem_mark.line + 1,
          p->problem_mark.column + 1, p->problem ? p->problem : "unknown problem", p->context ? " " : "",
          p->context ? p->context : "");
  return 0;
}

static dt_node *parse_node(yaml_parser_t *p, yaml_event_t *ev, const char *origin, int depth, dt_status *st) {
  if (depth > DT_YAML_MAX_DEPTH && (ev->type == YAML_SEQUENCE_START_EVENT || ev->type == YAML_MAPPING_START_EVENT)) {
    dt_fail(st, DT_EXIT_INPUT, "%s:%zu:%zu: YAML nested more than %d levels deep", origin, ev->start_mark.line + 1,
            ev->start_mark.column + 1, DT_YAML_MAX_DEPTH);
    yaml_event_delete(ev);
    return NULL;
  }
  switch (ev->type) {
    case YAML_SCALAR_EVENT: {
      dt_node *n = node_new(DT_NODE_SCALAR, origin, &ev->start_mark);
      n->scalar = dt_strdup((const char *)ev->data.scalar.value);
      n->quoted = ev->data.scalar.style == YAML_SINGLE_QUOTED_SCALAR_STYLE ||
                  ev->data.scalar.style == YAML_DOUBLE_QUOTED_SCALAR_STYLE;
      yaml_event_delete(ev);
      return n;
    }
    case YAML_SEQUENCE_START_EVENT: {
      dt_node *n = node_new(DT_NODE_SEQ, origin, &ev->start_mark);
      yaml_event_delete(ev);
      for (;;) {
        yaml_event_t child;
        if (!next_event(p, &child, origin, st)) goto fail_seq;
        if (child.type == YAML_SEQUENCE_END_EVENT) {
          yaml_event_delete(&child);
          return n;
        }
        dt_node *item = parse_node(p, &child, origin, depth + 1, st);
        if (!item) goto fail_seq;
        n->items = dt_realloc(n->items, (size_t)(n->n + 1) * sizeof *n->items);
        n->items[n->n++] = item;
      }
    fail_seq:
      yaml_tree_free(n);
      return NULL;
    }
    case YAML_MAPPING_START_EVENT: {
      dt_node *n = node_new(DT_NODE_MAP, origin, &ev->start_mark);
      yaml_event_delete(ev);
      for (;;) {
        yaml_event_t kev;
        if (!next_event(p, &kev, origin, st)) goto fail_map;
        if (kev.type == YAML_MAPPING_END_EVENT) {
          yaml_event_delete(&kev);
          return n;
        }
        if (kev.type != YAML_SCALAR_EVENT) {
          dt_fail(st, DT_EXIT_INPUT, "%s:%zu:%zu: a map key must be a plain scalar", origin, kev.start_mark.line + 1,
                  kev.start_mark.column + 1);
          yaml_event_delete(&kev);
          goto fail_map;
        }
        char *key = dt_strdup((const char *)kev.data.scalar.value);
        int kl = (int)kev.start_mark.line + 1, kc = (int)kev.start_mark.column + 1;
        yaml_event_delete(&kev);
        if (yaml_map_get(n, key)) {
          dt_fail(st, DT_EXIT_INPUT, "%s:%d:%d: duplicate key '%s'", origin, kl, kc, key);
          free(key);
          goto fail_map;
        }
        yaml_event_t vev;
        if (!next_event(p, &vev, origin, st)) {
          free(key);
          goto fail_map;
        }
        dt_node *value = parse_node(p, &vev, origin, depth + 1, st);
        if (!value) {
          free(key);
          goto fail_map;
        }
        map_push(n, key, kl, kc, value);
      }
    fail_map:
      yaml_tree_free(n);
      return NULL;
    }
    case YAML_ALIAS_EVENT:
      dt_fail(st, DT_EXIT_INPUT, "%s:%zu:%zu: YAML aliases are not supported", origin, ev->start_mark.line + 1,
              ev->start_mark.column + 1);
      yaml_event_delete(ev);
      return NULL;
    default:
      dt_fail(st, DT_EXIT_INPUT, "%s:%zu:%zu: unexpected YAML event", origin, ev->start_mark.line + 1,
              ev->start_mark.column + 1);
      yaml_event_delete(ev);
      return NULL;
  }
}

dt_node *yaml_tree_parse(const char *text, size_t len, const char *origin, dt_status *st) {
  yaml_parser_t p;
  if (!yaml_parser_initialize(&p)) {
    dt_fail(st, DT_EXIT_INPUT, "%s: libyaml could not initialise a parser", origin);
    return NULL;
  }
  yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
  dt_node *root = NULL;
  yaml_event_t ev;
  /* STREAM_START, then DOCUMENT_START or STREAM_END (empty input). */
  if (!next_event(&p, &ev, origin, st)) goto done;
  yaml_event_delete(&ev);
  if (!next_event(&p, &ev, origin, st)) goto done;
  if (ev.type == YAML_STREAM_END_EVENT) {
    yaml_event_delete(&ev);
    root = yaml_new_map(origin);
    goto done;
  }
  yaml_event_delete(&ev); /* DOCUMENT_START */
  if (!next_event(&p, &ev, origin, st)) goto done;
  root = parse_node(&p, &ev, origin, 1, st);
  if (!root) goto done;
  if (!next_event(&p, &ev, origin, st)) goto fail;
  yaml_event_delete(&ev); /* DOCUMENT_END */
  if (!next_event(&p, &ev, origin, st)) goto fail;
  if (ev.type != YAML_STREAM_END_EVENT) {
    dt_fail(st, DT_EXIT_INPUT, "%s:%zu:%zu: only one YAML document is allowed", origin, ev.start_mark.line + 1,
            ev.start_mark.column + 1);
    yaml_event_delete(&ev);
    goto fail;
  }
  yaml_event_delete(&ev);
  goto done;
fail:
  yaml_tree_free(root);
  root = NULL;
done:
  yaml_parser_delete(&p);
  return root;
}

static void append(char **out, size_t *len, size_t *cap, const char *s) {
  size_t n = strlen(s);
  if (*len + n + 1 > *cap) {
    *cap = (*len + n + 1) * 2;
    *out = dt_realloc(*out, *cap);
  }
  memcpy(*out + *len, s, n + 1);
  *len += n;
}

void yaml_emit_flow(const dt_node *node, char **out, size_t *len, size_t *cap) {
  if (!node) {
    append(out, len, cap, "null");
    return;
  }
  switch (node->kind) {
    case DT_NODE_SCALAR:
      if (node->quoted) append(out, len, cap, "\"");
      append(out, len, cap, node->scalar);
      if (node->quoted) append(out, len, cap, "\"");
      break;
    case DT_NODE_SEQ:
      append(out, len, cap, "[");
      for (int i = 0; i < node->n; i++) {
        if (i) append(out, len, cap, ", ");
        yaml_emit_flow(node->items[i], out, len, cap);
      }
      append(out, len, cap, "]");
      break;
    case DT_NODE_MAP:
      append(out, len, cap, "{");
      for (int i = 0; i < node->n; i++) {
        if (i) append(out, len, cap, ", ");
        append(out, len, cap, node->keys[i]);
        append(out, len, cap, ": ");
        yaml_emit_flow(node->items[i], out, len, cap);
      }
      append(out, len, cap, "}");
      break;
  }
}
