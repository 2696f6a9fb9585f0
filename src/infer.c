/* infer.c: the model without training: validation over the ranks (during training too),
 * --predict (the validation logits to a file) and --sample (text from a token model) (infer.h). */
#include "infer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "batch.h"
#include "checkpoint.h"
#include "tokenizer.h"

/* Forward over this rank's validation rows with params and bufs (backend memory: the model's or
 * the EMA's); sums[0..1] get loss and hits (read once at the end); logits (rows, K) and labels are
 * kept when given (host). */
static void eval_rows(dt_model *m, const float *params, const float *bufs, dt_data *d, double *sums, float *logits,
                      int32_t *all_labels, dt_status *st) {
  dt_split *s = &d->val;
  dt_backend *be = m->be;
  int64_t rows = s->hi - s->lo, cap = m->max_batch;
  float *x = dt_malloc((size_t)(cap * shape_size(m->input)) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)(cap * m->n_labels) * sizeof(int32_t));
  float *targets = dt_malloc((size_t)(cap * (m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1)) * sizeof(float));
  int64_t *idx = dt_malloc((size_t)cap * sizeof(int64_t));
  dt_dev_batch db;
  batch_alloc(&db, m, cap);
  double *dev_sums = (double *)be->alloc(be, 2 * sizeof(double));
  dt_pass pass = {.be = be,
                  .training = 0,
                  .global_targets = 1,
                  .params = (float *)params,
                  .grads = m->grads,
                  .bufs = (float *)bufs};
  for (int64_t i = 0; i < rows && !st->code; i += cap) {
    int64_t n = rows - i < cap ? rows - i : cap;
    for (int64_t k = 0; k < n; k++) idx[k] = s->lo + i + k;
    if (data_gather(d, s, idx, n, x, labels, targets, st)) break;
    dt_batch hb = {.x = x, .labels = labels, .targets = targets, .count = n};
    batch_upload(&db, m, &hb, 0, 0, 0);
    model_input(m, db.raw, n);
    pass.batch = n;
    model_forward(m, &pass);
    model_loss(m, &pass, db.labels, db.targets, dev_sums);
    if (logits) model_logits_to_host(m, logits + i * m->n_outputs, 0, n * m->n_labels);
    if (all_labels && s->y_k == 0)
      memcpy(all_labels + i * m->n_labels, labels, (size_t)(n * m->n_labels) * sizeof(int32_t));
  }
  double host[2];
  be->to_host(be, host, dev_sums, sizeof host);
  sums[0] += host[0];
  sums[1] += host[1];
  be->free(be, dev_sums);
  batch_free(&db, be);
  free(x);
  free(labels);
  free(targets);
  free(idx);
}

/* The targets of this rank's validation rows: labels per row (a token model's are T), less those
 * equal to loss.ignore_index. */
static double val_targets(const dt_model *m, const dt_data *d) {
  int64_t rows = d->val.hi - d->val.lo;
  if (!m->loss.ignore_index_set) return (double)(rows * m->n_labels);
  int64_t *idx = dt_malloc((size_t)(rows + 1) * sizeof(int64_t));
  for (int64_t i = 0; i < rows; i++) idx[i] = d->val.lo + i;
  double n = count_targets(&d->val, idx, rows, m->loss.ignore_index);
  free(idx);
  return n;
}

int infer_check_val(const dt_model *m, const dt_data *d, dt_comm *comm, dt_status *st) {
  if (!d->has_val || !m->loss.ignore_index_set) return comm_agree(comm, st); /* else every row is a target */
  double n = val_targets(m, d);
  comm_allreduce_sum_f64(comm, &n, 1, "validation target count");
  if (n == 0 && !st->code)
    dt_fail(st, DT_EXIT_INPUT,
            "%s: every target in dataset '%s' (data.val.x) is model.loss.ignore_index %lld: validation would score "
            "nothing; leave data.val.x empty to train without validation",
            d->path, d->val.x_name, (long long)m->loss.ignore_index);
  return comm_agree(comm, st);
}

void infer_evaluate(dt_model *m, const float *params, const float *bufs, dt_data *d, dt_comm *comm, double *loss,
                    double *acc, dt_status *st) {
  double sums[3] = {0, 0, val_targets(m, d)};
  eval_rows(m, params ? params : m->params, bufs ? bufs : m->bufs, d, sums, NULL, NULL, st);
  comm_allreduce_sum_f64(comm, sums, 3, "validation allreduce");
  *loss = sums[2] > 0 ? sums[0] / sums[2] : 0;
  *acc = m->loss.kind == DT_LOSS_CROSS_ENTROPY && sums[2] > 0 ? sums[1] / sums[2] : -1;
}

