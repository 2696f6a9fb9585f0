#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void shape_text(dt_shape s, char *buf, size_t cap) {
  if (s.rank == 1)
    snprintf(buf, cap, "(%lld)", (long long)s.c);
  else if (s.rank == 2)
    snprintf(buf, cap, "(%lld, %lld)", (long long)s.h, (long long)s.c);
  else
    snprintf(buf, cap, "(%lld, %lld, %lld)", (long long)s.c, (long long)s.h, (long long)s.w);
}

static int product_fits(int n, const int64_t *v) {
  int64_t p = 1;
  for (int i = 0; i < n; i++)
    if (v[i] < 0 || __builtin_mul_overflow(p, v[i], &p) || p > DT_MAX_ELEMENTS) return 0;
  return 1;
}

int shape_fits(dt_shape s) {
  const int64_t v[3] = {s.c, s.h, s.w};
  return product_fits(3, v);
}

void layer_add_tensor(dt_layer *l, const char *name, int is_buffer, int ndim, const int64_t *dims) {
  DT_ASSERT(l->n_tensors < 4);
  dt_tensor *t = &l->tensors[l->n_tensors++];
  snprintf(t->name, sizeof t->name, "%s.%s", l->name, name);
  t->ndim = ndim;
  t->count = 1;
  for (int i = 0; i < ndim; i++) t->dims[i] = dims[i];
  if (!product_fits(ndim, dims)) { /* seq_add refuses the layer */
    l->too_large = 1;
    t->count = 0;
  }
  for (int i = 0; i < ndim && !l->too_large; i++) t->count *= dims[i];
  t->is_buffer = is_buffer;
  /* offsets are relative to the layer until model_build lays the flat buffers out */
  if (is_buffer) {
    t->offset = l->n_bufs;
    l->n_bufs += t->count;
  } else {
    t->offset = l->n_params;
    l->n_params += t->count;
  }
}

void init_uniform(float *p, int64_t n, float bound, uint64_t seed) {
  for (int64_t i = 0; i < n; i++) p[i] = (2.0f * dt_hash_uniform(seed, (uint64_t)i) - 1.0f) * bound;
}

void init_normal(float *p, int64_t n, float std, uint64_t seed) {
  for (int64_t i = 0; i < n; i++) { /* Box-Muller on two counter-based uniforms */
    double u1 = dt_hash_uniform(seed, 2 * (uint64_t)i), u2 = dt_hash_uniform(seed, 2 * (uint64_t)i + 1);
    p[i] = (float)(std * sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2));
  }
}

static void register_layer(dt_model *m, dt_layer *l) {
  m->all = dt_realloc(m->all, (size_t)(m->n_all + 1) * sizeof *m->all);
  l->index = m->n_all;
  m->all[m->n_all++] = l;
}

/* The kind of a list item, `- relu` or `- conv2d: {...}` (NULL when it is neither), and in
 * *params its parameter map (NULL when none is given). */
static const char *item_kind(const dt_node *item, const dt_node **params) {
  *params = NULL;
  if (item->kind == DT_NODE_SCALAR) return item->scalar;
  if (item->kind != DT_NODE_MAP || item->n != 1) return NULL;
  const dt_node *p = item->items[0];
  if (!(p->kind == DT_NODE_SCALAR && (!strcmp(p->scalar, "") || !strcmp(p->scalar, "null") || !strcmp(p->scalar, "~"))))
    *params = p;
  return item->keys[0];
}

static void add_block(dt_seq *s, int first, int last) {
  s->blocks = dt_realloc(s->blocks, (size_t)(s->n_blocks + 1) * sizeof *s->blocks);
  s->blocks[s->n_blocks++] = (dt_block){first, last};
}

/* Builds one list item into s (appending), updating *cur; a repeat{times, layers} item appends
 * its layers `times` over, numbered on in the same list, each copy a block unless in_repeat (the
 * item is itself inside a copy, which is the block). */
static int seq_add(dt_model *m, dt_seq *s, const dt_node *item, int i, dt_shape *cur, const char *prefix,
                   const char *what, int in_repeat, dt_status *st) {
  char where[512];
  yaml_where(item, where, sizeof where);
  const dt_node *params;
  const char *kind = item_kind(item, &params);
  if (!kind)
    return dt_fail(st, DT_EXIT_INPUT, "%s: %s[%d]: a layer is a one-key map such as `- relu: {}`", where, what, i);
  if (!strcmp(kind, "repeat")) {
    static const dt_key repeat_keys[] = {
        {"times", DT_KEY_INT, offsetof(dt_layer_args, times), NULL, 1, 10000, NULL, "copies"},
        {"layers", DT_KEY_NODE, offsetof(dt_layer_args, layers), NULL, 1, 0, NULL, "list of layers"},
    };
    dt_layer_args ra = {0};
    char kp[256];
    snprintf(kp, sizeof kp, "%s[%d] repeat: ", what, i);
    if (keys_read(repeat_keys, 2, &ra, params, item, kp, "parameter", st)) return st->code;
    if (ra.layers->kind != DT_NODE_SEQ || ra.layers->n == 0)
      return dt_fail(st, DT_EXIT_INPUT, "%s: %s[%d] repeat: layers must be a non-empty list of layers", where, what, i);
    for (int64_t r = 0; r < ra.times; r++) {
      int first = s->n;
      for (int j = 0; j < ra.layers->n; j++)
        if (seq_add(m, s, ra.layers->items[j], i, cur, prefix, what, 1, st)) return st->code;
      if (!in_repeat) add_block(s, first, s->n - 1);
    }
    return 0;
  }
  const dt_layer_ops *ops = layer_kind(kind);
  if (!ops) {
    const char **names = dt_malloc((size_t)(dt_n_layer_kinds + 1) * sizeof *names);
    for (int k = 0; k < dt_n_layer_kinds; k++) names[k] = dt_layer_kinds[k]->kind;
    names[dt_n_layer_kinds] = "repeat";
    const char *near = keys_suggest(kind, names, dt_n_layer_kinds + 1);
    free(names);
    return dt_fail(st, DT_EXIT_INPUT, "%s: %s[%d]: unknown layer '%s'%s%s%s", where, what, i, kind,
                   near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
  }
  dt_layer *l = dt_calloc(1, sizeof *l);
  s->layers = dt_realloc(s->layers, (size_t)(s->n + 1) * sizeof *s->layers);
  s->layers[s->n++] = l;
  l->ops = ops;
  l->in = *cur;
  snprintf(l->name, sizeof l->name, "%s%d", prefix, s->n - 1);
  dt_strlcpy(l->where, where, sizeof l->where);
  register_layer(m, l);
  char kp[256];
  snprintf(kp, sizeof kp, "%s[%d] %s: ", what, i, kind);
  if (keys_read(ops->keys, ops->n_keys, &l->args, params, item, kp, "parameter", st)) return st->code;
  if (ops->setup(m, l, st)) return st->code;
  if (l->too_large || !shape_fits(l->out))
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s %s: %s would have more than 2^40 elements", l->where, l->name, kind,
                   l->too_large ? "a tensor" : "output per sample");
  *cur = l->out;
  if ((ops->traits & DT_LAYER_BLOCK) && !in_repeat) add_block(s, s->n - 1, s->n - 1);
  return 0;
}

