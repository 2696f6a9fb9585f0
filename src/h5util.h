/* h5util.h: HDF5's error stack as text for our messages. Call after a failed HDF5 call; clears
 * the stack. Automatic error printing is turned off by h5_quiet(). */
#ifndef DT_H5UTIL_H
#define DT_H5UTIL_H

#include <stddef.h>

/* The innermost messages of HDF5's error stack into buf; returns buf. */
const char *h5_error_text(char *buf, size_t cap);
/* Turns off HDF5's own printing of errors: ddp_train reports them itself. */
void h5_quiet(void);

#endif
