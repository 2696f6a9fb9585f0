// nccl.cc: NCCL on the stand-in, across the processes of one machine (the ranks mpirun starts).
// - The unique id names a shared-memory segment; each rank maps it, announces itself (pid, host,
//   device bus id) and waits for the others. Init in non-blocking mode stays ncclInProgress for a
//   few polls even after every rank has joined, so the caller's polling loop runs. Two ranks on
//   one device is ncclInvalidUsage ("Duplicate GPU detected"), as in NCCL.
// - Collectives (all-reduce, reduce, broadcast, all-gather, reduce-scatter) are queued on the
//   caller's stream and run when the stream does: each rank posts its part into its slot of the
//   segment, waits for every rank's part, and computes its result from all of them in rank order,
//   so every rank gets bit-identical sums. Parts larger than a slot go in several rounds.
// - Every round carries the call's kind, count, type, operation and root; ranks that disagree
//   set ncclInvalidUsage naming both calls (real NCCL would hang or corrupt memory).
// - On a capturing stream a collective is recorded into the graph, not issued: each launch of the
//   graph issues it anew, in the graph's order, exactly as if it were called then.
// - A peer that exits or aborts shows as ncclRemoteError on ncclCommGetAsyncError; ncclCommAbort
//   cancels this rank's queued collectives. Buffers must be device memory of the
//   communicator's device (ncclInvalidArgument otherwise).
// - GPUSIM_NCCL_FAULT=init@R makes rank R's initialisation fail (ncclSystemError) before it joins.
#include <errno.h>
#include <fcntl.h>
#include <nccl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "gpusim.h"

namespace gpusim {
namespace {

const char kIdMagic[] = "gpusim-nccl-id";
const size_t kSlotBytes = (size_t)8 << 20;  // one rank's part of a round

enum Coll { ALL_REDUCE, REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER };
const char *coll_name(int c) {
  static const char *names[] = {"ncclAllReduce", "ncclReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter"};
  return c >= 0 && c < 5 ? names[c] : "?";
}

struct Slot {  // one rank's announcement and its current round, in shared memory
  int32_t joined, aborted, pid, device;
  char host[64], bus[16];
  uint64_t ready, done;  // the last round posted, the last round consumed
  int32_t coll, type, op, root;
  uint64_t count;
  int32_t captured;  // the current round's collective runs in a CUDA graph launch
  char pad[60];
};

struct Segment {
  uint32_t nranks;  // set by the first rank to map it; the others must agree
  Slot slots[1];    // [nranks], then nranks data areas of kSlotBytes
};

size_t segment_bytes(int nranks) {
  return (sizeof(Segment) + sizeof(Slot) * (size_t)nranks + 4095) / 4096 * 4096 + kSlotBytes * (size_t)nranks;
}

thread_local int group_depth = 0;
thread_local std::string last_error;

ncclResult_t fail(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t fail(ncclResult_t r, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  last_error = buf;
  return r;
}

double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

template <class T>
T apply(int op, T a, T b) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;  // sum and avg
  }
}

template <class T>
void reduce_into(T *dst, const T *const *parts, int nparts, size_t n, int op) {
  for (size_t i = 0; i < n; i++) {
    T acc = parts[0][i];
    for (int r = 1; r < nparts; r++) acc = apply(op, acc, parts[r][i]);
    if (op == ncclAvg) acc = (T)(acc / (T)nparts);
    dst[i] = acc;
  }
}

void reduce16(uint16_t *dst, const uint16_t *const *parts, int nparts, size_t n, int op, bool bf16) {
  for (size_t i = 0; i < n; i++) {
    float acc = bf16 ? bf16_to_float(parts[0][i]) : half_to_float(parts[0][i]);
    for (int r = 1; r < nparts; r++)
      acc = apply(op, acc, bf16 ? bf16_to_float(parts[r][i]) : half_to_float(parts[r][i]));
    if (op == ncclAvg) acc /= (float)nparts;
    dst[i] = bf16 ? float_to_bf16(acc) : float_to_half(acc);
  }
}

// dst[0..n) = op over ranks of parts[r][0..n)
void reduce(void *dst, const void *const *parts, int nparts, size_t n, ncclDataType_t t, int op) {
  switch (t) {
    case ncclInt8: reduce_into((int8_t *)dst, (const int8_t *const *)parts, nparts, n, op); break;
    case ncclUint8: reduce_into((uint8_t *)dst, (const uint8_t *const *)parts, nparts, n, op); break;
    case ncclInt32: reduce_into((int32_t *)dst, (const int32_t *const *)parts, nparts, n, op); break;
    case ncclUint32: reduce_into((uint32_t *)dst, (const uint32_t *const *)parts, nparts, n, op); break;
    case ncclInt64: reduce_into((int64_t *)dst, (const int64_t *const *)parts, nparts, n, op); break;
    case ncclUint64: reduce_into((uint64_t *)dst, (const uint64_t *const *)parts, nparts, n, op); break;
    case ncclFloat32: reduce_into((float *)dst, (const float *const *)parts, nparts, n, op); break;
    case ncclFloat64: reduce_into((double *)dst, (const double *const *)parts, nparts, n, op); break;
    case ncclFloat16: reduce16((uint16_t *)dst, (const uint16_t *const *)parts, nparts, n, op, false); break;
    case ncclBfloat16: reduce16((uint16_t *)dst, (const uint16_t *const *)parts, nparts, n, op, true); break;
    default: break;
  }
}

// A communicator's state, shared by the handle and its queued collectives.
struct State {
  int nranks = 0, rank = 0, device = 0;
  bool blocking = true;
  enum { JOINING, READY, FAILED, ABORTED } phase = JOINING;
  ncclResult_t error = ncclSuccess;  // the asynchronous error once the phase is FAILED
  int settle_polls = 0;              // polls left that still answer ncclInProgress
  Segment *seg = nullptr;
  size_t seg_bytes = 0;
  char name[NCCL_UNIQUE_ID_BYTES] = "";
  uint64_t rounds = 0;            // rounds this rank has started
  int pending = 0;                // queued collectives not yet finished
  std::vector<Stream *> streams;  // where they are queued
  bool finalizing = false;
  double next_liveness = 0;
  Rng rng{0};

