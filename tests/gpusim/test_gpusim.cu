// test_gpusim: the GPU stand-in's own checks (tests/gpusim/README.md). Each check pairs a
// deliberately broken kernel or call sequence, which the stand-in must flag (an error code, a
// visibly wrong result, or the process aborting with a message), with a correct one that must
// pass. Compiled like kernels/*.cu: by the host C++ compiler against gpusim_device.h.
// Death checks run in a forked child whose stderr is captured. Run with GPUSIM_DEVICES=2.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublasLt.h>
#include <nccl.h>
#include <cublas_v2.h>
#include <cudnn.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

extern "C" {
#include <cmocka.h>
}

#include "common.cuh"

#define CUDA_OK(call)                                                                                    \
  do {                                                                                                   \
    cudaError_t e_ = (call);                                                                             \
    if (e_ != cudaSuccess) fail_msg("%s: %s (%s)", #call, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
  } while (0)

// ---- helpers ------------------------------------------------------------------------------------

template <class T>
static T *device_array(size_t n) {
  void *p = nullptr;
  CUDA_OK(cudaMalloc(&p, n * sizeof(T)));
  return static_cast<T *>(p);
}

template <class T>
static T *device_copy(const std::vector<T> &h) {
  T *d = device_array<T>(h.size());
  CUDA_OK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
static std::vector<T> host_copy(const T *d, size_t n) {
  std::vector<T> h(n);
  CUDA_OK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Runs fn in a child; passes when the child dies abnormally with `needle` in what it printed.
static void expect_death(void (*fn)(), const char *needle) {
  int fds[2];
  if (pipe(fds)) fail_msg("pipe failed");
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 1);  // a cmocka failure in the child must not print TAP lines of its own
    dup2(fds[1], 2);
    alarm(60);                       // a hang is a failure too
    gpusim_install_fault_handler();  // cmocka's per-test handler would catch the faults first
    fn();
    _exit(0);  // survived: the stand-in did not flag it
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) text.append(buf, (size_t)n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
    fail_msg("expected the stand-in to stop the program with \"%s\"; it ran on. It printed:\n%s", needle, text.c_str());
  if (text.find(needle) == std::string::npos)
    fail_msg("expected \"%s\" in the stand-in's message; got:\n%s", needle, text.c_str());
}

// Runs this test binary again with `arg` and the settings `env` ("GPUSIM_SEED=2"); returns what it
// printed (stderr too when status is given, which then receives the exit status; else the test
// fails unless the run succeeds).
static std::string run_self_with(const char *env, const char *arg, int *status = nullptr) {
  char cmd[256];
  snprintf(cmd, sizeof cmd, "%s /proc/%d/exe %s%s", env, (int)getpid(), arg, status ? " 2>&1" : "");
  FILE *p = popen(cmd, "r");
  if (!p) fail_msg("popen failed");
  std::string out;
  char buf[256];
  while (fgets(buf, sizeof buf, p)) out += buf;
  int st = pclose(p);
  if (status)
    *status = st;
  else if (st != 0)
    fail_msg("%s failed", cmd);
  return out;
}

// Runs this test binary again with `arg` under GPUSIM_SEED=seed; returns what it printed.
static std::string run_self(const char *arg, int seed) {
  char env[32];
  snprintf(env, sizeof env, "GPUSIM_SEED=%d", seed);
  return run_self_with(env, arg);
}

// ---- threads ------------------------------------------------------------------------------------

__global__ void builtins_kernel(int *out) {
  int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int linear = block * blockDim.x * blockDim.y * blockDim.z + thread;
  out[linear] = (int)(blockIdx.x + 10 * blockIdx.y + 100 * blockIdx.z + 1000 * threadIdx.x + 10000 * threadIdx.y +
                      100000 * threadIdx.z);
  if (linear == 0) out[2 * 3 * 2 * 4 * 2 * 3] = (int)(gridDim.x * 100 + gridDim.y * 10 + gridDim.z);
}

static void builtins_follow_the_launch(void **) {
  dim3 grid(2, 3, 2), block(4, 2, 3);
  int n = 2 * 3 * 2 * 4 * 2 * 3;
  int *d = device_array<int>((size_t)n + 1);
  LAUNCH(builtins_kernel, grid, block, 0, 0)(d);
  CUDA_OK(cudaGetLastError());
  std::vector<int> h = host_copy(d, (size_t)n + 1);
  for (int bz = 0; bz < 2; bz++)
    for (int by = 0; by < 3; by++)
      for (int bx = 0; bx < 2; bx++)
        for (int tz = 0; tz < 3; tz++)
          for (int ty = 0; ty < 2; ty++)
            for (int tx = 0; tx < 4; tx++) {
              int linear = (((bz * 3 + by) * 2 + bx) * 3 + tz) * 8 + ty * 4 + tx;
              assert_int_equal(h[(size_t)linear], bx + 10 * by + 100 * bz + 1000 * tx + 10000 * ty + 100000 * tz);
            }
  assert_int_equal(h[(size_t)n], 232);
  CUDA_OK(cudaFree(d));
}

// Each thread reads its neighbour's value from shared memory: correct only after the barrier.
__global__ void neighbour_kernel(int *out, int sync) {
  __shared__ int s[128];
  s[threadIdx.x] = (int)threadIdx.x + 1;
  if (sync) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// Prints a checksum of the neighbour kernel's results (run through run_self under a seed).
static int print_neighbour_checksum(int sync) {
  int *d = device_array<int>(64 * 128);
  LAUNCH(neighbour_kernel, 64, 128, 0, 0)(d, sync);
  std::vector<int> h = host_copy(d, 64 * 128);
  unsigned long long sum = 0;
  for (size_t i = 0; i < h.size(); i++) sum = sum * 1000003ull + (unsigned)h[i];
  printf("%llx\n", sum);
  return 0;
}

static void syncthreads_is_a_barrier_and_a_missing_one_shows(void **) {
  // with the barrier: right, and the same under any seed
  int *d = device_array<int>(64 * 128);
  LAUNCH(neighbour_kernel, 64, 128, 0, 0)(d, 1);
  std::vector<int> h = host_copy(d, 64 * 128);
  for (int i = 0; i < 64 * 128; i++) assert_int_equal(h[(size_t)i], (i + 1) % 128 + 1);
  CUDA_OK(cudaFree(d));
  assert_string_equal(run_self("--neighbour-sync", 1).c_str(), run_self("--neighbour-sync", 2).c_str());
  // without it: the result depends on the order threads run in, which follows the seed
  std::string a = run_self("--neighbour-race", 1), b = run_self("--neighbour-race", 2),
              a2 = run_self("--neighbour-race", 1);
  assert_string_equal(a.c_str(), a2.c_str());  // one seed, one result: reproducible
  if (a == b) fail_msg("a missing __syncthreads gave the same result under GPUSIM_SEED 1 and 2");
}

__global__ void divergent_barrier_kernel(int *out, int skip) {
  if ((int)threadIdx.x < skip) return;  // some threads leave before the barrier
  __syncthreads();
  out[threadIdx.x] = 1;
}

static void launch_divergent_barrier() {
  int *d = device_array<int>(64);
  LAUNCH(divergent_barrier_kernel, 1, 64, 0, 0)(d, 16);
  cudaDeviceSynchronize();
}

static void a_barrier_some_threads_skip_is_reported(void **) {
  int *d = device_array<int>(64);
  LAUNCH(divergent_barrier_kernel, 1, 64, 0, 0)(d, 0);  // every thread reaches it: fine
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(d));
  expect_death(launch_divergent_barrier, "undefined behaviour in CUDA");
}

// ---- shared memory ------------------------------------------------------------------------------

__global__ void block_count_kernel(float *out) {
  __shared__ float count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  atomicAdd(&count, 1.0f);
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = count;
}

__global__ void uninitialised_shared_kernel(float *out) {
  __shared__ float never_written[4];
  out[threadIdx.x] = never_written[threadIdx.x];
}

static void static_shared_memory_is_per_block_and_starts_as_garbage(void **) {
  float *d = device_array<float>(16);
  LAUNCH(block_count_kernel, 16, 96, 0, 0)(d);
  std::vector<float> h = host_copy(d, 16);
  for (float v : h) assert_true(v == 96.0f);  // each block counted its own threads only
  LAUNCH(uninitialised_shared_kernel, 1, 4, 0, 0)(d);
  h = host_copy(d, 4);
  for (int i = 0; i < 4; i++) assert_true(isnan(h[(size_t)i]));  // garbage, made visible
  CUDA_OK(cudaFree(d));
}

__global__ void reverse_kernel(float *out) {
  DYNAMIC_SHARED(float, buf);
  buf[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}

// One float past the launch's dynamic shared memory (of blockDim.x floats), or one before it.
__global__ void past_dynamic_shared_kernel(float *out, int before) {
  DYNAMIC_SHARED(float, buf);
  buf[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = before ? buf[(int)threadIdx.x - 1] : buf[threadIdx.x + 1];
}

static void launch_past_dynamic_shared(size_t smem, int before) {
  float *d = device_array<float>(64);
  LAUNCH(past_dynamic_shared_kernel, 1, 64, smem, 0)(d, before);
  CUDA_OK(cudaDeviceSynchronize());
}
static void launch_one_past_dynamic_shared() {
  launch_past_dynamic_shared(64 * sizeof(float), 0);
}
static void launch_one_before_dynamic_shared() {
  launch_past_dynamic_shared(64 * sizeof(float), 1);
}
static void launch_without_dynamic_shared() {  // a launch that forgot to ask for it
  launch_past_dynamic_shared(0, 0);
}

static void dynamic_shared_memory_and_its_limits(void **) {
  float *d = device_array<float>(256);
  LAUNCH(reverse_kernel, 1, 256, 256 * sizeof(float), 0)(d);
  CUDA_OK(cudaGetLastError());
  std::vector<float> h = host_copy(d, 256);
  for (int i = 0; i < 256; i++) assert_true(h[(size_t)i] == (float)(255 - i));
  // over 48 KiB needs the kernel's opt-in, up to 227 KiB
  LAUNCH(reverse_kernel, 1, 256, (48 << 10) + 4, 0)(d);
  assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
  CUDA_OK(cudaFuncSetAttribute((const void *)reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10));
  LAUNCH(reverse_kernel, 1, 256, (48 << 10) + 4, 0)(d);
  CUDA_OK(cudaGetLastError());
  assert_int_equal(
      cudaFuncSetAttribute((const void *)reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10),
      cudaErrorInvalidValue);
  cudaGetLastError();
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(d));
  // an access outside the launch's bytes, seen where kernels are traced (not in the sanitizer builds),
  // which GPUSIM_HAZARDS=off would turn off: the check runs in the default mode whatever the environment
  if (!gpusim_kernels_traced()) {
    printf("# kernels are not traced in this build (a sanitizer build): shared memory bounds are left out\n");
    return;
  }
  const int hazards = gpusim_set_hazards(2);
  expect_death(launch_one_past_dynamic_shared,
               "a read of 4 bytes at byte 256 of dynamic shared memory, outside the "
               "256 bytes its launch gave");
  expect_death(launch_one_past_dynamic_shared, "past_dynamic_shared_kernel");
  expect_death(launch_one_before_dynamic_shared, "a read of 4 bytes at byte -4 of dynamic shared memory");
  expect_death(launch_without_dynamic_shared, "of dynamic shared memory, outside the 0 bytes its launch gave");
  gpusim_set_hazards(hazards);
}

// A float4 read (common.cuh's load_float4) at `offset` floats into a device array: at 1, 4-byte aligned only.
__global__ void float4_read_kernel(const float *in, float *out, int offset) {
  float4 v = load_float4(in + offset);
  out[threadIdx.x] = v.x + v.y + v.z + v.w;
}

static void read_float4_at(int offset) {
  float *in = device_array<float>(16), *out = device_array<float>(32);
  CUDA_OK(cudaMemset(in, 0, 16 * sizeof(float)));
  LAUNCH(float4_read_kernel, 1, 32, 0, 0)(in, out, offset);
  CUDA_OK(cudaDeviceSynchronize());
}
static void read_misaligned_float4() {
  read_float4_at(1);
}

static void a_misaligned_vector_access_stops_the_program(void **) {
  read_float4_at(4);  // 16-byte aligned: fine
  expect_death(read_misaligned_float4, "a read of 16 bytes at 0x");
  expect_death(read_misaligned_float4, "which is not 16-byte aligned: a GPU stops with a misaligned address error");
  expect_death(read_misaligned_float4, "float4_read_kernel");
}

// ---- warps --------------------------------------------------------------------------------------

__global__ void shuffle_kernel(int *out) {
  int lane = threadIdx.x & 31, v = (int)threadIdx.x;
  int *o = out + threadIdx.x * 8;
  o[0] = __shfl_down_sync(0xffffffffu, v, 3);
  o[1] = __shfl_up_sync(0xffffffffu, v, 5);
  o[2] = __shfl_xor_sync(0xffffffffu, v, 6);
  o[3] = __shfl_sync(0xffffffffu, v, 7);
  o[4] = __shfl_down_sync(0xffffffffu, v, 2, 8);  // within segments of 8 lanes
  o[5] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  o[6] = __all_sync(0xffffffffu, lane < 31);
  o[7] = __any_sync(0xffffffffu, lane == 30);
}

static void warp_shuffles_and_votes(void **) {
  int *d = device_array<int>(64 * 8);
  LAUNCH(shuffle_kernel, 1, 64, 0, 0)(d);
  std::vector<int> h = host_copy(d, 64 * 8);
  unsigned ballot = 0;
  for (int l = 0; l < 32; l++) ballot |= (l % 3 == 0) << l;
  for (int t = 0; t < 64; t++) {
    int lane = t & 31, base = t - lane;
    const int *o = &h[(size_t)t * 8];
    assert_int_equal(o[0], lane + 3 < 32 ? t + 3 : t);
    assert_int_equal(o[1], lane >= 5 ? t - 5 : t);
    assert_int_equal(o[2], base + (lane ^ 6));
    assert_int_equal(o[3], base + 7);
    assert_int_equal(o[4], (lane & 7) + 2 < 8 ? t + 2 : t);
    assert_int_equal((unsigned)o[5], ballot);
    assert_int_equal(o[6], 0);
    assert_int_equal(o[7], 1);
  }
  CUDA_OK(cudaFree(d));
}

// Reading a lane that does not take part (here: does not exist) gives an undefined value.
__global__ void shuffle_missing_lane_kernel(float *out) {
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.0f, 16);
}

__global__ void mask_without_self_kernel(float *out) {
  out[threadIdx.x] = __shfl_down_sync(0x1u, 1.0f, 1);  // lanes other than 0 name only lane 0
}

static void launch_mask_without_self() {
  float *d = device_array<float>(32);
  LAUNCH(mask_without_self_kernel, 1, 32, 0, 0)(d);
  cudaDeviceSynchronize();
}

static void undefined_warp_reads_show_and_bad_masks_are_reported(void **) {
  float *d = device_array<float>(48);
  LAUNCH(shuffle_missing_lane_kernel, 1, 48, 0, 0)(d);  // the second warp has 16 lanes
  std::vector<float> h = host_copy(d, 48);
  for (int t = 0; t < 32; t++) assert_true(h[(size_t)t] == 1.0f);
  for (int t = 32; t < 48; t++) assert_true(isnan(h[(size_t)t]));  // lanes 48..63 do not exist
  CUDA_OK(cudaFree(d));
  expect_death(launch_mask_without_self, "does not name the lane itself");
}

// block_sum as it was before the stand-in: it assumed blockDim.x a multiple of 32.
static __device__ double block_sum_full_warps_only(double v) {
  __shared__ double warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? warp_sums[lane] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  __syncthreads();
  return v;
}

__global__ void block_sum_kernel(double *out, int old) {
  double v = (double)(threadIdx.x + 1);
  v = old ? block_sum_full_warps_only(v) : block_sum(v);
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

static void block_sum_works_for_any_block_size(void **) {
  double *d = device_array<double>(4);
  for (int threads : {1, 20, 32, 33, 100, 256, 1000}) {
    LAUNCH(block_sum_kernel, 4, threads, 0, 0)(d, 0);
    std::vector<double> h = host_copy(d, 4);
    for (double v : h) assert_true(v == threads * (threads + 1) / 2.0);
  }
  // the old version was right for full warps only: the stand-in shows it
  LAUNCH(block_sum_kernel, 4, 256, 0, 0)(d, 1);
  assert_true(host_copy(d, 4)[0] == 256 * 257 / 2.0);
  LAUNCH(block_sum_kernel, 4, 100, 0, 0)(d, 1);
  double broken = host_copy(d, 4)[0];
  if (broken == 100 * 101 / 2.0) fail_msg("the full-warps-only block sum gave the right sum for 100 threads");
  CUDA_OK(cudaFree(d));
}

// ---- bfloat16 and warp matrix operations ---------------------------------------------------------

__global__ void bf16_round_kernel(const float *x, float *y, int n) {
  GRID_STRIDE(i, n) y[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
}

static void bfloat16_rounds_to_nearest_even(void **) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: to the even one; 1 + 3 2^-8 halfway between
  // 1 + 2^-7 and 1 + 2^-6: up; just above a halfway point: up; the largest finite float: infinity
  std::vector<float> x = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -2.5f, 3.4028235e38f};
  std::vector<float> want = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f, -2.5f, INFINITY};
  float *dx = device_copy(x), *dy = device_array<float>(x.size());
  LAUNCH(bf16_round_kernel, 1, 32, 0, 0)(dx, dy, (int)x.size());
  std::vector<float> y = host_copy(dy, x.size());
  for (size_t i = 0; i < x.size(); i++) assert_true(y[i] == want[i]);
  CUDA_OK(cudaFree(dx));
  CUDA_OK(cudaFree(dy));
}

// Warp w computes D = A B + C for its own A (16, 16), B (16, 8) and C (16, 8), all row-major in global
// memory, through the m16n8k16 product: each lane places the elements the PTX ISA's fragment layout
// gives it (g = lane / 4, c = lane % 4) and stores its four results back where that layout says.
__global__ void mma_16816_kernel(const __nv_bfloat16 *a, const __nv_bfloat16 *b, const float *c, float *d) {
  const int w = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const __nv_bfloat16 *aw = a + w * 256, *bw = b + w * 128;
  auto pair = [](__nv_bfloat16 lo, __nv_bfloat16 hi) {
    uint16_t l, h;
    memcpy(&l, &lo, 2);
    memcpy(&h, &hi, 2);
    return (uint32_t)l | (uint32_t)h << 16;
  };
  uint32_t ra[4], rb[2];
  for (int r = 0; r < 4; r++) {  // rows g, g + 8, g, g + 8; columns 2q, 2q, 2q + 8, 2q + 8 (and the next)
    const int row = g + 8 * (r & 1), col = 2 * q + 8 * (r >> 1);
    ra[r] = pair(aw[row * 16 + col], aw[row * 16 + col + 1]);
  }
  for (int r = 0; r < 2; r++)  // rows 2q and 2q + 8 (and the next) of column g
    rb[r] = pair(bw[(2 * q + 8 * r) * 8 + g], bw[(2 * q + 8 * r + 1) * 8 + g]);
  float acc[4];
  for (int i = 0; i < 4; i++) acc[i] = c[w * 128 + (g + 8 * (i >> 1)) * 8 + 2 * q + (i & 1)];
  GPUSIM_MMA_16816(acc, ra, rb);
  for (int i = 0; i < 4; i++) d[w * 128 + (g + 8 * (i >> 1)) * 8 + 2 * q + (i & 1)] = acc[i];
}

__global__ void mma_partial_warp_kernel(float *d) {
  float acc[4] = {0, 0, 0, 0};
  const uint32_t ra[4] = {0, 0, 0, 0}, rb[2] = {0, 0};
  GPUSIM_MMA_16816(acc, ra, rb);
  d[threadIdx.x] = acc[0];
}

static void launch_mma_partial_warp() {
  float *d = device_array<float>(64);
  LAUNCH(mma_partial_warp_kernel, 1, 40, 0, 0)(d);  // the second warp has 8 lanes
  cudaDeviceSynchronize();
}

static void tensor_core_fragments_follow_the_ptx_layout(void **) {
  const int warps = 3;
  std::vector<float> fa(warps * 256), fb(warps * 128), c(warps * 128);
  std::vector<__nv_bfloat16> a(fa.size()), b(fb.size());
  for (size_t i = 0; i < fa.size(); i++)  // exact in bfloat16, every element different: the products are exact
    fa[i] = (float)((int)(i * 7 % 29) - 14) / 8.0f, a[i] = __float2bfloat16_rn(fa[i]);
  for (size_t i = 0; i < fb.size(); i++)
    fb[i] = (float)((int)(i * 5 % 31) - 15) / 4.0f, b[i] = __float2bfloat16_rn(fb[i]);
  for (size_t i = 0; i < c.size(); i++) c[i] = (float)(i % 11) - 5.0f;
  __nv_bfloat16 *da = device_copy(a), *db = device_copy(b);
  float *dc = device_copy(c), *dd = device_array<float>(c.size());
  LAUNCH(mma_16816_kernel, 1, 32 * warps, 0, 0)(da, db, dc, dd);
  std::vector<float> d = host_copy(dd, c.size());
  for (int w = 0; w < warps; w++)
    for (int r = 0; r < 16; r++)
      for (int col = 0; col < 8; col++) {
        double want = c[(size_t)(w * 128 + r * 8 + col)];
        for (int k = 0; k < 16; k++)
          want += (double)fa[(size_t)(w * 256 + r * 16 + k)] * fb[(size_t)(w * 128 + k * 8 + col)];
        assert_true(d[(size_t)(w * 128 + r * 8 + col)] == (float)want);
      }
  for (void *p : {(void *)da, (void *)db, (void *)dc, (void *)dd}) CUDA_OK(cudaFree(p));
  expect_death(launch_mma_partial_warp, "partial warp");
}

// ---- atomics ------------------------------------------------------------------------------------

__global__ void count_kernel(float *total) {
  atomicAdd(total, 1.0f);
}

__global__ void host_atomic_kernel(unsigned long long address) {
  atomicAdd(reinterpret_cast<float *>(address), 1.0f);
}

static float host_counter;
static void launch_host_atomic() {
  LAUNCH(host_atomic_kernel, 1, 1, 0, 0)((unsigned long long)(uintptr_t)&host_counter);
  cudaDeviceSynchronize();
}

static void atomics_add_up_and_must_target_device_memory(void **) {
  float *d = device_array<float>(1);
  CUDA_OK(cudaMemset(d, 0, sizeof(float)));
  LAUNCH(count_kernel, 100, 128, 0, 0)(d);
  assert_true(host_copy(d, 1)[0] == 12800.0f);
  CUDA_OK(cudaFree(d));
  expect_death(launch_host_atomic, "neither device nor shared memory");
}

// ---- launch limits ------------------------------------------------------------------------------

__global__ void noop_kernel(int *out) {
  if (out && threadIdx.x == 0 && blockIdx.x == 0) out[0] = 1;
}

static void launch_limits_are_checked(void **) {
  LAUNCH(noop_kernel, 1, 1024, 0, 0)(nullptr);
  CUDA_OK(cudaGetLastError());
  LAUNCH(noop_kernel, 1, 1025, 0, 0)(nullptr);
  assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
  LAUNCH(noop_kernel, 1, dim3(1, 1, 65), 0, 0)(nullptr);
  assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
  LAUNCH(noop_kernel, dim3(1, 65536), 1, 0, 0)(nullptr);
  assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
  LAUNCH(noop_kernel, dim3(1u << 31), 1, 0, 0)(nullptr);
  assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
  LAUNCH(noop_kernel, 0, 32, 0, 0)(nullptr);
  assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
  CUDA_OK(cudaDeviceSynchronize());
}

// ---- device memory ------------------------------------------------------------------------------

static void host_reads_device_memory() {
  float *d = device_array<float>(4);
  volatile float x = d[1];
  (void)x;
}

static void host_reads_freed_memory() {
  float *d = device_array<float>(4);
  cudaFree(d);
  volatile float x = d[0];
  (void)x;
}

static void host_cannot_touch_device_memory(void **) {
  expect_death(host_reads_device_memory, "host code dereferenced device memory");
  expect_death(host_reads_freed_memory, "freed allocation");
}

__global__ void write_at_kernel(float *y, long long at) {
  y[at] = 1.0f;
}

static void write_one_past_the_end() {
  float *d = device_array<float>(10);
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(d, 10);
  cudaDeviceSynchronize();
}

static void write_far_past_the_end() {
  float *d = device_array<float>(10);
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(d, 4000);
  cudaDeviceSynchronize();
}

static void write_before_the_start() {
  float *d = device_array<float>(10);
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(d, -1);
  cudaDeviceSynchronize();
}

static void kernels_are_bounds_checked(void **) {
  float *d = device_array<float>(10);
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(d, 9);  // the last element: fine
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(d));
  expect_death(write_one_past_the_end, "past the end of it");
  expect_death(write_before_the_start, "before it");
  expect_death(write_far_past_the_end, "write_at_kernel");
}

