// gpusim.h: the internals of the GPU stand-in (tests/gpusim/README.md), shared by its pieces:
// core.cc (configuration, devices, device memory, the fault handler), exec.cc (threads, blocks,
// warps, kernel launches), runtime.cc (streams, events, copies: the CUDA runtime API), graph.cc
// (stream capture and graphs), cublas.cc, cudnn.cc, nccl.cc. Nothing here is seen by the code
// under test, which includes only the toolkit's own headers (and, for kernels, gpusim_device.h).
//
// The model: a process sees GPUSIM_DEVICES stand-in devices. Device memory is a reserved
// address range that host code can never touch: every allocation sits between guard pages, is
// mapped readable only while queued device work executes, and is never reused after cudaFree.
// Queued work (kernels, copies, library calls, collectives) runs on the calling host thread and
// only when the programming model says it has run: a stream, event or device synchronisation, a
// blocking copy, or a wait between streams. Work enqueued on a capturing stream is recorded into
// a graph instead, and runs at each launch of the graph. Every entry point holds one process-wide
// lock.
#pragma once

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace gpusim {

// A bug in the program under test that the stand-in caught: prints "gpusim: error: ..." with the
// process id and the MPI rank (when launched by mpirun) and aborts the process.
[[noreturn]] void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// A warning that does not stop the program.
void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// Serialises every entry point (recursive: library calls nest).
struct ApiLock {
  ApiLock();
  ~ApiLock();
};

// The handles of one kind a library has handed out and not yet destroyed: a handle is checked by
// looking it up, never by reading memory that may already have been freed. Lives until exit.
template <class T>
struct Handles {
  std::set<const T *> &live() {
    static std::set<const T *> *s = new std::set<const T *>;
    return *s;
  }
  T *add(T *p) {
    live().insert(p);
    return p;
  }
  bool has(const T *p) { return p && live().count(p); }
  bool remove(const T *p) { return live().erase(p) > 0; }
};

// ---- configuration (core.cc), read once from the environment --------------------------------
struct Config {
  int devices;             // GPUSIM_DEVICES (default 1): devices this process sees
  int visible[64];         // physical index of each visible device (CUDA_VISIBLE_DEVICES)
  size_t memory_bytes;     // GPUSIM_MEMORY_MIB (default 81559): capacity per device
  uint64_t seed;           // GPUSIM_SEED (default 1): block, thread and completion orders
  const char *nccl_fault;  // GPUSIM_NCCL_FAULT: "init@RANK" or "hang@RANK" (tests)
  // GPUSIM_KERNEL_FAULT=NAME[:N][@RANK]: the Nth launch (the first) of kernel NAME faults, on rank
  // RANK (every rank): kernel_fault[0] == 0 for none
  char kernel_fault[128];
  uint64_t kernel_fault_launch;
  int kernel_fault_rank;
  int cc_major, cc_minor;  // GPUSIM_CC (default "9.0"): the devices' compute capability
  int ptx_version;         // GPUSIM_PTX (default the devices'): the PTX the kernels' code is compiled from
  int rank;                // OMPI_COMM_WORLD_RANK or -1, for messages
};
const Config &config();
void reinstall_fault_handler();

// A small deterministic generator (splitmix64), seeded from GPUSIM_SEED and a stream id.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint32_t below(uint32_t n) { return (uint32_t)(((next() >> 32) * n) >> 32); }  // in [0, n)
  // a UniformRandomBitGenerator, for std::shuffle
  using result_type = uint64_t;
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~0ull; }
  uint64_t operator()() { return next(); }
};
uint64_t next_seed();  // a fresh seed for the next launch, queue or poll sequence

// ---- devices and contexts (core.cc) ----------------------------------------------------------
struct Stream;
struct Device {
  int index;     // visible index
  int physical;  // index before CUDA_VISIBLE_DEVICES
  bool context;  // the primary context exists
  size_t used;   // bytes of live allocations
  size_t peak;
  double busy_s;                  // seconds spent executing its work (NVML utilisation)
  Stream *legacy;                 // the legacy default stream (created with the context)
  std::vector<Stream *> streams;  // every stream of the device, including destroyed ones with work
};
Device *device(int index);  // nullptr when out of range
// The calling thread's current device; makes its primary context (the CUDA 12+ behaviour).
// A process that has made a context on one device and makes one on another is a fatal error.
Device *current_device();
int current_index();
void set_current_index(int index);
void make_context(Device *d);
void pci_bus_id(int index, char *buf, size_t cap);  // "0000:1b:00.0"

