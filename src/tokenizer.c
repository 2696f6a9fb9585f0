/* tokenizer.c: a data file's vocabulary, decoding and BPE encoding (tokenizer.h). */
#include "tokenizer.h"

#include <hdf5.h>
#include <stdlib.h>
#include <string.h>

#include "h5util.h"
#include "hash.h"
#include "unicode_classes.h"

/* ---- reading /vocab ---- */

/* Reads dataset name of f (rank `rank`, its total size into *count) as mem_type into a new buffer. */
static void *read_all(hid_t f, const char *path, const char *name, hid_t mem_type, size_t elem, int rank,
                      int64_t *count, dt_status *st) {
  char e[256];
  hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
  if (ds < 0) {
    dt_fail(st, DT_EXIT_INPUT, "%s: cannot open %s: %s (written by scripts/tokenize_text.py?)", path, name,
            h5_error_text(e, sizeof e));
    return NULL;
  }
  hid_t sp = H5Dget_space(ds);
  hsize_t dims[2] = {0, 0};
  int nd = H5Sget_simple_extent_ndims(sp);
  H5Sget_simple_extent_dims(sp, dims, NULL);
  H5Sclose(sp);
  void *buf = NULL;
  if (nd != rank) {
    dt_fail(st, DT_EXIT_INPUT, "%s: %s has %d dimensions, expected %d", path, name, nd, rank);
  } else {
    *count = (int64_t)dims[0] * (rank == 2 ? (int64_t)dims[1] : 1);
    buf = dt_malloc((size_t)(*count ? *count : 1) * elem);
    if (*count && H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) < 0) {
      dt_fail(st, DT_EXIT_INPUT, "%s: cannot read %s: %s", path, name, h5_error_text(e, sizeof e));
      free(buf);
      buf = NULL;
    }
  }
  H5Dclose(ds);
  return buf;
}