static void pass_host_pointer() {
  static float host[4];
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(host, 0);
}

static void pass_freed_pointer() {
  float *d = device_array<float>(4);
  cudaFree(d);
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(d, 0);
}

__global__ void smuggled_pointer_kernel(float *mine, unsigned long long other) {
  mine[0] = reinterpret_cast<float *>(other)[0];
}

static void touch_unpassed_allocation() {
  float *a = device_array<float>(4), *b = device_array<float>(4);
  LAUNCH(write_at_kernel, 1, 1, 0, 0)(b, 0);  // b is this earlier op's, in the same synchronisation
  LAUNCH(smuggled_pointer_kernel, 1, 1, 0, 0)(a, (unsigned long long)(uintptr_t)b);
  cudaDeviceSynchronize();
}

static void kernel_pointers_must_be_live_device_memory(void **) {
  float *a = device_array<float>(4);
  LAUNCH(smuggled_pointer_kernel, 1, 1, 0, 0)(a, (unsigned long long)(uintptr_t)a);  // its own argument: fine
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(a));
  expect_death(pass_host_pointer, "must be device memory");
  expect_death(pass_freed_pointer, "freed allocation");
  expect_death(touch_unpassed_allocation, "none of its pointer arguments points into");
}

// ---- streams ------------------------------------------------------------------------------------

__global__ void fill_kernel(float *y, float v, int n) {
  GRID_STRIDE(i, n) y[i] = v;
}

static void free_while_queued() {
  float *d = device_array<float>(1024);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  LAUNCH(fill_kernel, 4, 256, 0, s)(d, 1.0f, 1024);
  cudaFree(d);  // the kernel has not run yet
}

static void copies_run_only_when_synchronised(void **) {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *d = device_array<float>(4);
  LAUNCH(fill_kernel, 1, 4, 0, s)(d, 7.0f, 4);
  float h[4] = {1, 1, 1, 1};
  CUDA_OK(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s));
  assert_true(h[0] == 1.0f);  // read before a sync: stale
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(h[0] == 7.0f);
  // a pageable host buffer changed after an async copy was queued: the copy may read it late
  float src[4] = {2, 2, 2, 2};
  CUDA_OK(cudaMemcpyAsync(d, src, sizeof src, cudaMemcpyHostToDevice, s));
  src[0] = 5.0f;
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(host_copy(d, 4)[0] == 5.0f);
  // freeing what queued work still uses is an error; after a sync it is fine
  LAUNCH(fill_kernel, 1, 4, 0, s)(d, 3.0f, 4);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaStreamDestroy(s));
  expect_death(free_while_queued, "while queued, unfinished work still uses it");
}

static void streams_are_ordered_only_by_events(void **) {
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  float *d = device_array<float>(256);
  CUDA_OK(cudaMemset(d, 0, 256 * sizeof(float)));
  CUDA_OK(cudaDeviceSynchronize());
  float h[256];
  // no ordering between the streams: the copy on s2 runs before the kernel on s1 (a hazard, shown
  // here as stale data with the hazard checker off; hazards_between_streams_are_reported has it on)
  int hazards = gpusim_set_hazards(0);
  LAUNCH(fill_kernel, 1, 256, 0, s1)(d, 5.0f, 256);
  CUDA_OK(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s2));
  CUDA_OK(cudaStreamSynchronize(s2));
  assert_true(h[0] == 0.0f);
  CUDA_OK(cudaStreamSynchronize(s1));
  // an event recorded on s1 and waited for on s2 orders them
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  LAUNCH(fill_kernel, 1, 256, 0, s1)(d, 6.0f, 256);
  CUDA_OK(cudaEventRecord(ev, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, ev, 0));
  CUDA_OK(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s2));
  CUDA_OK(cudaStreamSynchronize(s2));
  assert_true(h[0] == 6.0f && h[255] == 6.0f);
  // queries answer "not ready" until the device gets to it, then success
  LAUNCH(fill_kernel, 1, 256, 0, s1)(d, 8.0f, 256);
  CUDA_OK(cudaEventRecord(ev, s1));
  int not_ready = 0;
  cudaError_t q;
  while ((q = cudaEventQuery(ev)) == cudaErrorNotReady) not_ready++;
  CUDA_OK(q);
  assert_true(not_ready >= 1);
  assert_true(host_copy(d, 1)[0] == 8.0f);
  // the legacy default stream waits for blocking streams, not for non-blocking ones
  cudaStream_t blocking;
  CUDA_OK(cudaStreamCreate(&blocking));
  LAUNCH(fill_kernel, 1, 256, 0, blocking)(d, 9.0f, 256);
  assert_true(host_copy(d, 1)[0] == 9.0f);  // cudaMemcpy is on the legacy stream
  LAUNCH(fill_kernel, 1, 256, 0, s1)(d, 10.0f, 256);
  assert_true(host_copy(d, 1)[0] == 9.0f);  // s1 is non-blocking: not waited for
  CUDA_OK(cudaDeviceSynchronize());
  assert_true(host_copy(d, 1)[0] == 10.0f);
  gpusim_set_hazards(hazards);
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
  CUDA_OK(cudaStreamDestroy(blocking));
  CUDA_OK(cudaFree(d));
}

// ---- hazards between streams (hazard.cc) ---------------------------------------------------------

__global__ void sum_kernel(const float *x, float *out, int n) {  // one thread: out = sum of x
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    float s = 0;
    for (int i = 0; i < n; i++) s += x[i];
    *out = s;
  }
}

struct TwoStreams {
  cudaStream_t compute, other;
  cudaEvent_t ev;
  TwoStreams() {
    CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  ~TwoStreams() {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaEventDestroy(ev));
    CUDA_OK(cudaStreamDestroy(compute));
    CUDA_OK(cudaStreamDestroy(other));
  }
};

