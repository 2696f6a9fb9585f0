/* model.h: the network as a list of layers (residual blocks nest two lists), its shapes, and the
 * flat buffers: all parameters in one float buffer, all gradients in another, batchnorm running
 * statistics in a third. Tensor names follow a PyTorch nn.Sequential of the same layers
 * ("3.weight", "4.body.0.weight", "5.running_var"), which is the checkpoint/init_from layout.
 * Owns: layers, their activation buffers and the flat buffers (backend memory). Borrows: config, backend. */
#ifndef DT_MODEL_H
#define DT_MODEL_H

#include <stdint.h>
#include <stdio.h>

#include "backend.h"
#include "config.h"
#include "loss.h"

/* Per-sample shape: (C,H,W); a vector of D is (D,1,1) with rank 1; a sequence of T vectors of D
 * is rank 2 with c = D, h = T, stored (T, D) row-major: layers on sequences act on rows of D. */
typedef struct {
  int rank;
  int64_t c, h, w;
} dt_shape;

static inline int64_t shape_size(dt_shape s) {
  return s.c * s.h * s.w;
}
/* The most elements a sample's shape or a tensor may have (4 TiB of floats): model_build refuses
 * more with exit 2, so that no size computed from the config overflows. */
#define DT_MAX_ELEMENTS ((int64_t)1 << 40)
/* 1 when c * h * w is at most DT_MAX_ELEMENTS (computed without overflow). */
int shape_fits(dt_shape s);
void shape_text(dt_shape s, char *buf, size_t cap); /* "(32, 28, 28)" */

/* Parameters of any layer kind; each kind declares the keys it accepts. */
typedef struct {
  int64_t out, kernel, stride, pad;
  int bias, sync;
  double momentum, eps, p, label_smoothing;
  const dt_node *body, *shortcut, *layers;
  int64_t vocab, dim, max_len, heads, times;
  int positions, causal, approximate;
  char *tie; /* linear: the embedding layer whose token matrix is the weight */
} dt_layer_args;

/* A named tensor of a layer: in the flat params (is_buffer 0) or the flat buffers (1). */
typedef struct {
  char name[160];
  int ndim;
  int64_t dims[4];
  int is_buffer;
  int64_t offset; /* into the whole flat buffer */
  int64_t count;
} dt_tensor;

/* Memory one rank needs, in bytes, by part, for `batch` rows per rank. */
typedef struct {
  size_t params, grads, optim, ema, buffers, activations, workspace, teacher, total;
} dt_memory; /* teacher: distillation's frozen model (its parameters, buffers and activations) */

typedef struct dt_layer dt_layer;
typedef struct dt_pass dt_pass;
typedef struct dt_acts dt_acts;
typedef struct dt_seq dt_seq;
typedef struct dt_model dt_model;

typedef struct {
  const char *kind;
  const dt_key *keys; /* accepted parameters */
  int n_keys;
  /* Infers l->out from l->in and l->args; declares tensors. Returns 0 or st (exit 2). */
  int (*setup)(dt_model *m, dt_layer *l, dt_status *st);
  /* PyTorch's default initialisation of this layer's tensors (host copies of params/bufs). */
  void (*init)(dt_layer *l, float *params, float *bufs, uint64_t seed);
  /* Allocates private buffers for up to max_batch rows (after y/dy): what lives from the layer's
   * forward to its backward through acts_take, anything it keeps longer (running statistics,
   * constants) from be, which release frees. */
  void (*alloc)(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch);
  void (*forward)(dt_layer *l, dt_pass *pass, const float *x);
  /* Reads l->dy; overwrites dx (NULL: not needed) and adds into parameter gradients. */
  void (*backward)(dt_layer *l, dt_pass *pass, const float *x, float *dx);
  void (*release)(dt_layer *l, dt_backend *be);
  int64_t (*flops)(const dt_layer *l); /* forward FLOPs per sample */
  /* Memory beyond y and dy for `batch` rows: adds what alloc takes through acts_take to
   * mem->activations (model_alloc checks the two agree), what it keeps longer to mem->buffers, and
   * raises mem->workspace to the per-thread scratch its ops need. NULL: none. */
  void (*memory)(const dt_layer *l, int64_t batch, int threads, dt_memory *mem);
  /* Values per sample of the largest buffer its ops index, where that is more than its output
   * (attention's (H, T, T) scores): the CUDA kernels index with 32 bits. NULL: its output. */
  int64_t (*row_values)(const dt_layer *l);
  /* What the model and the loops need to know of a kind, so that they name none (DT_LAYER_*). */
  unsigned traits;
  /* Whether no position of a sequence sees later ones (--sample pads after the prompt): NULL for
   * a position-wise kind, which trivially does not. */
  int (*causal)(const dt_layer *l);
  /* Picks its ops for the device (model_pick_ops): NULL for a kind whose ops are the same on both. */
  void (*pick)(dt_layer *l, const dt_model *m, int cuda, size_t shared_per_block);
} dt_layer_ops;