int seq_build(dt_model *m, dt_seq *s, const dt_node *list, dt_shape in, const char *prefix, const char *what,
              dt_status *st) {
  char where[512];
  if (list->kind != DT_NODE_SEQ)
    return dt_fail(st, DT_EXIT_INPUT, "%s: %s: expected a list of layers", yaml_where(list, where, sizeof where), what);
  *s = (dt_seq){0};
  dt_shape cur = in;
  for (int i = 0; i < list->n; i++)
    if (seq_add(m, s, list->items[i], i, &cur, prefix, what, 0, st)) return st->code;
  return 0;
}

/* Lays tensors out: parameters and buffers in pre-order, each layer's block contiguous. */
static void layout(dt_model *m) {
  m->n_params = m->n_bufs = 0;
  m->tensors = dt_calloc((size_t)(m->n_all * 4 + 1), sizeof *m->tensors);
  m->n_tensors = 0;
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    l->param_off = m->n_params;
    l->buf_off = m->n_bufs;
    for (int t = 0; t < l->n_tensors; t++) {
      l->tensors[t].offset += l->tensors[t].is_buffer ? l->buf_off : l->param_off;
      m->tensors[m->n_tensors++] = l->tensors[t];
    }
    m->n_params += l->n_params;
    m->n_bufs += l->n_bufs;
  }
}

/* The block of train.recompute that layer i of s is in, or NULL. */
static const dt_block *block_of(const dt_seq *s, int i) {
  for (int b = 0; b < s->n_blocks; b++)
    if (s->blocks[b].first <= i && i <= s->blocks[b].last) return &s->blocks[b];
  return NULL;
}

/* Whether layer i of s is a linear, or a gelu in its tanh form (what cuBLASLt's epilogues compute). */
static int is_linear(const dt_seq *s, int i) {
  return i < s->n && (s->layers[i]->ops->traits & DT_LAYER_LINEAR);
}
static int is_gelu_tanh(const dt_seq *s, int i) {
  return i < s->n && (s->layers[i]->ops->traits & DT_LAYER_GELU) && s->layers[i]->args.approximate;
}

/* A branch that may take its residual's input and give its output as 16-bit NHWC: the identity, or a conv2d
 * first and last a batchnorm that reads its conv2d's 16-bit output (bn_next). */
static int branch16(const dt_seq *b) {
  return !b->n || ((b->layers[0]->ops->traits & DT_LAYER_CONV) && b->n >= 2 &&
                   b->layers[b->n - 2]->bn_next == b->layers[b->n - 1]);
}

/* The residual at s->layers[i]: whether its branches could sum 16-bit NHWC values, and its neighbours that
 * could write and read them (pick_trunk16 decides): before it (or its fused relu) a batchnorm that reads its
 * conv2d's 16-bit output, or a residual; after it (or its own fused relu) a conv2d, a global_avgpool or a
 * residual. */
static void link_residual(dt_seq *s, int i) {
  dt_layer *l = s->layers[i];
  l->branches16 = branch16(&l->body) && branch16(&l->shortcut);
  const int at = i > 0 && s->layers[i - 1]->fused_into ? i - 2 : i - 1; /* the layer before (its fused relu's) */
  dt_layer *prev = at >= 0 ? s->layers[at] : NULL;
  if (prev && ((prev->ops->traits & DT_LAYER_RESIDUAL) ||
               ((prev->ops->traits & DT_LAYER_BATCHNORM) && at > 0 && s->layers[at - 1]->bn_next == prev)))
    l->res_prev = prev, prev->res_next = l;
  const int after = i + 1 + l->fused_relu;
  if (after < s->n && (s->layers[after]->ops->traits & DT_LAYER_CONV)) l->conv_next = s->layers[after];
  if (after < s->n && (s->layers[after]->ops->traits & DT_LAYER_GAP)) l->gap_next = s->layers[after];
}

/* model.fuse: each relu right after a batchnorm, a residual or a linear is applied by that layer's ops (the
 * residual's sum, the linear's GEMM epilogue; not a linear's under fp16, linear_relu 0), and its output
 * buffers are that layer's (nothing else reads its output before the relu). A tanh gelu
 * right after a linear is applied by the linear's GEMM (its epilogue), and, when a linear follows
 * it, its derivative by that linear's input-gradient GEMM, into the dy it then shares with the first
 * linear; all three in one train.recompute block, so that each reads what its own block keeps. A
 * batchnorm right after a convolution without a bias may take that layer's output, and give its
 * gradient, as the convolution has them, and hand its own to a convolution right after it (or after
 * its fused relu), or to a maxpool that such a convolution follows, so too (model_pick_ops decides, for
 * the backend). A layernorm opening a residual's body (a pre-LN transformer block's) adds the identity
 * shortcut's gradient into its input gradient as it writes it, in place of the residual's sum. */
static void fuse_seq(dt_seq *s, int linear_relu) {
  for (int i = 0; i < s->n; i++) {
    dt_layer *l = s->layers[i];
    fuse_seq(&l->body, linear_relu);
    fuse_seq(&l->shortcut, linear_relu);
    /* a residual and a linear mask their relu's gradient in place: not in a dy that the sequence's end shares
     * (dy_of); a linear's relu in its own train.recompute block */
    const int linear = l->ops->traits & DT_LAYER_LINEAR, masks_in_place = l->body.n || linear;
    const int masks_own_dy = !masks_in_place || i + 2 < s->n;
    if (i + 1 < s->n && (l->ops->traits & DT_LAYER_FUSES_RELU) && (s->layers[i + 1]->ops->traits & DT_LAYER_RELU) &&
        masks_own_dy && (!linear || (linear_relu && block_of(s, i) == block_of(s, i + 1)))) {
      l->fused_relu = 1;
      s->layers[i + 1]->fused_into = l;
    }
    if (is_linear(s, i) && is_gelu_tanh(s, i + 1) && block_of(s, i) == block_of(s, i + 1)) {
      dt_layer *gelu = s->layers[i + 1];
      l->gelu_next = gelu, gelu->gelu_prev = l;
      if (is_linear(s, i + 2) && block_of(s, i) == block_of(s, i + 2)) s->layers[i + 2]->dgelu_aux = l, gelu->dy_of = l;
    }
    if ((l->ops->traits & DT_LAYER_CONV) && !l->args.bias && i + 1 < s->n &&
        (s->layers[i + 1]->ops->traits & DT_LAYER_BATCHNORM))
      l->bn_next = s->layers[i + 1];
    const int after = i + 1 + l->fused_relu; /* the layer reading this one's output */
    if (i > 0 && s->layers[i - 1]->bn_next == l && after < s->n) {
      dt_layer *next = s->layers[after];
      if (next->ops->traits & DT_LAYER_CONV)
        l->conv_next = next;
      else if ((next->ops->traits & DT_LAYER_MAXPOOL) && after + 1 < s->n &&
               (s->layers[after + 1]->ops->traits & DT_LAYER_CONV))
        l->pool_next = next, next->conv_next = s->layers[after + 1];
    }
    if (l->ops->traits & DT_LAYER_RESIDUAL) link_residual(s, i);
    if ((l->ops->traits & DT_LAYER_RESIDUAL) && !l->shortcut.n && (l->body.layers[0]->ops->traits & DT_LAYER_ADDS_DX))
      l->body.layers[0]->dx_adds = l; /* a layernorm: a batchnorm (a pre-activation block's) adds nothing */
  }
}