// The planted race of an input upload: the next batch is copied (on a copy stream) into the buffer
// that the queued step still reads, with no event ordering the copy after the step.
static void upload_over_a_batch_in_use(bool ordered) {
  TwoStreams t;
  const int n = 512;
  float *batch = device_array<float>(n), *sum = device_array<float>(1), *pinned;
  CUDA_OK(cudaMallocHost((void **)&pinned, n * sizeof(float)));
  for (int i = 0; i < n; i++) pinned[i] = 1.0f;
  CUDA_OK(cudaMemcpyAsync(batch, pinned, n * sizeof(float), cudaMemcpyHostToDevice, t.compute));
  LAUNCH(sum_kernel, 1, 32, 0, t.compute)(batch, sum, n);  // the step reads the batch
  if (ordered) {
    CUDA_OK(cudaEventRecord(t.ev, t.compute));
    CUDA_OK(cudaStreamWaitEvent(t.other, t.ev, 0));
  }
  CUDA_OK(cudaMemcpyAsync(batch, pinned, n * sizeof(float), cudaMemcpyHostToDevice, t.other));  // the next batch
  CUDA_OK(cudaStreamSynchronize(t.compute));  // the step first, as a GPU might run them
  CUDA_OK(cudaStreamSynchronize(t.other));
  assert_true(host_copy(sum, 1)[0] == (float)n);
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFree(batch));
  CUDA_OK(cudaFree(sum));
}
static void upload_over_a_batch_in_use_unordered() {
  upload_over_a_batch_in_use(false);
}

// The planted race of a gradient all-reduce: a second stream reads the gradients of the last
// layers before backward has written them (no event recorded after that backward work).
static void sum_before_backward(bool ordered) {
  TwoStreams t;
  const int n = 1024;
  float *grads = device_array<float>(n), *sum = device_array<float>(1);
  CUDA_OK(cudaMemsetAsync(grads, 0, n * sizeof(float), t.compute));
  LAUNCH(fill_kernel, 4, 128, 0, t.compute)(grads + n / 2, 2.0f, n / 2);  // backward of the last layers
  if (ordered) CUDA_OK(cudaEventRecord(t.ev, t.compute));
  LAUNCH(fill_kernel, 4, 128, 0, t.compute)(grads, 1.0f, n / 2);  // backward of the first layers
  if (ordered) CUDA_OK(cudaStreamWaitEvent(t.other, t.ev, 0));
  LAUNCH(sum_kernel, 1, 32, 0, t.other)(grads + n / 2, sum, n / 2);  // the "all-reduce" of the last bucket
  CUDA_OK(cudaStreamSynchronize(t.compute));                         // backward first, as a GPU might run them
  CUDA_OK(cudaStreamSynchronize(t.other));
  assert_true(host_copy(sum, 1)[0] == (float)n);
  CUDA_OK(cudaFree(grads));
  CUDA_OK(cudaFree(sum));
}
static void sum_before_backward_unordered() {
  sum_before_backward(false);
}

// A memset on one stream and a copy into the same buffer on another (the first upload after an
// allocation the backend clears on its compute stream).
static void memset_then_copy_elsewhere() {
  TwoStreams t;
  float *d = device_array<float>(64), h[64] = {0};
  CUDA_OK(cudaMemsetAsync(d, 0, sizeof h, t.compute));
  CUDA_OK(cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, t.other));
  CUDA_OK(cudaDeviceSynchronize());
}

// A graph whose second branch writes what its first reads, with no edge between them.
static void graph_branches_unordered() {
  TwoStreams t;
  const int n = 256;
  float *x = device_array<float>(n), *sum = device_array<float>(1);
  CUDA_OK(cudaMemset(x, 0, n * sizeof(float)));
  cudaEvent_t fork, join;
  CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  CUDA_OK(cudaStreamBeginCapture(t.compute, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaEventRecord(fork, t.compute));
  CUDA_OK(cudaStreamWaitEvent(t.other, fork, 0));
  LAUNCH(sum_kernel, 1, 32, 0, t.compute)(x, sum, n);
  LAUNCH(fill_kernel, 2, 128, 0, t.other)(x, 1.0f, n);
  CUDA_OK(cudaEventRecord(join, t.other));
  CUDA_OK(cudaStreamWaitEvent(t.compute, join, 0));
  cudaGraph_t g;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamEndCapture(t.compute, &g));
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_OK(cudaGraphLaunch(exec, t.compute));
  CUDA_OK(cudaStreamSynchronize(t.compute));
}

static void hazards_between_streams_are_reported(void **) {
  const int hazards = gpusim_set_hazards(2);  // reported as errors whatever GPUSIM_HAZARDS says
  // library calls and copies declare what they touch: checked in every build
  expect_death(memset_then_copy_elsewhere, "hazard (write after write)");
  expect_death(memset_then_copy_elsewhere, "cudaMemsetAsync (op 1 of stream");
  // kernels record it as they run, where they are built with the instrumentation (ASan excludes it)
  if (!gpusim_kernels_traced()) {
    printf("# kernels are not traced in this build (a sanitizer build): the kernel hazards are left out\n");
    gpusim_set_hazards(hazards);
    return;
  }
  // the two planted races: reported whichever order the stand-in runs the streams in
  expect_death(upload_over_a_batch_in_use_unordered, "hazard (write after read)");
  expect_death(upload_over_a_batch_in_use_unordered, "kernel sum_kernel");
  expect_death(sum_before_backward_unordered, "hazard (read after write)");
  expect_death(sum_before_backward_unordered, "kernel fill_kernel");
  expect_death(graph_branches_unordered, "of a graph launch");
  // ordered by events: no report, and the results are the ordered ones; the sum reads only the
  // half written before the event, while the other half is still being written (byte ranges)
  upload_over_a_batch_in_use(true);
  sum_before_backward(true);
  // ordered by the host: a synchronisation, then work on another stream
  TwoStreams t;
  float *d = device_array<float>(256), *sum = device_array<float>(1);
  LAUNCH(fill_kernel, 1, 256, 0, t.compute)(d, 3.0f, 256);
  CUDA_OK(cudaStreamSynchronize(t.compute));
  LAUNCH(sum_kernel, 1, 32, 0, t.other)(d, sum, 256);
  CUDA_OK(cudaEventRecord(t.ev, t.other));  // a write after that read needs this order
  CUDA_OK(cudaStreamWaitEvent(t.compute, t.ev, 0));
  LAUNCH(fill_kernel, 1, 256, 0, t.compute)(d, 1.0f, 256);
  cudaError_t q;
  while ((q = cudaStreamQuery(t.compute)) == cudaErrorNotReady) {
  }
  CUDA_OK(q);
  assert_true(host_copy(sum, 1)[0] == 768.0f);
  assert_true(host_copy(d, 1)[0] == 1.0f);
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaFree(sum));
  gpusim_set_hazards(hazards);
}

// Reads x on `compute` while `other` overwrites it, unordered (hazards off): prints what was read.
static void print_unordered_read() {
  gpusim_set_hazards(0);
  TwoStreams t;
  float *x = device_array<float>(64), *sum = device_array<float>(1);
  LAUNCH(fill_kernel, 1, 64, 0, t.compute)(x, 1.0f, 64);
  CUDA_OK(cudaStreamSynchronize(t.compute));
  LAUNCH(sum_kernel, 1, 32, 0, t.compute)(x, sum, 64);
  LAUNCH(fill_kernel, 1, 64, 0, t.other)(x, 2.0f, 64);
  CUDA_OK(cudaStreamSynchronize(t.compute));
  printf("%g\n", host_copy(sum, 1)[0]);
}

static void seeded_stream_order_runs_other_streams_early(void **) {
  // lazy (the default): the other stream's write waits for a synchronisation that needs it
  for (int seed = 1; seed <= 4; seed++) assert_string_equal(run_self("--unordered-read", seed).c_str(), "64\n");
  // seeded: for some seeds it runs before the read, as a GPU running both streams might
  std::set<std::string> seen;
  for (int seed = 1; seed <= 12; seed++) {
    char env[64];
    snprintf(env, sizeof env, "GPUSIM_STREAM_ORDER=seeded GPUSIM_SEED=%d", seed);
    seen.insert(run_self_with(env, "--unordered-read"));
  }
  assert_true(seen.count("64\n") && seen.count("128\n"));
}

