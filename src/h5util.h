/* h5util.h: HDF5's error stack as text for our messages, a crash-proof first read of a file, and
 * files built in memory for writing. Call h5_error_text after a failed HDF5 call; it clears the
 * stack. Automatic error printing is turned off by h5_quiet(). */
#ifndef DT_H5UTIL_H
#define DT_H5UTIL_H

#include <hdf5.h>
#include <stddef.h>

#include "common.h"

/* The innermost messages of HDF5's error stack into buf; returns buf. */
const char *h5_error_text(char *buf, size_t cap);
/* Whether HDF5's error stack says a file could not be locked (another process holds it, or the
 * filesystem has no locks); leaves the stack for h5_error_text. */
int h5_error_is_lock(void);
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

/* A file HDF5 builds in memory (the core driver, no backing store), for the caller to write out
 * with its own checked writes: HDF5 never sees a disk error. (After a write error in a file of
 * its own, such as ENOSPC, HDF5 1.10's H5Fclose fails half-way and leaves the file registered, and
 * its exit-time cleanup crashes in H5F__close_cb.) Owns: buf, from h5_image_create until
 * h5_image_free. */
typedef struct {
  unsigned char *buf; /* the file's bytes once it is closed */
  size_t cap;         /* bytes allocated */
  int closed;         /* HDF5 has closed the file: buf is the final image */
} h5_image;

/* Creates the file (name: for HDF5's messages only, as /dev/null/NAME; nothing on disk is read or
 * created) with checksummed metadata (the 1.10 format), its memory grown size_hint bytes at a time.
 * Returns the file, or -1 (HDF5's error stack set). */
hid_t h5_image_create(h5_image *im, const char *name, size_t size_hint);
/* The length of the closed image: the end-of-file address its superblock records. 0 when the image is
 * not a closed HDF5 file. */
size_t h5_image_length(const h5_image *im);
void h5_image_free(h5_image *im);

#endif
