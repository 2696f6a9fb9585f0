/* batch.c: micro-batches and the data cache in backend memory (batch.h). */
#include "batch.h"

void batch_alloc(dt_dev_batch *db, const dt_model *m, int64_t cap) {
  dt_backend *be = m->be;
  db->raw = be->alloc(be, (size_t)(cap * shape_size(m->input)) * sizeof(float));
  db->labels = (int32_t *)be->alloc(be, (size_t)(cap * m->n_labels) * sizeof(int32_t));
  db->targets = be->alloc(be, (size_t)(cap * (m->loss.kind == DT_LOSS_MSE ? m->n_outputs : 1)) * sizeof(float));
  db->seed = (uint64_t *)be->alloc(be, sizeof(uint64_t));
  db->rows = (int32_t *)be->alloc(be, (size_t)cap * sizeof(int32_t));
}

void batch_free(dt_dev_batch *db, dt_backend *be) {
  be->free(be, db->raw);
  be->free(be, db->labels);
  be->free(be, db->targets);
  be->free(be, db->seed);
  be->free(be, db->rows);
}

void batch_upload(dt_dev_batch *db, const dt_model *m, const dt_batch *b, int cached, uint64_t seed, int ahead) {
  dt_backend *be = m->be;
  void (*copy)(dt_backend *, void *, const void *, size_t) = ahead ? be->upload_ahead : be->upload;
  const int64_t rows = b->count;
  copy(be, db->seed, &seed, sizeof seed);
  if (cached) {
    copy(be, db->rows, b->rows, (size_t)rows * sizeof(int32_t));
    return;
  }
  copy(be, db->raw, b->x, (size_t)(rows * shape_size(m->input)) * sizeof(float));
  if (m->loss.kind == DT_LOSS_CROSS_ENTROPY)
    copy(be, db->labels, b->labels, (size_t)(rows * m->n_labels) * sizeof(int32_t));
  else
    copy(be, db->targets, b->targets, (size_t)(rows * m->n_outputs) * sizeof(float));
}

void cache_fill(dt_dev_cache *c, dt_backend *be, const dt_split *s) {
  size_t xb = (size_t)(s->hi - s->lo) * (size_t)s->row_elems * s->x_elem;
  size_t yb = (size_t)(s->hi - s->lo) * (s->labels ? sizeof(int32_t) : (size_t)s->y_k * sizeof(float));
  c->x = be->alloc(be, xb ? xb : 1);
  c->y = be->alloc(be, yb ? yb : 1);
  be->to_device(be, c->x, s->x, xb);
  be->to_device(be, c->y, s->labels ? (const void *)s->labels : (const void *)s->targets, yb);
}

void cache_free(dt_dev_cache *c, dt_backend *be) {
  be->free(be, c->x);
  be->free(be, c->y);
  c->x = c->y = NULL;
}

void cache_gather(const dt_dev_cache *c, dt_backend *be, const dt_split *s, const dt_dev_batch *db, int64_t rows) {
  dt_op x = {
      .type = DT_OP_GATHER,
      .p.gather = {.n = rows, .row = s->row_elems, .type = s->x_type, .src = c->x, .idx = db->rows, .out = db->raw}};
  backend_run(be, &x);
  dt_op y = {.type = DT_OP_GATHER,
             .p.gather = {.n = rows,
                          .row = s->labels ? 1 : s->y_k,
                          .type = s->labels ? DT_GATHER_I32 : DT_GATHER_F32,
                          .src = c->y,
                          .idx = db->rows,
                          .out = s->labels ? (void *)db->labels : (void *)db->targets}};
  backend_run(be, &y);
}

double count_targets(const dt_split *s, const int64_t *idx, int64_t n, int64_t ignore) {
  double c = 0;
  for (int64_t i = 0; i < n; i++) {
    if (!s->tokens) { /* left in the file: counted when it was opened */
      DT_ASSERT(s->row_targets);
      c += s->row_targets[idx[i] - s->lo];
      continue;
    }
    const int64_t at = (idx[i] - s->lo) * s->tok_stride;
    for (int64_t j = 1; j <= s->row_elems; j++) c += split_token(s, at + j) != ignore;
  }
  return c;
}
