/* fuzz_checkpoint: the checkpoint reader (libFuzzer). Input: a checkpoint file, read as --resume
 * reads it (the /meta attributes, then the tensors and SGD momentum state of a small CNN). Every
 * malformed file must give an exit-2 or exit-5 error with a message; none may crash, hang, leak
 * or trip a sanitizer in our code. The readers run in-process (checkpoint.c is included here for
 * its static read_meta and load) so that libFuzzer sees their coverage, after the h5_probe child
 * that ckpt_load runs: an input that crashes HDF5 itself there is skipped, and the child's status
 * must equal the in-process one. Seeds: tests/fuzz/corpus/checkpoint (make_seeds.py). */
#include "fuzz_h5.h"

#include "../../src/checkpoint.c"

int LLVMFuzzerTestOneInput(const uint8_t *input, size_t size) {
  fuzz_write(&setup, input, size);
  const dt_model *m = &setup.model;
  dt_ckpt_data d;
  memset(&d, 0, sizeof d);
  size_t pb = (size_t)(m->n_params ? m->n_params : 1) * sizeof(float);
  d.params = malloc(pb);
  d.opt[0] = malloc(pb);
  d.bufs = malloc((size_t)(m->n_bufs ? m->n_bufs : 1) * sizeof(float));
  probe_args a = {.path = setup.data_path, .m = m, .d = &d};
  dt_status probe = {0}, st = {0};
  if (!fuzz_probe("fuzz_checkpoint", setup.data_path, probe_load, &a, &probe)) {
    char *config_text = NULL;
    load(setup.data_path, m, &d, &config_text, &st);
    free(config_text);
    fuzz_check("fuzz_checkpoint", &st);
    fuzz_check_same("fuzz_checkpoint", &probe, &st);
    fuzz_check_closed("fuzz_checkpoint");
  }
  free(d.params);
  free(d.opt[0]);
  free(d.bufs);
  return 0;
}