/* Each residual's branches end in a layer whose dy is the residual's (l->dy_of). */
static void share_branch_grads(dt_seq *s) {
  for (int i = 0; i < s->n; i++) {
    dt_layer *l = s->layers[i];
    share_branch_grads(&l->body);
    share_branch_grads(&l->shortcut);
    const dt_seq *branches[2] = {&l->body, &l->shortcut};
    for (int b = 0; b < 2; b++) {
      if (!branches[b]->n) continue;
      dt_layer *last = branches[b]->layers[branches[b]->n - 1];
      (last->fused_into ? last->fused_into : last)->dy_of = l;
    }
  }
}

/* Each convolution with a bn_next hands it y and dy in `format` (half.h; DT_F16_NONE: FP32 NCHW), and each
 * such batchnorm with a conv_next its own to that convolution, which then keeps no copy of x; or with a
 * pool_next to that maxpool, which pools them as they are and hands its own to its conv_next so too. */
static void pick_y16(dt_model *m, int format) {
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    if (l->bn_next) l->y16 = l->bn_next->x16 = format;
    if (l->pool_next) l->y16 = l->pool_next->x16 = format;
    if (l->conv_next && !(l->ops->traits & DT_LAYER_RESIDUAL)) { /* a residual's: pick_trunk16 */
      l->y16 = l->conv_next->in16 = format;
      if (format) l->conv_next->keeps_x16 = 0;
    }
  }
}

/* A first layer that is a convolution reads the input as the input op writes it, 16-bit NHWC, and keeps no
 * copy of it (the input stays until the next micro-batch's): no pack of the input to 16 bits a forward. */
static void pick_input16(dt_model *m, int format) {
  dt_layer *first = m->top.n ? m->top.layers[0] : NULL;
  if (!first || !(first->ops->traits & DT_LAYER_CONV)) return;
  m->input16 = first->in16 = m->fuse && format && !m->tokens ? format : DT_F16_NONE;
  if (m->input16) first->keeps_x16 = 0;
}

/* Whether a residual's neighbours keep it 16-bit (l->y16 marks those still in the running): a batchnorm that
 * reads 16 bits writes them; a residual so marked writes and reads them; a conv2d and a global_avgpool read them. */
static int trunk16_fits(const dt_layer *l) {
  const dt_layer *p = l->res_prev, *n = l->res_next;
  const int in = p && ((p->ops->traits & DT_LAYER_BATCHNORM) ? p->x16 != 0 : p->y16 != 0);
  return in && (l->conv_next || l->gap_next || (n && n->y16));
}

/* Each residual whose branches can (branches16), between a layer that writes 16-bit NHWC values and one that
 * reads them, adds its branches' outputs as 16-bit NHWC and hands its sum, and takes its gradient, so: the
 * trunk of a ResNet from its stem's batchnorm to its global_avgpool, with no copies to and from FP32 NCHW. A
 * chain of residuals is 16-bit whole or not at all, so the marks are taken back until every one left fits. */
static void pick_trunk16(dt_model *m, int format) {
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    if (l->ops->traits & DT_LAYER_RESIDUAL) l->y16 = l->x16 = l->branches16 && l->res_prev ? format : DT_F16_NONE;
  }
  for (int changed = 1; changed;) {
    changed = 0;
    for (int i = 0; i < m->n_all; i++) {
      dt_layer *l = m->all[i];
      if ((l->ops->traits & DT_LAYER_RESIDUAL) && l->y16 && !trunk16_fits(l))
        l->y16 = l->x16 = DT_F16_NONE, changed = 1;
    }
  }
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    if (!(l->ops->traits & DT_LAYER_RESIDUAL) || !l->y16) continue;
    const dt_seq *branches[2] = {&l->body, &l->shortcut};
    for (int b = 0; b < 2; b++) {
      if (!branches[b]->n) continue;
      dt_layer *first = branches[b]->layers[0];
      first->in16 = format, first->keeps_x16 = 0;
      branches[b]->layers[branches[b]->n - 1]->y16 = format;
    }
    if (l->res_prev->ops->traits & DT_LAYER_BATCHNORM) l->res_prev->y16 = format;
    if (l->conv_next) l->conv_next->in16 = format, l->conv_next->keeps_x16 = 0;
    if (l->gap_next) l->gap_next->x16 = format;
  }
}

/* model.fuse under bf16 on CUDA: a classifier (the last layer, a linear without a bias, of at least
 * DT_GEMM16_MIN_DIM inputs and outputs) writes the logits as its bfloat16 GEMM has them, and its gradient GEMMs
 * read dlogits as the loss writes them, in the same rows: no FP32 logits, no copy of dlogits (as PyTorch's
 * autocast gives the loss bfloat16 logits). Not a teacher's, whose logits the loss reads in FP32. */
static void pick_logits16(dt_model *m, int format) {
  dt_layer *last = m->top.layers[m->top.n - 1];
  if (!(last->ops->traits & DT_LAYER_LINEAR)) return;
  last->y16 = format == DT_F16_BF16 && m->fuse && !m->frozen && !last->args.bias && !last->gelu_next &&
                      last->args.out >= DT_GEMM16_MIN_DIM && last->in.c >= DT_GEMM16_MIN_DIM
                  ? format
                  : DT_F16_NONE;
}

/* model.fuse under bf16 on CUDA: a linear, the tanh gelu its GEMM applies and the linear that applies the gelu's
 * derivative (a transformer's MLP: gelu_next, dgelu_aux) keep the hidden activations in bfloat16 rows, as
 * PyTorch's autocast does: the first writes the gelu's input and output (its y16: no FP32 copies, and none for
 * the second's GEMMs to make), and reads its dy so; the second reads x and writes dx so (its x16). Hidden widths
 * that are whole rows of 8 values (the gelu's buffers are laid out as the linear's), every dimension at least
 * DT_GEMM16_MIN_DIM. */
static void pick_gelu16(dt_model *m, int format) {
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *next = m->all[i], *l = next->dgelu_aux; /* the second linear, and the first */
    if (!l) continue;
    const int fits = format == DT_F16_BF16 && l->args.out % 8 == 0 && l->in.c >= DT_GEMM16_MIN_DIM &&
                     l->args.out >= DT_GEMM16_MIN_DIM && next->args.out >= DT_GEMM16_MIN_DIM;
    l->y16 = l->gelu_next->y16 = next->x16 = fits ? format : DT_F16_NONE;
  }
}

/* model.fuse under bf16 on CUDA: a layernorm right before a linear or an attention layer in its train.recompute
 * block (a pre-LN transformer's, and its last before the classifier) writes its output in bfloat16 rows, which
 * that layer's GEMMs read as they are (as autocast hands them bfloat16 values: no FP32 output, no copies), and
 * reads its gradient so, which that layer's input-gradient GEMM writes so (its x16). Widths that are whole rows
 * of 8 values, at least DT_GEMM16_MIN_DIM. */
