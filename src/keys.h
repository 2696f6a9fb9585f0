/* keys.h: typed key tables. A table declares each key once (dotted path, type, bounds, default,
 * doc) with its offset in a C struct; keys_read fills the struct from a YAML map, reporting
 * unknown keys with the nearest valid one, wrong types and out-of-range values with locations.
 * Used for the config sections and for each layer's parameters. */
#ifndef DT_KEYS_H
#define DT_KEYS_H

#include <stddef.h>

#include "common.h"
#include "yaml_tree.h"

#define DT_MAX_LIST 16

/* A list value: INTS and FLOATS keys. */
typedef struct {
  int n;
  double v[DT_MAX_LIST];
} dt_list;

typedef enum {
  DT_KEY_INT,      /* int64_t; with choices "auto", the word auto too, stored as -1 */
  DT_KEY_FLOAT,    /* double */
  DT_KEY_BOOL,     /* int (0/1) */
  DT_KEY_STRING,   /* char * (owned by the struct; freed by keys_free) */
  DT_KEY_ENUM,     /* int: index into choices "a|b|c" */
  DT_KEY_INTS,     /* dt_list of integers */
  DT_KEY_FLOATS,   /* dt_list */
  DT_KEY_DURATION, /* double seconds; "3h50m", "90s", "1h", or a number of seconds */
  DT_KEY_NODE      /* const dt_node * (borrowed from the tree); validated by its user */
} dt_key_type;

typedef struct {
  const char *path; /* dotted, relative to the map given to keys_read */
  dt_key_type type;
  size_t offset;       /* offsetof in the target struct */
  const char *deflt;   /* default as YAML text; NULL: required */
  double min, max;     /* bounds for INT/FLOAT (and list items); min > max: unbounded */
  const char *choices; /* ENUM: "a|b|c"; INT: "auto" where it takes auto, else NULL */
  const char *doc;
} dt_key;

/* Fills dst from map (may be NULL: all defaults). at: the node whose place a message names when
 * map is NULL (a bare `- conv2d` missing its required `out`); NULL for none. prefix ("train." or
 * "layer 3 conv2d: ") is put before key names in messages. Returns 0 or sets st (exit 2). */
int keys_read(const dt_key *table, int n, void *dst, const dt_node *map, const dt_node *at, const char *prefix,
              const char *what, dt_status *st);

/* Frees the STRING fields of dst. */
void keys_free(const dt_key *table, int n, void *dst);

/* Appends "path: value\n" for every key (the effective values, canonical text). */
void keys_dump(const dt_key *table, int n, const void *src, const char *prefix, char **out, size_t *len, size_t *cap);

/* " >= 0" or " in [0, 1]" for bounded INT/FLOAT keys, "" otherwise. */
void keys_bounds_text(const dt_key *key, char *buf, size_t cap);

/* Name of a key type for docs and messages. */
const char *keys_type_name(const dt_key *key);

/* Levenshtein distance (for suggestions). */
int keys_edit_distance(const char *a, const char *b);

/* The best suggestion for an unknown name among candidates; NULL when none is close. */
const char *keys_suggest(const char *unknown, const char *const *candidates, int n);

#endif
