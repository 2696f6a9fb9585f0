/* checkpoint.h: the HDF5 layout of a model's tensors, shared by model.init_from and the files
 * ddp_train writes. Group /model holds one float32 dataset per tensor, named as PyTorch's
 * state_dict keys of an nn.Sequential of the same layers ("0.weight", "4.body.1.running_var"),
 * shaped as PyTorch's tensors. Files are written under a temporary name, fsynced and renamed,
 * so a reader never sees a half-written file under the final name. */
#ifndef DT_CHECKPOINT_H
#define DT_CHECKPOINT_H

#include "config.h"
#include "model.h"

/* Loads every tensor of m from path (host arrays params (n_params), bufs (n_bufs)).
 * Exit 2 naming the file and tensor on a missing tensor or a shape mismatch. */
int ckpt_read_model(const char *path, const dt_model *m, float *params, float *bufs, dt_status *st);

/* Writes the /model tensors plus /meta attributes (config text, world size, step, version) atomically.
 * Exit 5 naming the path on any I/O failure. */
int ckpt_write_model(const char *path, const dt_model *m, const float *params, const float *bufs, const dt_config *cfg,
                     int world, int64_t step, dt_status *st);

#endif
