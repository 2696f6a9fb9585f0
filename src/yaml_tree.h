/* yaml_tree.h: a YAML document as a small tree of nodes that remember where they came from
 * (file:line:col, or the --set argument), so every later error can name its location. */
#ifndef DT_YAML_TREE_H
#define DT_YAML_TREE_H

#include "common.h"

typedef enum { DT_NODE_SCALAR, DT_NODE_SEQ, DT_NODE_MAP } dt_node_kind;

typedef struct dt_node {
  dt_node_kind kind;
  const char *origin;     /* borrowed: file name or "--set KEY"; lives as long as the tree's owner */
  int line, col;          /* 1-based; 0 when the node came from --set */
  char *scalar;           /* SCALAR only (owned) */
  int quoted;             /* SCALAR was quoted: always a string */
  int n;                  /* SEQ/MAP: number of children */
  struct dt_node **items; /* SEQ: items; MAP: values (owned) */
  char **keys;            /* MAP: keys (owned) */
  int *key_line, *key_col;
} dt_node;

/* Collections nested deeper than this are refused: the tree is walked recursively (a config needs a
 * handful of levels; tens of thousands overflowed the stack). */
#define DT_YAML_MAX_DEPTH 256

/* Parses text into a tree (caller frees with yaml_tree_free). origin names it in messages.
 * Returns NULL and sets st (exit 2) on a syntax error or a collection nested deeper than
 * DT_YAML_MAX_DEPTH. An empty document is an empty map. */
dt_node *yaml_tree_parse(const char *text, size_t len, const char *origin, dt_status *st);
void yaml_tree_free(dt_node *node);

/* Location text "FILE:LINE:COL" or "--set KEY" into buf; returns buf. */
const char *yaml_where(const dt_node *node, char *buf, size_t cap);

/* Map lookup; NULL when absent or when map is not a map. */
dt_node *yaml_map_get(const dt_node *map, const char *key);

/* Replaces or adds key in map, taking ownership of value. */
void yaml_map_set(dt_node *map, const char *key, dt_node *value);

dt_node *yaml_new_map(const char *origin);

/* Appends a flow-style YAML rendering of node to *out (growing it). */
void yaml_emit_flow(const dt_node *node, char **out, size_t *len, size_t *cap);

#endif