int infer_predict(dt_model *m, dt_data *d, dt_comm *comm, const char *path) {
  dt_status st = {0};
  if (!d->has_val)
    dt_fail(&st, DT_EXIT_INPUT, "--predict: there is no validation split (data.val.x is empty)");
  else if ((double)d->val.n * (double)m->n_outputs > 2147483647.0) /* MPI's counts are ints */
    dt_fail(&st, DT_EXIT_INPUT,
            "--predict: %lld validation rows of %lld logits%s are more than 2^31 values; use fewer rows (data.val.x)",
            (long long)d->val.n, (long long)m->n_outputs, m->tokens ? " (T x vocab)" : "");
  int code = comm_agree(comm, &st);
  if (code) return code;
  int64_t rows = d->val.hi - d->val.lo, k = m->n_outputs, n = d->val.n, per = m->n_labels;
  float *logits = dt_malloc((size_t)(rows * k + 1) * sizeof(float));
  float *labels_f = dt_malloc((size_t)(rows * per + 1) * sizeof(float));
  int32_t *labels = dt_malloc((size_t)(rows * per + 1) * sizeof(int32_t));
  double sums[2] = {0, 0};
  eval_rows(m, m->params, m->bufs, d, sums, logits, labels, &st);
  if ((code = comm_agree(comm, &st))) goto out;
  for (int64_t i = 0; i < rows * per; i++) labels_f[i] = (float)labels[i]; /* exact for class indices */
  float *all = comm->rank == 0 ? dt_malloc((size_t)(n * k + 1) * sizeof(float)) : NULL;
  float *all_labels = comm->rank == 0 ? dt_malloc((size_t)(n * per + 1) * sizeof(float)) : NULL;
  comm_gather_rows(comm, logits, rows, k, all);
  comm_gather_rows(comm, labels_f, rows, per, all_labels);
  if (comm->rank == 0) {
    int32_t *li = dt_malloc((size_t)(n * per + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < n * per; i++) li[i] = (int32_t)all_labels[i];
    /* a token model's targets are its data, shifted: only class labels are written */
    const int32_t *written = m->loss.kind == DT_LOSS_CROSS_ENTROPY && per == 1 ? li : NULL;
    if (!ckpt_write_predictions(path, all, written, n, k, &st))
      printf("wrote the logits of %lld validation rows to %s\n", (long long)n, path);
    free(li);
  }
  free(all);
  free(all_labels);
  code = comm_agree(comm, &st);
out:
  free(logits);
  free(labels_f);
  free(labels);
  return code;
}

static int cmp_desc(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x < y) - (x > y);
}

/* Draws a token from logits (V) at temperature among the top_k; u uniform in [0, 1). */
static int32_t sample_token(const float *logits, int64_t v, double temperature, int64_t top_k, double u,
                            float *scratch) {
  int64_t best = 0;
  for (int64_t i = 1; i < v; i++)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return (int32_t)best;
  float floor_logit = -INFINITY; /* logits below the k-th largest are left out */
  if (top_k > 0 && top_k < v) {
    memcpy(scratch, logits, (size_t)v * sizeof(float));
    qsort(scratch, (size_t)v, sizeof(float), cmp_desc);
    floor_logit = scratch[top_k - 1];
  }
  double total = 0;
  for (int64_t i = 0; i < v; i++)
    total += logits[i] >= floor_logit ? exp((logits[i] - logits[best]) / temperature) : 0.0;
  double target = u * total, run = 0;
  for (int64_t i = 0; i < v; i++) {
    if (logits[i] < floor_logit) continue;
    run += exp((logits[i] - logits[best]) / temperature);
    if (run > target) return (int32_t)i;
  }
  return (int32_t)best;
}

