// exec.cc: kernel launches on the stand-in. Each CUDA thread is a fiber (its own small stack);
// a block's scheduler starts threads in a seeded random order and runs each until it finishes
// or waits at a barrier (__syncthreads, a warp intrinsic). A barrier completes when every
// thread it names has arrived; waiting threads then resume, again in a random order. Blocks run
// one after another, in a seeded random order. So a missing barrier or an order-dependent
// result shows as a difference between two GPUSIM_SEED values, and a barrier that not every
// thread reaches is reported instead of hanging.
//
// Threads that never wait cost no fiber of their own: a runner fiber starts the next thread as
// soon as the previous one returns, and only a thread that parks at a barrier keeps its fiber.
#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <map>
#include <memory>

#include "gpusim.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define GPUSIM_ASAN 1
#endif

gpusim_builtins gpusim_now;

namespace gpusim {
namespace {

// ---- fibers ----------------------------------------------------------------------------------
struct Ctx {
  void *sp = nullptr;
  const void *stack_lo = nullptr;  // for AddressSanitizer's fiber switches
  size_t stack_size = 0;
  void *fake_stack = nullptr;
};

extern "C" void gpusim_fiber_switch(void **save_sp, void *new_sp);
extern "C" void gpusim_fiber_entry();

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save_sp and
// continues on new_sp. (The SSE and x87 control words are not switched: nothing here changes
// them.) A new fiber's stack is prepared so that the first switch "returns" into
// gpusim_fiber_entry, which calls r12(r13).
asm(R"(
  .text
  .globl gpusim_fiber_switch
  .type gpusim_fiber_switch,@function
gpusim_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size gpusim_fiber_switch, .-gpusim_fiber_switch
  .globl gpusim_fiber_entry
  .type gpusim_fiber_entry,@function
gpusim_fiber_entry:
  movq %r13, %rdi
  callq *%r12
  ud2
  .size gpusim_fiber_entry, .-gpusim_fiber_entry
)");
#else
#error "the GPU stand-in's fibers are written for x86-64"
#endif

const size_t kFiberStack =
#ifdef GPUSIM_ASAN
    1 << 20;
#else
    256 << 10;
#endif

struct Fiber {
  Ctx ctx;
  char *map = nullptr;  // guard page + stack
  size_t map_size = 0;
  bool idle = true;
};

void switch_to(Ctx *from, Ctx *to) {
#ifdef GPUSIM_ASAN
  __sanitizer_start_switch_fiber(&from->fake_stack, to->stack_lo, to->stack_size);
#endif
  gpusim_fiber_switch(&from->sp, to->sp);
#ifdef GPUSIM_ASAN
  const void *lo;
  size_t size;
  __sanitizer_finish_switch_fiber(from->fake_stack, &lo, &size);
#endif
}

// ---- blocks ----------------------------------------------------------------------------------
enum State { UNSTARTED, RUNNING, AT_BARRIER, AT_WARP, DONE };

struct SimThread {
  uint3 idx;
  int state;
  Fiber *fiber;
  // a pending warp operation
  int kind;
  unsigned mask;
  uint64_t value, result;
  int size, arg, width;
  // a pending __syncthreads_count/and/or
  int vote, pred;
};

struct Block {
  const gpusim_launch_desc *d = nullptr;
  void *task = nullptr;
  uint3 idx;
  int n = 0;  // threads
  SimThread th[1024];
  int next = 0;    // threads started so far
  int cursor = 0;  // the last thread started: threads start in the order c, c+a, c+2a, ... (mod n)
  int stride = 1;  // a, coprime to n
  int done = 0, at_barrier = 0, at_warp = 0;
  unsigned warp_dirty = 0;    // warps where a lane parked or exited since the last look
  unsigned warp_arrived[32];  // per warp: lanes waiting in a warp operation
  unsigned warp_done[32];     // per warp: lanes that have exited
  SimThread *running = nullptr;
  Fiber *fiber = nullptr;  // the fiber running now
  Ctx sched;
  Rng rng{0};
  char *dyn = nullptr;
};

struct Profile {
  uint64_t launches = 0, threads = 0;
  double seconds = 0;
};

struct Executor {
  Block block;
  std::map<std::string, Profile> profile;  // GPUSIM_PROFILE: per kernel
  bool active = false;
  std::vector<Fiber *> fibers;
  std::vector<Fiber *> idle;
  char *shared_lo = nullptr, *shared_hi = nullptr;
  std::vector<char> dyn;
  std::map<const void *, int> max_dynamic;  // cudaFuncAttributeMaxDynamicSharedMemorySize
};

// The one executor of this process (work runs under the API lock); lives until the process ends.
Executor *const the_executor = new Executor;
inline Executor &ex() {
  return *the_executor;
}

void runner_main(void *arg);

Fiber *new_fiber() {
  Fiber *f = new Fiber;
  long page = sysconf(_SC_PAGESIZE);
  f->map_size = kFiberStack + (size_t)page;
  void *m = mmap(nullptr, f->map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) fatal("cannot map a %zu-byte thread stack: %s", f->map_size, strerror(errno));
  f->map = (char *)m;
  if (mprotect(f->map, (size_t)page, PROT_NONE)) fatal("mprotect of a stack guard failed: %s", strerror(errno));
  // stack tops at different offsets within a page, or every fiber's hot frames would compete for
  // the same cache sets
  size_t colour = (ex().fibers.size() * 17 % 61) * 64;
  char *top = f->map + f->map_size - colour;  // 16-byte aligned
  uint64_t *sp = (uint64_t *)top;
  // see gpusim_fiber_switch: r15 r14 r13 r12 rbx rbp ret; after the pops and the ret the stack
  // pointer is top, 16-byte aligned as a call needs
  *--sp = (uint64_t)(uintptr_t)&gpusim_fiber_entry;
  *--sp = 0;                                  // rbp
  *--sp = 0;                                  // rbx
  *--sp = (uint64_t)(uintptr_t)&runner_main;  // r12
  *--sp = (uint64_t)(uintptr_t)f;             // r13
  *--sp = 0;                                  // r14
  *--sp = 0;                                  // r15
  f->ctx.sp = sp;
  f->ctx.stack_lo = f->map + page;
  f->ctx.stack_size = kFiberStack - colour;
  ex().fibers.push_back(f);
  return f;
}

Fiber *take_fiber() {
  Executor &e = ex();
  if (e.idle.empty()) return new_fiber();
  Fiber *f = e.idle.back();
  e.idle.pop_back();
  return f;
}

void set_now(Block *b, SimThread *t) {
  b->running = t;
  gpusim_now.thread_idx = t->idx;
}

int warp_of(const Block *b, const SimThread *t) {
  return (int)((t - b->th) >> 5);
}

// Runs unstarted threads one after another until none is left, then idles; a thread that parks
// takes this fiber with it and the scheduler starts another runner.
void runner_main(void *arg) {
  Fiber *f = static_cast<Fiber *>(arg);
#ifdef GPUSIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &ex().block.sched.stack_lo, &ex().block.sched.stack_size);
#endif
  for (;;) {
    Block *b = &ex().block;
    while (b->next < b->n) {
      b->next++;
      b->cursor += b->stride;
      if (b->cursor >= b->n) b->cursor -= b->n;
      int i = b->cursor;
      SimThread *t = &b->th[i];
      const dim3 &bd = b->d->block;
      b->running = t;
      b->fiber = f;
      gpusim_now.thread_idx = bd.y == 1 && bd.z == 1 ? uint3{(unsigned)i, 0, 0}
                                                     : uint3{(unsigned)(i % bd.x), (unsigned)(i / bd.x % bd.y),
                                                             (unsigned)(i / (bd.x * bd.y))};
      b->d->run_thread(b->task);
      t->state = DONE;
      b->done++;
      b->warp_done[i >> 5] |= 1u << (i & 31);
      if (b->at_warp) b->warp_dirty |= 1u << (i >> 5);  // a lane that exits no longer holds its warp back
      b->running = nullptr;
    }
    f->idle = true;
    ex().idle.push_back(f);
    switch_to(&f->ctx, &b->sched);
  }
}

// The running thread waits: back to the scheduler until released. It keeps its fiber.
void park(Block *b, SimThread *t) {
  Fiber *f = b->fiber;
  t->fiber = f;
  t->idx = gpusim_now.thread_idx;
  b->running = nullptr;
  switch_to(&f->ctx, &b->sched);
  // resumed by the scheduler, which has set gpusim_now
}

void resume(Block *b, SimThread *t) {
  t->state = RUNNING;
  set_now(b, t);
  b->fiber = t->fiber;
  switch_to(&b->sched, &t->fiber->ctx);
}

const char *op_name(int kind) {
  switch (kind) {
    case GPUSIM_WARP_SYNC: return "__syncwarp";
    case GPUSIM_SHFL_IDX: return "__shfl_sync";
    case GPUSIM_SHFL_UP: return "__shfl_up_sync";
    case GPUSIM_SHFL_DOWN: return "__shfl_down_sync";
    case GPUSIM_SHFL_XOR: return "__shfl_xor_sync";
    case GPUSIM_VOTE_ALL: return "__all_sync";
    case GPUSIM_VOTE_ANY: return "__any_sync";
    case GPUSIM_VOTE_BALLOT: return "__ballot_sync";
  }
  return "?";
}

std::string where(const Block *b) {
  char buf[256];
  snprintf(buf, sizeof buf, "kernel %s (launched at %s:%d) block (%u,%u,%u)", b->d->name, b->d->file, b->d->line,
           b->idx.x, b->idx.y, b->idx.z);
  return buf;
}

// A warp's lanes that wait with `mask` are released when every lane the mask names that exists
// and has not exited has arrived with the same mask. Returns that group's lane bits, or 0.
unsigned warp_group_ready(Block *b, int w, unsigned *group_mask) {
  int base = w * 32;
  int lanes = b->n - base < 32 ? b->n - base : 32;
  unsigned exist = lanes >= 32 ? ~0u : (1u << lanes) - 1u, arrived = b->warp_arrived[w];
  for (unsigned todo = arrived; todo;) {
    int l = __builtin_ctz(todo);
    SimThread *t = &b->th[base + l];
    unsigned mask = t->mask, group = arrived & mask;
    if (!(mask >> l & 1))
      fatal("%s: lane %d of warp %d called %s with mask 0x%08x, which does not name the lane itself", where(b).c_str(),
            l, w, op_name(t->kind), mask);
    todo &= ~group;                                       // lanes with another mask form another group
    unsigned required = mask & exist & ~b->warp_done[w];  // lanes that exist and have not exited
    if (required & ~arrived) continue;                    // someone named has not arrived yet
    for (unsigned g = group; g; g &= g - 1) {
      int k = __builtin_ctz(g);
      SimThread *o = &b->th[base + k];
      if (o->mask != mask)
        fatal(
            "%s: lanes %d and %d of warp %d wait in %s with masks 0x%08x and 0x%08x: every lane a mask names "
            "must make the same call with the same mask",
            where(b).c_str(), l, k, w, op_name(t->kind), mask, o->mask);
      if (o->kind != t->kind)
        fatal("%s: warp %d: lane %d called %s and lane %d called %s with the same mask 0x%08x", where(b).c_str(), w, l,
              op_name(t->kind), k, op_name(o->kind), mask);
    }
    *group_mask = mask;
    return group;
  }
  return 0;
}

uint64_t poison_bits(int size) {
  return size >= 8 ? ~0ull : (1ull << (8 * size)) - 1;  // NaN for floats and doubles
}

void release_warp(Block *b, int w, unsigned group) {
  int base = w * 32;
  SimThread *first = nullptr;
  for (int k = 0; k < 32; k++)
    if (group >> k & 1) {
      first = &b->th[base + k];
      break;
    }
  int kind = first->kind;
  int width = first->width;
  if (kind >= GPUSIM_SHFL_IDX && kind <= GPUSIM_SHFL_XOR && (width < 1 || width > 32 || (width & (width - 1))))
    fatal("%s: %s with width %d: the width must be a power of two from 1 to 32", where(b).c_str(), op_name(kind),
          width);
  uint64_t ballot = 0;
  bool all = true, any = false;
  for (int k = 0; k < 32; k++)
    if (group >> k & 1) {
      bool p = b->th[base + k].value != 0;
      ballot |= (uint64_t)p << k;
      all = all && p;
      any = any || p;
    }
  for (int k = 0; k < 32; k++) {
    if (!(group >> k & 1)) continue;
    SimThread *t = &b->th[base + k];
    int seg = k & ~(width - 1), src = -1;
    switch (kind) {
      case GPUSIM_SHFL_IDX: src = seg + (t->arg & (width - 1)); break;
      case GPUSIM_SHFL_UP: src = (k - seg) >= t->arg ? k - t->arg : k; break;
      case GPUSIM_SHFL_DOWN: src = (k - seg) + t->arg < width ? k + t->arg : k; break;
      case GPUSIM_SHFL_XOR: {
        int x = k ^ t->arg;
        src = (x & ~(width - 1)) == seg ? x : k;  // outside the segment: its own value
        break;
      }
      case GPUSIM_VOTE_ALL: t->result = all; break;
      case GPUSIM_VOTE_ANY: t->result = any; break;
      case GPUSIM_VOTE_BALLOT: t->result = ballot; break;
      default: t->result = 0;
    }
    if (src >= 0) {
      // reading a lane that does not take part gives an undefined value: poison it
      bool takes_part = src < 32 && (group >> src & 1);
      t->result = takes_part ? b->th[base + src].value : poison_bits(t->size);
    }
  }
  // resume the group in a random order
  int lanes[32], m = 0;
  for (int k = 0; k < 32; k++)
    if (group >> k & 1) lanes[m++] = k;
  for (int i = m - 1; i > 0; i--) {
    int j = (int)b->rng.below((uint32_t)i + 1), tmp = lanes[i];
    lanes[i] = lanes[j];
    lanes[j] = tmp;
  }
  b->at_warp -= m;
  b->warp_arrived[w] &= ~group;
  for (int i = 0; i < m; i++) b->th[base + lanes[i]].state = RUNNING;
  for (int i = 0; i < m; i++) resume(b, &b->th[base + lanes[i]]);
}

void release_barrier(Block *b) {
  int count = 0, all = 1, any = 0, vote = -1;
  int ids[1024], m = 0;
  for (int i = 0; i < b->n; i++) {
    SimThread *t = &b->th[i];
    if (t->state != AT_BARRIER) continue;
    ids[m++] = i;
    if (t->vote >= 0) vote = t->vote;
    count += t->pred != 0;
    all = all && t->pred;
    any = any || t->pred;
  }
  for (int i = m - 1; i > 0; i--) {
    int j = (int)b->rng.below((uint32_t)i + 1), tmp = ids[i];
    ids[i] = ids[j];
    ids[j] = tmp;
  }
  for (int i = 0; i < m; i++) {
    SimThread *t = &b->th[ids[i]];
    t->pred = vote == 0 ? count : vote == 1 ? all : any;
  }
  b->at_barrier = 0;
  for (int i = 0; i < m; i++) b->th[ids[i]].state = RUNNING;
  for (int i = 0; i < m; i++) resume(b, &b->th[ids[i]]);
}

[[noreturn]] void deadlock(Block *b) {
  char msg[2048];
  size_t len = (size_t)snprintf(msg, sizeof msg, "%s cannot continue: %d of %d threads have exited", where(b).c_str(),
                                b->done, b->n);
  if (b->at_barrier) len += (size_t)snprintf(msg + len, sizeof msg - len, ", %d wait at __syncthreads", b->at_barrier);
  for (int w = 0; w * 32 < b->n && len < sizeof msg - 200; w++) {
    for (int l = 0; l < 32 && w * 32 + l < b->n; l++) {
      SimThread *t = &b->th[w * 32 + l];
      if (t->state != AT_WARP) continue;
      len += (size_t)snprintf(msg + len, sizeof msg - len, "; warp %d lane %d waits in %s(mask 0x%08x)", w, l,
                              op_name(t->kind), t->mask);
      break;
    }
  }
  if (b->at_barrier && b->done)
    snprintf(msg + len, sizeof msg - len,
             ". A __syncthreads that some threads of the block skip (they returned early or took another branch) "
             "is undefined behaviour in CUDA");
  else
    snprintf(msg + len, sizeof msg - len, ". A barrier waits for threads that will never reach it");
  fatal("%s", msg);
}

void run_block(Block *b) {
  Executor &e = ex();
  b->next = b->done = b->at_barrier = b->at_warp = 0;
  b->warp_dirty = 0;
  for (int i = 0; i < b->n; i++) {
    b->th[i].state = UNSTARTED;
    b->th[i].vote = -1;
  }
  memset(b->warp_arrived, 0, sizeof b->warp_arrived);
  memset(b->warp_done, 0, sizeof b->warp_done);
  b->cursor = (int)b->rng.below((uint32_t)b->n);  // where this block's walk starts
  // shared memory starts out as garbage on a GPU: make reads before writes visible
  if (e.shared_hi > e.shared_lo) memset(e.shared_lo, 0xff, (size_t)(e.shared_hi - e.shared_lo));
  if (b->d->smem) memset(b->dyn, 0xff, b->d->smem);
  gpusim_now.block_idx = b->idx;
  unsigned ready = 0;  // warps with a group ready to release
  unsigned group[32], group_mask;
  for (;;) {
    // rescan only the warps where a lane parked or exited since the last look
    for (unsigned dirty = b->warp_dirty; dirty; dirty &= dirty - 1) {
      int w = __builtin_ctz(dirty);
      group[w] = b->at_warp ? warp_group_ready(b, w, &group_mask) : 0;
      ready = group[w] ? ready | 1u << w : ready & ~(1u << w);
    }
    b->warp_dirty = 0;
    // what could happen next: start a thread, release a warp group, release the block barrier
    enum { START, WARP, BARRIER };
    int kinds[34], warps[34];
    int n = 0;
    if (b->next < b->n) kinds[n] = START, n++;
    for (unsigned r = ready; r; r &= r - 1) kinds[n] = WARP, warps[n] = __builtin_ctz(r), n++;
    if (b->next == b->n && b->at_barrier && b->at_barrier + b->done == b->n && b->done == 0) kinds[n] = BARRIER, n++;
    if (n == 0) {
      if (b->done == b->n) return;
      deadlock(b);
    }
    int pick = n == 1 ? 0 : (int)b->rng.below((uint32_t)n);
    switch (kinds[pick]) {
      case START: {
        Fiber *f = take_fiber();
        f->idle = false;
        switch_to(&b->sched, &f->ctx);
        break;
      }
      case WARP: {
        int w = warps[pick];
        ready &= ~(1u << w);
        b->warp_dirty |= 1u << w;  // the rest of the warp may hold another group
        release_warp(b, w, group[w]);
        break;
      }
      case BARRIER: release_barrier(b); break;
    }
  }
}

SimThread *current_thread(const char *what) {
  Executor &e = ex();
  if (!e.active || !e.block.running) fatal("%s called outside a kernel (device code must run through a launch)", what);
  return e.block.running;
}

// Size of a launch's grid, and the x, y, z of block number i.
uint64_t grid_size(const dim3 &g) {
  return (uint64_t)g.x * g.y * g.z;
}

struct KernelOp : Op {
  gpusim_launch_desc d;
  void *task;
  KernelOp(const gpusim_launch_desc &desc, void *t) : d(desc), task(t) { traced = true; }
  ~KernelOp() override { d.destroy(task); }
  bool run() override {
    run_kernel(&d, task);
    return true;
  }
};

}  // namespace

void register_static_shared(char *lo, char *hi) {
  Executor &e = ex();
  if (!lo || !hi || hi <= lo) return;
  e.shared_lo = lo;
  e.shared_hi = hi;
}

size_t static_shared_bytes() {
  return (size_t)(ex().shared_hi - ex().shared_lo);
}

int max_dynamic_shared(const void *fn) {
  auto it = ex().max_dynamic.find(fn);
  return it == ex().max_dynamic.end() ? 48 << 10 : it->second;
}

void set_max_dynamic_shared(const void *fn, int bytes) {
  ex().max_dynamic[fn] = bytes;
}

namespace {

double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void print_profile() {
  Executor &e = ex();
  fprintf(stderr, "gpusim profile (pid %d): kernel, launches, threads, seconds, ns per thread\n", (int)getpid());
  for (auto &kv : e.profile)
    fprintf(stderr, "  %-28s %8llu %12llu %8.3f %6.1f\n", kv.first.c_str(), (unsigned long long)kv.second.launches,
            (unsigned long long)kv.second.threads, kv.second.seconds,
            kv.second.threads ? 1e9 * kv.second.seconds / (double)kv.second.threads : 0.0);
}

}  // namespace

void run_kernel(const gpusim_launch_desc *d, void *task) {
  if (kernel_faults(d->name)) return;
  Executor &e = ex();
  static bool profiling = getenv("GPUSIM_PROFILE") && atexit(print_profile) == 0;
  double t0 = profiling ? now_s() : 0;
  Block *b = &e.block;
  b->d = d;
  b->task = task;
  b->n = (int)(d->block.x * d->block.y * d->block.z);
  b->rng = Rng(next_seed());
  // the area has room for the most any launch may have (227 KiB), so that a traced access past this
  // launch's bytes lands in it and is reported (hazard_dynamic_shared)
  if (e.dyn.empty()) e.dyn.resize((227u << 10) + 80);
  // 16 bytes past a 64-byte boundary: the alignment of the element type, no more, is what a kernel may
  // count on (one that wants more rounds its pointer up)
  b->dyn = reinterpret_cast<char *>(((uintptr_t)e.dyn.data() + 63) / 64 * 64 + 16);
  hazard_dynamic_shared(e.dyn.data(), e.dyn.size(), b->dyn, d->smem);
  gpusim_now.block_dim = d->block;
  gpusim_now.grid_dim = d->grid;
  e.active = true;
  // threads start in a seeded order: an affine walk i -> i + a (mod n), a coprime to n
  b->stride = 1;
  if (b->n > 2)
    for (int tries = 0; tries < 16; tries++) {
      int a = 1 + (int)b->rng.below((uint32_t)b->n - 1), x = a, y = b->n;
      while (y) {
        int r = x % y;
        x = y;
        y = r;
      }
      if (x == 1) {
        b->stride = a;
        break;
      }
    }
  // blocks run one after another from a seeded starting block, forwards or backwards: the order
  // of any two neighbours varies with the seed, and memory is still walked in streams (a shuffled
  // order defeats the CPU's prefetchers and costs several times the time)
  uint64_t G = grid_size(d->grid), start = G > 1 ? b->rng.next() % G : 0;
  bool backwards = b->rng.next() & 1;
  for (uint64_t i = 0; i < G; i++) {
    uint64_t k = (start + (backwards ? G - i : i)) % G;
    b->idx = uint3{(unsigned)(k % d->grid.x), (unsigned)(k / d->grid.x % d->grid.y),
                   (unsigned)(k / ((uint64_t)d->grid.x * d->grid.y))};
    run_block(b);
  }
  e.active = false;
  if (profiling) {
    Profile &p = e.profile[d->name];
    p.launches++;
    p.threads += G * (uint64_t)b->n;
    p.seconds += now_s() - t0;
  }
}

bool describe_running_kernel(char *buf, size_t cap) {
  Executor &e = ex();
  if (!e.active) return false;
  const Block *b = &e.block;
  if (b->running)
    snprintf(buf, cap, "%s thread (%u,%u,%u)", where(b).c_str(), b->running->idx.x, b->running->idx.y,
             b->running->idx.z);
  else
    snprintf(buf, cap, "%s", where(b).c_str());
  return true;
}

}  // namespace gpusim

