// gpusim_device.h: compiles CUDA kernels (kernels/*.cu) with the host C++ compiler for the GPU
// stand-in. Force-included (g++ -include) before each kernel file; the kernels themselves are
// unchanged CUDA, written with the two forms both compilers accept (kernels/common.cuh):
//   LAUNCH(kernel, grid, block, smem, stream)(args...)   instead of kernel<<<...>>>(args...)
//   DYNAMIC_SHARED(T, name);                             instead of extern __shared__ T name[];
// Each CUDA thread runs as a fiber of the executor (exec.cc); __syncthreads and the warp
// intrinsics are real barriers between them, in an order that varies with GPUSIM_SEED.
// Anything CUDA offers that is not defined here fails to compile: nothing is silently a no-op.
#pragma once

// Before cuda_runtime.h: its host-compiler fallbacks only apply to what is still undefined.
#define __global__
#define __device__
#define __host__
// Static shared memory: one copy per program (blocks run one at a time), in a section of its
// own so the executor can size it against the 48 KiB limit and poison it before every block.
// (GCC keeps a section either shared between files or not: device functions in headers that
// declare __shared__ variables must be static, which is good practice for headers anyway.)
#define __shared__ static __attribute__((section("gpusim_shared"), aligned(16)))

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "gpusim_launch.h"

#define threadIdx (static_cast<const uint3 &>(gpusim_now.thread_idx))
#define blockIdx (static_cast<const uint3 &>(gpusim_now.block_idx))
#define blockDim (static_cast<const dim3 &>(gpusim_now.block_dim))
#define gridDim (static_cast<const dim3 &>(gpusim_now.grid_dim))
static const int warpSize = 32;

#define DYNAMIC_SHARED(T, name) T *name = static_cast<T *>(gpusim_dynamic_shared())
// A vector load's alignment (kernels/common.cuh's load_float4): the host compiler may split the load into
// narrower ones that need less.
#define GPUSIM_CHECK_ALIGNED(p, n) gpusim_check_aligned((p), (n))

// Registers this program's static shared section once (weak: a program may have none).
extern "C" __attribute__((weak)) char __start_gpusim_shared[], __stop_gpusim_shared[];
namespace {
struct gpusim_shared_registration {
  gpusim_shared_registration() { gpusim_register_static_shared(__start_gpusim_shared, __stop_gpusim_shared); }
};
static gpusim_shared_registration gpusim_shared_registered;
}  // namespace

static inline void __syncthreads() {
  gpusim_syncthreads();
}
static inline int __syncthreads_count(int p) {
  return gpusim_syncthreads_vote(0, p);
}
static inline int __syncthreads_and(int p) {
  return gpusim_syncthreads_vote(1, p);
}
static inline int __syncthreads_or(int p) {
  return gpusim_syncthreads_vote(2, p);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  gpusim_warp_op(GPUSIM_WARP_SYNC, mask, 0, 0, 0, 32);
}
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline long long __mul64hi(long long a, long long b) {
  return (long long)(((__int128)a * b) >> 64);
}
// Single roundings that are never fused into a multiply-add (the kernels build with -ffp-contract=off).
static inline float __fmul_rn(float a, float b) {
  return a * b;
}
static inline float __fadd_rn(float a, float b) {
  return a + b;
}
static inline float __fsub_rn(float a, float b) {
  return a - b;
}

// Fences order memory between threads; blocks and threads run one at a time here, so a compiler barrier does
// (an atomic fence is one -fsanitize=thread cannot instrument).
static inline void __threadfence() {
  __asm__ __volatile__("" ::: "memory");
}
static inline void __threadfence_block() {
  __asm__ __volatile__("" ::: "memory");
}

namespace gpusim_detail {
template <class T>
inline uint64_t bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move up to 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof v);
  return b;
}
template <class T>
inline T from_bits(uint64_t b) {
  T v;
  memcpy(&v, &b, sizeof v);
  return v;
}
template <class T>
inline T shfl(int kind, unsigned mask, T v, int arg, int width) {
  return from_bits<T>(gpusim_warp_op(kind, mask, bits(v), (int)sizeof(T), arg, width));
}
}  // namespace gpusim_detail

