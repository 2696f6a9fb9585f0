/* fuzz_data: HDF5 dataset validation and reading (libFuzzer). Input: an HDF5 file, opened as the
 * data file of a small CNN's config (/train/images, /train/labels, /test/...), its rows then read
 * as training does. Every malformed file must give an exit-2 (bad input) or exit-5 (read failure)
 * error with a message; none may crash, hang, leak or trip a sanitizer in our code.
 * The reader runs in-process (data_hdf5.c is included here for its static open_splits), so that
 * libFuzzer sees its coverage; h5_probe runs first, as data_open does, and an input that crashes
 * HDF5 itself in the probe's child is skipped (the product turns that crash into an exit-2 error:
 * test_cli's test_file_that_crashes_hdf5); a crash of our code there aborts. Seeds: tests/fuzz/corpus/data
 * (make_seeds.py). */
#include "fuzz_h5.h"

#include "../../src/data_hdf5.c"

int LLVMFuzzerTestOneInput(const uint8_t *input, size_t size) {
  fuzz_write(&setup, input, size);
  probe_args a = {&setup.cfg, &setup.model, 1, 0};
  dt_status probe = {0};
  if (fuzz_probe("fuzz_data", setup.data_path, probe_splits, &a, &probe)) return 0;
  dt_data d;
  dt_status st = {0};
  if (!open_splits(&d, &setup.cfg, &setup.model, 1, 0, setup.cfg.v.cache, &st)) {
    /* read the first and last rows of each split, as a batch */
    dt_split *splits[2] = {&d.train, d.has_val ? &d.val : NULL};
    for (int s = 0; s < 2 && splits[s] && !st.code; s++) {
      int64_t n = splits[s]->hi - splits[s]->lo, idx[2] = {splits[s]->lo, splits[s]->hi - 1};
      float x[2 * 36], targets[2 * 3];
      int32_t labels[2];
      if (n) data_gather(&d, splits[s], idx, 2, x, labels, targets, &st);
    }
  }
  fuzz_check("fuzz_data", &st);
  data_close(&d);
  fuzz_check_closed("fuzz_data");
  return 0;
}
