// runtime.cc: the CUDA runtime API on the stand-in: devices, memory, streams, events, copies.
// Semantics follow the CUDA Runtime API documentation and promise no more than it does:
// - work queued on a stream runs only when a stream, event or device synchronisation, a blocking
//   copy or a cross-stream wait requires it; a query may find it done after a few polls;
// - cudaMemcpyAsync between device and pageable host memory "might be synchronous": here it never
//   is, so the host buffer is read or written when the copy executes, not when it is queued;
// - the legacy default stream waits for every blocking stream and the other way round;
// - cudaFree while queued work still uses the allocation is an error, not an implicit sync;
// - on a capturing stream work is recorded, not run (graph.cc); the calls capture forbids fail with
//   the documented error and invalidate the capture.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <set>

#include "gpusim.h"

namespace gpusim {
namespace {

thread_local cudaError_t last_error = cudaSuccess;

struct Event {
  Stream *stream = nullptr;
  uint64_t seq = 0;
  bool recorded = false;
  int polls = 0, delay = 1;
  uint64_t capture = 0;       // last recorded in this capture (not a point of any queue), or 0
  std::vector<size_t> nodes;  // then: the graph nodes it follows
  Clock clock;                // its point in the happens-before order (hazard.cc)
};

struct Registry {
  std::set<Stream *> streams;  // live created streams
  std::set<Event *> events;
};

Registry &reg() {
  static Registry *r = new Registry;  // handles this process has handed out, for its lifetime
  return *r;
}

double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

// After a device fault every call that uses the device fails with the sticky error, before or
// after it waits for work (kernel_faults); one that queues work meets it in enqueue.
#define RETURN_IF_BROKEN()                                         \
  do {                                                             \
    if (cudaError_t sticky_ = sticky_error()) return ret(sticky_); \
  } while (0)

struct CopyOp : Op {
  void *dst;
  const void *src;
  size_t bytes;
  bool run() override {
    memcpy(dst, src, bytes);
    return true;
  }
};

struct SetOp : Op {
  void *dst;
  int value;
  size_t bytes;
  bool run() override {
    memset(dst, value, bytes);
    return true;
  }
};

Event *event_of(cudaEvent_t e) {
  Event *ev = reinterpret_cast<Event *>(e);
  return reg().events.count(ev) ? ev : nullptr;
}

// Queues a copy after checking both sides; kind as the caller gave it.
cudaError_t queue_copy(Stream *s, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, const char *api) {
  if (!bytes) return cudaSuccess;
  bool dst_dev = in_device_region(dst), src_dev = in_device_region(src);
  switch (kind) {
    case cudaMemcpyHostToDevice:
      if (src_dev || !dst_dev) return ret(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDeviceToHost:
      if (!src_dev || dst_dev) return ret(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDeviceToDevice:
      if (!src_dev || !dst_dev) return ret(cudaErrorInvalidValue);
      break;
    case cudaMemcpyHostToHost:
      if (src_dev || dst_dev) return ret(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDefault: break;
    default: return ret(cudaErrorInvalidMemcpyDirection);
  }
  if (s->legacy)
    if (cudaError_t e = check_legacy_use(s->dev)) return ret(e);
  std::unique_ptr<CopyOp> op(new CopyOp);
  for (int side = 0; side < 2; side++) {
    const void *p = side ? src : dst;
    if (!in_device_region(p)) {
      // a graph's copy node reads and writes its host buffer at every launch: it must stay there
      if (s->capture && !is_pinned(p, bytes)) return ret(refuse(s->capture, cudaErrorStreamCaptureUnsupported));
      op->pinned.emplace_back(p, bytes);
      continue;
    }
    const Allocation *a = device_range(p, bytes);
    if (!a)
      fatal("%s of %zu bytes: the %s range starts at %p, %s, and must lie inside one live allocation", api, bytes,
            side ? "source" : "destination", p, describe_address(p).c_str());
    op->uses.push_back(a);
    declare_access(op.get(), p, bytes, side == 0);
  }
  op->dst = dst;
  op->src = src;
  op->bytes = bytes;
  char what[128];
  snprintf(what, sizeof what, "%s of %zu bytes", api, bytes);
  op->what = what;
  if (!dst_dev && !src_dev && !s->capture) {  // host to host: fully synchronous
    drain(s, s->enqueued, api);
    hazard_host_waits(hazard_clock_of(s));
    memcpy(dst, src, bytes);
    return cudaSuccess;
  }
  return ret(enqueue(s, std::move(op)));
}

void fill_properties(cudaDeviceProp *p, int i) {
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "gpusim H100 80GB HBM3 (CPU stand-in)");
  for (int k = 0; k < 16; k++) p->uuid.bytes[k] = (char)(0x60 + k + 16 * i);
  p->totalGlobalMem = config().memory_bytes;
  p->sharedMemPerBlock = 48 << 10;
  p->sharedMemPerBlockOptin = 227 << 10;
  p->sharedMemPerMultiprocessor = 228 << 10;
  p->reservedSharedMemPerBlock = 1 << 10;
  p->regsPerBlock = 65536;
  p->regsPerMultiprocessor = 65536;
  p->warpSize = 32;
  p->memPitch = (size_t)1 << 31;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024, p->maxThreadsDim[1] = 1024, p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff, p->maxGridSize[1] = 65535, p->maxGridSize[2] = 65535;
  p->totalConstMem = 64 << 10;
  p->major = config().cc_major;
  p->minor = config().cc_minor;
  p->multiProcessorCount = 132;
  p->maxThreadsPerMultiProcessor = 2048;
  p->maxBlocksPerMultiProcessor = 32;
  p->concurrentKernels = 1;
  p->ECCEnabled = 1;
  char bus[32];
  pci_bus_id(i, bus, sizeof bus);
  unsigned dom = 0, b = 0, dev = 0;
  sscanf(bus, "%x:%x:%x", &dom, &b, &dev);
  p->pciDomainID = (int)dom;
  p->pciBusID = (int)b;
  p->pciDeviceID = (int)dev;
  p->asyncEngineCount = 3;
  p->unifiedAddressing = 1;
  p->memoryBusWidth = 5120;
  p->l2CacheSize = 50 << 20;
  p->managedMemory = 1;
  p->canMapHostMemory = 1;
  p->streamPrioritiesSupported = 1;
  p->cooperativeLaunch = 1;
  p->clusterLaunch = 1;
}

}  // namespace

cudaError_t set_error(cudaError_t e) {
  return ret(e);
}

Stream *stream_of(cudaStream_t h) {
  if (h == nullptr || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    Device *d = current_device();
    return d ? d->legacy : nullptr;
  }
  Stream *s = reinterpret_cast<Stream *>(h);
  return reg().streams.count(s) ? s : nullptr;
}

cudaError_t enqueue(Stream *s, std::unique_ptr<Op> op) {
  // a broken context takes no work: its error is what the library queuing it meets (cuBLAS answers
  // CUBLAS_STATUS_EXECUTION_FAILED, cuDNN CUDNN_STATUS_EXECUTION_FAILED, NCCL ncclUnhandledCudaError)
  if (cudaError_t e = sticky_error()) return e;
  Device *d = s->dev;
  if (s->capture) return capture_op(s, std::move(op));
  // the legacy stream and the blocking streams wait for each other's earlier work
  if (s->legacy) {
    if (cudaError_t e = check_legacy_use(d)) return e;
    for (Stream *o : d->streams)
      if (o != s && o->blocking && o->enqueued > 0) enqueue_wait(s, o, o->enqueued, hazard_clock_of(o));
  } else if (s->blocking && d->legacy->enqueued > 0) {
    enqueue_wait(s, d->legacy, d->legacy->enqueued, hazard_clock_of(d->legacy));
  }
  s->queue.push_back(std::move(op));
  s->enqueued++;
  hazard_stamp(s, s->queue.back().get());
  return cudaSuccess;
}

cudaError_t enqueue_wait(Stream *s, Stream *target, uint64_t seq, const Clock &at) {
  if (s->capture) return capture_op(s, std::unique_ptr<Op>(new WaitOp(target, seq)));
  hazard_stream_waits(s, at);
  if (target->completed >= seq) return cudaSuccess;  // done already: only the order is kept
  s->queue.emplace_back(new WaitOp(target, seq));
  s->enqueued++;
  hazard_stamp(s, s->queue.back().get());
  return cudaSuccess;
}

bool run_checked(Op *op, const LaunchCtx *g) {
  if (sticky_error()) return true;  // a broken context runs nothing more: the work is dropped
  grant_only(op->uses);  // the op reaches what it declared, nothing else
  if (op->traced) hazard_kernel_begin();
  bool done = op->run();
  std::vector<Access> traced;
  if (op->traced) traced = hazard_kernel_end();
  if (!done) return false;
  for (const Allocation *a : op->uses) check_guards(a, op->what.c_str());
  hazard_check(op, op->traced ? traced : op->accesses, g);
  return true;
}

// Runs s's first queued op; false when it cannot finish yet (a collective waiting for its peers).
static bool run_first(Stream *s) {
  if (!run_checked(s->queue.front().get(), nullptr)) return false;
  s->queue.pop_front();
  s->completed++;
  return true;
}

// GPUSIM_STREAM_ORDER=seeded: before each op of s, up to two ops that other streams of the device
// could run now (not a wait for unfinished work), in a seeded order: work runs earlier than a
// synchronisation needs it, as a GPU running streams side by side would.
static void run_others_first(Stream *s) {
  std::vector<Stream *> ready;
  for (int k = (int)s->rng.below(3); k > 0; k--) {
    ready.clear();
    for (Stream *o : s->dev->streams) {
      if (o == s || o->running || o->queue.empty()) continue;
      WaitOp *w = dynamic_cast<WaitOp *>(o->queue.front().get());
      if (w && w->target->completed < w->seq) continue;
      ready.push_back(o);
    }
    if (ready.empty()) return;
    Stream *o = ready[s->rng.below((uint32_t)ready.size())];
    o->running = true;
    run_first(o);
    o->running = false;
  }
}

bool progress(Stream *s, uint64_t until) {
  if (s->completed >= until) return true;
  if (s->running)
    fatal(
        "streams wait for each other in a cycle (cudaStreamWaitEvent on events recorded after the waits): "
        "this work can never run");
  s->running = true;
  open_device_memory();
  double t0 = now_s();
  while (s->completed < until && !s->queue.empty()) {
    if (stream_order() == ORDER_SEEDED) run_others_first(s);
    if (!run_first(s)) break;
  }
  s->dev->busy_s += now_s() - t0;
  close_device_memory();
  s->running = false;
  return s->completed >= until;
}

void drain(Stream *s, uint64_t until, const char *why) {
  double t0 = now_s(), warned = 0;
  useconds_t nap = 20;
  while (!progress(s, until)) {
    usleep(nap);
    if (nap < 2000) nap *= 2;
    double waited = now_s() - t0;
    if (waited - warned > 60) {
      warned = waited;
      warn("%s has waited %.0f s for queued work that cannot finish (a collective whose peers have not joined)", why,
           waited);
    }
  }
}

void run_ready_work() {
  for (bool ran = true; ran;) {  // again while a pass ran something: a wait may have become ready
    ran = false;
    for (int i = 0; Device *d = device(i); i++)
      for (size_t k = 0; k < d->streams.size(); k++) {
        Stream *s = d->streams[k];
        if (s->running || s->queue.empty()) continue;
        uint64_t before = s->completed;
        progress(s, s->enqueued);
        ran = ran || s->completed > before;
      }
  }
}

void release_destroyed_streams(Device *d) {
  for (size_t i = 0; i < d->streams.size();) {
    Stream *s = d->streams[i];
    bool waited_for = false;  // a queued wait elsewhere still points at it
    for (Stream *o : d->streams)
      for (auto &op : o->queue) {
        WaitOp *w = dynamic_cast<WaitOp *>(op.get());
        waited_for = waited_for || (w && w->target == s);
      }
    if (!s->destroyed || !s->queue.empty() || waited_for) {
      i++;
      continue;
    }
    for (Event *e : reg().events)  // events recorded on it have completed
      if (e->stream == s) e->recorded = false, e->stream = nullptr;
    d->streams.erase(d->streams.begin() + (long)i);
    delete s;
  }
}

const Op *pending_user(const Allocation *a) {
  for (int i = 0; Device *d = device(i); i++)
    for (Stream *s : d->streams)
      for (auto &op : s->queue)
        for (const Allocation *u : op->uses)
          if (u == a) return op.get();
  return nullptr;
}

}  // namespace gpusim

using namespace gpusim;

extern "C" {

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
#define N(x) \
  case x: return #x;
    N(cudaSuccess)
    N(cudaErrorInvalidValue)
    N(cudaErrorMemoryAllocation)
    N(cudaErrorInitializationError)
    N(cudaErrorInvalidConfiguration)
    N(cudaErrorInvalidDevice)
    N(cudaErrorInvalidMemcpyDirection)
    N(cudaErrorInvalidResourceHandle)
    N(cudaErrorNotReady)
    N(cudaErrorNoDevice)
    N(cudaErrorIllegalAddress)
    N(cudaErrorDevicesUnavailable)
    N(cudaErrorInvalidDevicePointer)
    N(cudaErrorStreamCaptureUnsupported)
    N(cudaErrorStreamCaptureInvalidated)
    N(cudaErrorStreamCaptureMerge)
    N(cudaErrorStreamCaptureUnmatched)
    N(cudaErrorStreamCaptureUnjoined)
    N(cudaErrorStreamCaptureIsolation)
    N(cudaErrorStreamCaptureImplicit)
    N(cudaErrorCapturedEvent)
    N(cudaErrorStreamCaptureWrongThread)
#undef N
    default: return "cudaErrorUnknown";
  }
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorDevicesUnavailable: return "CUDA-capable device(s) is/are busy or unavailable";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureMerge: return "operation would result in a merge of separate capture sequences";
    case cudaErrorStreamCaptureUnmatched: return "capture was not ended in the same stream as it began";
    case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation: return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    default: return "unrecognized error code";
  }
}