template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return gpusim_detail::shfl(GPUSIM_SHFL_IDX, mask, v, src, width);
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return gpusim_detail::shfl(GPUSIM_SHFL_UP, mask, v, (int)delta, width);
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return gpusim_detail::shfl(GPUSIM_SHFL_DOWN, mask, v, (int)delta, width);
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return gpusim_detail::shfl(GPUSIM_SHFL_XOR, mask, v, lane_mask, width);
}
static inline int __all_sync(unsigned mask, int p) {
  return (int)gpusim_warp_op(GPUSIM_VOTE_ALL, mask, p != 0, 4, 0, 32);
}
static inline int __any_sync(unsigned mask, int p) {
  return (int)gpusim_warp_op(GPUSIM_VOTE_ANY, mask, p != 0, 4, 0, 32);
}
static inline unsigned __ballot_sync(unsigned mask, int p) {
  return (unsigned)gpusim_warp_op(GPUSIM_VOTE_BALLOT, mask, p != 0, 4, 0, 32);
}

// bfloat16: the toolkit's own cuda_bf16.h (its host code: __float2bfloat16_rn rounds to nearest
// even), included above.

// The check every warp-wide operation makes: all 32 lanes of a full warp call it (and meet here).
inline void gpusim_warp_wide(const char *what) {
  const int64_t threads = (int64_t)blockDim.x * blockDim.y * blockDim.z;
  const int64_t tid = threadIdx.x + (int64_t)blockDim.x * (threadIdx.y + (int64_t)blockDim.y * threadIdx.z);
  if (threads - tid / 32 * 32 < 32) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s in a partial warp: it needs all 32 lanes", what);
    gpusim_kernel_error(msg);
  }
  __syncwarp();
}

// Tensor cores' m16n8k16 product as PTX's mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 runs it
// (kernels/attention.cu's mma_16816_bf16): d (16, 8) += a (16, 16) b (16, 8), each lane holding only its
// pieces, laid out as the PTX ISA says. With g = lane / 4 and c = lane % 4, each 32-bit register two
// bfloat16 (the lower column, or row of b, in the low half):
//   a[0] = A[g][2c..2c+1], a[1] = A[g+8][2c..2c+1], a[2] = A[g][2c+8..2c+9], a[3] = A[g+8][2c+8..2c+9]
//   b[0] = B[2c..2c+1][g], b[1] = B[2c+8..2c+9][g];  d[0..1] = D[g][2c..2c+1], d[2..3] = D[g+8][2c..2c+1]
// Every lane publishes its registers and reads the rows of A and the columns of B its d needs from the
// lanes that hold them, so a kernel that puts an element in the wrong register gets a wrong product here
// as on a GPU. Products exact, summed in FP32 in k order onto d. Warp-wide (gpusim_warp_wide).
#define GPUSIM_MMA_16816(d, a, b) gpusim_mma_16816((d), (a), (b))
// Untraced (GPUSIM_NO_TRACE): the registers it exchanges are the stand-in's, not the kernel's memory.
#define GPUSIM_NO_TRACE __attribute__((no_sanitize("thread")))
GPUSIM_NO_TRACE inline void gpusim_mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  gpusim_warp_wide("mma.sync.m16n8k16");
  struct regs {
    uint32_t a[4], b[2];
  };
  static thread_local regs published[32][32];  // [warp slot][lane]: blocks run one at a time
  const int64_t tid = threadIdx.x + (int64_t)blockDim.x * (threadIdx.y + (int64_t)blockDim.y * threadIdx.z);
  const int lane = (int)(tid % 32), g = lane / 4, c = lane % 4;
  regs *warp = published[tid / 32 % 32];
  memcpy(warp[lane].a, a, sizeof warp[lane].a);
  memcpy(warp[lane].b, b, sizeof warp[lane].b);
  __syncwarp();
  auto widen = [](uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  };
  auto lo = [&](uint32_t v) { return widen(v << 16); };
  auto hi = [&](uint32_t v) { return widen(v & 0xffff0000u); };
  float arow[2][16], bcol[2][16];    // A's rows g and g + 8, B's columns 2c and 2c + 1
  for (int src = 0; src < 4; src++)  // lane 4g + src holds columns 2 src + {0, 1, 8, 9} of rows g, g + 8
    for (int r = 0; r < 4; r++) {
      const uint32_t v = warp[4 * g + src].a[r];
      const int row = r & 1, col = 2 * src + (r >> 1) * 8;
      arow[row][col] = lo(v), arow[row][col + 1] = hi(v);
    }
  for (int n = 0; n < 2; n++)  // lane 4 (2c + n) + src holds rows 2 src + {0, 1, 8, 9} of column 2c + n
    for (int src = 0; src < 4; src++)
      for (int r = 0; r < 2; r++) {
        const uint32_t v = warp[4 * (2 * c + n) + src].b[r];
        bcol[n][2 * src + 8 * r] = lo(v), bcol[n][2 * src + 8 * r + 1] = hi(v);
      }
  __syncwarp();  // every lane has read before any publishes its next product's registers
  for (int i = 0; i < 4; i++) {
    float sum = d[i];
    for (int k = 0; k < 16; k++) sum += arow[i >> 1][k] * bcol[i & 1][k];
    d[i] = sum;
  }
}

