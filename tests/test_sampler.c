/* test_sampler: the sharding properties, for world sizes 1 to 5 and dataset sizes that the
 * batch does not divide: every sample exactly once per epoch across ranks, the same
 * permutation on every rank, equal step counts, contiguous ownership, and drop_last. */
#include "dt_test.h"

#include "config.h"
#include "sampler.h"

static const int64_t sizes[] = {1, 7, 100, 257};
static const int64_t batches[] = {1, 3, 16, 64};

/* Runs one epoch on every rank; counts how often each row is used. Returns rows used. */
static int64_t run_epoch(int64_t n, int world, int64_t G, int contiguous, int drop_last, int64_t epoch, int *seen) {
  int64_t used = 0, steps = -1;
  for (int r = 0; r < world; r++) {
    dt_sampler s;
    sampler_init(&s, n, world, r, G, contiguous, drop_last, 1, 42);
    if (steps < 0) steps = s.steps;
    assert_int_equal(s.steps, steps); /* every rank runs the same number of steps */
    int64_t *idx = malloc((size_t)sampler_max_local(&s) * sizeof *idx);
    for (int64_t st = 0; st < s.steps; st++) {
      int64_t total = 0;
      int64_t k = sampler_batch(&s, epoch, st, idx, &total);
      assert_true(k <= sampler_max_local(&s));
      assert_int_equal(total, sampler_count(&s, st));
      assert_true(total <= G);
      for (int64_t i = 0; i < k; i++) {
        assert_true(idx[i] >= 0 && idx[i] < n);
        if (contiguous) assert_true(idx[i] >= s.own_lo && idx[i] < s.own_hi);
        seen[idx[i]]++;
        used++;
      }
    }
    free(idx);
    sampler_free(&s);
  }
  return used;
}

static void every_sample_exactly_once_per_epoch(void **state) {
  (void)state;
  for (int contiguous = 0; contiguous < 2; contiguous++)
    for (int world = 1; world <= 5; world++)
      for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
        for (size_t b = 0; b < sizeof batches / sizeof *batches; b++) {
          int64_t n = sizes[a], G = batches[b];
          if (contiguous && G < world) continue; /* a rank with no share of the batch */
          int *seen = calloc((size_t)n, sizeof(int));
          int64_t used = run_epoch(n, world, G, contiguous, 0, 3, seen);
          assert_int_equal(used, n);
          for (int64_t i = 0; i < n; i++)
            if (seen[i] != 1)
              fail_msg("n=%lld W=%d G=%lld contiguous=%d: row %lld used %d times", (long long)n, world, (long long)G,
                       contiguous, (long long)i, seen[i]);
          free(seen);
        }
}

static void drop_last_never_repeats_and_drops_only_the_tail(void **state) {
  (void)state;
  for (int world = 1; world <= 5; world++)
    for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
      for (size_t b = 0; b < sizeof batches / sizeof *batches; b++) {
        int64_t n = sizes[a], G = batches[b];
        int *seen = calloc((size_t)n, sizeof(int));
        int64_t used = run_epoch(n, world, G, 0, 1, 0, seen);
        assert_int_equal(used, (n / G) * G);
        for (int64_t i = 0; i < n; i++) assert_true(seen[i] <= 1);
        free(seen);
      }
}

/* In global mode, the ranks' slices of a step, concatenated in rank order, are the same
 * global batch whatever the world size: the trajectory does not depend on W. */
static void same_permutation_on_every_rank_and_world_size(void **state) {
  (void)state;
  const int64_t n = 257, G = 16;
  int64_t ref[257];
  int64_t pos = 0;
  {
    dt_sampler s;
    sampler_init(&s, n, 1, 0, G, 0, 0, 1, 9);
    int64_t tot;
    for (int64_t st = 0; st < s.steps; st++) pos += sampler_batch(&s, 2, st, ref + pos, &tot);
    sampler_free(&s);
  }
  assert_int_equal(pos, n);
  for (int world = 2; world <= 5; world++) {
    int64_t got[257];
    int64_t k = 0;
    dt_sampler *ranks = calloc((size_t)world, sizeof *ranks);
    for (int r = 0; r < world; r++) sampler_init(&ranks[r], n, world, r, G, 0, 0, 1, 9);
    for (int64_t st = 0; st < ranks[0].steps; st++)
      for (int r = 0; r < world; r++) {
        int64_t tot;
        k += sampler_batch(&ranks[r], 2, st, got + k, &tot);
      }
    assert_int_equal(k, n);
    assert_memory_equal(got, ref, sizeof ref);
    for (int r = 0; r < world; r++) sampler_free(&ranks[r]);
    free(ranks);
  }
}

static void epochs_and_seeds_change_the_order(void **state) {
  (void)state;
  dt_sampler a, b;
  int64_t ia[100], ib[100], tot;
  sampler_init(&a, 100, 1, 0, 100, 0, 0, 1, 1);
  sampler_init(&b, 100, 1, 0, 100, 0, 0, 1, 1);
  sampler_batch(&a, 0, 0, ia, &tot);
  sampler_batch(&b, 0, 0, ib, &tot);
  assert_memory_equal(ia, ib, sizeof ia); /* same seed and epoch: same order */
  sampler_batch(&b, 1, 0, ib, &tot);
  assert_memory_not_equal(ia, ib, sizeof ia);
  sampler_free(&b);
  sampler_init(&b, 100, 1, 0, 100, 0, 0, 1, 2);
  sampler_batch(&b, 0, 0, ib, &tot);
  assert_memory_not_equal(ia, ib, sizeof ia);
  /* a shuffle, not the identity */
  int identity = 1;
  for (int i = 0; i < 100; i++) identity &= ia[i] == i;
  assert_false(identity);
  sampler_free(&a);
  sampler_free(&b);
}