static uint64_t bytes_hash(const uint8_t *p, int64_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

static uint64_t pair_hash(int32_t a, int32_t b) {
  return dt_hash64(((uint64_t)(uint32_t)a << 32) | (uint32_t)b);
}

/* The rank of merge (a, b), or -1. */
static int64_t pair_rank(const dt_vocab *v, int32_t a, int32_t b) {
  if (!v->pair_cap) return -1;
  for (uint64_t h = pair_hash(a, b);; h++) {
    int64_t r = v->pair_slots[h & (uint64_t)(v->pair_cap - 1)];
    if (r < 0) return -1;
    if (v->merges[2 * r] == a && v->merges[2 * r + 1] == b) return r;
  }
}

/* The tables encoding needs: each byte's token, each merge's result (the token of the two joined),
 * the merges by pair. Exit 2 for a merge whose result is not a token. */
static int build_tables(dt_vocab *v, const char *path, dt_status *st) {
  for (int b = 0; b < 256; b++) v->byte_id[b] = -1;
  v->specials = dt_malloc((size_t)v->n * sizeof(int32_t));
  for (int64_t i = 0; i < v->n; i++)
    if (v->special[i]) v->specials[v->n_specials++] = (int32_t)i;
  int64_t cap = 1;
  while (cap < 2 * v->n) cap *= 2;
  int64_t *slots = dt_malloc((size_t)cap * sizeof(int64_t)); /* token bytes -> id, the first of equal ones */
  for (int64_t i = 0; i < cap; i++) slots[i] = -1;
  for (int64_t i = 0; i < v->n; i++) {
    if (v->special[i]) continue;
    const uint8_t *p = v->bytes + v->offsets[i];
    const int64_t len = v->offsets[i + 1] - v->offsets[i];
    if (len == 1 && v->byte_id[p[0]] < 0) v->byte_id[p[0]] = (int32_t)i;
    for (uint64_t h = bytes_hash(p, len);; h++) {
      int64_t *s = &slots[h & (uint64_t)(cap - 1)];
      if (*s < 0) {
        *s = i;
        break;
      }
      if (v->offsets[*s + 1] - v->offsets[*s] == len && !memcmp(v->bytes + v->offsets[*s], p, (size_t)len)) break;
    }
  }
  v->merged = dt_malloc((size_t)(v->n_merges ? v->n_merges : 1) * sizeof(int32_t));
  uint8_t *joined = NULL;
  size_t joined_cap = 0;
  for (int64_t r = 0; r < v->n_merges && !st->code; r++) {
    const int32_t a = v->merges[2 * r], b = v->merges[2 * r + 1];
    const int64_t la = v->offsets[a + 1] - v->offsets[a], lb = v->offsets[b + 1] - v->offsets[b];
    if ((size_t)(la + lb) > joined_cap) joined = dt_realloc(joined, joined_cap = (size_t)(la + lb) * 2);
    memcpy(joined, v->bytes + v->offsets[a], (size_t)la);
    memcpy(joined + la, v->bytes + v->offsets[b], (size_t)lb);
    v->merged[r] = -1;
    for (uint64_t h = bytes_hash(joined, la + lb);; h++) {
      int64_t s = slots[h & (uint64_t)(cap - 1)];
      if (s < 0) break;
      if (v->offsets[s + 1] - v->offsets[s] == la + lb &&
          !memcmp(v->bytes + v->offsets[s], joined, (size_t)(la + lb))) {
        v->merged[r] = (int32_t)s;
        break;
      }
    }
    if (v->merged[r] < 0)
      dt_fail(st, DT_EXIT_INPUT, "%s: /vocab/merges[%lld] joins tokens %d and %d into bytes that are no token", path,
              (long long)r, a, b);
  }
  free(joined);
  free(slots);
  v->pair_cap = 1;
  while (v->pair_cap < 2 * v->n_merges + 2) v->pair_cap *= 2;
  v->pair_slots = dt_malloc((size_t)v->pair_cap * sizeof(int64_t));
  for (int64_t i = 0; i < v->pair_cap; i++) v->pair_slots[i] = -1;
  for (int64_t r = 0; r < v->n_merges; r++) { /* the lower rank wins a repeated pair */
    if (pair_rank(v, v->merges[2 * r], v->merges[2 * r + 1]) >= 0) continue;
    for (uint64_t h = pair_hash(v->merges[2 * r], v->merges[2 * r + 1]);; h++) {
      int64_t *s = &v->pair_slots[h & (uint64_t)(v->pair_cap - 1)];
      if (*s < 0) {
        *s = r;
        break;
      }
    }
  }
  return st->code;
}

static int read_vocab(dt_vocab *v, const char *path, int64_t model_vocab, dt_status *st) {
  char e[256];
  memset(v, 0, sizeof *v);
  hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return dt_fail(st, DT_EXIT_INPUT, "%s: cannot open: %s", path, h5_error_text(e, sizeof e));
  if (H5Lexists(f, "/vocab", H5P_DEFAULT) <= 0) {
    H5Fclose(f);
    return -1;
  }
  int64_t n_bytes = 0, n_off = 0, n_special = 0, n_merges2 = 0;
  char kind[16] = "";
  hid_t g = H5Gopen2(f, "/vocab", H5P_DEFAULT);
  if (g >= 0 && H5Aexists(g, "tokenizer") > 0) {
    hid_t a = H5Aopen(g, "tokenizer", H5P_DEFAULT), t = H5Aget_type(a), mt = H5Tcopy(H5T_C_S1);
    H5Tset_cset(mt, H5Tget_cset(t)); /* h5py writes UTF-8 */
    char *vs = NULL;
    if (H5Tis_variable_str(t) > 0) {
      H5Tset_size(mt, H5T_VARIABLE);
      if (H5Aread(a, mt, &vs) >= 0 && vs) snprintf(kind, sizeof kind, "%s", vs);
      free(vs);
    } else {
      H5Tset_size(mt, sizeof kind - 1);
      H5Aread(a, mt, kind);
    }
    H5Tclose(mt);
    H5Tclose(t);
    H5Aclose(a);
  }
  if (g >= 0) H5Gclose(g);
  v->gpt2 = !strcmp(kind, "gpt2");
  if (!v->gpt2 && strcmp(kind, "bytes"))
    dt_fail(st, DT_EXIT_INPUT, "%s: /vocab's tokenizer attribute is '%s', expected gpt2 or bytes", path, kind);
  if (!st->code) v->bytes = read_all(f, path, "/vocab/bytes", H5T_NATIVE_UINT8, 1, 1, &n_bytes, st);
  if (!st->code) v->offsets = read_all(f, path, "/vocab/offsets", H5T_NATIVE_INT64, sizeof(int64_t), 1, &n_off, st);
  if (!st->code) v->special = read_all(f, path, "/vocab/special", H5T_NATIVE_UINT8, 1, 1, &n_special, st);
  if (!st->code) v->merges = read_all(f, path, "/vocab/merges", H5T_NATIVE_INT32, sizeof(int32_t), 2, &n_merges2, st);
  H5Fclose(f);
  if (st->code) return st->code;
  v->n = n_off - 1;
  v->n_merges = n_merges2 / 2;
  if (v->n < 1 || n_special != v->n || v->offsets[0] != 0 || v->offsets[v->n] != n_bytes)
    return dt_fail(st, DT_EXIT_INPUT, "%s: /vocab/offsets, /vocab/bytes and /vocab/special do not fit together", path);
  for (int64_t i = 0; i < v->n; i++)
    if (v->offsets[i + 1] <= v->offsets[i])
      return dt_fail(st, DT_EXIT_INPUT, "%s: /vocab/offsets[%lld..%lld] give token %lld no bytes", path, (long long)i,
                     (long long)i + 1, (long long)i);
  for (int64_t i = 0; i < 2 * v->n_merges; i++)
    if (v->merges[i] < 0 || v->merges[i] >= v->n)
      return dt_fail(st, DT_EXIT_INPUT, "%s: /vocab/merges[%lld] names token %d, outside [0, %lld)", path,
                     (long long)(i / 2), v->merges[i], (long long)v->n);
  if (v->n > model_vocab)
    return dt_fail(st, DT_EXIT_INPUT, "%s: /vocab has %lld tokens but the model's vocabulary is %lld", path,
                   (long long)v->n, (long long)model_vocab);
  return build_tables(v, path, st);
}

typedef struct {
  const char *path;
  int64_t model_vocab;
} probe_args;

static int probe_vocab(void *ctx, dt_status *st) {
  probe_args *a = ctx;
  dt_vocab v;
  int rc = read_vocab(&v, a->path, a->model_vocab, st);
  vocab_free(&v);
  return rc < 0 ? 0 : rc;
}

int vocab_read(dt_vocab *v, const char *path, int64_t model_vocab, dt_status *st) {
  memset(v, 0, sizeof *v);
  probe_args a = {path, model_vocab};
  if (h5_probe(path, "the vocabulary (/vocab)", probe_vocab, &a, 600.0, st)) return st->code;
  int rc = read_vocab(v, path, model_vocab, st);
  if (rc < 0) return 1;
  if (rc) vocab_free(v);
  return rc;
}

void vocab_free(dt_vocab *v) {
  free(v->bytes);
  free(v->offsets);
  free(v->special);
  free(v->merges);
  free(v->merged);
  free(v->specials);
  free(v->pair_slots);
  memset(v, 0, sizeof *v);
}

void vocab_write(const dt_vocab *v, int32_t id, FILE *out) {
  if (id < 0 || id >= v->n) {
    fprintf(out, "<id %d>", id);
    return;
  }
  fwrite(v->bytes + v->offsets[id], 1, (size_t)(v->offsets[id + 1] - v->offsets[id]), out);
}

/* ---- encoding ---- */

static int in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (cp < r[mid][0])
      hi = mid;
    else if (cp > r[mid][1])
      lo = mid + 1;
    else
      return 1;
  }
  return 0;
}