// A sticky error stays: every call returns it, this one too.
cudaError_t cudaGetLastError(void) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  return last_error;
}

cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n) {
  ApiLock lock;
  *n = config().devices;
  return *n ? cudaSuccess : ret(cudaErrorNoDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int i) {
  ApiLock lock;
  if (!device(i)) return ret(cudaErrorInvalidDevice);
  fill_properties(p, i);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int i) {
  ApiLock lock;
  if (!device(i)) return ret(cudaErrorInvalidDevice);
  cudaDeviceProp p;
  fill_properties(&p, i);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    default: return ret(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *buf, int len, int i) {
  ApiLock lock;
  if (!device(i)) return ret(cudaErrorInvalidDevice);
  if (len < 13) return ret(cudaErrorInvalidValue);
  pci_bus_id(i, buf, (size_t)len);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *i) {
  ApiLock lock;
  *i = current_index();
  return cudaSuccess;
}

// Since CUDA 12 cudaSetDevice initialises the device's primary context at once.
cudaError_t cudaSetDevice(int i) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Device *d = device(i);
  if (!d) return ret(config().devices ? cudaErrorInvalidDevice : cudaErrorNoDevice);
  set_current_index(i);
  make_context(d);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Device *d = current_device();
  if (!d) return ret(cudaErrorNoDevice);
  *total = config().memory_bytes;
  *free_b = d->used < *total ? *total - d->used : 0;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Device *d = current_device();
  if (!d) return ret(cudaErrorNoDevice);
  if (!p) return ret(cudaErrorInvalidValue);
  if (cudaError_t e = check_unsafe_call()) return ret(e);
  if (!bytes) {
    *p = nullptr;
    return cudaSuccess;
  }
  *p = device_alloc(d, bytes);
  return *p ? cudaSuccess : ret(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void *p) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  if (cudaError_t e = check_unsafe_call()) return ret(e);
  if (!p) return cudaSuccess;
  const Allocation *a = find_allocation(p);
  if (!a || !a->live || a->base != (uintptr_t)p) return ret(cudaErrorInvalidValue);
  if (const Op *user = pending_user(a))
    fatal(
        "cudaFree(%p) of allocation #%llu (%zu bytes) while queued, unfinished work still uses it: %s; "
        "synchronize the stream (or wait for an event recorded after that work) before freeing",
        p, (unsigned long long)a->serial, a->size, user->what.c_str());
  device_free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  current_device();
  if (cudaError_t e = check_unsafe_call()) return ret(e);
  if (posix_memalign(p, 4096, bytes ? bytes : 1)) return ret(cudaErrorMemoryAllocation);
  pinned_add(*p, bytes);
  return cudaSuccess;
}

// Only what cudaMallocHost returned (the documentation does not promise that NULL is accepted).
cudaError_t cudaFreeHost(void *p) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  if (cudaError_t e = check_unsafe_call()) return ret(e);
  if (!p || !pinned_remove(p)) return ret(cudaErrorInvalidValue);
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t h) {
  ApiLock lock;
  Stream *s = stream_of(h);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  return queue_copy(s, dst, src, bytes, kind, "cudaMemcpyAsync");
}