// Two steps' results downloaded into pinned host memory, each step's end marked by an event: the
// host waits for step 1's event, then reads step 1's value from the slot step 2 also writes (a bug)
// and from a slot of its own. Prints both.
static void print_overwritten_slot() {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *d = device_array<float>(2), *h;
  CUDA_OK(cudaMallocHost((void **)&h, 3 * sizeof(float)));
  cudaEvent_t step1;
  CUDA_OK(cudaEventCreateWithFlags(&step1, cudaEventDisableTiming));
  LAUNCH(fill_kernel, 1, 1, 0, s)(d, 1.0f, 1);
  CUDA_OK(cudaMemcpyAsync(&h[0], d, sizeof(float), cudaMemcpyDeviceToHost, s));  // the shared slot
  CUDA_OK(cudaMemcpyAsync(&h[1], d, sizeof(float), cudaMemcpyDeviceToHost, s));  // step 1's own
  CUDA_OK(cudaEventRecord(step1, s));
  LAUNCH(fill_kernel, 1, 1, 0, s)(d + 1, 2.0f, 1);  // step 2, queued before the host reads step 1
  CUDA_OK(cudaMemcpyAsync(&h[0], d + 1, sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaMemcpyAsync(&h[2], d + 1, sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaEventSynchronize(step1));
  printf("%g %g\n", h[0], h[1]);
  CUDA_OK(cudaStreamSynchronize(s));
}

static void eager_stream_order_runs_work_as_soon_as_it_is_queued(void **) {
  // lazy (the default): waiting for step 1 runs only step 1, so the shared slot still holds its value
  // and the bug goes unseen
  assert_string_equal(run_self_with("GPUSIM_STREAM_ORDER=lazy", "--overwritten-slot").c_str(), "1 1\n");
  // eager: step 2 ran when it was queued, as a GPU that is ahead of the host would: the shared slot
  // holds step 2's value, while a slot of its own still holds step 1's
  assert_string_equal(run_self_with("GPUSIM_STREAM_ORDER=eager", "--overwritten-slot").c_str(), "2 1\n");
  // CUDA_LAUNCH_BLOCKING=1's launches return when their kernel has run: eager, unless an order is set
  assert_string_equal(run_self_with("CUDA_LAUNCH_BLOCKING=1", "--overwritten-slot").c_str(), "2 1\n");
  assert_string_equal(run_self_with("CUDA_LAUNCH_BLOCKING=1 GPUSIM_STREAM_ORDER=lazy", "--overwritten-slot").c_str(),
                      "1 1\n");
}

// Two steps queued on a stream, each a fill and a copy to the host; the second fill is launch 2 of
// fill_kernel, which GPUSIM_KERNEL_FAULT=fill_kernel:2 breaks. Prints what the calls return after.
static void print_kernel_fault() {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ncclUniqueId id;
  ncclComm_t comm;
  if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) {
    printf("no NCCL communicator\n");
    return;
  }
  float *d = device_array<float>(2), *h;
  CUDA_OK(cudaMallocHost((void **)&h, 2 * sizeof(float)));
  h[0] = h[1] = -1.0f;
  LAUNCH(fill_kernel, 1, 1, 0, s)(d, 1.0f, 1);
  CUDA_OK(cudaMemcpyAsync(&h[0], d, sizeof(float), cudaMemcpyDeviceToHost, s));
  LAUNCH(fill_kernel, 1, 1, 0, s)(d + 1, 2.0f, 1);
  cudaError_t copy = cudaMemcpyAsync(&h[1], d + 1, sizeof(float), cudaMemcpyDeviceToHost, s);
  printf("queued %s %s\n", cudaGetErrorName(copy), cudaGetErrorName(cudaGetLastError()));
  printf("sync %s\n", cudaGetErrorName(cudaStreamSynchronize(s)));
  printf("h %g %g\n", h[0], h[1]);
  void *more = nullptr;
  cudaError_t last = cudaGetLastError(), again = cudaGetLastError(), alloc = cudaMalloc(&more, 4);
  printf("then %s %s %s\n", cudaGetErrorName(last), cudaGetErrorName(again), cudaGetErrorName(alloc));
  LAUNCH(fill_kernel, 1, 1, 0, s)(d, 3.0f, 1);
  printf("launch %s\n", cudaGetErrorName(cudaGetLastError()));
  // NCCL meets the broken context in its own CUDA calls: its error, and its asynchronous state
  ncclResult_t state = ncclSuccess, sum = ncclAllReduce(d, d, 2, ncclFloat, ncclSum, comm, s);
  ncclResult_t query = ncclCommGetAsyncError(comm, &state);
  printf("nccl %d %d %d\n", (int)sum, (int)query, (int)state);
}

// GPUSIM_KERNEL_FAULT: a kernel's launch faults as a GPU's illegal address would. The error shows at
// the next synchronisation, the work after it never runs, and the context stays broken: every
// later call returns the error (a sticky error), as CUDA's documentation describes.
static void a_kernel_fault_breaks_the_context(void **) {
  char clean[256], nccl_broken[64];
  snprintf(clean, sizeof clean,
           "queued cudaSuccess cudaSuccess\nsync cudaSuccess\nh 1 2\nthen cudaSuccess cudaSuccess cudaSuccess\n"
           "launch cudaSuccess\nnccl %d %d %d\n",
           (int)ncclSuccess, (int)ncclSuccess, (int)ncclSuccess);
  snprintf(nccl_broken, sizeof nccl_broken, "nccl %d %d %d\n", (int)ncclUnhandledCudaError, (int)ncclSuccess,
           (int)ncclUnhandledCudaError);
  assert_string_equal(run_self_with("", "--kernel-fault").c_str(), clean);
  std::string after = std::string(
                          "sync cudaErrorIllegalAddress\nh 1 -1\nthen cudaErrorIllegalAddress cudaErrorIllegalAddress "
                          "cudaErrorIllegalAddress\nlaunch cudaErrorIllegalAddress\n") +
                      nccl_broken;
  std::string broken = std::string("queued cudaSuccess cudaSuccess\n") + after;
  assert_string_equal(run_self_with("GPUSIM_KERNEL_FAULT=fill_kernel:2", "--kernel-fault").c_str(), broken.c_str());
  // eagerly, the kernel runs (and faults) as its launch returns: the copy queued after it fails
  assert_string_equal(
      run_self_with("GPUSIM_STREAM_ORDER=eager GPUSIM_KERNEL_FAULT=fill_kernel:2", "--kernel-fault").c_str(),
      (std::string("queued cudaErrorIllegalAddress cudaErrorIllegalAddress\n") + after).c_str());
  // another rank's fault, another kernel's, a launch that never comes: nothing breaks
  for (const char *env : {"OMPI_COMM_WORLD_RANK=0 GPUSIM_KERNEL_FAULT=fill_kernel:2@1",
                          "GPUSIM_KERNEL_FAULT=axpy_kernel", "GPUSIM_KERNEL_FAULT=fill_kernel:4"})
    assert_string_equal(run_self_with(env, "--kernel-fault").c_str(), clean);
  assert_string_equal(
      run_self_with("OMPI_COMM_WORLD_RANK=1 GPUSIM_KERNEL_FAULT=fill_kernel:2@1", "--kernel-fault").c_str(),
      broken.c_str());
  int status = 0;
  std::string out = run_self_with("GPUSIM_KERNEL_FAULT=fill_kernel:0", "--kernel-fault", &status);
  assert_true(status != 0);
  assert_non_null(strstr(out.c_str(), "GPUSIM_KERNEL_FAULT=fill_kernel:0: expected KERNEL[:N][@RANK]"));
}

// ---- stream capture and graphs ------------------------------------------------------------------

__global__ void axpy_kernel(float *y, const float *x, float a, int n) {
  GRID_STRIDE(i, n) y[i] += a * x[i];
}

static cudaStreamCaptureStatus capture_status(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_OK(cudaStreamIsCapturing(s, &status));
  return status;
}

static size_t graph_nodes(cudaGraph_t g) {
  size_t n = 0;
  CUDA_OK(cudaGraphGetNodes(g, nullptr, &n));
  return n;
}

// x = h_in; y = 0; y += 2 x; y += x; h_out = y (h_in and h_out pinned)
static void queue_axpy_work(cudaStream_t s, float *x, float *y, const float *h_in, float *h_out, int n) {
  CUDA_OK(cudaMemcpyAsync(x, h_in, n * sizeof(float), cudaMemcpyHostToDevice, s));
  CUDA_OK(cudaMemsetAsync(y, 0, n * sizeof(float), s));
  LAUNCH(axpy_kernel, 2, 128, 0, s)(y, x, 2.0f, n);
  LAUNCH(axpy_kernel, 2, 128, 0, s)(y, x, 1.0f, n);
  CUDA_OK(cudaMemcpyAsync(h_out, y, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaGetLastError());
}

static void capture_records_work_that_each_launch_runs(void **) {
  const int n = 300;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *h_in, *h_out;
  CUDA_OK(cudaMallocHost((void **)&h_in, n * sizeof(float)));
  CUDA_OK(cudaMallocHost((void **)&h_out, n * sizeof(float)));
  std::vector<float> sevens(n, 7.0f);
  float *x = device_array<float>(n), *y = device_copy(sevens);
  for (int i = 0; i < n; i++) h_in[i] = (float)i, h_out[i] = -1;
  queue_axpy_work(s, x, y, h_in, h_out, n);  // eagerly, for reference
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<float> eager(h_out, h_out + n);
  for (int i = 0; i < n; i++) assert_true(eager[(size_t)i] == 3.0f * (float)i);
  // captured: recorded, not run
  CUDA_OK(cudaMemcpy(y, sevens.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  for (int i = 0; i < n; i++) h_out[i] = -1;
  assert_int_equal(capture_status(s), cudaStreamCaptureStatusNone);
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  assert_int_equal(capture_status(s), cudaStreamCaptureStatusActive);
  queue_axpy_work(s, x, y, h_in, h_out, n);
  cudaGraph_t g = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &g));
  assert_non_null(g);
  assert_int_equal(capture_status(s), cudaStreamCaptureStatusNone);
  assert_int_equal(graph_nodes(g), 5);
  assert_true(h_out[0] == -1.0f && host_copy(y, n)[1] == 7.0f);  // nothing ran
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  assert_true(h_out[0] == -1.0f && host_copy(y, n)[1] == 7.0f);
  // each launch runs every node again, after the stream's earlier work; the copy in reads h_in then
  for (int launch = 0; launch < 3; launch++) {
    for (int i = 0; i < n; i++) h_in[i] = (float)(i + launch), h_out[i] = -1;
    CUDA_OK(cudaGraphLaunch(exec, s));
    assert_true(h_out[0] == -1.0f);  // queued, like any work
    CUDA_OK(cudaStreamSynchronize(s));
    if (launch == 0) assert_memory_equal(h_out, eager.data(), n * sizeof(float));
    for (int i = 0; i < n; i++) assert_true(h_out[i] == 3.0f * (float)(i + launch));
  }
  for (int i = 0; i < n; i++) h_in[i] = 1.0f;
  for (int launch = 0; launch < 3; launch++) CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(h_out[0] == 3.0f && h_out[n - 1] == 3.0f);
  // the graph is independent of the executable graph made from it
  CUDA_OK(cudaGraphDestroy(g));
  assert_int_equal(cudaGraphDestroy(g), cudaErrorInvalidValue);
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaGraphExecDestroy(exec));
  assert_int_equal(cudaGraphLaunch(exec, s), cudaErrorInvalidValue);
  cudaGetLastError();
  CUDA_OK(cudaFree(x));
  CUDA_OK(cudaFree(y));
  CUDA_OK(cudaFreeHost(h_in));
  CUDA_OK(cudaFreeHost(h_out));
  CUDA_OK(cudaStreamDestroy(s));
}

static void graph_kernels_keep_their_arguments_and_read_memory_when_launched(void **) {
  const int n = 64;
  cudaStream_t s, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  std::vector<float> zeros(n, 0.0f), fives(n, 5.0f);
  float *x = device_copy(std::vector<float>(n, 1.0f)), *y = device_array<float>(n);
  float a = 2.0f;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaMemsetAsync(y, 0, n * sizeof(float), s));
  LAUNCH(axpy_kernel, 1, 64, 0, s)(y, x, a, n);
  cudaGraph_t g;
  CUDA_OK(cudaStreamEndCapture(s, &g));
  a = 100.0f;  // the graph keeps the value it was captured with
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(host_copy(y, n)[5] == 2.0f);
  // while memory is read when the launch runs
  CUDA_OK(cudaMemcpy(x, fives.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(host_copy(y, n)[5] == 10.0f);
  // launches of one executable graph are ordered even on different streams: y += x twice
  cudaGraph_t g2;
  cudaGraphExec_t add;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  LAUNCH(axpy_kernel, 1, 64, 0, s)(y, x, 1.0f, n);
  CUDA_OK(cudaStreamEndCapture(s, &g2));
  CUDA_OK(cudaGraphInstantiate(&add, g2, 0));
  CUDA_OK(cudaMemcpy(y, zeros.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaGraphLaunch(add, s));
  CUDA_OK(cudaGraphLaunch(add, s2));
  CUDA_OK(cudaStreamSynchronize(s2));  // not s: the second launch waited for the first
  assert_true(host_copy(y, n)[0] == 10.0f);
  // a launch on a capturing stream is recorded like other work (a child graph)
  cudaGraph_t outer;
  cudaGraphExec_t twice;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaGraphLaunch(add, s));
  CUDA_OK(cudaGraphLaunch(add, s));
  CUDA_OK(cudaStreamEndCapture(s, &outer));
  assert_int_equal(graph_nodes(outer), 2);
  CUDA_OK(cudaGraphInstantiate(&twice, outer, 0));
  CUDA_OK(cudaMemcpy(y, zeros.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaGraphLaunch(twice, s));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(host_copy(y, n)[0] == 10.0f);
  CUDA_OK(cudaGraphExecDestroy(twice));
  CUDA_OK(cudaGraphDestroy(outer));
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphExecDestroy(add));
  CUDA_OK(cudaGraphDestroy(g));
  CUDA_OK(cudaGraphDestroy(g2));
  CUDA_OK(cudaFree(x));
  CUDA_OK(cudaFree(y));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaStreamDestroy(s2));
}

static void capture_follows_events_across_streams_and_must_be_joined(void **) {
  const int n = 128;
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  float *a = device_array<float>(n), *b = device_array<float>(n), *c = device_array<float>(n);
  // a = 1; then b = 2 + 10 a on s2 while c = 3 on s1; then a += b + c: 16
  CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  LAUNCH(fill_kernel, 1, 128, 0, s1)(a, 1.0f, n);
  CUDA_OK(cudaEventRecord(fork, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, fork, 0));  // s2 joins the capture
  assert_int_equal(capture_status(s2), cudaStreamCaptureStatusActive);
  cudaStreamCaptureStatus status;
  unsigned long long id1 = 0, id2 = 0;
  size_t deps = 0;
  CUDA_OK(cudaStreamGetCaptureInfo(s1, &status, &id1));
  CUDA_OK(cudaStreamGetCaptureInfo(s2, &status, &id2, nullptr, nullptr, nullptr, &deps));
  assert_true(id1 != 0 && id1 == id2);
  assert_int_equal(deps, 1);  // s2's next node follows the fill of a
  LAUNCH(fill_kernel, 1, 128, 0, s2)(b, 2.0f, n);
  LAUNCH(axpy_kernel, 1, 128, 0, s2)(b, a, 10.0f, n);
  LAUNCH(fill_kernel, 1, 128, 0, s1)(c, 3.0f, n);
  CUDA_OK(cudaEventRecord(join, s2));
  CUDA_OK(cudaStreamWaitEvent(s1, join, 0));
  LAUNCH(axpy_kernel, 1, 128, 0, s1)(a, b, 1.0f, n);
  LAUNCH(axpy_kernel, 1, 128, 0, s1)(a, c, 1.0f, n);
  cudaGraph_t g;
  CUDA_OK(cudaStreamEndCapture(s1, &g));
  assert_int_equal(capture_status(s2), cudaStreamCaptureStatusNone);
  assert_int_equal(graph_nodes(g), 6);
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  for (int launch = 0; launch < 4; launch++) {  // independent nodes run in a different order each time
    CUDA_OK(cudaGraphLaunch(exec, s1));
    CUDA_OK(cudaStreamSynchronize(s1));
    assert_true(host_copy(a, n)[7] == 16.0f && host_copy(b, n)[7] == 12.0f);
  }
  // a fork that never rejoins the origin stream: no graph
  CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  LAUNCH(fill_kernel, 1, 128, 0, s1)(a, 1.0f, n);
  CUDA_OK(cudaEventRecord(fork, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, fork, 0));
  LAUNCH(fill_kernel, 1, 128, 0, s2)(b, 2.0f, n);
  cudaGraph_t unjoined = g;
  assert_int_equal(cudaStreamEndCapture(s1, &unjoined), cudaErrorStreamCaptureUnjoined);
  assert_null(unjoined);
  cudaGetLastError();
  assert_int_equal(capture_status(s1), cudaStreamCaptureStatusNone);
  assert_int_equal(capture_status(s2), cudaStreamCaptureStatusNone);
  LAUNCH(fill_kernel, 1, 128, 0, s2)(b, 4.0f, n);  // both streams work as before
  CUDA_OK(cudaStreamSynchronize(s2));
  assert_true(host_copy(b, n)[0] == 4.0f);
  // the capture ends where it began
  CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaEventRecord(fork, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, fork, 0));
  assert_int_equal(cudaStreamEndCapture(s2, &unjoined), cudaErrorStreamCaptureUnmatched);
  assert_int_equal(cudaStreamEndCapture(s1, &unjoined), cudaErrorStreamCaptureInvalidated);
  cudaGetLastError();
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(g));
  CUDA_OK(cudaEventDestroy(fork));
  CUDA_OK(cudaEventDestroy(join));
  cudaFree(a), cudaFree(b), cudaFree(c);
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
}

// Begins a capture on s in `mode` and makes `call`, which must fail with `want` and invalidate the
// capture: later work is refused and cudaStreamEndCapture returns no graph. The capture is ended
// before any check fails (a capture left open would fail every later test).
static void expect_capture_refuses(const char *what, cudaStream_t s, cudaStreamCaptureMode mode, cudaError_t want,
                                   const std::function<cudaError_t()> &call) {
  CUDA_OK(cudaStreamBeginCapture(s, mode));
  cudaError_t e = call();
  cudaStreamCaptureStatus status = capture_status(s);
  cudaGetLastError();
  LAUNCH(noop_kernel, 1, 1, 0, s)(nullptr);
  cudaError_t later = cudaGetLastError();
  cudaGraph_t g = nullptr;
  cudaError_t end = cudaStreamEndCapture(s, &g);
  cudaGetLastError();
  if (e != want)
    fail_msg("%s during capture returned %s, expected %s", what, cudaGetErrorName(e), cudaGetErrorName(want));
  if (status != cudaStreamCaptureStatusInvalidated) fail_msg("%s did not invalidate the capture", what);
  assert_int_equal(later, cudaErrorStreamCaptureInvalidated);
  assert_int_equal(end, cudaErrorStreamCaptureInvalidated);
  assert_null(g);
}

// Captures s in `mode` around `call`, which must succeed; returns the number of nodes recorded.
static size_t expect_capture_allows(const char *what, cudaStream_t s, cudaStreamCaptureMode mode,
                                    const std::function<cudaError_t()> &call) {
  CUDA_OK(cudaStreamBeginCapture(s, mode));
  cudaError_t e = call();
  cudaGraph_t g = nullptr;
  cudaError_t end = cudaStreamEndCapture(s, &g);
  if (e != cudaSuccess) fail_msg("%s during capture returned %s", what, cudaGetErrorName(e));
  CUDA_OK(end);
  size_t nodes = graph_nodes(g);
  CUDA_OK(cudaGraphDestroy(g));
  return nodes;
}

static void capture_refuses_what_it_cannot_record(void **) {
  cudaStream_t s, other, blocking;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreate(&blocking));
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  float *d = device_array<float>(16), pageable[16] = {0};
  float *pinned;
  CUDA_OK(cudaMallocHost((void **)&pinned, sizeof pageable));
  const cudaStreamCaptureMode global = cudaStreamCaptureModeGlobal, relaxed = cudaStreamCaptureModeRelaxed;
  // what cannot run while the stream only records
  expect_capture_refuses("cudaStreamSynchronize", s, global, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaStreamSynchronize(s); });
  expect_capture_refuses("cudaStreamQuery", s, relaxed, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaStreamQuery(s); });
  expect_capture_refuses("cudaDeviceSynchronize", s, relaxed, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaDeviceSynchronize(); });
  expect_capture_refuses("cudaEventQuery of an event recorded in the capture", s, relaxed, cudaErrorCapturedEvent, [&] {
    cudaEventRecord(ev, s);
    return cudaEventQuery(ev);
  });
  expect_capture_refuses("cudaEventSynchronize of an event recorded in the capture", s, relaxed, cudaErrorCapturedEvent,
                         [&] {
                           cudaEventRecord(ev, s);
                           return cudaEventSynchronize(ev);
                         });
  assert_int_equal(cudaEventQuery(ev), cudaErrorCapturedEvent);  // until it is recorded again
  CUDA_OK(cudaEventRecord(ev, s));
  CUDA_OK(cudaEventSynchronize(ev));
  expect_capture_refuses("waiting for work outside the capture", s, global, cudaErrorStreamCaptureIsolation, [&] {
    LAUNCH(fill_kernel, 1, 16, 0, other)(d, 1.0f, 16);
    cudaEventRecord(ev, other);
    return cudaStreamWaitEvent(s, ev, 0);
  });
  CUDA_OK(cudaStreamSynchronize(other));
  // pageable host memory: a graph's copy reads it at every launch, long after the call
  expect_capture_refuses("cudaMemcpyAsync from pageable memory", s, relaxed, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaMemcpyAsync(d, pageable, sizeof pageable, cudaMemcpyHostToDevice, s); });
  assert_int_equal(
      expect_capture_allows("cudaMemcpyAsync from pinned memory", s, global,
                            [&] { return cudaMemcpyAsync(d, pinned, sizeof pageable, cudaMemcpyHostToDevice, s); }),
      1);
  // the potentially unsafe calls: refused in global and thread-local mode, allowed in relaxed mode
  void *p = nullptr;
  expect_capture_refuses("cudaMalloc", s, global, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaMalloc(&p, 64); });
  expect_capture_refuses("cudaFree", s, cudaStreamCaptureModeThreadLocal, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaFree(d); });
  expect_capture_refuses("cudaMemcpy", s, global, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaMemcpy(d, pageable, sizeof pageable, cudaMemcpyHostToDevice); });
  expect_capture_refuses("cudaMemset", s, global, cudaErrorStreamCaptureUnsupported,
                         [&] { return cudaMemset(d, 0, sizeof pageable); });
  expect_capture_allows("cudaMalloc and cudaFree", s, relaxed, [&] {
    cudaError_t e = cudaMalloc(&p, 64);
    return e ? e : cudaFree(p);
  });
  expect_capture_allows("cudaMalloc after cudaThreadExchangeStreamCaptureMode", s, global, [&] {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CUDA_OK(cudaThreadExchangeStreamCaptureMode(&mode));
    cudaError_t e = cudaMalloc(&p, 64);
    if (!e) e = cudaFree(p);
    CUDA_OK(cudaThreadExchangeStreamCaptureMode(&mode));
    assert_int_equal(mode, cudaStreamCaptureModeRelaxed);
    return e;
  });
  // the legacy stream would depend on a capturing blocking stream; not on a non-blocking one
  CUDA_OK(cudaStreamBeginCapture(blocking, relaxed));
  cudaStreamCaptureStatus status;
  assert_int_equal(cudaStreamIsCapturing(0, &status), cudaErrorStreamCaptureImplicit);
  assert_int_equal(capture_status(blocking), cudaStreamCaptureStatusActive);  // asking does not invalidate
  cudaGetLastError();
  cudaGraph_t g;
  CUDA_OK(cudaStreamEndCapture(blocking, &g));
  CUDA_OK(cudaGraphDestroy(g));
  expect_capture_refuses("a launch on the legacy stream", blocking, relaxed, cudaErrorStreamCaptureImplicit, [&] {
    LAUNCH(noop_kernel, 1, 1, 0, 0)(nullptr);
    return cudaGetLastError();
  });
  assert_int_equal(
      expect_capture_allows("cudaMemcpy", s, relaxed,
                            [&] { return cudaMemcpy(d, pageable, sizeof pageable, cudaMemcpyHostToDevice); }),
      0);
  // where a capture can begin and end
  assert_int_equal(cudaStreamBeginCapture(0, global), cudaErrorInvalidValue);
  CUDA_OK(cudaStreamBeginCapture(s, global));
  assert_int_equal(cudaStreamBeginCapture(s, global), cudaErrorInvalidValue);
  CUDA_OK(cudaStreamEndCapture(s, &g));
  assert_int_equal(graph_nodes(g), 0);
  cudaGraph_t none;
  assert_int_equal(cudaStreamEndCapture(s, &none), cudaErrorInvalidValue);  // not capturing
  cudaGetLastError();
  CUDA_OK(cudaGraphDestroy(g));
  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFree(d));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaStreamDestroy(other));
  CUDA_OK(cudaStreamDestroy(blocking));
}