enum {
  DT_LAYER_FUSES_RELU = 1,  /* applies a relu right after it in its own ops (model.fuse: batchnorm, residual,
                               linear) */
  DT_LAYER_RELU = 2,        /* a relu: the layer before may apply it */
  DT_LAYER_NORM = 4,        /* a normalisation: its weights are optim.no_decay's "norm" group */
  DT_LAYER_EMBEDDING = 8,   /* a token embedding: optim.no_decay's "embedding", what linear{tie} may name */
  DT_LAYER_BLOCK = 16,      /* a block for train.recompute (residual) where it is not inside a repeat's copy */
  DT_LAYER_LINEAR = 32,     /* a linear: its GEMM may apply the tanh gelu after it, or that gelu's derivative
                               before it (model.fuse) */
  DT_LAYER_GELU = 64,       /* a gelu: in its tanh form, the linears around it may apply it */
  DT_LAYER_CONV = 128,      /* a convolution: without a bias, a batchnorm right after it may take its output and
                               give its gradient as the 16-bit convolution has them (y16, model.fuse) */
  DT_LAYER_BATCHNORM = 256, /* a batchnorm: what such a convolution may hand its output to */
  DT_LAYER_MAXPOOL = 512,   /* a max pooling: between such a batchnorm and a convolution, it may pool their 16-bit
                               NHWC values as they are */
  DT_LAYER_RESIDUAL = 1024, /* a residual: between such a batchnorm (or another) and a convolution, a global
                               average pool (or another), it may add 16-bit NHWC values (model.c's pick_trunk16) */
  DT_LAYER_GAP = 2048,      /* a global average pool: it may average such a residual's 16-bit sums */
  DT_LAYER_ADDS_DX = 4096,  /* a layernorm: opening a residual's body, its backward may add the residual's
                               gradient into its input gradient (dx_adds, model.fuse); before a linear or an
                               attention layer, it may hand them its output in bfloat16 (pick_norm16) */
  DT_LAYER_ATTENTION = 8192 /* an attention layer: its projection may read such a layernorm's 16-bit output */
};

/* The layer kinds (layers.c): the one of that name in the config, or NULL; their names (n_kinds). */
const dt_layer_ops *layer_kind(const char *kind);
extern const dt_layer_ops *const dt_layer_kinds[];
extern const int dt_n_layer_kinds;

/* A block of train.recompute blocks: layers first..last of a sequence. Only its input and its
 * output (last's y and dy) are kept through forward; the rest is laid out in a region every block
 * shares, and backward runs the block's forward again just before the block's own backward. */
typedef struct {
  int first, last;
} dt_block;

struct dt_seq {
  int n;
  dt_layer **layers;
  dt_block *blocks; /* each residual layer, each copy of a repeat's layers, in order */
  int n_blocks;
  int recompute; /* the model's top sequence under train.recompute blocks */
};