// Blocking: queued on the legacy stream (after every blocking stream's work) and run to the end.
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
  ApiLock lock;
  Stream *s = stream_of(nullptr);
  if (!s) return ret(cudaErrorNoDevice);
  if (cudaError_t e = check_unsafe_call()) return ret(e);
  cudaError_t e = queue_copy(s, dst, src, bytes, kind, "cudaMemcpy");
  if (e == cudaSuccess) {
    drain(s, s->enqueued, "cudaMemcpy");
    RETURN_IF_BROKEN();
    hazard_host_waits(hazard_clock_of(s));
  }
  return e;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t h) {
  ApiLock lock;
  Stream *s = stream_of(h);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (!bytes) return cudaSuccess;
  const Allocation *a = device_range(p, bytes, s->dev->index);
  if (!a)
    fatal("cudaMemsetAsync of %zu bytes at %p, %s: the range must lie inside one live allocation of device %d", bytes,
          p, describe_address(p).c_str(), s->dev->index);
  std::unique_ptr<SetOp> op(new SetOp);
  op->dst = p;
  op->value = value;
  op->bytes = bytes;
  op->uses.push_back(a);
  declare_access(op.get(), p, bytes, true);
  op->what = "cudaMemsetAsync";
  return ret(enqueue(s, std::move(op)));
}