  // One more collective queued on s (ncclCommFinalize waits for them).
  void track(Stream *s) {
    pending++;
    if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
  }
  Slot *slot(int r) { return &seg->slots[r]; }
  char *data(int r) {
    return (char *)seg + (sizeof(Segment) + sizeof(Slot) * (size_t)nranks + 4095) / 4096 * 4096 +
           kSlotBytes * (size_t)r;
  }
  ~State() {
    if (!seg) return;
    munmap(seg, seg_bytes);
    shm_unlink(name);  // usually done at join already (ENOENT then); not when joining failed
  }
  void set_failed(ncclResult_t e, const std::string &why) {
    if (phase == FAILED || phase == ABORTED) return;
    phase = FAILED;
    error = e;
    last_error = why;
    warn("NCCL rank %d: %s", rank, why.c_str());
  }
  // A peer that exited or aborted is an asynchronous remote error (checked now and then).
  bool peers_alive() {
    double t = now_s();
    if (t < next_liveness) return true;
    next_liveness = t + 0.1;
    for (int r = 0; r < nranks; r++) {
      Slot *s = slot(r);
      if (r == rank || !__atomic_load_n(&s->joined, __ATOMIC_ACQUIRE)) continue;
      char why[256];
      if (__atomic_load_n(&s->aborted, __ATOMIC_ACQUIRE)) {
        snprintf(why, sizeof why, "peer rank %d aborted its communicator", r);
        set_failed(ncclRemoteError, why);
        return false;
      }
      if (kill(s->pid, 0) && errno == ESRCH) {
        snprintf(why, sizeof why, "peer rank %d (pid %d) exited", r, s->pid);
        set_failed(ncclRemoteError, why);
        return false;
      }
    }
    return true;
  }
  // Joining: true once every rank has announced itself (and the answer settles).
  void progress_join() {
    if (phase != JOINING) return;
    int joined = 0;
    for (int r = 0; r < nranks; r++) joined += __atomic_load_n(&slot(r)->joined, __ATOMIC_ACQUIRE);
    if (joined < nranks) {
      peers_alive();
      return;
    }
    for (int a = 0; a < nranks; a++)
      for (int b = a + 1; b < nranks; b++)
        if (!strcmp(slot(a)->host, slot(b)->host) && !strcmp(slot(a)->bus, slot(b)->bus)) {
          char why[256];
          snprintf(why, sizeof why, "Duplicate GPU detected: rank %d and rank %d both on CUDA device with bus id %s", a,
                   b, slot(a)->bus);
          set_failed(ncclInvalidUsage, why);
          return;
        }
    if (rank == 0) shm_unlink(name);  // every rank has it mapped: no file is left behind
    if (settle_polls-- > 0) return;
    phase = READY;
  }
};

}  // namespace
}  // namespace gpusim

