/* layer_embedding.c: embedding{vocab, dim, positions, max_len}: T token ids (the model's input,
 * as floats) -> (T, D) = tok.weight[id] + pos.weight[t]. Tensors: tok.weight (vocab, D) and
 * pos.weight (max_len, D), as torch.nn.Embedding; GPT-2's normal(0, 0.02) initialisation. Only the
 * first layer of a model may be an embedding; a linear{tie} head may share tok.weight. */
#include <stddef.h>
#include <string.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key embedding_keys[] = {
    {"vocab", DT_KEY_INT, A(vocab), NULL, 2, 16777216, NULL,
     "token ids are in [0, vocab) (at most 2^24: ids travel as floats)"},
    {"dim", DT_KEY_INT, A(dim), NULL, 1, 1e6, NULL, "width D of each position's vector"},
    {"positions", DT_KEY_BOOL, A(positions), "true", 1, 0, NULL, "add a learned position vector (GPT-2's wpe)"},
    {"max_len", DT_KEY_INT, A(max_len), "0", 0, 1e7, NULL, "rows of pos.weight (0: T); T may be fewer"},
};

static int embedding_setup(dt_model *m, dt_layer *l, dt_status *st) {
  if (!m->tokens || l->index != 0)
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s: layer %s embedding: only the first layer of model.layers may be an embedding", l->where,
                   l->name);
  int64_t t = l->in.c;
  if (l->args.max_len == 0) l->args.max_len = t;
  if (l->args.positions && l->args.max_len < t)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s embedding: max_len %lld is shorter than model.input's %lld tokens",
                   l->where, l->name, (long long)l->args.max_len, (long long)t);
  l->out = (dt_shape){2, l->args.dim, t, 1};
  int64_t tok[2] = {l->args.vocab, l->args.dim}, pos[2] = {l->args.max_len, l->args.dim};
  layer_add_tensor(l, "tok.weight", 0, 2, tok);
  if (l->args.positions) layer_add_tensor(l, "pos.weight", 0, 2, pos);
  return 0;
}

static void embedding_init(dt_layer *l, float *params, float *bufs, uint64_t seed) {
  (void)bufs;
  for (int t = 0; t < l->n_tensors; t++)
    init_normal(params + l->tensors[t].offset, l->tensors[t].count, 0.02f, dt_hash64(seed + (uint64_t)t));
}

static void embedding_forward(dt_layer *l, dt_pass *pass, const float *x) {
  const float *w = pass->params + l->param_off;
  dt_op op = {.type = DT_OP_EMBED_FWD,
              .p.embed_fwd = {.n = pass->batch * l->out.h,
                              .t = l->out.h,
                              .d = l->args.dim,
                              .vocab = l->args.vocab,
                              .tokens = x,
                              .wte = w,
                              .wpe = l->args.positions ? w + l->args.vocab * l->args.dim : NULL,
                              .y = l->y}};
  backend_run(pass->be, &op);
}

static void embedding_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  (void)dx; /* token ids have no gradient */
  float *dw = pass->grads + l->param_off;
  dt_op op = {.type = DT_OP_EMBED_BWD,
              .p.embed_bwd = {.n = pass->batch * l->out.h,
                              .t = l->out.h,
                              .d = l->args.dim,
                              .vocab = l->args.vocab,
                              .tokens = x,
                              .dy = l->dy,
                              .dwte = dw,
                              .dwpe = l->args.positions ? dw + l->args.vocab * l->args.dim : NULL}};
  backend_run(pass->be, &op);
}

static int64_t embedding_flops(const dt_layer *l) {
  return l->args.positions ? shape_size(l->out) : 0;
}

const dt_layer_ops dt_layer_embedding = {.kind = "embedding",
                                         .traits = DT_LAYER_EMBEDDING,
                                         .keys = embedding_keys,
                                         .n_keys = 4,
                                         .setup = embedding_setup,
                                         .init = embedding_init,
                                         .forward = embedding_forward,
                                         .backward = embedding_backward,
                                         .flops = embedding_flops};