static void pick_norm16(dt_seq *s, int fuse, int format) {
  for (int i = 0; i < s->n; i++) {
    dt_layer *l = s->layers[i];
    pick_norm16(&l->body, fuse, format);
    pick_norm16(&l->shortcut, fuse, format);
    if (!(l->ops->traits & DT_LAYER_ADDS_DX)) continue; /* a layernorm */
    dt_layer *next = i + 1 < s->n ? s->layers[i + 1] : NULL;
    const int linear = next && (next->ops->traits & DT_LAYER_LINEAR),
              reader = linear || (next && (next->ops->traits & DT_LAYER_ATTENTION));
    const int fits = reader && fuse && format == DT_F16_BF16 && block_of(s, i) == block_of(s, i + 1) &&
                     l->in.c % 8 == 0 && l->in.c >= DT_GEMM16_MIN_DIM &&
                     (!linear || next->args.out >= DT_GEMM16_MIN_DIM);
    l->y16 = fits ? format : DT_F16_NONE;
    if (reader) next->x16 = l->y16;
  }
}

/* model.fuse under bf16 on CUDA: an attention layer in the fused ops keeps q, k, v, the merged heads and their
 * gradients in bfloat16 (heads16), as autocast's projections and SDPA have them: its qkv projection writes them
 * so, the fused ops read and write them so (their tensor-core tiles are bfloat16 anyway), and its output
 * projection reads them as they are. Widths that are whole rows of 8 values, at least DT_GEMM16_MIN_DIM. */
static void pick_heads16(dt_model *m, int format) {
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    if (l->ops->traits & DT_LAYER_ATTENTION)
      l->heads16 =
          m->fuse && format == DT_F16_BF16 && l->fused_attention && l->in.c % 8 == 0 && l->in.c >= DT_GEMM16_MIN_DIM
              ? format
              : DT_F16_NONE;
  }
}

/* A weight tensor's 16-bit copy in m's table: a dense weight (out, in) as bfloat16 rows of dt_ld16(in), a filter
 * (O, C, K, K) as (O, K, K, C), each at the next 256-byte boundary. Returns its offset in weights16. */
static int64_t add_weight16(dt_model *m, const dt_tensor *t, int format) {
  const int filter = t->ndim == 4;
  dt_weight16 e = {.src = t->offset, .rows = t->dims[0], .cols = t->dims[1], .format = format};
  e.inner = filter ? t->dims[2] * t->dims[3] : 1;
  e.ld = filter ? e.cols : dt_ld16(e.cols);
  e.dst = m->w16_values, e.row0 = m->w16_rows;
  e.grad = filter && !m->frozen; /* cuDNN's filter gradient is 16-bit: it goes to grads16 (conv_bwd_filter.dw16) */
  if (e.grad) {                  /* in order of src, as the backward finishes them in reverse (model_add_grads16) */
    for (int i = m->n_w16 - 1; i >= 0; i--)
      if (m->w16_table[i].grad) {
        DT_ASSERT(m->w16_table[i].src < e.src);
        break;
      }
    m->g16_values = e.dst + e.rows * e.inner * e.ld;
  }
  m->w16_table = dt_realloc(m->w16_table, (size_t)(m->n_w16 + 1) * sizeof *m->w16_table);
  m->w16_table[m->n_w16++] = e;
  m->w16_values += (e.rows * e.inner * e.ld + 127) / 128 * 128;
  m->w16_rows += e.rows;
  return e.dst;
}

/* model.fuse on CUDA under bf16: every weight a dense product reads on bfloat16 operands (a linear's, a tied
 * one's embedding's, an attention layer's two projections'; every dimension at least DT_GEMM16_MIN_DIM); under
 * bf16 and fp16: every convolution's filter. Each is copied to 16 bits once a forward, by one op over all of
 * them (as autocast casts a weight once and keeps the copy for the backward), where each of its GEMMs and
 * convolutions copied it again: twice a step for a linear, and one launch each. */
static void pick_weights16(dt_model *m, int format) {
  free(m->w16_table);
  m->w16_table = NULL, m->n_w16 = 0, m->w16_rows = m->w16_values = m->g16_values = 0;
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    const unsigned traits = l->ops->traits;
    const int dense =
        format == DT_F16_BF16 && l->in.c >= DT_GEMM16_MIN_DIM &&
        ((traits & DT_LAYER_ATTENTION) || ((traits & DT_LAYER_LINEAR) && l->args.out >= DT_GEMM16_MIN_DIM));
    l->w16 = m->fuse && (dense || (format && (traits & DT_LAYER_CONV))) ? format : DT_F16_NONE;
    if (!l->w16) continue;
    if (l->tied) {
      l->w16_off[0] = add_weight16(m, &l->tied->tensors[0], format);
      continue;
    }
    int n = 0;
    for (int t = 0; t < l->n_tensors; t++) /* the weights: 2-D (dense) or 4-D (filters); not the biases */
      if (l->tensors[t].ndim >= 2) {
        DT_ASSERT(n < 2);
        l->w16_off[n++] = add_weight16(m, &l->tensors[t], format);
      }
  }
}

/* Under bf16 and fp16 CUDA convolves 16-bit NHWC copies: a convolution's output and gradient between it and
 * its batchnorm stay as cuDNN has them. The teacher runs in the model's precision (the backend's). */
static void pick_ops(dt_model *m, int cuda, size_t shared_per_block, int format) {
  for (int i = 0; i < m->n_all; i++)
    if (m->all[i]->ops->pick) m->all[i]->ops->pick(m->all[i], m, cuda, shared_per_block);
  pick_input16(m, format);
  pick_y16(m, format);
  pick_trunk16(m, format);
  pick_logits16(m, format);
  pick_gelu16(m, format);
  pick_norm16(&m->top, m->fuse, format);
  pick_heads16(m, format);
  pick_weights16(m, format);
  if (m->teacher) pick_ops(m->teacher, cuda, shared_per_block, format);
}

void model_pick_ops(dt_model *m, int cuda, size_t shared_per_block) {
  pick_ops(m, cuda, shared_per_block,
           !cuda                          ? DT_F16_NONE
           : m->precision == DT_PREC_BF16 ? DT_F16_BF16
           : m->precision == DT_PREC_FP16 ? DT_F16_HALF
                                          : DT_F16_NONE);
}