struct ncclComm {
  std::shared_ptr<gpusim::State> st;  // shared with its queued collectives
};

namespace gpusim {
namespace {

Handles<ncclComm> comms;

State *state_of(ncclComm_t c) {
  return comms.has(c) ? c->st.get() : nullptr;
}

// One collective, queued on a stream.
struct Collective {
  int coll;
  const void *send;
  void *recv;
  size_t count;  // all-reduce/reduce/broadcast: elements; all-gather: per rank sent; reduce-scatter: per rank received
  ncclDataType_t type;
  int op, root;
  cudaStream_t stream;
};

struct NcclOp : Op {
  std::shared_ptr<State> st;
  Collective c;
  size_t done_elems = 0, total_elems = 0, chunk = 0;
  enum { POST, CONSUME } phase = POST;
  uint64_t round = 0;
  bool finished = false;
  bool captured = false;  // issued by a graph launch (recorded in a capture), not queued eagerly

  // elements of each rank's part in one round
  size_t part_elems(size_t n) const { return c.coll == REDUCE_SCATTER ? n * (size_t)st->nranks : n; }

  void finish() {
    if (!finished) {
      finished = true;
      st->pending--;
    }
  }
  bool run() override;
  // recorded in a graph: every launch issues the collective again, from its first round
  std::unique_ptr<Op> relaunch(Stream *s) override {
    std::unique_ptr<NcclOp> op(new NcclOp);
    op->st = st;
    op->c = c;
    op->total_elems = total_elems;
    op->chunk = chunk;
    op->what = what;
    op->uses = uses;
    op->accesses = accesses;
    op->captured = true;
    st->track(s);
    return op;
  }
};

bool NcclOp::run() {
  State &s = *st;
  if (s.phase != State::READY) {  // aborted or failed: the work is cancelled
    finish();
    return true;
  }
  size_t es = type_size(c.type);
  int me = s.rank, n = s.nranks;
  if (!round) round = ++s.rounds;  // rounds are numbered in execution order, the same on every rank
  for (;;) {
    if (done_elems >= total_elems && total_elems) {
      finish();
      return true;
    }
    size_t len = total_elems - done_elems < chunk ? total_elems - done_elems : chunk;
    if (phase == POST) {
      // my data area is free once every rank consumed my previous round
      for (int r = 0; r < n; r++)
        if (__atomic_load_n(&s.slot(r)->done, __ATOMIC_ACQUIRE) + 1 < round)
          return s.peers_alive() ? false : (finish(), true);
      Slot *mine = s.slot(me);
      char *area = s.data(me);
      const char *src = (const char *)c.send;
      switch (c.coll) {
        case ALL_REDUCE:
        case REDUCE:
        case ALL_GATHER: memcpy(area, src + done_elems * es, len * es); break;
        case BROADCAST:
          if (me == c.root) memcpy(area, src + done_elems * es, len * es);
          break;
        case REDUCE_SCATTER:  // my contribution to every rank's block
          for (int r = 0; r < n; r++)
            memcpy(area + (size_t)r * len * es, src + ((size_t)r * c.count + done_elems) * es, len * es);
          break;
      }
      mine->coll = c.coll, mine->type = c.type, mine->op = c.op, mine->root = c.root;
      mine->count = c.count;
      mine->captured = captured;
      __atomic_store_n(&mine->ready, round, __ATOMIC_RELEASE);
      phase = CONSUME;
    }
    for (int r = 0; r < n; r++)
      if (__atomic_load_n(&s.slot(r)->ready, __ATOMIC_ACQUIRE) < round)
        return s.peers_alive() ? false : (finish(), true);
    for (int r = 0; r < n; r++) {
      Slot *o = s.slot(r);
      if (o->coll != c.coll || o->type != c.type || o->count != c.count ||
          (c.coll != ALL_GATHER && c.coll != BROADCAST && o->op != c.op) ||
          ((c.coll == REDUCE || c.coll == BROADCAST) && o->root != c.root)) {
        char why[512];
        snprintf(why, sizeof why,
                 "ranks disagree on collective number %llu: rank %d called %s(count %llu, type %d, op %d, root %d), "
                 "rank %d called %s(count %llu, type %d, op %d, root %d)",
                 (unsigned long long)round, me, coll_name(c.coll), (unsigned long long)c.count, c.type, c.op, c.root, r,
                 coll_name(o->coll), (unsigned long long)o->count, o->type, o->op, o->root);
        s.set_failed(ncclInvalidUsage, why);
        finish();
        return true;
      }
    }
    for (int r = 0; r < n; r++) {
      Slot *o = s.slot(r);
      if (o->captured != (int32_t)captured) {
        // NCCL's rule for CUDA graphs: a collective is captured on every rank or on none
        char why[512];
        snprintf(why, sizeof why,
                 "ranks disagree on whether collective number %llu (%s of %llu elements) runs in a CUDA graph: rank "
                 "%d %s, rank %d %s; every rank must capture the same collectives",
                 (unsigned long long)round, coll_name(c.coll), (unsigned long long)c.count, me,
                 captured ? "launched it from a graph" : "queued it eagerly", r,
                 o->captured ? "launched it from a graph" : "queued it eagerly");
        s.set_failed(ncclInvalidUsage, why);
        finish();
        return true;
      }
    }
    const void *parts[64];
    char *dst = (char *)c.recv;
    switch (c.coll) {
      case ALL_REDUCE:
      case REDUCE:
        for (int r = 0; r < n; r++) parts[r] = s.data(r);
        if (c.coll == ALL_REDUCE || me == c.root) reduce(dst + done_elems * es, parts, n, len, c.type, c.op);
        break;
      case BROADCAST: memcpy(dst + done_elems * es, s.data(c.root), len * es); break;
      case ALL_GATHER:
        for (int r = 0; r < n; r++) memcpy(dst + ((size_t)r * c.count + done_elems) * es, s.data(r), len * es);
        break;
      case REDUCE_SCATTER:
        for (int r = 0; r < n; r++) parts[r] = s.data(r) + (size_t)me * len * es;
        reduce(dst + done_elems * es, parts, n, len, c.type, c.op);
        break;
    }
    __atomic_store_n(&s.slot(me)->done, round, __ATOMIC_RELEASE);
    done_elems += len;
    phase = POST;
    if (done_elems < total_elems) round = ++s.rounds;
  }
}

thread_local std::vector<std::pair<std::shared_ptr<State>, Collective>> group_ops;

ncclResult_t queue_collective(const std::shared_ptr<State> &st, const Collective &c) {
  Stream *s = stream_of(c.stream);
  std::unique_ptr<NcclOp> op(new NcclOp);
  op->st = st;
  op->c = c;
  size_t es = type_size(c.type);
  op->total_elems = c.count;
  op->chunk = kSlotBytes / (es * (c.coll == REDUCE_SCATTER ? (size_t)st->nranks : 1));
  if (!c.count) return ncclSuccess;  // nothing to exchange
  char what[128];
  snprintf(what, sizeof what, "%s of %zu elements (NCCL rank %d)", coll_name(c.coll), c.count, st->rank);
  op->what = what;
  for (int side = 0; side < 2; side++) {
    const void *p = side ? c.recv : c.send;
    if (p && in_device_region(p)) op->uses.push_back(find_allocation(p));
  }
  // the bytes each side covers: reduce-scatter sends every rank's block, all-gather receives them
  const size_t n = (size_t)st->nranks, bytes = c.count * es;
  declare_access(op.get(), c.send, c.coll == REDUCE_SCATTER ? bytes * n : bytes, false);
  declare_access(op.get(), c.recv, c.coll == ALL_GATHER ? bytes * n : bytes, true);
  bool capturing = s->capture;  // recorded: issued by each launch of the graph
  if (cudaError_t e = enqueue(s, std::move(op)))
    return fail(ncclUnhandledCudaError, "%s: %s", coll_name(c.coll), cudaGetErrorString(e));
  if (!capturing) st->track(s);
  return ncclSuccess;
}

// Checks a collective's arguments and queues it, or keeps it for ncclGroupEnd.
ncclResult_t submit(ncclComm_t comm, const Collective &c) {
  ApiLock lock;
  State *s = state_of(comm);
  const char *api = coll_name(c.coll);
  if (!s) return fail(ncclInvalidArgument, "%s: invalid communicator", api);
  if (s->phase == State::JOINING)
    return fail(ncclInvalidUsage,
                "%s: the communicator is still initialising; poll ncclCommGetAsyncError until it "
                "returns ncclSuccess first",
                api);
  if (s->phase != State::READY) return s->error ? s->error : ncclInvalidUsage;
  if (s->settle_polls > 0)
    return fail(ncclInvalidUsage,
                "%s: the previous call is still in progress; poll ncclCommGetAsyncError until it "
                "returns ncclSuccess first",
                api);
  size_t es = type_size(c.type);
  if (!es) return fail(ncclInvalidArgument, "%s: unsupported datatype %d", api, c.type);
  if (c.op < ncclSum || c.op > ncclAvg)
    return fail(ncclInvalidArgument, "%s: invalid reduction operation %d", api, c.op);
  if ((c.coll == REDUCE || c.coll == BROADCAST) && (c.root < 0 || c.root >= s->nranks))
    return fail(ncclInvalidArgument, "%s: root %d is not a rank of the %d", api, c.root, s->nranks);
  Stream *stream = stream_of(c.stream);
  if (!stream) return fail(ncclInvalidArgument, "%s: invalid stream", api);
  if (stream->dev->index != s->device)
    return fail(ncclInvalidArgument, "%s: the stream belongs to device %d, the communicator to device %d", api,
                stream->dev->index, s->device);
  size_t n = s->nranks;
  size_t send_elems = c.coll == REDUCE_SCATTER ? c.count * n : c.count;
  size_t recv_elems = c.coll == ALL_GATHER ? c.count * n : c.count;
  bool needs_send = !(c.coll == BROADCAST && s->rank != c.root);
  bool needs_recv = !(c.coll == REDUCE && s->rank != c.root);
  for (int side = 0; side < 2; side++) {
    const void *p = side ? (const void *)c.recv : c.send;
    size_t bytes = (side ? recv_elems : send_elems) * es;
    if (!(side ? needs_recv : needs_send) || !bytes) continue;
    if (!device_range(p, bytes, s->device))
      return fail(ncclInvalidArgument, "%s: %s %p (%zu bytes) is not device memory of device %d (%s)", api,
                  side ? "recvbuff" : "sendbuff", p, bytes, s->device, describe_address(p).c_str());
  }
  std::shared_ptr<State> st = comm->st;
  if (group_depth > 0) {
    group_ops.emplace_back(st, c);
    return ncclSuccess;
  }
  if (ncclResult_t r = queue_collective(st, c)) return r;
  // a non-blocking communicator may report the call as still being issued
  if (!s->blocking && s->rng.below(2)) {
    s->settle_polls = 1 + (int)s->rng.below(3);
    return ncclInProgress;
  }
  return ncclSuccess;
}

}  // namespace
}  // namespace gpusim