/* Activation memory: what layers keep from their forward to their backward in one pass. A layer
 * asks for it in alloc; the memory is in place (zeroed) when model_alloc returns. Owned by the
 * model (model.c). *slot is a pointer variable of the layer's state (float *, int32_t *, ...). */
void acts_take(dt_acts *a, void *slot, size_t bytes);

struct dt_layer {
  const dt_layer_ops *ops;
  dt_layer_args args;
  char name[128];  /* PyTorch module path: "3", "4.body.0" */
  char where[512]; /* config location, for messages */
  int index;       /* pre-order index over all layers (dropout streams) */
  dt_shape in, out;
  int64_t n_params, param_off, n_bufs, buf_off;
  dt_tensor tensors[4];
  int n_tensors;
  float *y, *dy;         /* (B, out) backend memory */
  dt_seq body, shortcut; /* residual only */
  dt_layer *tied;        /* linear{tie}: the embedding whose token matrix it uses (borrowed) */
  int fused_relu;        /* batchnorm, residual, linear: applies the relu that follows it (model.fuse) */
  dt_layer *fused_into;  /* relu: the layer that applies it; y and dy are that layer's (borrowed) */
  dt_layer *dy_of;       /* the layer whose dy this one's is (borrowed): for the last layer (or, for a fused
                            relu, its batchnorm) of a residual's body or shortcut, that residual (a term of a
                            sum has the sum's gradient, and no backward writes its own dy); for a gelu whose
                            backward the next linear applies, the linear before it */
  dt_layer *gelu_next;   /* linear: the tanh gelu right after it, which its GEMM's epilogue applies (model.fuse),
                            writing that layer's y; this layer's y is the gelu's input */
  dt_layer *gelu_prev;   /* gelu: the linear whose epilogue computes it (its forward has nothing to do) */
  dt_layer *dgelu_aux;   /* linear right after such a gelu: the linear before the gelu, whose y is the gelu's
                            input; this layer's input gradient passes through the gelu's derivative in its
                            GEMM's epilogue, into the gelu's dy, which is that linear's (dy_of) */
  dt_layer *dx_adds;     /* layernorm opening the body of a residual with no shortcut layers (model.fuse): that
                            residual, whose dy this layer's backward adds into its dx as it writes it (the
                            shortcut's gradient, which the residual then does not add) */
  int too_large;         /* layer_add_tensor got a tensor of more than DT_MAX_ELEMENTS */
  int fused_attention;   /* attention: its heads in the fused ops (model.attention, heads of at most
                            DT_ATTENTION_MAX_HD values) */
  int heads16;           /* attention with fused_attention (pick_heads16, CUDA under bf16): its projections q, k, v,
                            the merged heads and their gradients in bfloat16 (half.h's DT_F16_BF16), rows of 3C
                            and C values: written and read so by its GEMMs and the fused ops */
  int keeps_x16;         /* conv2d: its forward leaves x's 16-bit copy for its backward filter (CUDA,
                            train.precision bf16 or fp16, a model that trains) */
  dt_layer *bn_next;     /* conv2d without a bias: the batchnorm right after it (model.fuse), which may read
                            its y and write its dy as its 16-bit convolution has them */
  dt_layer *conv_next;   /* batchnorm after such a conv2d: the conv2d right after it (or after its fused relu),
                            which may read its y and write its dy as 16-bit NHWC too; maxpool after such a
                            batchnorm (pool_next), or a residual: the conv2d right after it, so too */
  dt_layer *pool_next;   /* batchnorm after such a conv2d: a maxpool right after it (or after its fused relu) that
                            a conv2d follows, which may pool its y and give its dy as 16-bit NHWC */
  dt_layer *res_next;    /* batchnorm after such a conv2d, or a residual: the residual right after it (or after
                            its fused relu), which may add its y and give its dy as 16-bit NHWC (pick_trunk16) */
  dt_layer *res_prev;    /* residual: the layer whose res_next it is */
  dt_layer *gap_next;    /* residual: a global_avgpool right after it (or after its fused relu), which may average
                            its y and give its dy so */
  int branches16;        /* residual: each branch begins with a conv2d and ends in a batchnorm right after a
                            conv2d (its bn_next), or is the identity: each may take x and give y as 16-bit NHWC */
  int y16;               /* conv2d with a bn_next, batchnorm with a conv_next, or a residual so (pick_trunk16),
                            picked for CUDA under bf16 or fp16: y and dy hold 16-bit values (half.h's DT_F16_*)
                            as (B, H, W, C), NHWC, as cuDNN writes and reads them (no copies to and from FP32
                            NCHW), 2 bytes a value; 0: FP32. The last layer, a linear (pick_logits16, CUDA under
                            bf16): the logits and their gradient in bfloat16 rows of dt_ld16(out) values
                            (backend.h's loss.logits16); so too a linear whose GEMM applies the gelu after it, and
                            that gelu (pick_gelu16: its input and output, and their shared gradient), and a
                            layernorm before a linear or attention layer (pick_norm16) */
  int x16;               /* batchnorm after such a conv2d: its x and dx are that layer's y and dy, in this format;
                            a pool_next, or a residual: so too, and its y and dy (y16); a global_avgpool: x, dx; a
                            linear after such a gelu, or a linear or attention layer after such a layernorm: x and
                            dx in bfloat16 rows (its GEMMs' a16, b16 and c16) */
  int in16;              /* conv2d after such a batchnorm or residual, or first in such a residual's branch: its
                            x and dx are that layer's y and dy, in this format (read as they are: no x16 copy);
                            the model's first layer: its x is the input op's (the model's input16; no dx) */
  int w16;               /* linear, attention, conv2d (model.c's pick_weights16): its weights are read from their
                            16-bit copies in the model's weights16, made once a forward (a frozen model's once,
                            as its weights are loaded; half.h's format) */
  int64_t w16_off[2];    /* those copies' offsets in weights16 (16-bit values), in the order of the layer's
                            weights (attention: qkv's, then proj's; a tied linear: its embedding's) */
  void *priv;            /* per-kind state */
};