// ---- device memory (core.cc) -----------------------------------------------------------------
struct Allocation {
  uintptr_t base;    // what cudaMalloc returned (256-byte aligned)
  size_t size;       // requested bytes
  uintptr_t lo, hi;  // its mapped pages [lo, hi), with a guard page on each side
  int device;
  uint64_t serial;  // allocation number, for messages
  bool live;
  bool open;  // accessible now (granted to the executing work)
};
void *device_alloc(Device *d, size_t bytes);  // nullptr when the device is full
bool device_free(void *p);                    // false: not the base of a live allocation
// The allocation containing p (live or freed), or nullptr; p may be one past the end.
const Allocation *find_allocation(const void *p);
bool in_device_region(const void *p);
void device_region(uintptr_t *lo, uintptr_t *hi);  // [lo, hi): every allocation's addresses
// Checks that [p, p + bytes) lies inside one live allocation (of device `dev` unless -1).
const Allocation *device_range(const void *p, size_t bytes, int dev = -1);
// Describes an address for messages: "byte 12 past the end of allocation #3 (400 bytes)".
std::string describe_address(const void *p);

// Device memory is reachable only inside an execution window (nested), and there only the
// allocations granted to the work that runs: the ones an op declared in its `uses`.
void open_device_memory();
void grant(const Allocation *a);
// Makes exactly `uses` reachable (grants them, takes back every other grant): an op reaches only
// what it declared, and consecutive ops sharing buffers cost no extra protection changes.
void grant_only(const std::vector<const Allocation *> &uses);
void close_device_memory();
// Verifies the guard bytes around an allocation after work that used it.
void check_guards(const Allocation *a, const char *after_what);

// Pinned host memory (cudaMallocHost): plain host memory the copies treat as page-locked.
bool is_pinned(const void *p, size_t bytes);
void pinned_add(void *p, size_t bytes);
bool pinned_remove(void *p);

// ---- hazards between streams (hazard.cc) -----------------------------------------------------
// A byte range of one allocation that an op reads or writes.
struct Access {
  const Allocation *a;
  uintptr_t lo, hi;  // [lo, hi) inside [a->base, a->base + a->size)
  bool write;
};
// What each stream (by id) is known to have completed: a vector clock. Entry i is the number of
// ops stream i had enqueued at the point that happens before.
struct Clock {
  std::vector<uint64_t> v;
  uint64_t at(uint32_t id) const { return id < v.size() ? v[id] : 0; }
  bool join(const Clock &o);  // true when it grew
};
// Where an op stands in the happens-before order: enqueued as number `epoch` on stream `stream`,
// after what `seen` says of the other streams.
struct Stamp {
  uint32_t stream = 0;
  uint64_t epoch = 0;
  std::shared_ptr<const Clock> seen;
};

// ---- streams and queued work (runtime.cc) ----------------------------------------------------
struct Op {
  virtual ~Op() {}
  // Executes the work; false when it cannot finish yet (a collective waiting for its peers):
  // it is called again later. Device memory is accessible while it runs.
  virtual bool run() = 0;
  // A graph runs its recorded ops again at every launch: the op that runs this one for a launch
  // on stream s, or nullptr when this op itself can run again (it keeps no state between runs).
  virtual std::unique_ptr<Op> relaunch(Stream * /*s*/) { return nullptr; }
  std::string what;                                     // "kernel bias_add_kernel (elementwise.cu:95)"
  std::vector<const Allocation *> uses;                 // device allocations it reads or writes
  std::vector<std::pair<const void *, size_t>> pinned;  // pinned host memory it reads or writes
  // The byte ranges it reads and writes, for the hazard checker: declared when queued (copies,
  // memsets, library calls, collectives); a kernel's are recorded while it runs instead.
  std::vector<Access> accesses;
  bool traced = false;  // a kernel: its accesses are recorded as it runs
  Stamp stamp;          // set when queued (a graph node: its launch's)
};

struct Capture;
struct Stream {
  Device *dev;
  bool blocking;  // synchronises with the legacy stream (not cudaStreamNonBlocking)
  bool legacy;
  bool destroyed;
  bool running;                  // being executed (a cycle of waits shows as re-entry)
  uint64_t enqueued, completed;  // ops so far
  int polls;                     // cudaStreamQuery calls since it last reported done
  std::deque<std::unique_ptr<Op>> queue;
  Rng rng;
  Capture *capture;             // the capture it takes part in (graph.cc), or nullptr
  std::vector<size_t> deps;     // while capturing: the graph nodes its next node depends on
  uint32_t id = 0;              // its entry in vector clocks (hazard.cc)
  std::shared_ptr<Clock> seen;  // what its next op will have seen of other streams
  uint64_t host_seen = 0;       // the host clock's version last joined into seen
  Stream()
      : dev(nullptr),
        blocking(true),
        legacy(false),
        destroyed(false),
        running(false),
        enqueued(0),
        completed(0),
        polls(0),
        rng(0),
        capture(nullptr) {}
};