using namespace gpusim;

extern "C" {

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t) {
  return last_error.c_str();
}

ncclResult_t ncclGetVersion(int *v) {
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  ApiLock lock;
  memset(id, 0, sizeof *id);
  char host[64] = "";
  gethostname(host, sizeof host - 1);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  Rng rng(next_seed() ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32));
  snprintf(id->internal, sizeof id->internal, "%s", kIdMagic);
  snprintf(id->internal + 16, sizeof id->internal - 16, "/gpusim-nccl-%d-%016llx", (int)getpid(),
           (unsigned long long)rng.next());
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
  ApiLock lock;
  *out = nullptr;
  if (nranks < 1 || nranks > 64 || rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, "ncclCommInitRankConfig: rank %d of %d", rank, nranks);
  if (strcmp(id.internal, kIdMagic)) return fail(ncclInvalidArgument, "ncclCommInitRankConfig: not a unique id");
  bool blocking = true;
  if (config) {
    if (config->magic != 0xcafebeef || config->size != sizeof(ncclConfig_t))
      return fail(ncclInvalidArgument, "ncclCommInitRankConfig: the config was not set from NCCL_CONFIG_INITIALIZER");
    blocking = config->blocking == NCCL_CONFIG_UNDEF_INT || config->blocking != 0;
  }
  Device *d = current_device();
  if (!d) return fail(ncclUnhandledCudaError, "ncclCommInitRankConfig: no CUDA device");
  auto st = std::make_shared<State>();
  st->nranks = nranks;
  st->rank = rank;
  st->device = d->index;
  st->blocking = blocking;
  st->rng = Rng(next_seed());
  st->settle_polls = 2 + (int)st->rng.below(4);
  snprintf(st->name, sizeof st->name, "%s", id.internal + 16);
  const char *fault = gpusim::config().nccl_fault;
  int fail_rank = -1;
  if (fault && sscanf(fault, "init@%d", &fail_rank) == 1 && fail_rank == rank) {
    ncclComm *c = comms.add(new ncclComm);
    c->st = st;
    st->set_failed(ncclSystemError, "injected initialisation failure (GPUSIM_NCCL_FAULT)");
    *out = c;
    return blocking ? ncclSystemError : ncclInProgress;
  }
  st->seg_bytes = segment_bytes(nranks);
  int fd = shm_open(st->name, O_RDWR | O_CREAT, 0600);
  if (fd < 0) return fail(ncclSystemError, "shm_open %s: %s", st->name, strerror(errno));
  if (ftruncate(fd, (off_t)st->seg_bytes)) {
    close(fd);
    return fail(ncclSystemError, "ftruncate %s: %s", st->name, strerror(errno));
  }
  void *m = mmap(nullptr, st->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return fail(ncclSystemError, "mmap %s: %s", st->name, strerror(errno));
  st->seg = (Segment *)m;
  uint32_t expected = 0;
  if (!__atomic_compare_exchange_n(&st->seg->nranks, &expected, (uint32_t)nranks, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE) &&
      expected != (uint32_t)nranks) {
    ncclComm *c = comms.add(new ncclComm);
    c->st = st;
    *out = c;
    st->set_failed(ncclInvalidUsage, "ranks disagree on the communicator size: " + std::to_string(expected) + " and " +
                                         std::to_string(nranks));
    return blocking ? ncclInvalidUsage : ncclInProgress;
  }
  Slot *me = st->slot(rank);
  me->pid = (int32_t)getpid();
  me->device = d->index;
  gethostname(me->host, sizeof me->host - 1);
  pci_bus_id(d->index, me->bus, sizeof me->bus);
  __atomic_store_n(&me->joined, 1, __ATOMIC_RELEASE);
  ncclComm *c = comms.add(new ncclComm);
  c->st = st;
  *out = c;
  if (!blocking) return ncclInProgress;
  while (st->phase == State::JOINING) {
    st->progress_join();
    if (st->phase == State::JOINING) usleep(200);
  }
  return st->phase == State::READY ? ncclSuccess : st->error;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  ApiLock lock;
  State *s = state_of(comm);
  if (!s) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: invalid communicator");
  if (s->phase == State::JOINING) {
    s->progress_join();
    *state = s->phase == State::JOINING ? ncclInProgress : s->phase == State::READY ? ncclSuccess : s->error;
    return ncclSuccess;
  }
  if (s->phase != State::READY) {
    *state = s->error;
    return ncclSuccess;
  }
  if (cudaError_t e = sticky_error()) {  // a broken context (kernel_faults) is NCCL's asynchronous error too
    fail(ncclUnhandledCudaError, "Cuda failure '%s'", cudaGetErrorString(e));
    *state = ncclUnhandledCudaError;
    return ncclSuccess;
  }
  if (s->settle_polls > 0) {
    s->settle_polls--;
    *state = ncclInProgress;
    return ncclSuccess;
  }
  if (s->finalizing && s->pending) {
    for (Stream *st : s->streams) progress(st, st->enqueued);
    *state = s->pending ? ncclInProgress : ncclSuccess;
    if (!s->pending) s->streams.clear();
    return ncclSuccess;
  }
  *state = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  ApiLock lock;
  State *s = state_of(comm);
  if (!s) return fail(ncclInvalidArgument, "ncclCommFinalize: invalid communicator");
  s->finalizing = true;
  if (!s->pending) return ncclSuccess;
  if (!s->blocking) return ncclInProgress;
  for (Stream *st : s->streams) drain(st, st->enqueued, "ncclCommFinalize");
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  ApiLock lock;
  if (!comms.remove(comm)) return fail(ncclInvalidArgument, "ncclCommDestroy: invalid communicator");
  delete comm;  // queued collectives keep the state alive until they finish
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  ApiLock lock;
  State *s = state_of(comm);
  if (!s) return ncclSuccess;
  if (s->seg) __atomic_store_n(&s->slot(s->rank)->aborted, 1, __ATOMIC_RELEASE);
  s->phase = State::ABORTED;
  s->error = ncclInvalidUsage;
  comms.remove(comm);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  State *s = state_of(comm);
  if (!s) return ncclInvalidArgument;
  *count = s->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  State *s = state_of(comm);
  if (!s) return ncclInvalidArgument;
  *rank = s->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  State *s = state_of(comm);
  if (!s) return ncclInvalidArgument;
  *device = s->device;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  ApiLock lock;
  if (group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth > 0) return ncclSuccess;
  bool in_progress = false;
  ncclResult_t r = ncclSuccess;
  for (auto &g : group_ops) {
    ncclResult_t q = queue_collective(g.first, g.second);
    if (q != ncclSuccess && r == ncclSuccess) r = q;
    if (!g.first->blocking && g.first->rng.below(2)) {
      g.first->settle_polls = 1 + (int)g.first->rng.below(3);
      in_progress = true;
    }
  }
  group_ops.clear();
  if (r != ncclSuccess) return r;
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return submit(comm, Collective{ALL_REDUCE, send, recv, count, type, op, 0, stream});
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  return submit(comm, Collective{REDUCE, send, recv, count, type, op, root, stream});
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return submit(comm, Collective{BROADCAST, send, recv, count, type, ncclSum, root, stream});
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t type, int root, ncclComm_t comm, cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, type, root, comm, stream);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return submit(comm, Collective{ALL_GATHER, send, recv, count, type, ncclSum, 0, stream});
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  return submit(comm, Collective{REDUCE_SCATTER, send, recv, count, type, op, 0, stream});
}

}  // extern "C"