int model_build(dt_model *m, const dt_config *cfg, dt_status *st) {
  memset(m, 0, sizeof *m);
  const dt_list *in = &cfg->v.input;
  const dt_config_values *v = &cfg->v;
  const dt_node *first_params, *layers = cfg->v.layers;
  const char *first =
      layers && layers->kind == DT_NODE_SEQ && layers->n ? item_kind(layers->items[0], &first_params) : NULL;
  if (first && !strcmp(first, "embedding")) {
    if (in->n != 1)
      return dt_fail(st, DT_EXIT_INPUT,
                     "model.input: a token model (first layer embedding) takes [T] tokens, got %d dims", in->n);
    if (v->mean.n || v->std.n || v->scale != 1.0)
      return dt_fail(st, DT_EXIT_INPUT,
                     "data.scale, data.mean, data.std: a token model's input is token ids, unscaled");
    m->tokens = (int64_t)in->v[0];
  }
  if (in->n == 3)
    m->input = (dt_shape){3, (int64_t)in->v[0], (int64_t)in->v[1], (int64_t)in->v[2]};
  else if (in->n == 2)
    m->input = (dt_shape){3, 1, (int64_t)in->v[0], (int64_t)in->v[1]};
  else
    m->input = (dt_shape){1, (int64_t)in->v[0], 1, 1};
  m->in_scale = (float)v->scale;
  m->in_channels = m->input.rank == 3 ? (int)m->input.c : 1;
  m->has_mean = v->mean.n > 0;
  m->has_std = v->std.n > 0;
  for (int c = 0; c < v->mean.n && c < DT_MAX_LIST; c++) m->in_mean[c] = (float)v->mean.v[c];
  for (int c = 0; c < v->std.n && c < DT_MAX_LIST; c++) m->in_std[c] = (float)v->std.v[c];
  if (!shape_fits(m->input))
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.input: more than 2^40 elements per sample", cfg->path);
  m->attention = cfg->v.attention;
  m->precision = cfg->v.precision;
  if (seq_build(m, &m->top, cfg->v.layers, m->input, "", "model.layers", st)) return st->code;
  m->fuse = cfg->v.fuse;
  /* a linear's relu in cuBLASLt's epilogue, max(x, 0), may make a NaN 0: not under fp16, whose activations
   * overflow, and whose inf - inf in a hidden layer must reach the loss (exit 4, or a skipped step) */
  if (m->fuse) fuse_seq(&m->top, m->precision != DT_PREC_FP16);
  share_branch_grads(&m->top);
  m->recompute = m->top.recompute = cfg->v.recompute == DT_RECOMPUTE_BLOCKS;
  if (loss_parse(&m->loss, cfg->v.loss, st)) return st->code;
  const dt_layer *last = m->top.layers[m->top.n - 1];
  dt_shape out = last->out;
  m->n_outputs = shape_size(out);
  m->n_labels = 1;
  char s[64];
  shape_text(out, s, sizeof s);
  if (m->tokens) {
    if (out.rank != 2 || out.h != m->tokens)
      return dt_fail(st, DT_EXIT_INPUT,
                     "%s: the last layer outputs %s; a token model needs logits (T, vocab) = (%lld, V) per sample",
                     last->where, s, (long long)m->tokens);
    if (m->loss.kind != DT_LOSS_CROSS_ENTROPY)
      return dt_fail(st, DT_EXIT_INPUT, "model.loss: a token model is trained with cross_entropy over its next tokens");
    m->n_labels = m->tokens;
  } else if (out.rank != 1) {
    return dt_fail(st, DT_EXIT_INPUT, "%s: the last layer outputs %s; the loss needs a vector (add flatten and linear)",
                   last->where, s);
  }
  if (m->loss.ignore_index_set && !m->tokens)
    return dt_fail(st, DT_EXIT_INPUT, "model.loss: ignore_index is for token models (padding in a sequence)");
  const int metric = cfg->v.early_metric;
  if ((metric == DT_METRIC_VAL_ACC || metric == DT_METRIC_EMA_VAL_ACC) && m->loss.kind != DT_LOSS_CROSS_ENTROPY)
    return dt_fail(st, DT_EXIT_INPUT,
                   "%s: train.early_stopping.metric %s: an accuracy needs a cross_entropy loss; this model's is mse "
                   "(use %s)",
                   cfg->path, metric == DT_METRIC_VAL_ACC ? "val_acc" : "ema_val_acc",
                   metric == DT_METRIC_VAL_ACC ? "val_loss" : "ema_val_loss");
  m->n_classes = m->n_outputs / m->n_labels;
  if (m->loss.kind == DT_LOSS_CROSS_ENTROPY && m->n_classes < 2)
    return dt_fail(st, DT_EXIT_INPUT, "%s: cross_entropy needs at least 2 outputs, the model has %lld", last->where,
                   (long long)m->n_classes);
  layout(m);
  return 0;
}

/* ---- activation memory ---- */

enum { ACTS_ALIGN = 256 }; /* each shared buffer's start: what the CUDA kernels' vector loads assume */

typedef struct {
  void **slot;
  size_t offset;
} acts_request;

struct dt_acts {
  dt_backend *be;
  int shared;        /* requests go to the blocks' shared region (else each is its own allocation) */
  size_t used, peak; /* bytes of the shared region the block being laid out takes; the most any block does */
  void **owned;      /* the allocations outside it */
  int n_owned;
  size_t owned_bytes;     /* what they asked for */
  acts_request *requests; /* in the shared region, placed once every block is laid out */
  int n_requests;
  float *region;
};

static size_t align_up(size_t bytes) {
  return (bytes + ACTS_ALIGN - 1) / ACTS_ALIGN * ACTS_ALIGN;
}

void acts_take(dt_acts *a, void *slot, size_t bytes) {
  if (!a->shared) {
    a->owned = dt_realloc(a->owned, (size_t)(a->n_owned + 1) * sizeof *a->owned);
    a->owned[a->n_owned++] = *(void **)slot = a->be->alloc(a->be, bytes ? bytes : 1);
    a->owned_bytes += bytes;
    return;
  }
  a->requests = dt_realloc(a->requests, (size_t)(a->n_requests + 1) * sizeof *a->requests);
  a->requests[a->n_requests++] = (acts_request){slot, a->used};
  a->used += align_up(bytes);
}

/* The end of a block's layout: the next block starts the shared region again. */
static void acts_end_block(dt_acts *a) {
  if (a->used > a->peak) a->peak = a->used;
  a->used = 0;
}

static void acts_place(dt_acts *a) {
  if (!a->n_requests) return;
  a->region = a->be->alloc(a->be, a->peak);
  for (int i = 0; i < a->n_requests; i++) *a->requests[i].slot = (char *)a->region + a->requests[i].offset;
}

static void acts_free(dt_acts *a) {
  if (!a) return;
  for (int i = 0; i < a->n_owned; i++) a->be->free(a->be, a->owned[i]);
  if (a->region) a->be->free(a->be, a->region);
  free(a->owned);
  free(a->requests);
  free(a);
}

/* Whether layer i of block b holds the block's output in its y and dy: the last layer, or the
 * batchnorm whose buffers a fused relu ending the block shares. */
static int block_output(const dt_seq *s, const dt_block *b, int i) {
  return i == b->last || s->layers[b->last]->fused_into == s->layers[i];
}

/* The bytes of l's y (and of its dy) for `batch` rows: 2 a value when 16-bit (y16), a linear's in rows of
 * dt_ld16(out) values. */
static size_t act_bytes(const dt_layer *l, int64_t batch) {
  if (l->y16 && (l->ops->traits & DT_LAYER_LINEAR))
    return (size_t)(shape_rows(l->in, batch) * dt_ld16(l->args.out)) * 2;
  return (size_t)(batch * shape_size(l->out)) * (l->y16 ? 2 : sizeof(float));
}