// An executable graph that fills y (16 floats).
static cudaGraphExec_t graph_writing(float *y, cudaStream_t s) {
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  LAUNCH(fill_kernel, 1, 16, 0, s)(y, 1.0f, 16);
  cudaGraph_t g;
  CUDA_OK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  CUDA_OK(cudaGraphDestroy(g));
  return exec;
}

static void launch_graph_after_free() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  float *y = device_array<float>(16);
  cudaGraphExec_t exec = graph_writing(y, s);
  cudaFree(y);  // nothing queued uses it: allowed
  cudaGraphLaunch(exec, s);
  cudaStreamSynchronize(s);
}

static void launch_graph_after_free_host() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  float *y = device_array<float>(16), *h;
  cudaMallocHost((void **)&h, 16 * sizeof(float));
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  cudaMemcpyAsync(h, y, 16 * sizeof(float), cudaMemcpyDeviceToHost, s);
  cudaGraph_t g;
  cudaStreamEndCapture(s, &g);
  cudaGraphExec_t exec;
  cudaGraphInstantiate(&exec, g, 0);
  cudaFreeHost(h);
  cudaGraphLaunch(exec, s);
  cudaStreamSynchronize(s);
}

static void free_while_graph_launch_queued() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  float *y = device_array<float>(16);
  cudaGraphLaunch(graph_writing(y, s), s);
  cudaFree(y);
}

static void graphs_check_the_memory_they_use_when_launched(void **) {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *y = device_array<float>(16);
  cudaGraphExec_t exec = graph_writing(y, s);
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  assert_true(host_copy(y, 16)[15] == 1.0f);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaFree(y));  // after the last launch: fine
  CUDA_OK(cudaStreamDestroy(s));
  expect_death(launch_graph_after_free, "freed since the graph was captured");
  expect_death(launch_graph_after_free_host, "that is no longer pinned");
  expect_death(free_while_graph_launch_queued, "while queued, unfinished work still uses it: a launch of a graph");
}

// ---- cuBLAS -------------------------------------------------------------------------------------

#define BLAS_OK(call)                                                                      \
  do {                                                                                     \
    cublasStatus_t s_ = (call);                                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) fail_msg("%s: %s", #call, cublasGetStatusString(s_)); \
  } while (0)

static float pseudo(int i, int salt) {
  return (float)((i * 7919 + salt * 104729) % 2003) / 1001.0f - 1.0f;
}

// C (m x n, column-major, ld ldc) = alpha op(A) op(B) + beta C, in double.
static void gemm_reference(bool ta, bool tb, int m, int n, int k, double alpha, const std::vector<float> &A, int lda,
                           const std::vector<float> &B, int ldb, double beta, std::vector<double> &C, int ldc) {
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      double s = 0;
      for (int p = 0; p < k; p++)
        s += (double)(ta ? A[(size_t)i * lda + p] : A[(size_t)p * lda + i]) *
             (double)(tb ? B[(size_t)p * ldb + j] : B[(size_t)j * ldb + p]);
      C[(size_t)j * ldc + i] = alpha * s + (beta != 0 ? beta * C[(size_t)j * ldc + i] : 0);
    }
}

static double max_rel(const std::vector<float> &got, const std::vector<double> &want) {
  double worst = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); i++) scale = fmax(scale, fabs(want[i]));
  for (size_t i = 0; i < want.size(); i++) worst = fmax(worst, fabs(got[i] - want[i]) / scale);
  return worst;
}

static void cublas_gemm_follows_column_major_rules(void **) {
  cublasHandle_t h;
  BLAS_OK(cublasCreate(&h));
  BLAS_OK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  int m = 5, n = 4, k = 3;
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      int lda = (ta ? k : m) + 2, ldb = (tb ? n : k) + 1, ldc = m + 3;
      std::vector<float> A((size_t)lda * (ta ? m : k)), B((size_t)ldb * (tb ? k : n)), C((size_t)ldc * n);
      for (size_t i = 0; i < A.size(); i++) A[i] = pseudo((int)i, 1);
      for (size_t i = 0; i < B.size(); i++) B[i] = pseudo((int)i, 2);
      for (size_t i = 0; i < C.size(); i++) C[i] = pseudo((int)i, 3);
      std::vector<double> want(C.begin(), C.end());
      gemm_reference(ta, tb, m, n, k, 0.5, A, lda, B, ldb, 2.0, want, ldc);
      float *dA = device_copy(A), *dB = device_copy(B), *dC = device_copy(C);
      float alpha = 0.5f, beta = 2.0f;
      BLAS_OK(cublasSgemm(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, dA, lda,
                          dB, ldb, &beta, dC, ldc));
      std::vector<float> got = host_copy(dC, C.size());
      for (int j = 0; j < n; j++)  // the padding rows between columns stay as they were
        for (int i = m; i < ldc; i++) assert_true(got[(size_t)j * ldc + i] == C[(size_t)j * ldc + i]);
      if (max_rel(got, want) > 1e-6) fail_msg("gemm ta %d tb %d: error %g", ta, tb, max_rel(got, want));
      // beta 0: C is not read, so NaN there does not matter
      CUDA_OK(cudaMemset(dC, 0xff, C.size() * sizeof(float)));
      beta = 0;
      BLAS_OK(cublasSgemm(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha, dA, lda,
                          dB, ldb, &beta, dC, ldc));
      got = host_copy(dC, C.size());
      for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) assert_false(isnan(got[(size_t)j * ldc + i]));
      cudaFree(dA), cudaFree(dB), cudaFree(dC);
    }
  // a leading dimension smaller than the rows is invalid
  float one = 1, zero = 0;
  float *d = device_array<float>(64);
  assert_int_equal(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, 3, d, 4, &zero, d, 4),
                   CUBLAS_STATUS_INVALID_VALUE);
  // strided batches: three independent products
  std::vector<float> A(3 * 16), B(3 * 16), C(3 * 16, 0.0f);
  for (size_t i = 0; i < A.size(); i++) A[i] = pseudo((int)i, 4), B[i] = pseudo((int)i, 5);
  float *dA = device_copy(A), *dB = device_copy(B), *dC = device_copy(C);
  BLAS_OK(
      cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, dA, 4, 16, dB, 4, 16, &zero, dC, 4, 16, 3));
  std::vector<float> got = host_copy(dC, C.size());
  for (int b = 0; b < 3; b++) {
    std::vector<float> Ab(A.begin() + b * 16, A.begin() + b * 16 + 16), Bb(B.begin() + b * 16, B.begin() + b * 16 + 16);
    std::vector<double> want(16, 0.0);
    gemm_reference(false, false, 4, 4, 4, 1.0, Ab, 4, Bb, 4, 0.0, want, 4);
    std::vector<float> gb(got.begin() + b * 16, got.begin() + b * 16 + 16);
    assert_true(max_rel(gb, want) < 1e-6);
  }
  cudaFree(dA), cudaFree(dB), cudaFree(dC), cudaFree(d);
  BLAS_OK(cublasDestroy(h));
}

static void device_alpha_in_host_mode() {
  cublasHandle_t h;
  cublasCreate(&h);
  float *d = device_array<float>(16);
  cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 1, d, d, 4, d, 1, d, d, 4);
}

// cuBLASLt: the bias epilogue by hand (D = A B + bias per row, C read only with beta), and what
// cublasLtMatmul refuses: an algorithm chosen for other descriptors, a pointer less aligned than
// the heuristic was told, a missing workspace; GPUSIM_CUBLASLT=none leaves the heuristic empty.
static void cublaslt_bias_epilogue_and_its_checks(void **) {
  cublasLtHandle_t lt;
  BLAS_OK(cublasLtCreate(&lt));
  // A (2 x 3) and B (3 x 2), column-major: A = [1 2 3; 4 5 6], B = [1 0; 0 1; 1 1]
  float *dA = device_copy(std::vector<float>{1, 4, 2, 5, 3, 6}),
        *dB = device_copy(std::vector<float>{1, 0, 1, 0, 1, 1});
  float *dC = device_copy(std::vector<float>{10, 20, 30, 40}), *dD = device_copy(std::vector<float>(4, -1.0f));
  float *dbias = device_copy(std::vector<float>{0.5f, -0.5f, 0, 0, 7, 7, 7, 7});
  cublasLtMatmulDesc_t desc;
  BLAS_OK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasLtEpilogue_t bias = CUBLASLT_EPILOGUE_BIAS;
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &bias, sizeof bias));
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dbias, sizeof dbias));
  cublasLtMatrixLayout_t la, lb, lc, other;
  BLAS_OK(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 2, 3, 2));
  BLAS_OK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, 3, 2, 3));
  BLAS_OK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 2, 2, 2));
  BLAS_OK(cublasLtMatrixLayoutCreate(&other, CUDA_R_32F, 2, 2, 4));
  cublasLtMatmulPreference_t pref;
  BLAS_OK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws_bytes = 1 << 20;
  BLAS_OK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
  // A and B: 4-byte aligned (their leading dimensions are 2 and 3 floats); C and D: 8 bytes
  const uint32_t align[4] = {4, 4, 8, 8};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; i++)
    BLAS_OK(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof align[i]));
  cublasLtMatmulHeuristicResult_t r;
  int found = 0;
  BLAS_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found));
  assert_int_equal(found, 1);
  float one = 1, zero = 0, half = 0.5f;
  cudaStream_t s = 0;
  // A B = [4 5; 10 11]; plus the bias per row: [4.5 5.5; 9.5 10.5]; column-major D
  BLAS_OK(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &zero, dC, lc, dD, lc, &r.algo, nullptr, 0, s));
  std::vector<float> got = host_copy(dD, 4);
  assert_true(got == (std::vector<float>{4.5f, 9.5f, 5.5f, 10.5f}));
  // beta: D = A B + 0.5 C + bias, C left as it was
  BLAS_OK(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &half, dC, lc, dD, lc, &r.algo, nullptr, 0, s));
  got = host_copy(dD, 4);
  assert_true(got == (std::vector<float>{9.5f, 19.5f, 20.5f, 30.5f}));
  assert_true(host_copy(dC, 4) == (std::vector<float>{10, 20, 30, 40}));
  // B one float past its allocation's start is as aligned as the heuristic was told; D there is not
  float *dB4 = device_copy(std::vector<float>{9, 1, 0, 1, 0, 1, 1}), *dD4 = device_copy(std::vector<float>(5, 0.0f));
  BLAS_OK(cublasLtMatmul(lt, desc, &one, dA, la, dB4 + 1, lb, &zero, dC, lc, dD, lc, &r.algo, nullptr, 0, s));
  assert_int_equal(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &zero, dC, lc, dD4 + 1, lc, &r.algo, nullptr, 0, s),
                   CUBLAS_STATUS_INVALID_VALUE);
  // the bias moved to a 4-byte boundary after the heuristic saw it 256-byte aligned
  float *moved = dbias + 1;
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &moved, sizeof moved));
  assert_int_equal(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &zero, dC, lc, dD, lc, &r.algo, nullptr, 0, s),
                   CUBLAS_STATUS_INVALID_VALUE);
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dbias, sizeof dbias));
  // an algorithm is for the descriptors it was chosen for
  assert_int_equal(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &zero, dC, other, dD, other, &r.algo, nullptr, 0, s),
                   CUBLAS_STATUS_INVALID_VALUE);
  // k = 40 takes an algorithm with a workspace (split-K's partial sums), which must be given, unless
  // the preference rules out every reduction scheme
  const uint32_t no_split = CUBLASLT_REDUCTION_SCHEME_NONE;
  float *dA40 = device_copy(std::vector<float>(80, 1.0f)), *dB40 = device_copy(std::vector<float>(80, 1.0f));
  cublasLtMatrixLayout_t la40, lb40;
  BLAS_OK(cublasLtMatrixLayoutCreate(&la40, CUDA_R_32F, 2, 40, 2));
  BLAS_OK(cublasLtMatrixLayoutCreate(&lb40, CUDA_R_32F, 40, 2, 40));
  cublasLtMatmulPreference_t pref_no_split;
  BLAS_OK(cublasLtMatmulPreferenceCreate(&pref_no_split));
  BLAS_OK(cublasLtMatmulPreferenceSetAttribute(pref_no_split, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                               sizeof ws_bytes));
  BLAS_OK(cublasLtMatmulPreferenceSetAttribute(pref_no_split, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split,
                                               sizeof no_split));
  for (int i = 0; i < 4; i++)
    BLAS_OK(cublasLtMatmulPreferenceSetAttribute(pref_no_split, align_attr[i], &align[i], sizeof align[i]));
  BLAS_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la40, lb40, lc, lc, pref_no_split, 1, &r, &found));
  assert_true(found == 1 && r.workspaceSize == 0);
  BLAS_OK(cublasLtMatmulPreferenceDestroy(pref_no_split));
  BLAS_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la40, lb40, lc, lc, pref, 1, &r, &found));
  assert_true(found == 1 && r.workspaceSize > 0);
  assert_int_equal(
      cublasLtMatmul(lt, desc, &one, dA40, la40, dB40, lb40, &zero, dC, lc, dD, lc, &r.algo, nullptr, 0, s),
      CUBLAS_STATUS_INVALID_VALUE);
  void *ws = nullptr;
  assert_int_equal(cudaMalloc(&ws, r.workspaceSize), cudaSuccess);
  BLAS_OK(
      cublasLtMatmul(lt, desc, &one, dA40, la40, dB40, lb40, &zero, dC, lc, dD, lc, &r.algo, ws, r.workspaceSize, s));
  assert_true(host_copy(dD, 4) == (std::vector<float>{40.5f, 39.5f, 40.5f, 39.5f}));
  setenv("GPUSIM_CUBLASLT", "none", 1);
  assert_int_equal(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found),
                   CUBLAS_STATUS_NOT_SUPPORTED);
  assert_int_equal(found, 0);
  unsetenv("GPUSIM_CUBLASLT");
  for (cublasLtMatrixLayout_t l : {la, lb, lc, other, la40, lb40}) BLAS_OK(cublasLtMatrixLayoutDestroy(l));
  BLAS_OK(cublasLtMatmulPreferenceDestroy(pref));
  BLAS_OK(cublasLtMatmulDescDestroy(desc));
  BLAS_OK(cublasLtDestroy(lt));
  for (void *p : {(void *)dA, (void *)dB, (void *)dC, (void *)dD, (void *)dbias, (void *)dB4, (void *)dD4, (void *)dA40,
                  (void *)dB40, ws})
    cudaFree(p);
}