// Asynchronous with respect to the host (the documentation says so for device memory), yet not a
// stream operation: capture forbids it as it does cudaMemcpy.
cudaError_t cudaMemset(void *p, int value, size_t bytes) {
  ApiLock lock;
  if (cudaError_t e = check_unsafe_call()) return ret(e);
  return cudaMemsetAsync(p, value, bytes, nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *h, unsigned flags) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Device *d = current_device();
  if (!d) return ret(cudaErrorNoDevice);
  if (flags & ~(unsigned)cudaStreamNonBlocking) return ret(cudaErrorInvalidValue);
  Stream *s = new Stream;
  s->dev = d;
  s->blocking = !(flags & cudaStreamNonBlocking);
  s->rng = Rng(next_seed());
  hazard_stream_created(s);
  d->streams.push_back(s);
  reg().streams.insert(s);
  *h = reinterpret_cast<cudaStream_t>(s);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *h) {
  return cudaStreamCreateWithFlags(h, cudaStreamDefault);
}

// The handle dies at once; queued work still runs when something waits for it (or at a device
// synchronisation), as the documentation promises. The stream itself goes once nothing can
// reach it any more.
cudaError_t cudaStreamDestroy(cudaStream_t h) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Stream *s = stream_of(h);
  if (!s || s->legacy) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) return ret(refuse(s->capture, cudaErrorStreamCaptureUnsupported));
  reg().streams.erase(s);
  s->destroyed = true;
  release_destroyed_streams(s->dev);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Stream *s = stream_of(h);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) return ret(refuse(s->capture, cudaErrorStreamCaptureUnsupported));
  if (s->legacy)
    if (cudaError_t e = check_legacy_use(s->dev)) return ret(e);
  drain(s, s->enqueued, "cudaStreamSynchronize");
  RETURN_IF_BROKEN();
  hazard_host_waits(hazard_clock_of(s));
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Stream *s = stream_of(h);
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) return ret(refuse(s->capture, cudaErrorStreamCaptureUnsupported));
  if (s->legacy)
    if (cudaError_t e = check_legacy_use(s->dev)) return ret(e);
  if (s->completed >= s->enqueued) {
    hazard_host_waits(hazard_clock_of(s));
    return cudaSuccess;
  }
  // the device works in the background: queued work is found done after a few polls, never at
  // the first one
  if (++s->polls >= 2 + (int)s->rng.below(3) && progress(s, s->enqueued)) {
    RETURN_IF_BROKEN();
    s->polls = 0;
    hazard_host_waits(hazard_clock_of(s));
    return cudaSuccess;
  }
  return cudaErrorNotReady;
}

