// hazard.cc: the stand-in's hazard checker between streams, as compute-sanitizer's racecheck
// checks them on a GPU. The stand-in runs queued work only at synchronisation points, in an order
// that is often the safe one, so a missing event between two streams can go unseen; this makes it
// show every time, whatever the order.
//
// - Happens-before comes from the programming model alone: stream order, events recorded and
//   waited for (cudaStreamWaitEvent, the legacy stream's implicit waits, a graph launch after the
//   previous launch of the same graph), and the host's synchronisations (a stream, event or device
//   synchronised or found done by a query, a blocking copy): work queued after one happens after
//   everything it waited for. Each stream keeps a vector clock of what its next op has seen; each op
//   is stamped with its stream, its place on it and that clock when it is queued (a graph node with
//   its launch's stamp, and the graph's own dependencies between its nodes).
// - Every op's accesses are byte ranges of allocations: declared when queued for copies, memsets,
//   cuBLAS, cuDNN and NCCL calls; recorded as a kernel runs, per allocation the span it read and
//   the span it wrote (the kernels are compiled with GCC's -fsanitize=thread instrumentation, whose
//   hooks are defined at the end of this file; no ThreadSanitizer runtime is linked).
// - For each allocation a shadow keeps, per byte range, the last writer and the readers since it
//   (FastTrack's epochs): a write by an op that does not happen after them, or a read that does not
//   happen after the last write, is a hazard. It stops the program naming both operations, their
//   streams and the bytes (GPUSIM_HAZARDS=warn prints each pair once and goes on; off disables).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <unordered_map>

#include "gpusim.h"