/* Lays out the activations of s's layers: everything in the shared region when `inside` a block;
 * else, when `recompute`, each block's layers there but for the block's output. */
static void alloc_seq(dt_seq *s, dt_backend *be, dt_acts *acts, int64_t max_batch, int recompute, int inside,
                      int frozen) {
  for (int i = 0; i < s->n; i++) {
    dt_layer *l = s->layers[i];
    const dt_block *b = recompute && !inside ? block_of(s, i) : NULL;
    const int shared = inside || b;
    if (!l->fused_into) { /* a fused relu's output is its batchnorm's (model_alloc, once placed) */
      size_t bytes = act_bytes(l, max_batch);
      acts->shared = inside || (b && !block_output(s, b, i));
      acts_take(acts, &l->y, bytes);
      if (!frozen && !l->dy_of) acts_take(acts, &l->dy, bytes); /* a frozen model has no backward */
      acts->shared = shared;
      if (l->ops->alloc) l->ops->alloc(l, be, acts, max_batch);
      alloc_seq(&l->body, be, acts, max_batch, 0, shared, frozen);
      alloc_seq(&l->shortcut, be, acts, max_batch, 0, shared, frozen);
    }
    if (b && i == b->last) acts_end_block(acts);
  }
  acts->shared = 0;
}

/* What a layer's memory callback adds to the activations for `batch` rows. */
static size_t layer_own_bytes(const dt_layer *l, int64_t batch) {
  dt_memory mem = {0};
  if (l->ops->memory) l->ops->memory(l, batch, 1, &mem);
  return mem.activations;
}

/* Mirrors alloc_seq: adds the bytes each buffer takes to *kept (outside the shared region) or to
 * *used (the block being counted), raising *peak at each block's end. */
static void count_seq(const dt_seq *s, int64_t batch, int recompute, int inside, int frozen, size_t *kept, size_t *used,
                      size_t *peak) {
  for (int i = 0; i < s->n; i++) {
    const dt_layer *l = s->layers[i];
    const dt_block *b = recompute && !inside ? block_of(s, i) : NULL;
    const int shared = inside || b;
    if (!l->fused_into) {
      size_t out = (frozen || l->dy_of ? 1 : 2) * act_bytes(l, batch); /* y, dy */
      *(inside || (b && !block_output(s, b, i)) ? used : kept) += out;
      *(shared ? used : kept) += layer_own_bytes(l, batch);
      count_seq(&l->body, batch, 0, shared, frozen, kept, used, peak);
      count_seq(&l->shortcut, batch, 0, shared, frozen, kept, used, peak);
    }
    if (b && i == b->last) {
      if (*used > *peak) *peak = *used;
      *used = 0;
    }
  }
}

size_t model_activation_bytes(const dt_model *m, int64_t batch, int recompute) {
  size_t kept = 0, used = 0, peak = 0;
  count_seq(&m->top, batch, recompute == DT_RECOMPUTE_BLOCKS, 0, m->frozen, &kept, &used, &peak);
  return kept + peak;
}

const dt_layer *model_largest_activations(const dt_model *m, int64_t batch, size_t *bytes) {
  const dt_layer *most = NULL;
  *bytes = 0;
  for (int i = 0; i < m->top.n; i++) {
    dt_seq one = {.n = 1, .layers = &m->top.layers[i]};
    size_t kept = 0, used = 0, peak = 0;
    count_seq(&one, batch, 0, 0, m->frozen, &kept, &used, &peak);
    if (kept > *bytes) *bytes = kept, most = m->top.layers[i];
  }
  return most;
}

void model_alloc(dt_model *m, dt_backend *be, int64_t max_batch, uint64_t seed) {
  m->be = be;
  m->max_batch = max_batch;
  m->params = be->alloc(be, (size_t)m->n_params * sizeof(float));
  m->grads = m->frozen ? NULL : be->alloc(be, (size_t)m->n_params * sizeof(float));
  m->bufs = be->alloc(be, (size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float));
  m->input_x = be->alloc(be, (size_t)(max_batch * shape_size(m->input)) * sizeof(float));
  if (m->n_w16) {
    m->weights16 = (void *)be->alloc(be, (size_t)m->w16_values * sizeof *m->weights16);
    m->w16_entries = (void *)be->alloc(be, (size_t)m->n_w16 * sizeof *m->w16_entries);
    be->to_device(be, m->w16_entries, m->w16_table, (size_t)m->n_w16 * sizeof *m->w16_entries);
  }
  if (m->g16_values) m->grads16 = (void *)be->alloc(be, (size_t)m->g16_values * sizeof *m->grads16);
  m->norm = be->alloc(be, (size_t)(2 * m->in_channels) * sizeof(float));
  be->to_device(be, m->norm, m->in_mean, (size_t)m->in_channels * sizeof(float));
  be->to_device(be, m->norm + m->in_channels, m->in_std, (size_t)m->in_channels * sizeof(float));
  m->acts = dt_calloc(1, sizeof *m->acts);
  m->acts->be = be;
  alloc_seq(&m->top, be, m->acts, max_batch, m->recompute, 0, m->frozen);
  acts_place(m->acts);
  for (int i = 0; i < m->n_all; i++) { /* pre-order: a residual before its branches, a batchnorm before its relu */
    dt_layer *l = m->all[i];
    if (l->dy_of) l->dy = l->dy_of->dy;
    if (l->fused_into) l->y = l->fused_into->y, l->dy = l->fused_into->dy;
  }
  /* the estimate (--dry-run, the memory check) is the layers' memory callbacks: they must mirror alloc */
  size_t want = model_activation_bytes(m, max_batch, m->recompute ? DT_RECOMPUTE_BLOCKS : DT_RECOMPUTE_NONE);
  size_t got = m->acts->owned_bytes + m->acts->peak;
  DT_ASSERT(got >= want && got <= want + (size_t)m->acts->n_requests * ACTS_ALIGN);
  float *hp = dt_calloc((size_t)(m->n_params ? m->n_params : 1), sizeof(float));
  float *hb = dt_calloc((size_t)(m->n_bufs ? m->n_bufs : 1), sizeof(float));
  for (int i = 0; i < m->n_all; i++) {
    dt_layer *l = m->all[i];
    /* each layer's stream is derived from the seed and its pre-order index */
    if (l->ops->init) l->ops->init(l, hp, hb, dt_hash64(seed * 1000003ULL + (uint64_t)i + 1));
  }
  be->to_device(be, m->params, hp, (size_t)m->n_params * sizeof(float));
  be->to_device(be, m->bufs, hb, (size_t)m->n_bufs * sizeof(float));
  free(hp);
  free(hb);
}

static void free_seq(dt_seq *s, dt_backend *be) {
  for (int i = 0; i < s->n; i++) {
    dt_layer *l = s->layers[i];
    if (be && !l->fused_into && l->ops->release) l->ops->release(l, be);
    free_seq(&l->body, be);
    free_seq(&l->shortcut, be);
    free(l->args.tie);
    free(l->priv);
    free(l);
  }
  free(s->layers);
  free(s->blocks);
  *s = (dt_seq){0};
}

