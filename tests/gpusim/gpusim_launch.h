// gpusim_launch.h: the few entry points between kernels compiled for the stand-in
// (gpusim_device.h) and its executor (exec.cc). Plain C types: it is the stand-in's ABI.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The built-in variables of the thread running now (read by threadIdx, blockIdx, ...).
typedef struct {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
} gpusim_builtins;
extern gpusim_builtins gpusim_now;

enum { GPUSIM_MAX_ARGS = 32 };

typedef struct {
  const char *name, *file; /* the kernel and where it was launched */
  int line;
  const void *fn; /* the kernel function, for cudaFuncSetAttribute limits */
  dim3 grid, block;
  size_t smem; /* dynamic shared memory bytes */
  cudaStream_t stream;
  int n_args;
  int is_pointer[GPUSIM_MAX_ARGS];
  const void *pointer[GPUSIM_MAX_ARGS]; /* the value of each pointer argument */
  void (*run_thread)(void *task);       /* runs the kernel body for gpusim_now's thread */
  void (*destroy)(void *task);
} gpusim_launch_desc;

/* Queues a launch (checks limits and pointer arguments); takes ownership of task. */
void gpusim_launch(const gpusim_launch_desc *d, void *task);

/* Block and warp synchronisation (exec.cc). */
void gpusim_syncthreads(void);
int gpusim_syncthreads_vote(int kind, int pred); /* 0 count, 1 and, 2 or */
enum {
  GPUSIM_WARP_SYNC,
  GPUSIM_SHFL_IDX,
  GPUSIM_SHFL_UP,
  GPUSIM_SHFL_DOWN,
  GPUSIM_SHFL_XOR,
  GPUSIM_VOTE_ALL,
  GPUSIM_VOTE_ANY,
  GPUSIM_VOTE_BALLOT
};
/* One warp-wide operation: value is the lane's bits (size bytes); returns the result's bits. */
uint64_t gpusim_warp_op(int kind, unsigned mask, uint64_t value, int size, int arg, int width);
/* Checks that an atomic's address is device or shared memory. */
void gpusim_check_atomic(const void *p, size_t bytes, const char *what);
/* Stops the program: a kernel broke a rule of the programming model (what), named with the kernel,
 * block and thread. */
void gpusim_kernel_error(const char *what);
/* The dynamic shared memory of the running block. */
void *gpusim_dynamic_shared(void);
/* Puts the stand-in's device-memory fault handler back in front of any installed since. */
void gpusim_install_fault_handler(void);
/* The hazard checker's mode (0 off, 1 warn, 2 error: GPUSIM_HAZARDS); returns the previous one. */
int gpusim_set_hazards(int mode);
/* Whether kernels record the memory they touch for the hazard checker (not in sanitizer builds). */
int gpusim_kernels_traced(void);
/* Stops the program, naming the running kernel, unless p is n-byte aligned (a kernel's vector load). */
void gpusim_check_aligned(const void *p, size_t n);
/* Registers the program's static __shared__ section (done once per kernel file). */
void gpusim_register_static_shared(char *lo, char *hi);

#ifdef __cplusplus
}
#endif