// Resolves a stream handle (0, cudaStreamLegacy, cudaStreamPerThread or a created stream);
// nullptr for an unknown or destroyed handle.
Stream *stream_of(cudaStream_t s);
// Queues op on s (ordering it after the legacy stream's work, or the other way round, as CUDA does),
// or records it when s captures. An error (nothing queued): cudaErrorStreamCaptureInvalidated on
// a capture a refused call invalidated, cudaErrorStreamCaptureImplicit on the legacy stream while
// a blocking stream captures.
cudaError_t enqueue(Stream *s, std::unique_ptr<Op> op);
// Runs s up to op number `until` (without waiting); true when reached.
bool progress(Stream *s, uint64_t until);
// Runs s up to `until`, waiting for blocked work (collectives) as long as it takes.
void drain(Stream *s, uint64_t until, const char *why);
// GPUSIM_STREAM_ORDER=eager, as the outermost API call ends: every stream runs what it can now (up
// to a collective whose peers have not joined, or a wait for such), without waiting.
void run_ready_work();
// Any queued, unfinished work that uses allocation a (for cudaFree); nullptr if none.
const Op *pending_user(const Allocation *a);
// Deletes the device's destroyed streams that nothing can reach any more.
void release_destroyed_streams(Device *d);

// Waits for another stream's work up to op number seq (cudaStreamWaitEvent, the legacy stream's
// implicit ordering). A stream is not deleted while a queued WaitOp names it.
struct WaitOp : Op {
  Stream *target;
  uint64_t seq;
  WaitOp(Stream *t, uint64_t s) : target(t), seq(s) { what = "a wait for another stream"; }
  bool run() override { return progress(target, seq); }
};
// Queues a wait on s for `target` up to op `seq`, whose point in the order is `at` (the clock of
// target at seq, its own entry included): what s queues next happens after it.
cudaError_t enqueue_wait(Stream *s, Stream *target, uint64_t seq, const Clock &at);

// An op from a function (library calls).
struct FnOp : Op {
  std::function<void()> fn;
  bool run() override {
    fn();
    return true;
  }
};

// ---- the hazard checker's entry points (hazard.cc) ----
enum HazardMode { HAZARD_OFF, HAZARD_WARN, HAZARD_ERROR };
HazardMode hazard_mode();    // GPUSIM_HAZARDS: error (default), warn or off
// GPUSIM_STREAM_ORDER: lazy (queued work runs when a synchronisation needs it), seeded (ready
// streams run early, in a seeded order) or eager (work runs as soon as the call that queued it ends).
enum StreamOrder { ORDER_LAZY, ORDER_SEEDED, ORDER_EAGER };
StreamOrder stream_order();
void hazard_stream_created(Stream *s);
// Stamps op as the next op of s (its own epoch is s->enqueued after it is counted).
void hazard_stamp(Stream *s, Op *op);
// The clock of stream s at its current end (its own entry included).
Clock hazard_clock_of(const Stream *s);
// s waits for a point in the order: what it queues next has seen `at`.
void hazard_stream_waits(Stream *s, const Clock &at);
// The host has seen `at` complete (a synchronisation): every op queued later happens after it.
void hazard_host_waits(const Clock &at);
// Checks an executed op's accesses against earlier ones on other streams, then records them. g:
// the graph launch it is a node of, or nullptr.
struct LaunchCtx {
  uint64_t launch;                                  // unique per graph launch
  const std::vector<std::vector<uint64_t>> *reach;  // [j]: bitset of the nodes that run before node j
  size_t node;
};
void hazard_check(const Op *op, const std::vector<Access> &accesses, const LaunchCtx *g);
// Runs op with only its declared allocations reachable, traced when it is a kernel, then checks the
// guards and the hazards (g: the graph launch it belongs to, or null); false when it cannot finish
// yet (a collective waiting for its peers).
bool run_checked(Op *op, const LaunchCtx *g);
// A kernel about to run (its accesses are recorded from here) and done (returns them).
void hazard_kernel_begin();
std::vector<Access> hazard_kernel_end();
// The running kernel's dynamic shared memory: [dyn, dyn + bytes) of the executor's area, [area,
// area + area_bytes). A traced access elsewhere in the area stops the program (the area holds every
// launch's, up to the 227 KiB limit, so an access past a launch's bytes lands there).
void hazard_dynamic_shared(const char *area, size_t area_bytes, const char *dyn, size_t bytes);
// An allocation freed: its history goes.
void hazard_forget(const Allocation *a);
// Declares [p, p + bytes) of a live allocation as read or written by op (library calls).
void declare_access(Op *op, const void *p, size_t bytes, bool write);