void model_free(dt_model *m) {
  dt_backend *be = m->be;
  if (be) {
    be->free(be, m->params);
    if (m->grads) be->free(be, m->grads);
    be->free(be, m->bufs);
    be->free(be, m->input_x);
    be->free(be, m->norm);
    if (m->weights16) be->free(be, m->weights16), be->free(be, m->w16_entries);
    if (m->grads16) be->free(be, m->grads16);
  }
  free(m->w16_table);
  free_seq(&m->top, be);
  acts_free(m->acts);
  free(m->all);
  free(m->tensors);
  memset(m, 0, sizeof *m);
}

/* The layer a parameter tensor belongs to. */
static const dt_layer *tensor_layer(const dt_model *m, const dt_tensor *t) {
  for (int i = 0; i < m->n_all; i++) {
    const dt_layer *l = m->all[i];
    if (t->offset >= l->param_off && t->offset < l->param_off + l->n_params) return l;
  }
  return NULL;
}

static int tensor_decays(const dt_model *m, const dt_tensor *t, int no_decay) {
  const dt_layer *l = tensor_layer(m, t);
  const char *leaf = strrchr(t->name, '.');
  int norm = l && (l->ops->traits & DT_LAYER_NORM);
  if ((no_decay & DT_NO_DECAY_NORM) && norm) return 0;
  if ((no_decay & DT_NO_DECAY_EMBEDDING) && l && (l->ops->traits & DT_LAYER_EMBEDDING)) return 0;
  if ((no_decay & DT_NO_DECAY_BIAS) && !norm && leaf && !strcmp(leaf, ".bias")) return 0;
  return 1;
}

int model_decay_runs(const dt_model *m, int no_decay, float weight_decay, dt_decay_run *runs) {
  int n = 0;
  int64_t end = 0; /* the parameters are laid out one tensor after another: each run ends where the next starts */
  for (int i = 0; i < m->n_tensors; i++) {
    const dt_tensor *t = &m->tensors[i];
    if (t->is_buffer) continue;
    DT_ASSERT(t->offset == end);
    const float wd = tensor_decays(m, t, no_decay) ? weight_decay : 0.0f;
    if (!n || runs[n - 1].weight_decay != wd) runs[n++] = (dt_decay_run){.start = t->offset, .weight_decay = wd};
    end += t->count;
  }
  return n;
}

void model_print_layer_keys(FILE *out) {
  fprintf(out, "\n| layer | parameters (type, default) |\n|---|---|\n");
  for (int k = 0; k < dt_n_layer_kinds; k++) {
    const dt_layer_ops *ops = dt_layer_kinds[k];
    fprintf(out, "| `%s` |", ops->kind);
    if (!ops->n_keys) fprintf(out, " none");
    for (int i = 0; i < ops->n_keys; i++) {
      const dt_key *key = &ops->keys[i];
      fprintf(out, "%s `%s` (%s, %s): %s", i ? ";" : "", key->path, keys_type_name(key),
              key->deflt ? key->deflt : "required", key->doc);
    }
    fprintf(out, " |\n");
  }
}

/* Mirrors model_alloc and the layers' alloc functions, plus the CPU backend's per-thread conv
 * workspaces (columns of one sample and private filter gradients). The input is m->input_x. */
dt_memory model_memory(const dt_model *m, int64_t batch, int optim_states, int threads) {
  dt_memory mem = {0};
  size_t f = sizeof(float);
  mem.params = (size_t)m->n_params * f;
  mem.grads = m->frozen ? 0 : mem.params;
  mem.optim = (size_t)optim_states * mem.params;
  mem.buffers =
      (size_t)m->n_bufs * f + (size_t)(m->w16_values + m->g16_values) * 2 + (size_t)m->n_w16 * sizeof(dt_weight16);
  for (int i = 0; i < m->n_all; i++) {
    dt_memory layer = {0}; /* its activations are counted where model_activation_bytes places them */
    if (m->all[i]->ops->memory) m->all[i]->ops->memory(m->all[i], batch, threads, &layer);
    mem.buffers += layer.buffers;
    if (layer.workspace > mem.workspace) mem.workspace = layer.workspace;
  }
  mem.activations = (size_t)(batch * shape_size(m->input)) * f +
                    model_activation_bytes(m, batch, m->recompute ? DT_RECOMPUTE_BLOCKS : DT_RECOMPUTE_NONE);
  mem.total = mem.params + mem.grads + mem.optim + mem.buffers + mem.activations + mem.workspace;
  return mem;
}

int64_t model_max_row(const dt_model *m) {
  int64_t most = shape_size(m->input);
  for (int i = 0; i < m->n_all; i++) {
    const dt_layer *l = m->all[i];
    int64_t v = l->ops->row_values ? l->ops->row_values(l) : shape_size(l->out);
    if (v > most) most = v;
  }
  const int64_t teacher = m->teacher ? model_max_row(m->teacher) : 0; /* its batch is ours */
  return teacher > most ? teacher : most;
}

int64_t model_flops(const dt_model *m) {
  int64_t f = 0;
  for (int i = 0; i < m->n_all; i++)
    if (m->all[i]->ops->flops) f += m->all[i]->ops->flops(m->all[i]);
  return f;
}

static void print_int(FILE *out, int64_t v, int width) {
  char raw[32], buf[48];
  snprintf(raw, sizeof raw, "%lld", (long long)v);
  int len = (int)strlen(raw), k = 0;
  for (int i = 0; i < len; i++) {
    buf[k++] = raw[i];
    if ((len - i - 1) % 3 == 0 && i != len - 1) buf[k++] = ',';
  }
  buf[k] = 0;
  fprintf(out, "%*s", width, buf);
}

static void summary_seq(const dt_seq *s, FILE *out, int depth) {
  for (int i = 0; i < s->n; i++) {
    const dt_layer *l = s->layers[i];
    char shape[64], label[96];
    shape_text(l->out, shape, sizeof shape);
    snprintf(label, sizeof label, "%*s%s%s", depth * 2, "", l->ops->kind,
             l->fused_into || l->gelu_prev ? " (fused)" : "");
    int64_t own = 0;
    for (int t = 0; t < l->n_tensors; t++)
      if (!l->tensors[t].is_buffer) own += l->tensors[t].count;
    fprintf(out, "  %-14s %-22s %-20s", l->name, label, shape);
    print_int(out, own, 12);
    fprintf(out, "\n");
    if (l->body.n) {
      summary_seq(&l->body, out, depth + 1);
      summary_seq(&l->shortcut, out, depth + 1);
    }
  }
}