namespace gpusim {

bool Clock::join(const Clock &o) {
  bool grew = false;
  if (o.v.size() > v.size()) v.resize(o.v.size(), 0);
  for (size_t i = 0; i < o.v.size(); i++)
    if (o.v[i] > v[i]) v[i] = o.v[i], grew = true;
  return grew;
}

namespace {

// One op's access as the shadow remembers it.
struct Rec {
  uint32_t stream = 0;
  uint64_t epoch = 0;
  uint64_t launch = 0;  // a graph node: its launch (unique), else 0
  uint32_t node = 0;    // and its number in the graph
  uint32_t what = 0;    // the op's description, interned
  bool operator==(const Rec &o) const {
    return stream == o.stream && epoch == o.epoch && launch == o.launch && node == o.node;
  }
};

// The bytes [start, hi) of an allocation: the last write since which the reads happened.
struct Seg {
  uintptr_t hi = 0;
  bool written = false;
  Rec w;
  std::vector<Rec> reads;
  bool same(const Seg &o) const {
    if (written != o.written || (written && !(w == o.w)) || reads.size() != o.reads.size()) return false;
    for (size_t i = 0; i < reads.size(); i++)
      if (!(reads[i] == o.reads[i])) return false;
    return true;
  }
};

// A traced kernel's spans of one allocation: the lowest and highest byte it read and wrote, not
// clipped to the allocation until the kernel ends.
struct Span {
  const Allocation *a;
  uintptr_t base, size;  // the allocation's
  uintptr_t rlo, rhi, wlo, whi;
};

struct Tracker {
  bool ready = false;
  HazardMode mode = HAZARD_ERROR;
  StreamOrder order = ORDER_LAZY;
  uint32_t streams = 0;
  Clock host;
  uint64_t host_version = 1;
  std::vector<std::string> names;
  std::unordered_map<std::string, uint32_t> name_ids;
  std::map<const Allocation *, std::map<uintptr_t, Seg>> shadow;
  std::set<std::pair<uint32_t, uint32_t>> warned;
};

// The index of environment variable var's value among names[0..2], names[0] when it is unset or empty.
static int env_choice(const char *var, const char *const names[3]) {
  const char *v = getenv(var);
  if (!v || !*v) return 0;
  for (int i = 0; i < 3; i++)
    if (!strcmp(v, names[i])) return i;
  fatal("%s=%s: expected %s, %s or %s", var, v, names[0], names[1], names[2]);
}

Tracker &tr() {
  static Tracker *t = new Tracker;  // lives until the process ends
  if (!t->ready) {
    t->ready = true;
    static const char *const modes[3] = {"error", "warn", "off"}, *const orders[3] = {"lazy", "seeded", "eager"};
    static const HazardMode mode_of[3] = {HAZARD_ERROR, HAZARD_WARN, HAZARD_OFF};
    static const StreamOrder order_of[3] = {ORDER_LAZY, ORDER_SEEDED, ORDER_EAGER};
    t->mode = mode_of[env_choice("GPUSIM_HAZARDS", modes)];
    t->order = order_of[env_choice("GPUSIM_STREAM_ORDER", orders)];
    // CUDA_LAUNCH_BLOCKING=1 makes each launch return when its kernel has run: eager, unless the order is set
    const char *blocking = getenv("CUDA_LAUNCH_BLOCKING"), *order = getenv("GPUSIM_STREAM_ORDER");
    if (blocking && !strcmp(blocking, "1") && !(order && *order)) t->order = ORDER_EAGER;
  }
  return *t;
}

// The kernel being traced: set around its run, read by the instrumentation hooks (no lock: they
// run inside the op, which holds the API lock).
bool tracing = false;
bool instrumented = false;  // some object was compiled with the instrumentation (__tsan_init ran)
std::deque<Span> spans;     // a deque: the page cache points into it, and adding moves none
// Which span a device page belongs to (allocations own whole pages): a direct-mapped cache, so that
// a kernel reading several buffers in turn finds each with one comparison. 16384 pages (64 MB): a
// batchnorm kernel walks three activations a channel's stride apart, and 256 pages missed on most
// of its accesses. An entry's key is its page and the kernel's generation, so that a new kernel
// empties the cache by counting up.
struct PageSpan {
  uint64_t key;
  Span *span;
};
constexpr size_t PAGE_CACHE = 16384;
constexpr int PAGE_GEN_SHIFT = 48;  // keys: the page below, the generation above (device pages < 2^48)
PageSpan page_cache[PAGE_CACHE];
uint64_t page_gen = 1;  // 0 is the empty entries'

void empty_page_cache() {
  if (++page_gen >> (64 - PAGE_GEN_SHIFT)) {  // wrapped: entries of generation 1 could match again
    memset(page_cache, 0, sizeof page_cache);
    page_gen = 1;
  }
}

inline uint64_t page_key(uintptr_t x) {
  return (uint64_t)(x >> 12) | page_gen << PAGE_GEN_SHIFT;
}
uintptr_t region_lo = 1, region_hi = 0;  // the device address range: anything else is not recorded
// the executor's dynamic shared memory area, and the running launch's part of it
uintptr_t dyn_area_lo = 0, dyn_area_hi = 0, dyn_lo = 0, dyn_hi = 0;

uint32_t intern(const std::string &s) {
  Tracker &t = tr();
  auto it = t.name_ids.find(s);
  if (it != t.name_ids.end()) return it->second;
  t.names.push_back(s);
  return t.name_ids[s] = (uint32_t)(t.names.size() - 1);
}

bool happens_before(const Rec &r, const Stamp &st, const LaunchCtx *g) {
  if (r.launch && g && r.launch == g->launch) {  // two nodes of one graph launch: the graph's edges
    if (r.node == g->node) return true;
    const std::vector<uint64_t> &bits = (*g->reach)[g->node];
    return (bits[r.node / 64] >> (r.node % 64)) & 1;
  }
  if (r.stream == st.stream) return true;  // run earlier on the same stream
  return st.seen && st.seen->at(r.stream) >= r.epoch;
}

std::string describe(const Rec &r) {
  char buf[96];
  if (r.launch)
    snprintf(buf, sizeof buf, " (node %u of a graph launch, op %llu of stream %u)", r.node + 1,
             (unsigned long long)r.epoch, r.stream);
  else
    snprintf(buf, sizeof buf, " (op %llu of stream %u)", (unsigned long long)r.epoch, r.stream);
  return tr().names[r.what] + buf;
}

void report(const Rec &earlier, bool earlier_wrote, const Rec &now, bool now_writes, const Allocation *a, uintptr_t lo,
            uintptr_t hi) {
  Tracker &t = tr();
  if (t.mode == HAZARD_WARN && !t.warned.insert({earlier.what, now.what}).second) return;
  const char *kind = earlier_wrote ? (now_writes ? "write after write" : "read after write") : "write after read";
  char msg[2048];
  snprintf(msg, sizeof msg,
           "hazard (%s) on bytes [%zu, %zu) of allocation #%llu (%zu bytes on device %d): %s %s them, and %s %s "
           "them, with nothing ordering the two: no event wait, stream order or host synchronisation links them",
           kind, (size_t)(lo - a->base), (size_t)(hi - a->base), (unsigned long long)a->serial, a->size, a->device,
           describe(earlier).c_str(), earlier_wrote ? "wrote" : "read", describe(now).c_str(),
           now_writes ? "writes" : "reads");
  if (t.mode == HAZARD_ERROR) fatal("%s", msg);
  warn("%s", msg);
}

// Splits the segment that holds p strictly inside, so that a segment starts at p.
void split_at(std::map<uintptr_t, Seg> &segs, uintptr_t p) {
  auto it = segs.upper_bound(p);
  if (it == segs.begin()) return;
  --it;
  if (it->first < p && it->second.hi > p) {
    Seg right = it->second;
    it->second.hi = p;
    segs.emplace(p, right);
  }
}

void apply(std::map<uintptr_t, Seg> &segs, const Access &x, const Rec &cur, const Stamp &st, const LaunchCtx *g) {
  split_at(segs, x.lo);
  split_at(segs, x.hi);
  auto it = segs.lower_bound(x.lo);
  uintptr_t at = x.lo;
  while (at < x.hi) {
    if (it == segs.end() || it->first > at) {  // bytes no op touched yet
      Seg fresh;
      fresh.hi = it == segs.end() ? x.hi : std::min(x.hi, it->first);
      it = segs.emplace_hint(it, at, fresh);
    }
    Seg &s = it->second;
    if (x.write)  // the reads since the last write first: the latest access is the one to name
      for (const Rec &r : s.reads)
        if (!happens_before(r, st, g)) {
          report(r, false, cur, true, x.a, at, s.hi);
          break;
        }
    if (s.written && !happens_before(s.w, st, g)) report(s.w, true, cur, x.write, x.a, at, s.hi);
    if (x.write) {
      s.written = true;
      s.w = cur;
      s.reads.clear();
    } else {
      // a read that happens before this one is covered by it: a later write ordered after this
      // read is ordered after that one too
      s.reads.erase(std::remove_if(s.reads.begin(), s.reads.end(),
                                   [&](const Rec &r) { return r == cur || happens_before(r, st, g); }),
                    s.reads.end());
      s.reads.push_back(cur);
    }
    at = s.hi;
    ++it;
  }
  // merge the touched segments with equal neighbours, so that the shadow stays small
  auto m = segs.lower_bound(x.lo);
  if (m != segs.begin()) --m;
  while (m != segs.end() && m->first < x.hi) {
    auto n = std::next(m);
    if (n != segs.end() && n->first == m->second.hi && n->second.same(m->second)) {
      m->second.hi = n->second.hi;
      segs.erase(n);
    } else {
      m = n;
    }
  }
}

// A device access whose page the cache does not hold: finds or adds the span of its allocation.
__attribute__((noinline)) Span *span_of(uintptr_t x) {
  Span *s = nullptr;
  for (size_t i = 0; i < spans.size() && !s; i++)
    if (x - spans[i].base < spans[i].size) s = &spans[i];
  if (!s) {
    const Allocation *a = find_allocation((const void *)x);
    if (!a || !a->live || x >= a->base + a->size) return nullptr;  // a bad access: the fault handler reports it
    spans.push_back(Span{a, a->base, a->size, UINTPTR_MAX, 0, UINTPTR_MAX, 0});
    s = &spans.back();
  }
  page_cache[(x >> 12) % PAGE_CACHE] = PageSpan{page_key(x), s};
  return s;
}

// An access to dynamic shared memory outside the bytes the launch gave (compute-sanitizer's memcheck
// reports it as an invalid __shared__ access; unchecked, a GPU may read another block's data or fault).
[[noreturn]] __attribute__((noinline)) void dynamic_shared_out_of_bounds(uintptr_t x, size_t n, bool write) {
  char here[512] = "";
  describe_running_kernel(here, sizeof here);
  fatal("%s: %s of %zu bytes at byte %lld of dynamic shared memory, outside the %llu bytes its launch gave", here,
        write ? "a write" : "a read", n, (long long)(x - dyn_lo), (unsigned long long)(dyn_hi - dyn_lo));
}

// An access the compiler emitted as aligned (the type's alignment, float4's 16 bytes) at an address that
// is not: a GPU stops the kernel with a misaligned address error; the host would go on.
[[noreturn]] __attribute__((noinline)) void misaligned(const void *p, size_t n, bool write) {
  char here[512] = "";
  describe_running_kernel(here, sizeof here);
  fatal("%s: %s of %zu bytes at %p, which is not %zu-byte aligned: a GPU stops with a misaligned address error", here,
        write ? "a write" : "a read", n, p, n);
}

inline void record(const void *p, size_t n, bool write) {
  uintptr_t x = (uintptr_t)p;
  if (x - region_lo >= region_hi - region_lo) {  // stack, shared memory, host variables
    if (x - dyn_area_lo < dyn_area_hi - dyn_area_lo && (x < dyn_lo || x + n > dyn_hi))
      dynamic_shared_out_of_bounds(x, n, write);
    return;
  }
  const PageSpan &c = page_cache[(x >> 12) % PAGE_CACHE];
  Span *s = c.key == page_key(x) ? c.span : span_of(x);
  if (!s) return;
  if (write) {
    s->wlo = std::min(s->wlo, x);
    s->whi = std::max(s->whi, x + n);
  } else {
    s->rlo = std::min(s->rlo, x);
    s->rhi = std::max(s->rhi, x + n);
  }
}

// An access the compiler emitted as aligned to its size n, recorded once its address is.
inline void record_aligned(const void *p, size_t n, bool write) {
  if ((uintptr_t)p % n) misaligned(p, n, write);
  record(p, n, write);
}

}  // namespace

HazardMode hazard_mode() {
  return tr().mode;
}

StreamOrder stream_order() {
  return tr().order;
}

void hazard_stream_created(Stream *s) {
  Tracker &t = tr();
  s->id = t.streams++;
  s->seen = std::make_shared<Clock>(t.host);
  s->host_seen = t.host_version;
}

// What s's next op has seen must include `at`: copied first when an op holds the current one.
static void join_into(Stream *s, const Clock &at) {
  if (!s->seen) s->seen = std::make_shared<Clock>();
  bool grows = at.v.size() > s->seen->v.size();
  for (size_t i = 0; !grows && i < at.v.size(); i++) grows = at.v[i] > s->seen->v[i];
  if (!grows) return;
  if (s->seen.use_count() > 1) s->seen = std::make_shared<Clock>(*s->seen);
  s->seen->join(at);
}

void hazard_stamp(Stream *s, Op *op) {
  Tracker &t = tr();
  if (s->host_seen != t.host_version) {
    join_into(s, t.host);
    s->host_seen = t.host_version;
  }
  op->stamp.stream = s->id;
  op->stamp.epoch = s->enqueued;
  op->stamp.seen = s->seen;
}

Clock hazard_clock_of(const Stream *s) {
  Clock c;
  if (s->seen) c = *s->seen;
  if (c.v.size() <= s->id) c.v.resize(s->id + 1, 0);
  c.v[s->id] = std::max(c.v[s->id], s->enqueued);
  return c;
}

void hazard_stream_waits(Stream *s, const Clock &at) {
  join_into(s, at);
}

void hazard_host_waits(const Clock &at) {
  Tracker &t = tr();
  if (t.host.join(at)) t.host_version++;
}

void hazard_check(const Op *op, const std::vector<Access> &accesses, const LaunchCtx *g) {
  Tracker &t = tr();
  if (t.mode == HAZARD_OFF || accesses.empty()) return;
  Rec cur;
  cur.stream = op->stamp.stream;
  cur.epoch = op->stamp.epoch;
  cur.launch = g ? g->launch : 0;
  cur.node = g ? (uint32_t)g->node : 0;
  cur.what = intern(op->what);
  for (const Access &x : accesses)
    if (x.a->live && x.lo < x.hi) apply(t.shadow[x.a], x, cur, op->stamp, g);
}

void hazard_kernel_begin() {
  spans.clear();
  empty_page_cache();
  device_region(&region_lo, &region_hi);
  tracing = instrumented && tr().mode != HAZARD_OFF;
}

void hazard_dynamic_shared(const char *area, size_t area_bytes, const char *dyn, size_t bytes) {
  dyn_area_lo = (uintptr_t)area, dyn_area_hi = (uintptr_t)area + area_bytes;
  dyn_lo = (uintptr_t)dyn, dyn_hi = (uintptr_t)dyn + bytes;
}

std::vector<Access> hazard_kernel_end() {
  tracing = false;
  std::vector<Access> out;
  for (const Span &s : spans) {  // clipped to the allocation: a stray access is the guards' business
    const uintptr_t lo = s.a->base, hi = s.a->base + s.a->size;
    if (std::max(s.rlo, lo) < std::min(s.rhi, hi))
      out.push_back(Access{s.a, std::max(s.rlo, lo), std::min(s.rhi, hi), false});
    if (std::max(s.wlo, lo) < std::min(s.whi, hi))
      out.push_back(Access{s.a, std::max(s.wlo, lo), std::min(s.whi, hi), true});
  }
  spans.clear();
  return out;
}

void hazard_forget(const Allocation *a) {
  tr().shadow.erase(a);
}

void declare_access(Op *op, const void *p, size_t bytes, bool write) {
  if (!bytes || !p) return;
  const Allocation *a = find_allocation(p);
  if (!a || !a->live) return;  // the caller has checked the range; host memory is not tracked
  uintptr_t lo = (uintptr_t)p, hi = std::min(lo + bytes, a->base + a->size);
  op->accesses.push_back(Access{a, lo, hi, write});
}

}  // namespace gpusim