using namespace gpusim;

extern "C" void gpusim_register_static_shared(char *lo, char *hi) {
  register_static_shared(lo, hi);
}

extern "C" void gpusim_syncthreads(void) {
  gpusim_syncthreads_vote(-1, 0);
}

extern "C" int gpusim_syncthreads_vote(int kind, int pred) {
  SimThread *t = current_thread("__syncthreads");
  Block *b = &ex().block;
  t->state = AT_BARRIER;
  t->vote = kind;
  t->pred = pred;
  b->at_barrier++;
  b->warp_dirty |= 1u << warp_of(b, t);
  park(b, t);
  int r = t->pred;
  t->vote = -1;
  return r;
}

extern "C" uint64_t gpusim_warp_op(int kind, unsigned mask, uint64_t value, int size, int arg, int width) {
  SimThread *t = current_thread(op_name(kind));
  Block *b = &ex().block;
  t->state = AT_WARP;
  t->kind = kind;
  t->mask = mask;
  t->value = value;
  t->size = size;
  t->arg = arg;
  t->width = width;
  b->at_warp++;
  int w = warp_of(b, t);
  b->warp_arrived[w] |= 1u << ((t - b->th) & 31);
  b->warp_dirty |= 1u << w;
  park(b, t);
  return t->result;
}