/* Rows a layer's ops see for `batch` samples: B for vectors and images, B * T for sequences. */
static inline int64_t shape_rows(dt_shape s, int64_t batch) {
  return s.rank == 2 ? batch * s.h : batch;
}

/* Everything a pass needs; the train loop fills it for each micro-step. */
struct dt_pass {
  dt_backend *be;
  int64_t batch; /* local rows */
  int training;
  int recomputing;           /* train.recompute: a block's forward again, before its backward (batchnorm keeps the
                                statistics of the first forward: running ones are not updated twice) */
  double global_targets;     /* targets in the global batch (rows x labels per row, less ignored): the loss's weight */
  const double *loss_weight; /* (1) backend memory or NULL: 1 / global_targets, uploaded each step (so a captured
                                step replays whatever the count) */
  const float *grad_scale;   /* (1) backend memory or NULL: the fp16 loss scale dlogits carry */
  const uint64_t *step_seed; /* (1) backend memory: the micro-batch's dropout seed; NULL when not training */
  const float *teacher_logits;  /* (B, K) backend memory: distillation's teacher's logits for the loss, or NULL */
  float *params, *grads, *bufs; /* flat, backend memory */
  const uint16_t *weights16;    /* the model's 16-bit copies of params' weights (its weights16; set by model_forward),
                                   which layers with w16 read */
  uint16_t *grads16;            /* where layers with w16 leave their 16-bit filter gradients (the model's grads16;
                                   set by model_backward) */
  /* sync batchnorm: sums (n doubles, backend memory) over all ranks in place, queued where the
   * communicator allows; NULL: single process */
  void (*allreduce_sum)(void *ctx, double *data, int n);
  /* backward hook: every gradient at offset >= from is final for this pass */
  void (*grads_ready)(void *ctx, int64_t from);
  void *ctx;
};