cudaError_t cudaDeviceSynchronize(void) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Device *d = current_device();
  if (!d) return ret(cudaErrorNoDevice);
  if (cudaError_t e = check_device_sync(d)) return ret(e);
  for (size_t i = 0; i < d->streams.size(); i++) {
    drain(d->streams[i], d->streams[i]->enqueued, "cudaDeviceSynchronize");
    RETURN_IF_BROKEN();
    hazard_host_waits(hazard_clock_of(d->streams[i]));
  }
  release_destroyed_streams(d);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *h, unsigned flags) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  if (!current_device()) return ret(cudaErrorNoDevice);
  if (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess))
    return ret(cudaErrorInvalidValue);
  Event *e = new Event;
  reg().events.insert(e);
  *h = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *h) {
  return cudaEventCreateWithFlags(h, cudaEventDefault);
}

// In a capture the event marks the capturing stream's place in the graph (its dependencies):
// another stream that waits for it joins the capture there.
cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t sh) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Event *e = event_of(h);
  Stream *s = stream_of(sh);
  if (!e || !s) return ret(cudaErrorInvalidResourceHandle);
  if (s->capture) {
    if (s->capture->invalidated) return ret(cudaErrorStreamCaptureInvalidated);
    e->stream = nullptr;
    e->recorded = false;
    e->clock = Clock();
    e->capture = s->capture->id;
    e->nodes = s->deps;
    return cudaSuccess;
  }
  if (s->legacy)
    if (cudaError_t err = check_legacy_use(s->dev)) return ret(err);
  e->capture = 0;
  e->nodes.clear();
  e->stream = s;
  e->seq = s->enqueued;
  e->clock = hazard_clock_of(s);
  e->recorded = true;
  e->polls = 0;
  e->delay = 2 + (int)s->rng.below(3);  // "not ready" at least once
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t h) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Event *e = event_of(h);
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  if (e->capture) return ret(refuse(find_capture(e->capture), cudaErrorCapturedEvent));
  if (!e->recorded) {
    hazard_host_waits(e->clock);
    return cudaSuccess;
  }
  if (e->stream->completed >= e->seq || (++e->polls >= e->delay && progress(e->stream, e->seq))) {
    RETURN_IF_BROKEN();
    hazard_host_waits(e->clock);
    return cudaSuccess;
  }
  return cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t h) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Event *e = event_of(h);
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  if (e->capture) return ret(refuse(find_capture(e->capture), cudaErrorCapturedEvent));
  if (e->recorded) drain(e->stream, e->seq, "cudaEventSynchronize");
  RETURN_IF_BROKEN();
  hazard_host_waits(e->clock);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t h) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Event *e = event_of(h);
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  reg().events.erase(e);
  delete e;
  return cudaSuccess;
}