// The runtime's per-thread last error (cudaGetLastError).
cudaError_t set_error(cudaError_t e);

// A device fault (GPUSIM_KERNEL_FAULT), as a GPU's illegal address in a kernel: kernel_faults(name)
// is called as a kernel starts to run, and true means that it does not run and the process's context
// is broken from then on: queued and later work is dropped unrun, and every runtime call that uses
// the device returns sticky_error() (cudaErrorIllegalAddress; cudaSuccess before any fault).
bool kernel_faults(const char *name);
cudaError_t sticky_error();

// ---- stream capture (graph.cc) ---------------------------------------------------------------
// While a stream captures, what is enqueued on it becomes a node of the capture's graph instead
// of work: nothing runs until the graph is instantiated and launched. Another stream joins the
// capture by waiting for an event recorded in it, and must be waited for by the origin stream
// before the capture ends. A call the capture forbids fails and invalidates it.
struct Graph;
struct Capture {
  uint64_t id;                    // unique in the process (cudaStreamGetCaptureInfo)
  Stream *origin;                 // where it began and must end
  cudaStreamCaptureMode mode;     // which unsafe calls it forbids (cudaThreadExchangeStreamCaptureMode)
  std::thread::id thread;         // that began it
  bool invalidated;               // a forbidden call: cudaStreamEndCapture returns no graph
  Graph *graph;                   // what has been recorded so far
  std::vector<Stream *> streams;  // the origin and the streams that joined
};
// Records op as a node of s's capture, after the nodes in s->deps.
cudaError_t capture_op(Stream *s, std::unique_ptr<Op> op);
// Makes s wait, in capture c, for `nodes` (an event's record): s joins c if it is not capturing.
cudaError_t capture_wait(Stream *s, Capture *c, const std::vector<size_t> &nodes);
// The capture with this id while it is active (streams capture into it), else nullptr.
Capture *find_capture(uint64_t id);
// Returns e after invalidating c (a call it forbids was refused).
cudaError_t refuse(Capture *c, cudaError_t e);
// Whether a blocking stream of d captures: the legacy stream would depend on it implicitly.
bool blocking_stream_captures(const Device *d);
// Use of d's legacy stream: cudaErrorStreamCaptureImplicit (invalidating the captures it would
// depend on) while a blocking stream captures, else cudaSuccess.
cudaError_t check_legacy_use(const Device *d);
// A potentially unsafe call (cudaMalloc, cudaFree, a synchronous copy) while captures forbid it
// under the calling thread's capture mode: cudaErrorStreamCaptureUnsupported, invalidating them;
// else cudaSuccess.
cudaError_t check_unsafe_call();
// A device synchronisation: cudaErrorStreamCaptureUnsupported (invalidating them) while any
// stream of d captures, whatever the mode; else cudaSuccess.
cudaError_t check_device_sync(const Device *d);

// ---- kernels (exec.cc) -----------------------------------------------------------------------
// What the device emulation header passes to a launch (see gpusim_device.h).
}  // namespace gpusim

#include "gpusim_launch.h"

namespace gpusim {
// Runs one kernel launch to the end: every block, every thread (called from its op).
void run_kernel(const gpusim_launch_desc *d, void *task);
// The kernel currently executing, for the fault handler: a line naming kernel, block and thread.
bool describe_running_kernel(char *buf, size_t cap);
// Registers the device-shared (static __shared__) section of the program under test.
void register_static_shared(char *lo, char *hi);
size_t static_shared_bytes();
// The opt-in dynamic shared memory limit a kernel has (cudaFuncSetAttribute).
int max_dynamic_shared(const void *fn);
void set_max_dynamic_shared(const void *fn, int bytes);

// ---- libraries ----------------------------------------------------------------------------
// TF32: round a float to 10 explicit mantissa bits (nearest, ties away), as tensor cores read it.
float to_tf32(float x);
// IEEE binary16 and bfloat16, rounded to nearest even.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace gpusim