static int is_letter(uint32_t cp) {
  return in_ranges(dt_unicode_letters, sizeof dt_unicode_letters / sizeof *dt_unicode_letters, cp);
}

static int is_number(uint32_t cp) {
  return in_ranges(dt_unicode_numbers, sizeof dt_unicode_numbers / sizeof *dt_unicode_numbers, cp);
}

/* Unicode's White_Space property (the regex \s of GPT-2's rules). */
static int is_space(uint32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* The code point at s[*i] (advancing *i), or -1 for bytes that are not UTF-8. */
static int64_t utf8_next(const uint8_t *s, int64_t n, int64_t *i) {
  const uint8_t c = s[*i];
  int len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (!len || *i + len > n) return -1;
  uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
  for (int k = 1; k < len; k++) {
    if ((s[*i + k] & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (s[*i + k] & 0x3F);
  }
  static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000}; /* overlong forms are not UTF-8 */
  if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return -1;
  *i += len;
  return cp;
}

typedef struct {
  int32_t *ids;
  int64_t n, cap;
} id_list;

static void push(id_list *l, int32_t id) {
  if (l->n == l->cap) l->ids = dt_realloc(l->ids, (size_t)(l->cap = l->cap ? 2 * l->cap : 64) * sizeof(int32_t));
  l->ids[l->n++] = id;
}

/* Bytes p[0..n) of one piece, each byte's token merged by rank (GPT-2's bpe(): the lowest-ranked
 * adjacent pair, every occurrence left to right, until none is a merge), appended to out. */
static int bpe_piece(const dt_vocab *v, const uint8_t *p, int64_t n, int64_t at, id_list *out, dt_status *st) {
  int32_t *w = dt_malloc((size_t)n * sizeof(int32_t));
  for (int64_t i = 0; i < n; i++) {
    w[i] = v->byte_id[p[i]];
    if (w[i] < 0) {
      free(w);
      return dt_fail(st, DT_EXIT_INPUT, "--prompt: byte %lld (0x%02x) has no token in the vocabulary",
                     (long long)(at + i), p[i]);
    }
  }
  int64_t len = n;
  while (v->gpt2 && len > 1) {
    int64_t best = -1;
    for (int64_t i = 0; i + 1 < len; i++) {
      int64_t r = pair_rank(v, w[i], w[i + 1]);
      if (r >= 0 && (best < 0 || r < best)) best = r;
    }
    if (best < 0) break;
    const int32_t a = v->merges[2 * best], b = v->merges[2 * best + 1];
    int64_t k = 0;
    for (int64_t i = 0; i < len; i++) {
      if (i + 1 < len && w[i] == a && w[i + 1] == b) {
        w[k++] = v->merged[best];
        i++;
      } else {
        w[k++] = w[i];
      }
    }
    len = k;
  }
  for (int64_t i = 0; i < len; i++) push(out, w[i]);
  free(w);
  return 0;
}

/* GPT-2's pre-tokenizer over s[0..n) (UTF-8): the pieces its pattern
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * matches, in order, each given to bpe_piece. at: s's offset in the prompt, for messages. */
static int gpt2_pieces(const dt_vocab *v, const uint8_t *s, int64_t n, int64_t at, id_list *out, dt_status *st) {
  int64_t cap = n + 1, count = 0;
  uint32_t *cp = dt_malloc((size_t)cap * sizeof(uint32_t));
  int64_t *pos = dt_malloc((size_t)(cap + 1) * sizeof(int64_t)); /* each code point's byte offset */
  for (int64_t i = 0; i < n;) {
    pos[count] = i;
    int64_t c = utf8_next(s, n, &i);
    if (c < 0) {
      free(cp);
      free(pos);
      return dt_fail(st, DT_EXIT_INPUT,
                     "--prompt: byte %lld is not UTF-8; GPT-2's tokenizer encodes text, so this prompt cannot be "
                     "encoded as it would",
                     (long long)(at + i));
    }
    cp[count++] = (uint32_t)c;
  }
  pos[count] = n;
#define CLASS(c) (is_letter(c) ? 1 : is_number(c) ? 2 : is_space(c) ? 3 : 0) /* 0: other */
  for (int64_t i = 0; i < count && !st->code;) {
    int64_t end = i;
    if (cp[i] == '\'' && i + 1 < count) { /* contractions, lower case as GPT-2's pattern */
      uint32_t a = cp[i + 1], b = i + 2 < count ? cp[i + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd')
        end = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        end = i + 3;
    }
    if (end == i) {
      int64_t j = cp[i] == ' ' && i + 1 < count ? i + 1 : i; /* the optional leading space */
      int cls = CLASS(cp[j]);
      if (cls != 3 && !(j == i && cp[i] == ' ')) { /* a run of letters, numbers or others */
        end = j;
        while (end < count && CLASS(cp[end]) == cls) end++;
      } else { /* whitespace: all but the last before a non-space, or the whole run */
        end = i;
        while (end < count && is_space(cp[end])) end++;
        if (end < count && end - i > 1) end--;
      }
    }
    bpe_piece(v, s + pos[i], pos[end] - pos[i], at + pos[i], out, st);
    i = end;
  }
#undef CLASS
  free(cp);
  free(pos);
  return st->code;
}

int vocab_encode(const dt_vocab *v, const char *text, int32_t **ids, int64_t *n, dt_status *st) {
  const uint8_t *s = (const uint8_t *)text;
  const int64_t len = (int64_t)strlen(text);
  id_list out = {0};
  int64_t start = 0;
  for (int64_t i = 0; i <= len && !st->code;) {
    int32_t hit = -1; /* a special token's text starting at i: the longest */
    int64_t hit_len = 0;
    for (int64_t k = 0; k < v->n_specials && i < len; k++) {
      const int32_t t = v->specials[k];
      const int64_t l = v->offsets[t + 1] - v->offsets[t];
      if (l > hit_len && i + l <= len && !memcmp(s + i, v->bytes + v->offsets[t], (size_t)l)) hit = t, hit_len = l;
    }
    if (hit < 0 && i < len) {
      i++;
      continue;
    }
    if (i > start) { /* the text before it */
      if (v->gpt2)
        gpt2_pieces(v, s + start, i - start, start, &out, st);
      else
        bpe_piece(v, s + start, i - start, start, &out, st);
    }
    if (hit >= 0) push(&out, hit);
    i += hit >= 0 ? hit_len : 1;
    start = i;
  }
  if (st->code) {
    free(out.ids);
    return st->code;
  }
  *ids = out.ids ? out.ids : dt_malloc(sizeof(int32_t));
  *n = out.n;
  return 0;
}