// cuBLASLt's GELU epilogues on the same 2 x 3 by 3 x 2 product, A B = [4 5; 10 11]: GELU_AUX_BIAS writes
// the gelu's input (A B + bias, here [-0.5 0.5; 0 1]) to aux and its tanh-form gelu to D; DGELU writes
// A B times the gelu's derivative at aux. aux's leading dimension must be a multiple of 8.
static void cublaslt_gelu_epilogues(void **) {
  auto gelu = [](double x) { return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); };
  auto dgelu = [](double x) {
    double t = tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * sqrt(2 / M_PI) * (1 + 3 * 0.044715 * x * x);
  };
  cublasLtHandle_t lt;
  BLAS_OK(cublasLtCreate(&lt));
  float *dA = device_copy(std::vector<float>{1, 4, 2, 5, 3, 6}),
        *dB = device_copy(std::vector<float>{1, 0, 1, 0, 1, 1});
  float *dbias = device_copy(std::vector<float>{-4.5f, -10.0f}), *dD = device_copy(std::vector<float>(4, 0.0f));
  float *daux = device_copy(std::vector<float>(16, 7.0f));  // (2 x 2) at leading dimension 8
  cublasLtMatmulDesc_t desc;
  BLAS_OK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const int64_t ld8 = 8, ld2 = 2;
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dbias, sizeof dbias));
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &daux, sizeof daux));
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld2, sizeof ld2));
  cublasLtMatrixLayout_t la, lb, lc;
  BLAS_OK(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 2, 3, 2));
  BLAS_OK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, 3, 2, 3));
  BLAS_OK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 2, 2, 2));
  cublasLtMatmulPreference_t pref;
  BLAS_OK(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t four = 4;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    BLAS_OK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &four, sizeof four));
  cublasLtMatmulHeuristicResult_t r;
  int found = 0;
  assert_int_equal(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found),
                   CUBLAS_STATUS_INVALID_VALUE);  // aux's leading dimension 2: not a multiple of 8
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld8, sizeof ld8));
  BLAS_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found));
  float one = 1, zero = 0;
  BLAS_OK(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &zero, dD, lc, dD, lc, &r.algo, nullptr, 0, 0));
  const double pre[4] = {-0.5, 0, 0.5, 1};  // column-major
  std::vector<float> got = host_copy(dD, 4), aux = host_copy(daux, 16);
  for (int i = 0; i < 4; i++) {
    const int at = (i / 2) * 8 + i % 2;
    if (aux[at] != (float)pre[i] || fabs(got[i] - gelu(pre[i])) > 1e-6)
      fail_msg("element %d: aux %g (want %g), D %.7g (want %.7g)", i, aux[at], pre[i], got[i], gelu(pre[i]));
  }
  assert_true(aux[2] == 7.0f && aux[10] == 7.0f);  // past each column's 2 rows: untouched
  // DGELU: D = A B * gelu'(aux), no bias
  epi = CUBLASLT_EPILOGUE_DGELU;
  BLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  BLAS_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found));
  BLAS_OK(cublasLtMatmul(lt, desc, &one, dA, la, dB, lb, &zero, dD, lc, dD, lc, &r.algo, nullptr, 0, 0));
  got = host_copy(dD, 4);
  const double product[4] = {4, 10, 5, 11};
  for (int i = 0; i < 4; i++)
    if (fabs(got[i] - product[i] * dgelu(pre[i])) > 1e-5)
      fail_msg("element %d: D %.7g, want %.7g", i, got[i], product[i] * dgelu(pre[i]));
  for (cublasLtMatrixLayout_t l : {la, lb, lc}) BLAS_OK(cublasLtMatrixLayoutDestroy(l));
  BLAS_OK(cublasLtMatmulPreferenceDestroy(pref));
  BLAS_OK(cublasLtMatmulDescDestroy(desc));
  BLAS_OK(cublasLtDestroy(lt));
  for (float *p : {dA, dB, dbias, dD, daux}) cudaFree(p);
}

static void cublas_math_modes_types_and_pointer_modes(void **) {
  cublasHandle_t h;
  BLAS_OK(cublasCreate(&h));
  int m = 16, n = 16, k = 64;
  std::vector<float> A((size_t)m * k), B((size_t)k * n), C((size_t)m * n, 0.0f);
  for (size_t i = 0; i < A.size(); i++) A[i] = 1.0f + pseudo((int)i, 6) * 1e-3f;
  for (size_t i = 0; i < B.size(); i++) B[i] = 1.0f + pseudo((int)i, 7) * 1e-3f;
  std::vector<double> want(C.size(), 0.0);
  gemm_reference(false, false, m, n, k, 1.0, A, m, B, k, 0.0, want, m);
  float *dA = device_copy(A), *dB = device_copy(B), *dC = device_copy(C), one = 1, zero = 0;
  // FP32 stays FP32 unless TF32 is allowed, which reads the inputs with 10 mantissa bits
  BLAS_OK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  BLAS_OK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, m, dB, k, &zero, dC, m));
  double pedantic = max_rel(host_copy(dC, C.size()), want);
  BLAS_OK(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH));
  BLAS_OK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, m, dB, k, &zero, dC, m));
  double tf32 = max_rel(host_copy(dC, C.size()), want);
  if (!(pedantic < 1e-6 && tf32 > 1e-5)) fail_msg("pedantic error %g, TF32 error %g", pedantic, tf32);
  // GemmEx: half inputs, float output, float compute
  std::vector<uint16_t> Ah(A.size()), Bh(B.size());
  for (size_t i = 0; i < A.size(); i++) {
    float a = A[i], b = B[i];  // 1 + small: round to half on the host the simple way (truncate)
    uint32_t ua, ub;
    memcpy(&ua, &a, 4), memcpy(&ub, &b, 4);
    Ah[i] = (uint16_t)(((ua >> 16) & 0x8000) | ((((ua >> 23) & 0xff) - 112) << 10) | ((ua >> 13) & 0x3ff));
    Bh[i] = (uint16_t)(((ub >> 16) & 0x8000) | ((((ub >> 23) & 0xff) - 112) << 10) | ((ub >> 13) & 0x3ff));
  }
  uint16_t *dAh = device_copy(Ah), *dBh = device_copy(Bh);
  BLAS_OK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dAh, CUDA_R_16F, m, dBh, CUDA_R_16F, k, &zero, dC,
                       CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  double half = max_rel(host_copy(dC, C.size()), want);
  if (!(half > 1e-5 && half < 1e-2)) fail_msg("half-input GEMM error %g", half);
  assert_int_equal(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dAh, CUDA_R_16F, m, dB, CUDA_R_32F, k,
                                &zero, dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   CUBLAS_STATUS_NOT_SUPPORTED);  // mixed input types
  // device pointer mode reads alpha and beta from device memory when the work runs
  BLAS_OK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  BLAS_OK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE));
  float *scalars = device_copy(std::vector<float>{2.0f, 0.0f});
  BLAS_OK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, scalars, dA, m, dB, k, scalars + 1, dC, m));
  std::vector<float> got = host_copy(dC, C.size());
  for (double &w : want) w *= 2;
  assert_true(max_rel(got, want) < 1e-6);
  cudaFree(dA), cudaFree(dB), cudaFree(dC), cudaFree(dAh), cudaFree(dBh), cudaFree(scalars);
  BLAS_OK(cublasDestroy(h));
  expect_death(device_alpha_in_host_mode, "CUBLAS_POINTER_MODE_HOST");
}

static void cublas_gemm_in_a_graph(void **) {
  cublasHandle_t h;
  cudaStream_t s;
  BLAS_OK(cublasCreate(&h));
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BLAS_OK(cublasSetStream(h, s));
  BLAS_OK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  int m = 6, n = 5, k = 4;
  std::vector<float> A((size_t)m * k), B((size_t)k * n), C((size_t)m * n, -1.0f);
  for (size_t i = 0; i < B.size(); i++) B[i] = pseudo((int)i, 15);
  float *dA = device_array<float>(A.size()), *dB = device_copy(B), *dC = device_copy(C);
  float alpha = 1.5f, beta = 0.0f;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  BLAS_OK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, dA, m, dB, k, &beta, dC, m));
  cudaGraph_t g;
  CUDA_OK(cudaStreamEndCapture(s, &g));
  alpha = 3.0f;  // host pointer mode: the value at capture is kept
  assert_true(host_copy(dC, C.size())[0] == -1.0f);
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  for (int launch = 0; launch < 2; launch++) {
    for (size_t i = 0; i < A.size(); i++) A[i] = pseudo((int)i, 16 + launch);
    CUDA_OK(cudaMemcpy(dA, A.data(), A.size() * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<double> want(C.size(), 0.0);
    gemm_reference(false, false, m, n, k, 1.5, A, m, B, k, 0.0, want, m);
    double err = max_rel(host_copy(dC, C.size()), want);
    if (err > 1e-6) fail_msg("launch %d: error %g", launch, err);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(g));
  cudaFree(dA), cudaFree(dB), cudaFree(dC);
  BLAS_OK(cublasDestroy(h));
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- cuDNN --------------------------------------------------------------------------------------

#define DNN_OK(call)                                                                    \
  do {                                                                                  \
    cudnnStatus_t s_ = (call);                                                          \
    if (s_ != CUDNN_STATUS_SUCCESS) fail_msg("%s: %s", #call, cudnnGetErrorString(s_)); \
  } while (0)

struct ConvCase {
  int n, c, h, w, k, r, pad, stride;
  bool nhwc;
};

// Offsets of x (n, c, h, w) and of the filter (k, c, r, s) in either layout.
static size_t x_at(const ConvCase &t, int n, int c, int h, int w, int H, int W, int C) {
  return t.nhwc ? (((size_t)n * H + h) * W + w) * C + c : (((size_t)n * C + c) * H + h) * W + w;
}

static void cudnn_convolutions_match_direct_loops(void **) {
  cudnnHandle_t h;
  DNN_OK(cudnnCreate(&h));
  ConvCase cases[] = {{2, 3, 7, 6, 4, 3, 1, 2, false}, {3, 2, 5, 5, 3, 3, 1, 1, true}};
  for (const ConvCase &t : cases) {
    int P = (t.h + 2 * t.pad - t.r) / t.stride + 1, Q = (t.w + 2 * t.pad - t.r) / t.stride + 1;
    cudnnTensorFormat_t fmt = t.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    cudnnTensorDescriptor_t xd, yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    DNN_OK(cudnnCreateTensorDescriptor(&xd));
    DNN_OK(cudnnCreateTensorDescriptor(&yd));
    DNN_OK(cudnnCreateFilterDescriptor(&wd));
    DNN_OK(cudnnCreateConvolutionDescriptor(&cd));
    DNN_OK(cudnnSetTensor4dDescriptor(xd, fmt, CUDNN_DATA_FLOAT, t.n, t.c, t.h, t.w));
    DNN_OK(cudnnSetTensor4dDescriptor(yd, fmt, CUDNN_DATA_FLOAT, t.n, t.k, P, Q));
    DNN_OK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, fmt, t.k, t.c, t.r, t.r));
    DNN_OK(cudnnSetConvolution2dDescriptor(cd, t.pad, t.pad, t.stride, t.stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                           CUDNN_DATA_FLOAT));
    DNN_OK(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH));
    size_t nx = (size_t)t.n * t.c * t.h * t.w, ny = (size_t)t.n * t.k * P * Q, nw = (size_t)t.k * t.c * t.r * t.r;
    std::vector<float> X(nx), Wt(nw), Y(ny), DY(ny);
    for (size_t i = 0; i < nx; i++) X[i] = pseudo((int)i, 8);
    for (size_t i = 0; i < nw; i++) Wt[i] = pseudo((int)i, 9);
    for (size_t i = 0; i < ny; i++) Y[i] = pseudo((int)i, 10), DY[i] = pseudo((int)i, 11);
    // direct loops in double
    std::vector<double> y_ref(ny), dx_ref(nx, 0.0), dw_ref(nw, 0.0);
    for (int n = 0; n < t.n; n++)
      for (int k = 0; k < t.k; k++)
        for (int p = 0; p < P; p++)
          for (int q = 0; q < Q; q++) {
            double s = 0;
            size_t yi = x_at(t, n, k, p, q, P, Q, t.k);
            for (int c = 0; c < t.c; c++)
              for (int r = 0; r < t.r; r++)
                for (int u = 0; u < t.r; u++) {
                  int ih = p * t.stride - t.pad + r, iw = q * t.stride - t.pad + u;
                  if (ih < 0 || iw < 0 || ih >= t.h || iw >= t.w) continue;
                  size_t xi = x_at(t, n, c, ih, iw, t.h, t.w, t.c), wi = x_at(t, k, c, r, u, t.r, t.r, t.c);
                  s += (double)X[xi] * Wt[wi];
                  dx_ref[xi] += (double)DY[yi] * Wt[wi];
                  dw_ref[wi] += (double)DY[yi] * X[xi];
                }
            y_ref[yi] = 2.0 * s + 0.5 * Y[yi];  // alpha 2, beta 0.5
          }
    for (size_t i = 0; i < nw; i++) dw_ref[i] += Wt[i];  // backward filter adds (beta 1) into w
    float *dX = device_copy(X), *dW = device_copy(Wt), *dY = device_copy(Y), *dDY = device_copy(DY);
    float *dDX = device_array<float>(nx);
    void *ws = device_array<char>(64 << 20);
    float two = 2, half = 0.5f, one = 1, zero = 0;
    DNN_OK(cudnnConvolutionForward(h, &two, xd, dX, wd, dW, cd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, ws, 64 << 20, &half,
                                   yd, dY));
    DNN_OK(cudnnConvolutionBackwardData(h, &one, wd, dW, yd, dDY, cd, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, ws, 64 << 20,
                                        &zero, xd, dDX));
    DNN_OK(cudnnConvolutionBackwardFilter(h, &one, xd, dX, yd, dDY, cd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, ws,
                                          64 << 20, &one, wd, dW));
    double e1 = max_rel(host_copy(dY, ny), y_ref), e2 = max_rel(host_copy(dDX, nx), dx_ref),
           e3 = max_rel(host_copy(dW, nw), dw_ref);
    if (e1 > 1e-6 || e2 > 1e-6 || e3 > 1e-6)
      fail_msg("%s: forward %g, backward data %g, backward filter %g", t.nhwc ? "NHWC" : "NCHW", e1, e2, e3);
    cudaFree(dX), cudaFree(dW), cudaFree(dY), cudaFree(dDY), cudaFree(dDX), cudaFree(ws);
    cudnnDestroyTensorDescriptor(xd), cudnnDestroyTensorDescriptor(yd);
    cudnnDestroyFilterDescriptor(wd), cudnnDestroyConvolutionDescriptor(cd);
  }
  DNN_OK(cudnnDestroy(h));
}