// Atomics: the threads of the stand-in never run at the same moment, so each is a checked
// read-modify-write of device or shared memory.
#define GPUSIM_ATOMIC(name, T, expr)          \
  static inline T name(T *p, T v) {           \
    gpusim_check_atomic(p, sizeof(T), #name); \
    T old = *p;                               \
    *p = (expr);                              \
    return old;                               \
  }
GPUSIM_ATOMIC(atomicAdd, int, old + v)
GPUSIM_ATOMIC(atomicAdd, unsigned, old + v)
GPUSIM_ATOMIC(atomicAdd, unsigned long long, old + v)
GPUSIM_ATOMIC(atomicAdd, float, old + v)
GPUSIM_ATOMIC(atomicAdd, double, old + v)
GPUSIM_ATOMIC(atomicSub, int, old - v)
GPUSIM_ATOMIC(atomicSub, unsigned, old - v)
GPUSIM_ATOMIC(atomicMax, int, old > v ? old : v)
GPUSIM_ATOMIC(atomicMax, unsigned, old > v ? old : v)
GPUSIM_ATOMIC(atomicMin, int, old < v ? old : v)
GPUSIM_ATOMIC(atomicMin, unsigned, old < v ? old : v)
GPUSIM_ATOMIC(atomicExch, int, v)
GPUSIM_ATOMIC(atomicExch, unsigned, v)
GPUSIM_ATOMIC(atomicExch, float, v)
#undef GPUSIM_ATOMIC
template <class T>
static inline T atomicCAS(T *p, T compare, T v) {
  gpusim_check_atomic(p, sizeof(T), "atomicCAS");
  T old = *p;
  if (old == compare) *p = v;
  return old;
}

namespace gpusim {

// The launch of one kernel: its arguments converted to the kernel's parameter types, run once
// per thread. Kernel is a template argument so that its body inlines into run_thread.
template <class F, F Kernel>
struct Task;
template <class... P, void (*Kernel)(P...)>
struct Task<void (*)(P...), Kernel> {
  std::tuple<std::decay_t<P>...> args;
  static void run_thread(void *t) { std::apply(Kernel, static_cast<Task *>(t)->args); }
  static void destroy(void *t) { delete static_cast<Task *>(t); }
};

template <class F, F Kernel>
struct Launcher;
template <class... P, void (*Kernel)(P...)>
struct Launcher<void (*)(P...), Kernel> {
  gpusim_launch_desc d;
  Launcher(const char *name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const char *file, int line) {
    d = gpusim_launch_desc();
    d.name = name;
    d.file = file;
    d.line = line;
    d.fn = reinterpret_cast<const void *>(Kernel);
    d.grid = grid;
    d.block = block;
    d.smem = smem;
    d.stream = stream;
  }
  template <class... A>
  void operator()(A &&...a) {
    static_assert(sizeof...(A) == sizeof...(P), "a kernel launch passes every parameter");
    static_assert(sizeof...(P) <= GPUSIM_MAX_ARGS, "too many kernel parameters");
    using T = Task<void (*)(P...), Kernel>;
    T *task = new T{std::tuple<std::decay_t<P>...>(std::forward<A>(a)...)};
    d.n_args = (int)sizeof...(P);
    describe(task->args, std::index_sequence_for<P...>{});
    d.run_thread = &T::run_thread;
    d.destroy = &T::destroy;
    gpusim_launch(&d, task);
  }

 private:
  template <class Tuple, size_t... I>
  void describe(const Tuple &t, std::index_sequence<I...>) {
    (note(I, std::get<I>(t)), ...);
  }
  template <class V>
  void note(size_t i, const V &v) {
    d.is_pointer[i] = std::is_pointer<V>::value;
    if constexpr (std::is_pointer<V>::value) d.pointer[i] = static_cast<const void *>(v);
  }
};

}  // namespace gpusim

#define LAUNCH(kernel, grid, block, smem, stream) \
  ::gpusim::Launcher<decltype(&kernel), &kernel>(#kernel, (grid), (block), (smem), (stream), __FILE__, __LINE__)
