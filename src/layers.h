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

#endif