// Later work on `sh` waits for the work queued before the event's most recent record. An event
// recorded in a capture makes the stream join that capture; a capturing stream may not wait for
// work outside its capture.
cudaError_t cudaStreamWaitEvent(cudaStream_t sh, cudaEvent_t h, unsigned flags) {
  ApiLock lock;
  RETURN_IF_BROKEN();
  Stream *s = stream_of(sh);
  Event *e = event_of(h);
  if (!s || !e) return ret(cudaErrorInvalidResourceHandle);
  if (flags & ~(unsigned)cudaEventWaitExternal) return ret(cudaErrorInvalidValue);
  if (e->capture) {
    Capture *c = find_capture(e->capture);
    if (!c) return ret(refuse(s->capture, cudaErrorCapturedEvent));  // that capture has ended
    return ret(capture_wait(s, c, e->nodes));
  }
  if (s->capture) {
    if (s->capture->invalidated) return ret(cudaErrorStreamCaptureInvalidated);
    if (!e->recorded) return cudaSuccess;  // nothing to wait for
    return ret(refuse(s->capture, cudaErrorStreamCaptureIsolation));
  }
  if (!e->recorded) {  // never recorded, or its stream is gone (its work done): only the order is kept
    hazard_stream_waits(s, e->clock);
    return cudaSuccess;
  }
  if (e->stream == s) return cudaSuccess;
  return ret(enqueue_wait(s, e->stream, e->seq, e->clock));
}

// What a kernel was built as: PTX and machine code of GPUSIM_PTX (a build whose newest PTX is older
// than the GPU, compiled by the driver), its shared memory limits and block size.
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *attr, const void *fn) {
  ApiLock lock;
  if (!attr || !fn) return ret(cudaErrorInvalidValue);
  memset(attr, 0, sizeof *attr);
  attr->sharedSizeBytes = static_shared_bytes();
  attr->maxThreadsPerBlock = 1024;
  attr->ptxVersion = attr->binaryVersion = config().ptx_version;
  attr->maxDynamicSharedSizeBytes = max_dynamic_shared(fn);
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void *fn, cudaFuncAttribute attr, int value) {
  ApiLock lock;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || (size_t)value + static_shared_bytes() > (227u << 10)) return ret(cudaErrorInvalidValue);
    set_max_dynamic_shared(fn, value);
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  return ret(cudaErrorInvalidValue);
}

}  // extern "C"