// GCC's -fsanitize=thread instrumentation of the kernels (compiled for the stand-in with
// --param tsan-instrument-func-entry-exit=0): each load and store calls one of these first.
// Only accesses to device memory while a kernel runs are recorded.
using gpusim::tracing;

extern "C" {
void __tsan_init(void) {
  gpusim::instrumented = true;
}
// The aligned hooks are the accesses the compiler took to be aligned to their size (the unaligned ones
// it could not): in a kernel, the address must be.
#define GPUSIM_TSAN_HOOKS(n)                          \
  void __tsan_read##n(void *p) {                      \
    if (tracing) gpusim::record_aligned(p, n, false); \
  }                                                   \
  void __tsan_write##n(void *p) {                     \
    if (tracing) gpusim::record_aligned(p, n, true);  \
  }                                                   \
  void __tsan_unaligned_read##n(void *p) {            \
    if (tracing) gpusim::record(p, n, false);         \
  }                                                   \
  void __tsan_unaligned_write##n(void *p) {           \
    if (tracing) gpusim::record(p, n, true);          \
  }                                                   \
  void __tsan_volatile_read##n(void *p) {             \
    if (tracing) gpusim::record(p, n, false);         \
  }                                                   \
  void __tsan_volatile_write##n(void *p) {            \
    if (tracing) gpusim::record(p, n, true);          \
  }