int infer_sample(const dt_config *cfg, dt_model *m, dt_comm *comm, int64_t n, const char *prompt, double temperature,
                 int64_t top_k) {
  dt_status st = {0};
  const int64_t t = m->tokens, v = m->n_classes;
  dt_vocab vocab = {0}; /* the data file's, when it holds one (scripts/tokenize_text.py) */
  const int has_vocab = t && cfg->v.data_path[0] && !vocab_read(&vocab, cfg->v.data_path, v, &st);
  const int bytes = v == 256 && !has_vocab;
  int64_t len = 0, cap = (int64_t)strlen(prompt) + n + 2;
  int32_t *ctx = dt_malloc((size_t)cap * sizeof(int32_t));
  int causal = 1; /* the context is padded after the prompt: only causal attention leaves that unseen */
  for (int i = 0; i < m->n_all; i++)
    if (m->all[i]->ops->causal && !m->all[i]->ops->causal(m->all[i])) causal = 0;
  if (st.code) {
  } else if (!t) {
    dt_fail(&st, DT_EXIT_INPUT, "--sample: the model is not a token model (its first layer is not an embedding)");
  } else if (!causal) {
    dt_fail(&st, DT_EXIT_INPUT,
            "--sample: the model has attention with causal: false, which sees the tokens after "
            "each position; sampling needs causal attention");
  } else if (has_vocab) {
    int32_t *ids;
    if (!vocab_encode(&vocab, prompt, &ids, &len, &st)) {
      ctx = dt_realloc(ctx, (size_t)(cap = len + n + 2) * sizeof(int32_t));
      memcpy(ctx, ids, (size_t)len * sizeof(int32_t));
      free(ids);
    }
  } else if (bytes) {
    for (const unsigned char *p = (const unsigned char *)prompt; *p; p++) ctx[len++] = *p;
  } else {
    for (const char *p = prompt; *p && !st.code;) {
      char *end;
      long id = strtol(p, &end, 10);
      if (end == p) {
        if (*p == ' ' || *p == ',') {
          p++;
          continue;
        }
        dt_fail(&st, DT_EXIT_INPUT, "--prompt: with vocab %lld the prompt is token ids separated by spaces; got '%s'",
                (long long)v, prompt);
      } else if (id < 0 || id >= v) {
        dt_fail(&st, DT_EXIT_INPUT, "--prompt: token %ld is outside [0, %lld)", id, (long long)v);
      } else {
        ctx[len++] = (int32_t)id;
      }
      p = end == p ? p : end;
    }
  }
  int code = comm_agree(comm, &st);
  if (code) {
    free(ctx);
    vocab_free(&vocab);
    return code;
  }
  if (len == 0) /* an empty prompt starts a new line */
    ctx[len++] = has_vocab && vocab.byte_id['\n'] >= 0 ? vocab.byte_id['\n'] : bytes ? '\n' : 0;
  dt_backend *be = m->be;
  float *x = dt_calloc((size_t)t, sizeof(float)), *logits = dt_malloc((size_t)v * sizeof(float));
  float *scratch = dt_malloc((size_t)v * sizeof(float));
  float *raw = be->alloc(be, (size_t)t * sizeof(float));
  dt_pass pass = {.be = be,
                  .batch = 1,
                  .training = 0,
                  .global_targets = 1,
                  .params = m->params,
                  .grads = m->grads,
                  .bufs = m->bufs};
  if (comm->rank == 0 && (bytes || has_vocab)) fwrite(prompt, 1, strlen(prompt), stdout);
  for (int64_t i = 0; i < n; i++) {
    /* the last T tokens, left-aligned: causal attention keeps the zero padding after them unseen */
    int64_t start = len > t ? len - t : 0, w = len - start;
    for (int64_t j = 0; j < t; j++) x[j] = j < w ? (float)ctx[start + j] : 0.0f;
    be->to_device(be, raw, x, (size_t)t * sizeof(float));
    model_input(m, raw, 1);
    model_forward(m, &pass);
    model_logits_to_host(m, logits, w - 1, 1); /* row w - 1 of the one sample's (T, V) */
    int32_t tok =
        sample_token(logits, v, temperature, top_k, dt_hash_uniform((uint64_t)cfg->v.seed, (uint64_t)i), scratch);
    ctx[len++] = tok;
    if (comm->rank == 0) {
      if (has_vocab)
        vocab_write(&vocab, tok, stdout);
      else if (bytes)
        fputc(tok, stdout);
      else
        printf("%s%d", i ? " " : "", tok);
      fflush(stdout);
    }
  }
  if (comm->rank == 0) printf("\n");
  be->free(be, raw);
  free(x);
  free(logits);
  free(scratch);
  free(ctx);
  vocab_free(&vocab);
  return comm_agree(comm, &st);
}