struct dt_model {
  dt_shape input;
  dt_seq top;
  dt_layer **all; /* every layer in pre-order (borrowed pointers) */
  int n_all;
  dt_loss loss;
  int64_t n_outputs; /* logits per sample */
  int64_t tokens;    /* T for a token model (first layer embedding: the input is T token ids), else 0 */
  int64_t n_labels;  /* labels per sample: T for a token model, else 1 */
  int64_t n_classes; /* logits per label: n_outputs / n_labels */
  int64_t n_params, n_bufs;
  int recompute;      /* train.recompute blocks */
  int attention;      /* model.attention (DT_ATTENTION_*): read by the attention layers' setup and pick */
  int precision;      /* train.precision (DT_PREC_*): read by the conv layers' pick */
  int frozen;         /* forward only (distillation's teacher): no gradients, no dy; set before model_alloc */
  int fuse;           /* model.fuse */
  dt_model *teacher;  /* distill.teacher: its logits join the training loss (distill.h; borrowed), or NULL */
  dt_tensor *tensors; /* every tensor, in PyTorch state_dict order */
  int n_tensors;
  /* input normalisation (data.scale, data.mean, data.std): x = (raw * scale - mean[c]) / std[c] */
  float in_scale;
  int in_channels, has_mean, has_std;
  float in_mean[DT_MAX_LIST], in_std[DT_MAX_LIST];
  /* backend memory, after model_alloc */
  dt_backend *be;
  int64_t max_batch;
  float *params, *grads, *bufs;
  float *input_x; /* (B, input); as 16-bit NHWC (B, S, C) where input16 */
  int input16;    /* half.h's format: model_input writes input_x so, for a first conv2d (its in16) */
  /* model.fuse under bf16 (fp16: convolutions only) on CUDA: one 16-bit copy of each weight a GEMM or a
   * convolution reads, made at the start of each forward (pick_weights16; a layer's w16), or a frozen
   * model's once, as its weights are loaded (model_weights16) */
  dt_weight16 *w16_table; /* (n_w16) host memory: each copy's entry, in the order of the layers */
  int n_w16;
  int64_t w16_rows;         /* the entries' rows */
  int64_t w16_values;       /* the copies' 16-bit values, each copy's start 256-byte aligned */
  dt_weight16 *w16_entries; /* backend memory: w16_table */
  uint16_t *weights16;      /* backend memory: the copies */
  int w16_made;             /* model_weights16 has queued them at least once */
  /* a model that trains: its convolutions' filter gradients in 16 bits, as cuDNN computes them (the table's
   * entries with grad), each in its entry's layout at its dst, added into grads by model_add_grads16 */
  int64_t g16_values; /* the end of the last entry with grad, in 16-bit values; 0: none */
  uint16_t *grads16;  /* backend memory (g16_values), or NULL */
  int g16_pending;    /* during a backward: the entries before this one are not yet added into grads */
  float *norm;    /* (2 * in_channels): mean, then std */
  dt_acts *acts;  /* every layer's activation memory (owned) */
};

/* Parses model.layers/loss, infers every shape. Returns 0 or st (exit 2 naming layer and shapes). */
int model_build(dt_model *m, const dt_config *cfg, dt_status *st);
/* Layers whose ops depend on the device pick them for `cuda`, a GPU whose blocks may opt in to
 * shared_per_block bytes of shared memory (attention under model.attention auto: fused on CUDA where
 * its kernels fit), in m and its teacher; model_build has picked the CPU's. Before the memory
 * estimate and model_alloc. */
void model_pick_ops(dt_model *m, int cuda, size_t shared_per_block);
/* Allocates flat buffers and activations for max_batch rows; initialises from seed. */
void model_alloc(dt_model *m, dt_backend *be, int64_t max_batch, uint64_t seed);
void model_free(dt_model *m);