GPUSIM_TSAN_HOOKS(1)
GPUSIM_TSAN_HOOKS(2)
GPUSIM_TSAN_HOOKS(4)
GPUSIM_TSAN_HOOKS(8)
GPUSIM_TSAN_HOOKS(16)
#undef GPUSIM_TSAN_HOOKS
void __tsan_read_range(void *p, unsigned long n) {
  if (tracing) gpusim::record(p, n, false);
}
void __tsan_write_range(void *p, unsigned long n) {
  if (tracing) gpusim::record(p, n, true);
}
void __tsan_func_entry(void *) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void **, void *) {}
void __tsan_vptr_read(void **) {}
}

// For the stand-in's own tests: whether kernels record their accesses (built with the
// instrumentation: not in the sanitizer builds, where ASan excludes it).
extern "C" int gpusim_kernels_traced(void) {
  return gpusim::instrumented;
}

extern "C" void gpusim_check_aligned(const void *p, size_t n) {
  if ((uintptr_t)p % n) gpusim::misaligned(p, n, false);
}

// For the stand-in's own tests: sets the hazard mode (0 off, 1 warn, 2 error); returns the last.
extern "C" int gpusim_set_hazards(int mode) {
  gpusim::ApiLock lock;
  gpusim::Tracker &t = gpusim::tr();
  int old = (int)t.mode;
  t.mode = (gpusim::HazardMode)mode;
  return old;
}