static void uneven_final_batch_is_split_across_ranks(void **state) {
  (void)state;
  /* n = 10, G = 8, W = 3: step 1 has 2 rows; the ranks take 0, 1 and 1 of them */
  int64_t counts[3], idx[8], tot;
  for (int r = 0; r < 3; r++) {
    dt_sampler s;
    sampler_init(&s, 10, 3, r, 8, 0, 0, 1, 5);
    assert_int_equal(s.steps, 2);
    counts[r] = sampler_batch(&s, 0, 1, idx, &tot);
    assert_int_equal(tot, 2);
    sampler_free(&s);
  }
  assert_int_equal(counts[0] + counts[1] + counts[2], 2);
  assert_true(counts[0] <= 1 && counts[1] <= 1 && counts[2] <= 1);
}

/* A local batch is never larger than the global batch's share rounded up (config_max_local_rows, what
 * every batch buffer holds), and a full global batch reaches it. */
static void largest_local_batch_is_the_rounded_up_share(void **state) {
  (void)state;
  for (int world = 1; world <= 5; world++)
    for (size_t bi = 0; bi < sizeof batches / sizeof *batches; bi++)
      for (size_t ni = 0; ni < sizeof sizes / sizeof *sizes; ni++)
        for (int contiguous = 0; contiguous < 2; contiguous++) {
          const int64_t G = batches[bi], n = sizes[ni];
          dt_config_values v = {.global_batch_size = G};
          const int64_t cap = config_max_local_rows(&v, world);
          int64_t most = 0;
          for (int r = 0; r < world; r++) {
            dt_sampler s;
            sampler_init(&s, n, world, r, G, contiguous, 0, 1, 7);
            int64_t *idx = malloc((size_t)(sampler_max_local(&s) + 1) * sizeof *idx), tot;
            assert_true(sampler_max_local(&s) <= cap);
            for (int64_t st = 0; st < s.steps; st++) {
              int64_t k = sampler_batch(&s, 0, st, idx, &tot);
              assert_true(k <= sampler_max_local(&s));
              if (k > most) most = k;
            }
            free(idx);
            sampler_free(&s);
          }
          assert_true(most <= cap);
          if (!contiguous && n >= G) assert_int_equal(most, cap);
        }
  dt_config_values one = {.global_batch_size = 8};
  assert_int_equal(config_max_local_rows(&one, 1), 8); /* --dry-run said 9 */
  assert_int_equal(config_max_local_rows(&one, 3), 3);
  dt_config_values per_rank = {.batch_size = 5};
  assert_int_equal(config_max_local_rows(&per_rank, 4), 5);
}

static void contiguous_mode_owns_its_rows(void **state) {
  (void)state;
  dt_sampler s;
  sampler_init(&s, 100, 4, 2, 8, 1, 0, 1, 3);
  assert_int_equal(s.own_lo, 50);
  assert_int_equal(s.own_hi, 75);
  assert_int_equal(s.steps, 13); /* 25 rows, 2 per step */
  int64_t idx[4], tot;
  assert_int_equal(sampler_batch(&s, 0, 12, idx, &tot), 1);
  assert_int_equal(tot, 4);
  sampler_free(&s);
}

static void shuffle_false_keeps_file_order(void **state) {
  (void)state;
  dt_sampler s;
  sampler_init(&s, 10, 2, 1, 4, 0, 0, 0, 3);
  int64_t idx[4], tot;
  assert_int_equal(sampler_batch(&s, 5, 1, idx, &tot), 2);
  assert_int_equal(idx[0], 6);
  assert_int_equal(idx[1], 7);
  sampler_free(&s);
}

static void shuffle_is_a_permutation(void **state) {
  (void)state;
  int64_t p[1000];
  for (int i = 0; i < 1000; i++) p[i] = i;
  sampler_shuffle(p, 1000, 77);
  int seen[1000] = {0};
  for (int i = 0; i < 1000; i++) seen[p[i]]++;
  for (int i = 0; i < 1000; i++) assert_int_equal(seen[i], 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(every_sample_exactly_once_per_epoch),
      cmocka_unit_test(drop_last_never_repeats_and_drops_only_the_tail),
      cmocka_unit_test(same_permutation_on_every_rank_and_world_size),
      cmocka_unit_test(epochs_and_seeds_change_the_order),
      cmocka_unit_test(uneven_final_batch_is_split_across_ranks),
      cmocka_unit_test(largest_local_batch_is_the_rounded_up_share),
      cmocka_unit_test(contiguous_mode_owns_its_rows),
      cmocka_unit_test(shuffle_false_keeps_file_order),
      cmocka_unit_test(shuffle_is_a_permutation),
  };
  return cmocka_run_group_tests_name("sampler", tests, NULL, NULL);
}