extern "C" void gpusim_check_atomic(const void *p, size_t bytes, const char *what) {
  Executor &e = ex();
  const char *c = static_cast<const char *>(p);
  bool shared = (c >= e.shared_lo && c + bytes <= e.shared_hi) ||
                (e.block.d && c >= e.block.dyn && c + bytes <= e.block.dyn + e.block.d->smem);
  if (!shared && !device_range(p, bytes)) {
    char here[512] = "";
    describe_running_kernel(here, sizeof here);
    fatal("%s: %s on %p, which is neither device nor shared memory (%s)", here, what, p, describe_address(p).c_str());
  }
}

extern "C" void gpusim_kernel_error(const char *what) {
  char here[512] = "";
  describe_running_kernel(here, sizeof here);
  fatal("%s: %s", here, what);
}

extern "C" void *gpusim_dynamic_shared(void) {
  current_thread("dynamic shared memory");
  return ex().block.dyn;
}

extern "C" void gpusim_launch(const gpusim_launch_desc *d, void *task) {
  ApiLock lock;
  std::unique_ptr<KernelOp> op(new KernelOp(*d, task));
  Stream *s = stream_of(d->stream);
  if (!s) {
    set_error(cudaErrorInvalidResourceHandle);
    return;
  }
  const dim3 &g = d->grid, &bk = d->block;
  if (bk.x < 1 || bk.y < 1 || bk.z < 1 || bk.x > 1024 || bk.y > 1024 || bk.z > 64 ||
      (uint64_t)bk.x * bk.y * bk.z > 1024 || g.x < 1 || g.y < 1 || g.z < 1 || g.x > 0x7fffffffu || g.y > 65535 ||
      g.z > 65535) {
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (static_shared_bytes() > (48u << 10))
    fatal("the kernels' static __shared__ memory totals %zu bytes, over the 48 KiB a block may declare statically",
          static_shared_bytes());
  if (d->smem > (size_t)max_dynamic_shared(d->fn) || d->smem + static_shared_bytes() > (227u << 10)) {
    set_error(cudaErrorInvalidValue);
    return;
  }
  int dev = s->dev->index;
  for (int i = 0; i < d->n_args; i++) {
    if (!d->is_pointer[i] || !d->pointer[i]) continue;
    const Allocation *a = find_allocation(d->pointer[i]);
    if (!a || !a->live || a->device != dev)
      fatal(
          "kernel %s (launched at %s:%d): argument %d is %p, %s; every pointer a kernel receives must be device "
          "memory of device %d or null",
          d->name, d->file, d->line, i + 1, d->pointer[i], describe_address(d->pointer[i]).c_str(), dev);
    op->uses.push_back(a);
  }
  char what[256];
  const char *base = strrchr(d->file, '/');
  snprintf(what, sizeof what, "kernel %s (%s:%d)", d->name, base ? base + 1 : d->file, d->line);
  op->what = what;
  if (cudaError_t e = enqueue(s, std::move(op))) set_error(e);  // a capture refused it
}