void model_summary(const dt_model *m, FILE *out) {
  char in[64];
  shape_text(m->input, in, sizeof in);
  fprintf(out, "  %-14s %-22s %-20s %12s\n", "name", "layer", "output shape", "params");
  fprintf(out, "  %-14s %-22s %-20s %12s\n", "", "input", in, "");
  summary_seq(&m->top, out, 0);
  fprintf(out, "  total parameters: ");
  print_int(out, m->n_params, 0);
  if (m->n_bufs) fprintf(out, " (plus %lld batchnorm running-statistics values)", (long long)m->n_bufs);
  fprintf(out, "\n");
  fprintf(out, "  forward FLOPs per sample: ");
  print_int(out, model_flops(m), 0);
  fprintf(out, " (%.2f MFLOP)\n", (double)model_flops(m) / 1e6);
  fprintf(out, "  loss: %s", loss_name(&m->loss));
  if (m->loss.label_smoothing > 0) fprintf(out, " (label_smoothing %g)", m->loss.label_smoothing);
  fprintf(out, "\n");
  if (m->teacher) {
    const dt_model *t = m->teacher;
    fprintf(out, "  distillation: %g x %s from a frozen teacher + %g x the loss; teacher: ", m->loss.alpha,
            m->loss.distill == DT_DISTILL_KL ? "T^2 KL" : "mse", 1.0 - m->loss.alpha);
    print_int(out, t->n_params, 0);
    fprintf(out, " parameters, %.2f MFLOP per sample (%.2fx the model's forward)", (double)model_flops(t) / 1e6,
            model_flops(m) ? (double)model_flops(t) / (double)model_flops(m) : 0.0);
    if (m->loss.distill == DT_DISTILL_KL) fprintf(out, ", temperature %g", m->loss.temperature);
    fprintf(out, "\n");
  }
}

void seq_forward(dt_seq *s, dt_pass *pass, const float *x) {
  for (int i = 0; i < s->n; i++) {
    dt_layer *l = s->layers[i];
    l->ops->forward(l, pass, i == 0 ? x : s->layers[i - 1]->y);
  }
}

/* train.recompute blocks: the forward of block b again, from its kept input, filling the shared
 * region its backward reads. Dropout draws from the micro-batch's seed and the layer's index, so
 * they repeat; batchnorm reuses its statistics (pass->recomputing). */
static void recompute_block(dt_seq *s, dt_pass *pass, const float *x, const dt_block *b) {
  pass->recomputing = 1;
  for (int i = b->first; i <= b->last; i++) {
    dt_layer *l = s->layers[i];
    l->ops->forward(l, pass, i == 0 ? x : s->layers[i - 1]->y);
  }
  pass->recomputing = 0;
}

void seq_backward(dt_seq *s, dt_pass *pass, const float *x, float *dx) {
  int b = s->n_blocks - 1; /* the last block that does not start after layer i */
  for (int i = s->n - 1; i >= 0; i--) {
    dt_layer *l = s->layers[i];
    while (b >= 0 && s->blocks[b].first > i) b--;
    /* the last block's insides are still in the shared region from forward */
    if (s->recompute && b >= 0 && b < s->n_blocks - 1 && s->blocks[b].last == i)
      recompute_block(s, pass, x, &s->blocks[b]);
    const float *xin = i == 0 ? x : s->layers[i - 1]->y;
    float *dxin = i == 0 ? dx : s->layers[i - 1]->dy;
    l->ops->backward(l, pass, xin, dxin);
    if (pass->grads_ready && l->n_params) pass->grads_ready(pass->ctx, l->param_off);
  }
}

void model_weights16(dt_model *m, const float *params) {
  if (!m->n_w16) return;
  dt_op op = {.type = DT_OP_WEIGHTS16};
  op.p.weights16 = (typeof(op.p.weights16)){
      .params = params, .w16 = m->weights16, .table = m->w16_entries, .n = m->n_w16, .rows = m->w16_rows};
  backend_run(m->be, &op);
  m->w16_made = 1;
}

void model_forward(dt_model *m, dt_pass *pass) {
  pass->weights16 = m->weights16;
  DT_ASSERT(!m->frozen || !m->n_w16 || m->w16_made); /* a frozen model's, as its weights were loaded */
  if (!m->frozen) model_weights16(m, pass->params);
  seq_forward(&m->top, pass, m->input_x);
}
void model_backward(dt_model *m, dt_pass *pass) {
  DT_ASSERT(!m->grads16 || pass->grads == m->grads);
  pass->grads16 = m->grads16;
  m->g16_pending = m->n_w16;
  seq_backward(&m->top, pass, m->input_x, NULL);
  model_add_grads16(m, 0);
}

void model_add_grads16(dt_model *m, int64_t from) {
  if (!m->grads16) return; /* no filters, or a frozen model's */
  const dt_weight16 *t = m->w16_table;
  int first = -1, last = -1; /* the entries with grad not yet added, at offsets >= from: first..last */
  for (int i = m->g16_pending - 1; i >= 0 && (!t[i].grad || t[i].src >= from); i--)
    if (t[i].grad) {
      if (last < 0) last = i;
      first = i;
    }
  if (first < 0) return;
  m->g16_pending = first;
  const int64_t rows = t[last].row0 + t[last].rows - t[first].row0;
  dt_op op = {.type = DT_OP_GRADS16};
  op.p.grads16 = (typeof(op.p.grads16)){
      .grads = m->grads, .g16 = m->grads16, .table = m->w16_entries + first, .n = last - first + 1, .rows = rows};
  backend_run(m->be, &op);
}
float *model_logits(dt_model *m) {
  return m->top.layers[m->top.n - 1]->y;
}
float *model_dlogits(dt_model *m) {
  return m->top.layers[m->top.n - 1]->dy;
}

void model_logits_to_host(dt_model *m, float *dst, int64_t row, int64_t n) {
  const int format = m->top.layers[m->top.n - 1]->y16;
  const int64_t k = m->n_classes, ld = dt_ld16(k);
  if (!format) {
    m->be->to_host(m->be, dst, model_logits(m) + row * k, (size_t)(n * k) * sizeof(float));
    return;
  }
  uint16_t *h = dt_malloc((size_t)(n * ld + 1) * sizeof *h);
  m->be->to_host(m->be, h, (const uint16_t *)(const void *)model_logits(m) + row * ld, (size_t)(n * ld) * sizeof *h);
  for (int64_t r = 0; r < n; r++)
    for (int64_t j = 0; j < k; j++) dst[r * k + j] = dt_from_16(h[r * ld + j], format);
  free(h);
}

void model_input(dt_model *m, const float *raw, int64_t rows) {
  if (m->tokens) { /* token ids, taken as they are */
    backend_copy(m->be, m->input_x, raw, rows * m->tokens);
    return;
  }
  int64_t ch = m->in_channels;
  dt_op op = {.type = DT_OP_INPUT,
              .p.input = {.b = rows,
                          .c = ch,
                          .s = shape_size(m->input) / ch,
                          .scale = m->in_scale,
                          .mean = m->has_mean ? m->norm : NULL,
                          .std = m->has_std ? m->norm + ch : NULL,
                          .raw = raw,
                          .x = m->input_x,
                          .x16 = m->input16}};
  backend_run(m->be, &op);
}

void model_loss(dt_model *m, dt_pass *pass, const int32_t *labels, const float *targets, double *sums) {
  loss_run(&m->loss, pass->be, pass->batch * m->n_labels, m->n_classes, 1.0 / pass->global_targets, pass->loss_weight,
           pass->grad_scale, model_logits(m), pass->teacher_logits, labels, targets, model_dlogits(m), sums,
           m->top.layers[m->top.n - 1]->y16);
}
