/* layers.h: the layer kinds, one family per file (layer_*.c). */
#ifndef DT_LAYERS_H
#define DT_LAYERS_H

#include "model.h"

extern const dt_layer_ops dt_layer_linear;    /* layer_dense.c */
extern const dt_layer_ops dt_layer_conv2d;    /* layer_conv.c */
extern const dt_layer_ops dt_layer_batchnorm; /* layer_norm.c */
extern const dt_layer_ops dt_layer_maxpool;   /* layer_pool.c */
extern const dt_layer_ops dt_layer_avgpool;
extern const dt_layer_ops dt_layer_global_avgpool;
extern const dt_layer_ops dt_layer_relu; /* layer_activation.c */
extern const dt_layer_ops dt_layer_gelu;
extern const dt_layer_ops dt_layer_tanh;
extern const dt_layer_ops dt_layer_sigmoid;
extern const dt_layer_ops dt_layer_dropout;
extern const dt_layer_ops dt_layer_flatten;
extern const dt_layer_ops dt_layer_residual; /* layer_residual.c */

/* layer_loss.c: parses model.loss (a name or a one-key map) */
int loss_parse(dt_model *m, const dt_node *node, dt_status *st);
/* Loss over pass->batch rows: writes dlogits (weighted by 1/global_count); adds to sums. */
void loss_compute(dt_model *m, dt_pass *pass, const int32_t *labels, const float *targets, double *loss_sum,
                  double *correct);

#endif
