/* tokenizer.h: a data file's vocabulary (scripts/tokenize_text.py's /vocab group), for --sample to
 * print text and to encode --prompt: GPT-2's byte-level BPE (its pre-tokenizer rules, then the merges
 * by rank) or plain bytes. Token i is the bytes bytes[offsets[i]:offsets[i+1]]; special tokens
 * (<|endoftext|>) are matched whole in a prompt, as Hugging Face's tokenizers match added tokens.
 * Owns its arrays. */
#ifndef DT_TOKENIZER_H
#define DT_TOKENIZER_H

#include <stdint.h>
#include <stdio.h>

#include "common.h"

typedef struct {
  int64_t n;         /* tokens */
  uint8_t *bytes;    /* every token's bytes, concatenated */
  int64_t *offsets;  /* (n + 1) */
  uint8_t *special;  /* (n) 1: a special token */
  int32_t *specials; /* (n_specials) their ids */
  int64_t n_specials;
  int32_t *merges; /* (n_merges, 2): the ids joined, by rank */
  int32_t *merged; /* (n_merges): the id of each merge's result */
  int64_t n_merges;
  int gpt2;             /* GPT-2's pre-tokenizer and merges; 0: each byte a token */
  int32_t byte_id[256]; /* the token of each single byte (-1: none) */
  int64_t *pair_slots;  /* hash of (a, b) -> merge rank (open addressing; -1 empty) */
  int64_t pair_cap;
} dt_vocab;

/* Reads path's /vocab into v for a model of model_vocab tokens. Returns 1 when the file has none (v
 * untouched), 0 when read, else st (exit 2 naming the file and what is wrong). */
int vocab_read(dt_vocab *v, const char *path, int64_t model_vocab, dt_status *st);
/* text (NUL-terminated) as token ids the way the tokenizer encodes it: *ids (caller frees) and *n.
 * Text that cannot be encoded exactly (not UTF-8 under GPT-2's rules, a byte without a token) is
 * exit 2 in st saying where. */
int vocab_encode(const dt_vocab *v, const char *text, int32_t **ids, int64_t *n, dt_status *st);
/* Writes token id's bytes to out ("<id N>" for an id past the vocabulary). */
void vocab_write(const dt_vocab *v, int32_t id, FILE *out);
void vocab_free(dt_vocab *v);

#endif