/* What a rank's buffers take for `batch` rows under the model's train.recompute. */
dt_memory model_memory(const dt_model *m, int64_t batch, int optim_states, int threads);
/* The layers' activation memory for `batch` rows (y, dy and what alloc takes through acts_take, not
 * the input) under train.recompute `recompute` (DT_RECOMPUTE_*), whatever the model's. */
size_t model_activation_bytes(const dt_model *m, int64_t batch, int recompute);
/* The top-level layer whose activations (with everything inside it, all kept) take the most for
 * `batch` rows, and in *bytes how much; NULL for a model without layers. */
const dt_layer *model_largest_activations(const dt_model *m, int64_t batch, size_t *bytes);

/* Splits the flat parameters into runs of consecutive tensors that do (weight_decay) or do not (0) take
 * weight decay under optim.no_decay's DT_NO_DECAY_* bits. Fills runs (capacity: m->n_tensors; the first
 * starts at 0, each ends where the next starts) and returns their number. */
int model_decay_runs(const dt_model *m, int no_decay, float weight_decay, dt_decay_run *runs);

/* Prints every layer kind with its parameters (Markdown), from the layers' own key tables. */
void model_print_layer_keys(FILE *out);

/* Prints the summary: each layer's output shape and parameters, totals, FLOPs per sample. */
void model_summary(const dt_model *m, FILE *out);
int64_t model_flops(const dt_model *m);
/* The largest tensor one row passes through: the input or a layer's output (values per row), the
 * teacher's included. */
int64_t model_max_row(const dt_model *m);

/* Queues the normalised input of rows raw rows (backend memory, (rows, input)) into m->input_x. */
void model_input(dt_model *m, const float *raw, int64_t rows);
/* Queues the 16-bit copies of params' weights (m->n_w16; none: nothing) into m->weights16. */
void model_weights16(dt_model *m, const float *params);
/* Forward over pass->batch rows of m->input_x; logits end in the last layer's y. First makes the 16-bit
 * copies of pass->params' weights (model_weights16; a frozen model's were made as its weights were loaded)
 * and points pass->weights16 at them, for its backward too. */
void model_forward(dt_model *m, dt_pass *pass);
/* The loss of the last forward over pass->batch rows: dlogits (the last layer's dy) written,
 * the summed loss and hits added to sums[0], sums[1]. labels, targets, sums: backend memory. */
void model_loss(dt_model *m, dt_pass *pass, const int32_t *labels, const float *targets, double *sums);
/* Backward from the last layer's dy (set by model_loss). */
void model_backward(dt_model *m, dt_pass *pass);
/* During model_backward, once every gradient at offset >= from is final: queues the addition of the 16-bit
 * filter gradients at offsets >= from that this backward has not yet added into m->grads (one op; none:
 * nothing). model_backward adds what is left as it ends; before then, whoever reads those gradients (the
 * buckets of ddp_ready) calls it first. */
void model_add_grads16(dt_model *m, int64_t from);
float *model_logits(dt_model *m);
float *model_dlogits(dt_model *m);
/* The logits of rows [row, row + n) of the last forward (rows of n_classes values) to host memory as FP32,
 * widened from bfloat16 where the classifier writes them so (y16). */
void model_logits_to_host(dt_model *m, float *dst, int64_t row, int64_t n);

/* Sequence runners (used by residual). dx may be NULL. */
void seq_forward(dt_seq *s, dt_pass *pass, const float *x);
void seq_backward(dt_seq *s, dt_pass *pass, const float *x, float *dx);
/* Builds a sequence from a YAML list; prefix names modules ("4.body."). */
int seq_build(dt_model *m, dt_seq *s, const dt_node *list, dt_shape in, const char *prefix, const char *origin_what,
              dt_status *st);

/* Layer helpers for families. */
void layer_add_tensor(dt_layer *l, const char *name, int is_buffer, int ndim, const int64_t *dims);
void init_uniform(float *p, int64_t n, float bound, uint64_t seed);
void init_normal(float *p, int64_t n, float std, uint64_t seed); /* normal(0, std) */

#endif
