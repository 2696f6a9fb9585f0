/* h5util.h: HDF5's error stack as text for our messages, and a crash-proof first read of a file.
 * Call h5_error_text after a failed HDF5 call; it clears the stack. Automatic error printing is
 * turned off by h5_quiet(). */
#ifndef DT_H5UTIL_H
#define DT_H5UTIL_H

#include <stddef.h>

#include "common.h"

/* The innermost messages of HDF5's error stack into buf; returns buf. */
const char *h5_error_text(char *buf, size_t cap);
/* Turns off HDF5's own printing of errors: ddp_train reports them itself. */
void h5_quiet(void);

/* Runs reader(ctx, st) in a forked child first and returns the child's status. HDF5 1.10 does not
 * check every structure of a file it parses: a corrupt heap or B-tree can make it crash (a NULL
 * from a huge allocation it then copies into) or spin. In the child such a crash or a read that
 * outlasts timeout_s (killed then) becomes an exit-2 error naming path and `what`; the caller
 * reads the file for real only after the child succeeded. reader must not touch MPI, CUDA or
 * threads; what it allocates dies with the child. */
int h5_probe(const char *path, const char *what, int (*reader)(void *ctx, dt_status *st), void *ctx, double timeout_s,
             dt_status *st);

#endif