static void cudnn_algorithms_workspaces_math_and_determinism(void **) {
  cudnnHandle_t h;
  DNN_OK(cudnnCreate(&h));
  cudnnTensorDescriptor_t xd, yd;
  cudnnFilterDescriptor_t wd;
  cudnnConvolutionDescriptor_t cd;
  DNN_OK(cudnnCreateTensorDescriptor(&xd));
  DNN_OK(cudnnCreateTensorDescriptor(&yd));
  DNN_OK(cudnnCreateFilterDescriptor(&wd));
  DNN_OK(cudnnCreateConvolutionDescriptor(&cd));
  // a zero-sized tensor is a bad parameter, as in cuDNN
  assert_int_equal(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 0, 3, 8, 8),
                   CUDNN_STATUS_BAD_PARAM);
  DNN_OK(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 8, 16, 12, 12));
  DNN_OK(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 8, 16, 12, 12));
  DNN_OK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, 16, 16, 3, 3));
  DNN_OK(cudnnSetConvolution2dDescriptor(cd, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  DNN_OK(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH));
  // the heuristics list several algorithms with their workspace sizes, as the size queries give
  cudnnConvolutionFwdAlgoPerf_t perf[8];
  int count = 0, with_workspace = 0;
  DNN_OK(cudnnGetConvolutionForwardAlgorithm_v7(h, xd, wd, cd, yd, 8, &count, perf));
  assert_true(count >= 3);
  for (int i = 0; i < count; i++) {
    if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
    size_t ws = 0;
    DNN_OK(cudnnGetConvolutionForwardWorkspaceSize(h, xd, wd, cd, yd, perf[i].algo, &ws));
    assert_int_equal(ws, perf[i].memory);
    assert_int_equal(perf[i].mathType, CUDNN_FMA_MATH);
    with_workspace += ws > 0;
  }
  assert_true(with_workspace >= 1);
  size_t need = 0;
  DNN_OK(cudnnGetConvolutionForwardWorkspaceSize(h, xd, wd, cd, yd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, &need));
  assert_true(need > 0);
  size_t nx = 8 * 16 * 12 * 12, nw = 16 * 16 * 9;
  std::vector<float> X(nx), Wt(nw);
  for (size_t i = 0; i < nx; i++) X[i] = 1.0f + pseudo((int)i, 12) * 1e-3f;
  for (size_t i = 0; i < nw; i++) Wt[i] = 1.0f + pseudo((int)i, 13) * 1e-3f;
  float *dX = device_copy(X), *dW = device_copy(Wt), *dY = device_array<float>(nx), *dW2 = device_array<float>(nw);
  char *ws = device_array<char>(need);
  float one = 1, zero = 0;
  // a workspace one byte short is refused
  assert_int_equal(cudnnConvolutionForward(h, &one, xd, dX, wd, dW, cd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, ws, need - 1,
                                           &zero, yd, dY),
                   CUDNN_STATUS_BAD_PARAM);
  // the math type decides the numerics: FMA is FP32, the default reads TF32 on this "H100"
  DNN_OK(
      cudnnConvolutionForward(h, &one, xd, dX, wd, dW, cd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, ws, need, &zero, yd, dY));
  std::vector<float> fma = host_copy(dY, nx);
  DNN_OK(cudnnSetConvolutionMathType(cd, CUDNN_DEFAULT_MATH));
  DNN_OK(
      cudnnConvolutionForward(h, &one, xd, dX, wd, dW, cd, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, ws, need, &zero, yd, dY));
  std::vector<float> tf32 = host_copy(dY, nx);
  std::vector<double> fma_d(fma.begin(), fma.end());
  if (max_rel(tf32, fma_d) < 1e-5) fail_msg("CUDNN_DEFAULT_MATH gave FP32 results: no TF32 rounding");
  DNN_OK(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH));
  // non-deterministic algorithms sum in a different order on each call; deterministic ones do not
  size_t ws0 = 0, ws1 = 0;
  DNN_OK(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd, yd, cd, wd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, &ws0));
  DNN_OK(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd, yd, cd, wd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, &ws1));
  char *big = device_array<char>(ws0 > ws1 ? ws0 : ws1);
  std::vector<float> runs[4];
  for (int i = 0; i < 4; i++) {
    cudnnConvolutionBwdFilterAlgo_t a =
        i < 2 ? CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 : CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;
    DNN_OK(cudnnConvolutionBackwardFilter(h, &one, xd, dX, yd, dX, cd, a, big, ws0 > ws1 ? ws0 : ws1, &zero, wd, dW2));
    runs[i] = host_copy(dW2, nw);
  }
  assert_true(memcmp(runs[2].data(), runs[3].data(), nw * sizeof(float)) == 0);
  if (memcmp(runs[0].data(), runs[1].data(), nw * sizeof(float)) == 0)
    fail_msg("CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 (non-deterministic) gave identical bits twice");
  // and so at each launch of a graph that captured it
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DNN_OK(cudnnSetStream(h, s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  DNN_OK(cudnnConvolutionBackwardFilter(h, &one, xd, dX, yd, dX, cd, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, big,
                                        ws0 > ws1 ? ws0 : ws1, &zero, wd, dW2));
  cudaGraph_t g;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamEndCapture(s, &g));
  CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
  for (int i = 0; i < 2; i++) {
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    runs[i] = host_copy(dW2, nw);
  }
  if (memcmp(runs[0].data(), runs[1].data(), nw * sizeof(float)) == 0)
    fail_msg("two launches of a graph with CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 gave identical bits");
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(g));
  CUDA_OK(cudaStreamDestroy(s));
  cudaFree(dX), cudaFree(dW), cudaFree(dY), cudaFree(dW2), cudaFree(ws), cudaFree(big);
  cudnnDestroyTensorDescriptor(xd), cudnnDestroyTensorDescriptor(yd);
  cudnnDestroyFilterDescriptor(wd), cudnnDestroyConvolutionDescriptor(cd);
  DNN_OK(cudnnDestroy(h));
}

// ---- cuDNN with half and bfloat16 data ----------------------------------------------------------

// A 16-bit type on the host, independently of the stand-in: `bits` significant bits, normal from
// 2^min_exp (half's subnormals included); the values here stay far from overflow.
struct Type16 {
  cudnnDataType_t type;
  const char *name;
  int bits, min_exp;
};
static const Type16 kHalf = {CUDNN_DATA_HALF, "half", 11, -14}, kBf16 = {CUDNN_DATA_BFLOAT16, "bfloat16", 8, -126};

// The spacing of t's values at v (one ulp), and v rounded to t (to nearest even).
static double ulp16(const Type16 &t, double v) {
  int e;
  frexp(v, &e);  // |v| = m 2^e, m in [0.5, 1)
  return ldexp(1.0, (e - 1 > t.min_exp ? e - 1 : t.min_exp) - (t.bits - 1));
}
static double round16(const Type16 &t, double v) {
  double u = ulp16(t, v);
  return nearbyint(v / u) * u;
}

// The bits of v, a value of t, and back.
static uint16_t bits16(const Type16 &t, double v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, 4);
  if (t.type == CUDNN_DATA_BFLOAT16) return (uint16_t)(u >> 16);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  double a = fabs(v);
  if (a < ldexp(1.0, -14)) return (uint16_t)(sign | (uint16_t)(a / ldexp(1.0, -24)));  // subnormal
  int e;
  double m = frexp(a, &e);
  return (uint16_t)(sign | (e + 14) << 10 | (uint16_t)((2 * m - 1) * 1024));
}
static double value16(const Type16 &t, uint16_t b) {
  if (t.type == CUDNN_DATA_BFLOAT16) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  int exp = (b >> 10) & 0x1f, man = b & 0x3ff;
  double a = exp == 0x1f ? NAN : exp == 0 ? ldexp(man, -24) : ldexp(1024 + man, exp - 25);
  return b & 0x8000 ? -a : a;
}

// n values of t from pseudo(), as doubles and as bits.
static std::vector<double> values16(const Type16 &t, size_t n, int salt, std::vector<uint16_t> *bits) {
  std::vector<double> v(n);
  bits->resize(n);
  for (size_t i = 0; i < n; i++) {
    v[i] = round16(t, pseudo((int)i, salt)), (*bits)[i] = bits16(t, v[i]);
    if (value16(t, (*bits)[i]) != v[i]) fail_msg("%s: %.9g does not encode", t.name, v[i]);
  }
  return v;
}

// The sums of a convolution in double: y = x * w, dx = dy * w^T, dw = dy^T x (x, dy, w in t's layout).
static void conv_sums(const ConvCase &t, int P, int Q, const std::vector<double> &X, const std::vector<double> &W,
                      const std::vector<double> &DY, std::vector<double> *y, std::vector<double> *dx,
                      std::vector<double> *dw) {
  y->assign(DY.size(), 0.0), dx->assign(X.size(), 0.0), dw->assign(W.size(), 0.0);
  for (int n = 0; n < t.n; n++)
    for (int k = 0; k < t.k; k++)
      for (int p = 0; p < P; p++)
        for (int q = 0; q < Q; q++) {
          size_t yi = x_at(t, n, k, p, q, P, Q, t.k);
          for (int c = 0; c < t.c; c++)
            for (int r = 0; r < t.r; r++)
              for (int u = 0; u < t.r; u++) {
                int ih = p * t.stride - t.pad + r, iw = q * t.stride - t.pad + u;
                if (ih < 0 || iw < 0 || ih >= t.h || iw >= t.w) continue;
                size_t xi = x_at(t, n, c, ih, iw, t.h, t.w, t.c), wi = x_at(t, k, c, r, u, t.r, t.r, t.c);
                (*y)[yi] += X[xi] * W[wi];
                (*dx)[xi] += DY[yi] * W[wi];
                (*dw)[wi] += DY[yi] * X[xi];
              }
        }
}

// got (bits of t) against want rounded to t: each within one ulp, and nearly all equal (a result
// truncated instead of rounded to nearest would miss about half of them).
static void expect_rounded(const Type16 &t, const char *what, const std::vector<uint16_t> &got,
                           const std::vector<double> &want) {
  size_t inexact = 0;
  for (size_t i = 0; i < want.size(); i++) {
    double g = value16(t, got[i]), r = round16(t, want[i]);
    if (!(fabs(g - r) <= ulp16(t, r))) fail_msg("%s %s[%zu]: %.9g, want %.9g", t.name, what, i, g, r);
    inexact += g != r;
  }
  if (inexact > want.size() / 50 + 1)
    fail_msg("%s %s: %zu of %zu results not rounded to nearest", t.name, what, inexact, want.size());
}

// Descriptors of a convolution with the given types (x, w, y), compute type and math type.
struct ConvDescs {
  cudnnTensorDescriptor_t x, y;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t cv;
};

static ConvDescs conv_descs(const ConvCase &t, cudnnDataType_t xt, cudnnDataType_t wt, cudnnDataType_t yt,
                            cudnnDataType_t compute, cudnnMathType_t math) {
  int P = (t.h + 2 * t.pad - t.r) / t.stride + 1, Q = (t.w + 2 * t.pad - t.r) / t.stride + 1;
  cudnnTensorFormat_t fmt = t.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  ConvDescs d;
  DNN_OK(cudnnCreateTensorDescriptor(&d.x));
  DNN_OK(cudnnCreateTensorDescriptor(&d.y));
  DNN_OK(cudnnCreateFilterDescriptor(&d.w));
  DNN_OK(cudnnCreateConvolutionDescriptor(&d.cv));
  DNN_OK(cudnnSetTensor4dDescriptor(d.x, fmt, xt, t.n, t.c, t.h, t.w));
  DNN_OK(cudnnSetTensor4dDescriptor(d.y, fmt, yt, t.n, t.k, P, Q));
  DNN_OK(cudnnSetFilter4dDescriptor(d.w, wt, fmt, t.k, t.c, t.r, t.r));
  DNN_OK(
      cudnnSetConvolution2dDescriptor(d.cv, t.pad, t.pad, t.stride, t.stride, 1, 1, CUDNN_CROSS_CORRELATION, compute));
  DNN_OK(cudnnSetConvolutionMathType(d.cv, math));
  return d;
}

static void destroy_descs(const ConvDescs &d) {
  cudnnDestroyTensorDescriptor(d.x), cudnnDestroyTensorDescriptor(d.y);
  cudnnDestroyFilterDescriptor(d.w), cudnnDestroyConvolutionDescriptor(d.cv);
}

static void cudnn_half_and_bfloat16_convolutions_round_to_nearest(void **) {
  cudnnHandle_t h;
  DNN_OK(cudnnCreate(&h));
  void *ws = device_array<char>(64 << 20);
  for (const Type16 &ty : {kHalf, kBf16})
    for (bool nhwc : {false, true})
      for (int stride : {1, 2}) {
        ConvCase t = {2, 3, 5, 5, 4, 3, 1, stride, nhwc};
        int P = (t.h + 2 * t.pad - t.r) / t.stride + 1, Q = (t.w + 2 * t.pad - t.r) / t.stride + 1;
        ConvDescs d = conv_descs(t, ty.type, ty.type, ty.type, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH);
        size_t nx = (size_t)t.n * t.c * t.h * t.w, ny = (size_t)t.n * t.k * P * Q, nw = (size_t)t.k * t.c * t.r * t.r;
        std::vector<uint16_t> bX, bW, bY, bDY;
        std::vector<double> X = values16(ty, nx, 8, &bX), Wt = values16(ty, nw, 9, &bW), Y = values16(ty, ny, 10, &bY),
                            DY = values16(ty, ny, 11, &bDY);
        std::vector<double> y_ref, dx_ref, dw_ref;
        conv_sums(t, P, Q, X, Wt, DY, &y_ref, &dx_ref, &dw_ref);
        for (size_t i = 0; i < ny; i++) y_ref[i] = 2.0 * y_ref[i] + 0.5 * Y[i];  // alpha 2, beta 0.5
        for (size_t i = 0; i < nw; i++) dw_ref[i] += Wt[i];                      // beta 1 adds into w
        uint16_t *dX = device_copy(bX), *dW = device_copy(bW), *dY = device_copy(bY), *dDY = device_copy(bDY);
        uint16_t *dDX = device_array<uint16_t>(nx);
        float two = 2, half = 0.5f, one = 1, zero = 0;
        DNN_OK(cudnnConvolutionForward(h, &two, d.x, dX, d.w, dW, d.cv, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, ws, 64 << 20,
                                       &half, d.y, dY));
        DNN_OK(cudnnConvolutionBackwardData(h, &one, d.w, dW, d.y, dDY, d.cv, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, ws,
                                            64 << 20, &zero, d.x, dDX));
        DNN_OK(cudnnConvolutionBackwardFilter(h, &one, d.x, dX, d.y, dDY, d.cv, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, ws,
                                              64 << 20, &one, d.w, dW));
        char what[64];
        snprintf(what, sizeof what, "%s stride %d: y", nhwc ? "NHWC" : "NCHW", stride);
        expect_rounded(ty, what, host_copy(dY, ny), y_ref);
        snprintf(what, sizeof what, "%s stride %d: dx", nhwc ? "NHWC" : "NCHW", stride);
        expect_rounded(ty, what, host_copy(dDX, nx), dx_ref);
        snprintf(what, sizeof what, "%s stride %d: dw", nhwc ? "NHWC" : "NCHW", stride);
        expect_rounded(ty, what, host_copy(dW, nw), dw_ref);
        cudaFree(dX), cudaFree(dW), cudaFree(dY), cudaFree(dDY), cudaFree(dDX);
        destroy_descs(d);
      }
  cudaFree(ws);
  DNN_OK(cudnnDestroy(h));
}

// What the _v7 heuristics answer for one direction (0 forward, 1 backward data, 2 backward
// filter), each supported algorithm's workspace checked against the size query.
struct AlgoRow {
  int algo;
  cudnnStatus_t status;
  size_t memory;
  cudnnDeterminism_t determinism;
  cudnnMathType_t math;
  bool operator==(const AlgoRow &o) const {
    return algo == o.algo && status == o.status && memory == o.memory && determinism == o.determinism;
  }
};

template <class Perf>
static std::vector<AlgoRow> algo_rows(const Perf *perf, int count) {
  std::vector<AlgoRow> rows;
  for (int i = 0; i < count; i++)
    rows.push_back({(int)perf[i].algo, perf[i].status, perf[i].memory, perf[i].determinism, perf[i].mathType});
  return rows;
}

static std::vector<AlgoRow> heuristics(cudnnHandle_t h, const ConvDescs &d, int dir) {
  cudnnConvolutionFwdAlgoPerf_t fwd[16];
  cudnnConvolutionBwdDataAlgoPerf_t bwd_data[16];
  cudnnConvolutionBwdFilterAlgoPerf_t bwd_filter[16];
  int count = 0;
  std::vector<AlgoRow> rows;
  if (dir == 0) {
    DNN_OK(cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.cv, d.y, 16, &count, fwd));
    rows = algo_rows(fwd, count);
  } else if (dir == 1) {
    DNN_OK(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d.w, d.y, d.cv, d.x, 16, &count, bwd_data));
    rows = algo_rows(bwd_data, count);
  } else {
    DNN_OK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.x, d.y, d.cv, d.w, 16, &count, bwd_filter));
    rows = algo_rows(bwd_filter, count);
  }
  cudnnMathType_t asked;
  DNN_OK(cudnnGetConvolutionMathType(d.cv, &asked));
  for (const AlgoRow &r : rows) {  // the size query with each row's math type set, as cuDNN wants
    if (r.status != CUDNN_STATUS_SUCCESS) continue;
    size_t ws = 0;
    DNN_OK(cudnnSetConvolutionMathType(d.cv, r.math));
    if (dir == 0)
      DNN_OK(cudnnGetConvolutionForwardWorkspaceSize(h, d.x, d.w, d.cv, d.y, (cudnnConvolutionFwdAlgo_t)r.algo, &ws));
    else if (dir == 1)
      DNN_OK(cudnnGetConvolutionBackwardDataWorkspaceSize(h, d.w, d.y, d.cv, d.x, (cudnnConvolutionBwdDataAlgo_t)r.algo,
                                                          &ws));
    else
      DNN_OK(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, d.x, d.y, d.cv, d.w,
                                                            (cudnnConvolutionBwdFilterAlgo_t)r.algo, &ws));
    if (ws != r.memory)
      fail_msg("direction %d algorithm %d: heuristics %zu bytes, query %zu", dir, r.algo, r.memory, ws);
  }
  DNN_OK(cudnnSetConvolutionMathType(d.cv, asked));
  return rows;
}

static void cudnn_half_and_bfloat16_configurations_and_heuristics(void **) {
  cudnnHandle_t h;
  DNN_OK(cudnnCreate(&h));
  ConvCase t = {2, 3, 5, 5, 4, 3, 1, 1, true}, wide = {2, 8, 5, 5, 8, 3, 1, 1, true};
  for (const Type16 &ty : {kHalf, kBf16}) {
    // The math type per algorithm, as cuDNN reports it: where the shape has tensor-core kernels
    // (channels in multiples of 8) and the descriptor permits them, each algorithm is listed with
    // them first and with the default kernels after; a first layer of 3 channels has none, and its
    // rows say CUDNN_DEFAULT_MATH whatever the descriptor asks (only FMA stays FMA). The default
    // kernels widen 16-bit operands in their workspace: they need more than the tensor cores.
    for (const ConvCase &c : {t, wide})
      for (cudnnMathType_t math : {CUDNN_TENSOR_OP_MATH, CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH}) {
        ConvDescs d16 = conv_descs(c, ty.type, ty.type, ty.type, CUDNN_DATA_FLOAT, math);
        const bool tensor = c.c == 8 && math == CUDNN_TENSOR_OP_MATH;
        for (int dir = 0; dir < 3; dir++) {
          std::vector<AlgoRow> rows = heuristics(h, d16, dir);
          bool usable = false, tensor_rows = false;
          for (const AlgoRow &r : rows) {
            if (math == CUDNN_FMA_MATH)
              assert_int_equal(r.math, CUDNN_FMA_MATH);
            else if (!tensor)
              assert_int_equal(r.math, CUDNN_DEFAULT_MATH);
            tensor_rows |= r.math == CUDNN_TENSOR_OP_MATH;
            usable |= r.status == CUDNN_STATUS_SUCCESS && r.determinism == CUDNN_DETERMINISTIC;
            for (const AlgoRow &o : rows)  // the same algorithm on default kernels needs more workspace
              if (r.math == CUDNN_TENSOR_OP_MATH && o.math == CUDNN_DEFAULT_MATH && o.algo == r.algo &&
                  r.status == CUDNN_STATUS_SUCCESS)
                assert_true(o.memory > r.memory);
            if (r.math == CUDNN_TENSOR_OP_MATH && dir == 2 && r.algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1)
              assert_int_equal(r.determinism, CUDNN_NON_DETERMINISTIC);
          }
          if (tensor_rows != tensor)
            fail_msg("%s direction %d: tensor-core rows %d, expected %d", ty.name, dir, (int)tensor_rows, (int)tensor);
          if (tensor && rows[0].math != CUDNN_TENSOR_OP_MATH)
            fail_msg("%s direction %d: tensor cores not first", ty.name, dir);
          if (!usable) fail_msg("%s direction %d: no supported deterministic algorithm", ty.name, dir);
        }
        destroy_descs(d16);
      }
    // x, w and y of one type: mixed with float or the other 16-bit type is refused everywhere
    const Type16 &other = ty.type == CUDNN_DATA_HALF ? kBf16 : kHalf;
    cudnnDataType_t mixes[][3] = {
        {ty.type, ty.type, CUDNN_DATA_FLOAT}, {CUDNN_DATA_FLOAT, ty.type, ty.type}, {ty.type, other.type, ty.type}};
    uint16_t *buf = device_array<uint16_t>(1 << 12);
    float one = 1, zero = 0;
    for (auto &m : mixes) {
      ConvDescs d = conv_descs(t, m[0], m[1], m[2], CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH);
      cudnnConvolutionFwdAlgoPerf_t perf[8];
      int count = 0;
      size_t ws = 0;
      assert_int_equal(cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.cv, d.y, 8, &count, perf),
                       CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE);
      assert_int_equal(
          cudnnGetConvolutionForwardWorkspaceSize(h, d.x, d.w, d.cv, d.y, CUDNN_CONVOLUTION_FWD_ALGO_GEMM, &ws),
          CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE);
      assert_int_equal(cudnnConvolutionForward(h, &one, d.x, buf, d.w, buf, d.cv,
                                               CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, nullptr, 0, &zero, d.y, buf),
                       CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE);
      destroy_descs(d);
    }
    // the compute type is FP32 (PSEUDO_HALF_CONFIG, PSEUDO_BFLOAT16_CONFIG); 16-bit arithmetic,
    // TRUE_HALF_CONFIG included, is not modelled
    for (cudnnDataType_t compute : {CUDNN_DATA_HALF, CUDNN_DATA_BFLOAT16}) {
      ConvDescs d = conv_descs(t, ty.type, ty.type, ty.type, compute, CUDNN_TENSOR_OP_MATH);
      assert_int_equal(cudnnConvolutionForward(h, &one, d.x, buf, d.w, buf, d.cv,
                                               CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, nullptr, 0, &zero, d.y, buf),
                       CUDNN_STATUS_NOT_SUPPORTED);
      destroy_descs(d);
    }
    cudaFree(buf);
  }
  DNN_OK(cudnnDestroy(h));
}

// ---- devices ------------------------------------------------------------------------------------

static void second_context() {
  void *p;
  cudaSetDevice(0);
  cudaMalloc(&p, 16);
  cudaSetDevice(1);  // a context on another device
}

static void devices_are_h100_like_and_one_per_process(void **) {
  int n = 0;
  CUDA_OK(cudaGetDeviceCount(&n));
  const char *want = getenv("GPUSIM_DEVICES");
  assert_int_equal(n, want ? atoi(want) : 1);
  if (n < 2) skip();
  cudaDeviceProp p;
  CUDA_OK(cudaGetDeviceProperties(&p, 1));  // no context needed
  assert_int_equal(p.major, 9);
  assert_int_equal(p.maxThreadsPerBlock, 1024);
  assert_int_equal(p.warpSize, 32);
  assert_int_equal(p.sharedMemPerBlock, 48 << 10);
  assert_int_equal(p.sharedMemPerBlockOptin, 227 << 10);
  assert_true(p.totalGlobalMem > ((size_t)79 << 30));
  char a[32], b[32];
  CUDA_OK(cudaDeviceGetPCIBusId(a, sizeof a, 0));
  CUDA_OK(cudaDeviceGetPCIBusId(b, sizeof b, 1));
  assert_string_not_equal(a, b);
  expect_death(second_context, "made a CUDA context on device 1 after making one on device 0");
}

// Prints the compute capability the properties and the attributes give, and whether a GEMM that
// allows TF32 rounds its inputs (run through run_self_with under a GPUSIM_CC).
static int print_compute_capability() {
  cudaDeviceProp p;
  int major = -1, minor = -1;
  CUDA_OK(cudaGetDeviceProperties(&p, 0));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  cublasHandle_t h;
  BLAS_OK(cublasCreate(&h));
  BLAS_OK(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH));
  float *a = device_copy(std::vector<float>{1.0f + 0x1p-20f}), *c = device_array<float>(1), one = 1, zero = 0;
  BLAS_OK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, a, 1, a, 1, &zero, c, 1));
  printf("%d.%d %d.%d tf32 %d\n", p.major, p.minor, major, minor, host_copy(c, 1)[0] == 1.0f);
  return 0;
}

static void compute_capability_is_settable(void **) {
  assert_string_equal(run_self_with("GPUSIM_CC=", "--compute-capability").c_str(), "9.0 9.0 tf32 1\n");
  assert_string_equal(run_self_with("GPUSIM_CC=8.6", "--compute-capability").c_str(), "8.6 8.6 tf32 1\n");
  assert_string_equal(run_self_with("GPUSIM_CC=7.0", "--compute-capability").c_str(), "7.0 7.0 tf32 0\n");
  int status = 0;
  std::string out = run_self_with("GPUSIM_CC=9", "--compute-capability", &status);
  assert_true(status != 0);
  if (out.find("GPUSIM_CC=9: expected a compute capability") == std::string::npos)
    fail_msg("GPUSIM_CC=9 gave: %s", out.c_str());
}

// Two allocations, one freed: GPUSIM_LEAK_CHECK=1 names the other at exit and fails the run.
static int leave_one_allocation() {
  float *kept = nullptr, *freed = nullptr;
  CUDA_OK(cudaMalloc(&kept, 1000));
  CUDA_OK(cudaMalloc(&freed, 24));
  CUDA_OK(cudaFree(freed));
  printf("allocated\n");
  return 0;
}

static void a_leak_is_reported_where_asked(void **) {
  int status = 0;
  std::string out = run_self_with("GPUSIM_LEAK_CHECK=1", "--leave-one-allocation", &status);
  assert_true(status != 0);
  if (out.find("allocated") == std::string::npos ||
      out.find("(1000 bytes on device 0) never freed") == std::string::npos ||
      out.find("LEAK SUMMARY: 1000 bytes leaked in 1 allocations") == std::string::npos)
    fail_msg("GPUSIM_LEAK_CHECK=1 gave: %s", out.c_str());
  out = run_self_with("GPUSIM_LEAK_CHECK=", "--leave-one-allocation", &status);  // not asked: no check
  assert_int_equal(status, 0);
  if (out.find("never freed") != std::string::npos) fail_msg("unasked, it said: %s", out.c_str());
}

// ---- the kernels' helpers -----------------------------------------------------------------------

static void fast_division_matches_division(void **) {
  uint64_t x = 88172645463325252ull;
  auto next = [&]() {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  const uint32_t divisors[] = {1, 2, 3, 5, 7, 10, 28, 49, 64, 255, 784, 1000, 65535, 65537, 1u << 20, 0x7fffffffu};
  for (uint32_t d : divisors) {
    fast_div f = make_fast_div(d);
    for (int i = 0; i < 20000; i++) {
      uint32_t n = i < 100   ? (uint32_t)i
                   : i < 200 ? 0x7fffffffu - (uint32_t)(i - 100)
                             : (uint32_t)(next() & 0x7fffffffu);
      if (div_by(n, f) != n / d) fail_msg("%u / %u: fast %u, exact %u", n, d, div_by(n, f), n / d);
    }
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--unordered-read")) return print_unordered_read(), 0;
  if (argc > 1 && !strcmp(argv[1], "--overwritten-slot")) return print_overwritten_slot(), 0;
  if (argc > 1 && !strcmp(argv[1], "--kernel-fault")) return print_kernel_fault(), 0;
  if (argc > 1 && !strcmp(argv[1], "--neighbour-sync")) return print_neighbour_checksum(1);
  if (argc > 1 && !strcmp(argv[1], "--neighbour-race")) return print_neighbour_checksum(0);
  if (argc > 1 && !strcmp(argv[1], "--compute-capability")) return print_compute_capability();
  if (argc > 1 && !strcmp(argv[1], "--leave-one-allocation")) return leave_one_allocation();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(builtins_follow_the_launch),
      cmocka_unit_test(syncthreads_is_a_barrier_and_a_missing_one_shows),
      cmocka_unit_test(a_barrier_some_threads_skip_is_reported),
      cmocka_unit_test(a_misaligned_vector_access_stops_the_program),
      cmocka_unit_test(static_shared_memory_is_per_block_and_starts_as_garbage),
      cmocka_unit_test(dynamic_shared_memory_and_its_limits),
      cmocka_unit_test(warp_shuffles_and_votes),
      cmocka_unit_test(undefined_warp_reads_show_and_bad_masks_are_reported),
      cmocka_unit_test(block_sum_works_for_any_block_size),
      cmocka_unit_test(bfloat16_rounds_to_nearest_even),
      cmocka_unit_test(tensor_core_fragments_follow_the_ptx_layout),
      cmocka_unit_test(atomics_add_up_and_must_target_device_memory),
      cmocka_unit_test(launch_limits_are_checked),
      cmocka_unit_test(host_cannot_touch_device_memory),
      cmocka_unit_test(kernels_are_bounds_checked),
      cmocka_unit_test(kernel_pointers_must_be_live_device_memory),
      cmocka_unit_test(copies_run_only_when_synchronised),
      cmocka_unit_test(streams_are_ordered_only_by_events),
      cmocka_unit_test(hazards_between_streams_are_reported),
      cmocka_unit_test(seeded_stream_order_runs_other_streams_early),
      cmocka_unit_test(eager_stream_order_runs_work_as_soon_as_it_is_queued),
      cmocka_unit_test(a_kernel_fault_breaks_the_context),
      cmocka_unit_test(capture_records_work_that_each_launch_runs),
      cmocka_unit_test(graph_kernels_keep_their_arguments_and_read_memory_when_launched),
      cmocka_unit_test(capture_follows_events_across_streams_and_must_be_joined),
      cmocka_unit_test(capture_refuses_what_it_cannot_record),
      cmocka_unit_test(graphs_check_the_memory_they_use_when_launched),
      cmocka_unit_test(cublas_gemm_follows_column_major_rules),
      cmocka_unit_test(cublas_math_modes_types_and_pointer_modes),
      cmocka_unit_test(cublaslt_bias_epilogue_and_its_checks),
      cmocka_unit_test(cublaslt_gelu_epilogues),
      cmocka_unit_test(cublas_gemm_in_a_graph),
      cmocka_unit_test(cudnn_convolutions_match_direct_loops),
      cmocka_unit_test(cudnn_algorithms_workspaces_math_and_determinism),
      cmocka_unit_test(cudnn_half_and_bfloat16_convolutions_round_to_nearest),
      cmocka_unit_test(cudnn_half_and_bfloat16_configurations_and_heuristics),
      cmocka_unit_test(devices_are_h100_like_and_one_per_process),
      cmocka_unit_test(compute_capability_is_settable),
      cmocka_unit_test(a_leak_is_reported_where_asked),
      cmocka_unit_test(fast_division_matches_division),
  };
  return cmocka_run_group_tests_name("gpusim", tests, NULL, NULL);
}
