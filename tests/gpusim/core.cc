// core.cc: the stand-in's configuration, its errors, devices and contexts, and device memory.
//
// Device memory: one large address range is reserved at start (no access). Each allocation takes
// fresh pages in it, with an inaccessible guard page on both sides; the returned pointer is placed
// so that the allocation ends less than 256 bytes before its last page ends, and the slack on
// both sides is filled with guard bytes checked after every op that used the allocation. The
// pages are readable and writable only while queued work executes; at any other moment a host
// access faults and the handler below names the allocation. Freed pages are released and never
// handed out again, so a late use faults too.
#include <cblas.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <mutex>

#include "gpusim.h"

namespace gpusim {
namespace {

const uint8_t kGuardByte = 0xa5;
const size_t kRegionBytes = (size_t)1 << 40;     // address space for every device's allocations
const size_t kContextBytes = (size_t)500 << 20;  // what a primary context takes, as nvidia-smi shows it

struct Core {
  std::recursive_mutex lock;
  Config cfg;
  bool ready = false;
  long page = 4096;
  // device memory
  uintptr_t region_lo = 0, region_hi = 0, next = 0;
  std::map<uintptr_t, Allocation *> by_lo;  // every allocation ever made, by its first page
  uint64_t serial = 0;
  int open_depth = 0;
  std::vector<Allocation *> opened;  // made accessible in the current execution window
  // devices
  std::vector<Device> devices;
  int context_device = -1;             // the device this process made its first context on
  std::map<uintptr_t, size_t> pinned;  // cudaMallocHost blocks
  uint64_t seeds = 0;
  uint64_t fault_launches = 0;       // launches so far of GPUSIM_KERNEL_FAULT's kernel
  cudaError_t sticky = cudaSuccess;  // the context's sticky error after a device fault
  struct sigaction previous_segv, previous_bus;
};

// The process's one stand-in, like a GPU driver: it lives until the process ends (never
// destroyed, so what it points to stays reachable for LeakSanitizer's check at exit).
Core &core() {
  static Core *c = new Core;
  return *c;
}

thread_local int current_index_of_thread = 0;

size_t env_size(const char *name, size_t dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  unsigned long long x = strtoull(v, &end, 10);
  if (*end) fatal("%s=%s: expected a non-negative integer", name, v);
  return (size_t)x;
}

void on_fault(int sig, siginfo_t *info, void *uctx);

// GPUSIM_MEMORY_REPORT=FILE: at exit, a line per device this process made a context on, appended
// to FILE in one write (ranks may share it): "rank R pid P device D peak BYTES used BYTES context
// BYTES", the most bytes in use at once (the context's and the live allocations', at cudaMalloc's
// requested sizes), what is still in use, and the context's part of both.
void report_memory() {
  Core &c = core();
  std::lock_guard<std::recursive_mutex> guard(c.lock);
  const char *path = getenv("GPUSIM_MEMORY_REPORT");
  FILE *f = path && *path ? fopen(path, "a") : nullptr;
  if (!f) {
    fprintf(stderr, "gpusim: GPUSIM_MEMORY_REPORT=%s: cannot append: %s\n", path ? path : "", strerror(errno));
    return;
  }
  setvbuf(f, nullptr, _IOFBF, 1 << 16);  // every line in one write at fclose
  for (const Device &d : c.devices)
    if (d.context)
      fprintf(f, "rank %d pid %d device %d peak %zu used %zu context %zu\n", c.cfg.rank, (int)getpid(), d.index, d.peak,
              d.used, kContextBytes);
  if (fclose(f)) fprintf(stderr, "gpusim: GPUSIM_MEMORY_REPORT=%s: %s\n", path, strerror(errno));
}

// GPUSIM_LEAK_CHECK=1: at exit, each cudaMalloc allocation never freed is reported, and the process
// exits 1, as compute-sanitizer --leak-check full reports them on a GPU (it found a test's leak there).
void check_leaks() {
  Core &c = core();
  std::lock_guard<std::recursive_mutex> guard(c.lock);
  size_t n = 0, bytes = 0;
  for (const auto &[lo, a] : c.by_lo)
    if (a->live) {
      fprintf(stderr, "gpusim: leak: allocation #%llu (%zu bytes on device %d) never freed\n",
              (unsigned long long)a->serial, a->size, a->device);
      n++, bytes += a->size;
    }
  if (!n) return;
  fprintf(stderr, "gpusim: LEAK SUMMARY: %zu bytes leaked in %zu allocations\n", bytes, n);
  fflush(nullptr);
  _exit(1);
}

void install_handler() {
  Core &c = core();
  // a handler stack, so that a fault on a small thread stack can still be reported
  static char alt[1 << 16];
  stack_t ss;
  memset(&ss, 0, sizeof ss);
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  sigaltstack(&ss, nullptr);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &c.previous_segv);
  sigaction(SIGBUS, &sa, &c.previous_bus);
}

// GPUSIM_KERNEL_FAULT=NAME[:N][@RANK] into cfg (empty: no fault).
void parse_kernel_fault(Config &cfg, const char *kf) {
  if (!*kf) return;
  size_t name = strcspn(kf, ":@");
  const char *p = kf + name;
  char *end = nullptr;
  bool ok = name > 0 && name < sizeof cfg.kernel_fault;
  if (ok && *p == ':') {
    unsigned long long n = strtoull(p + 1, &end, 10);
    ok = end != p + 1 && n >= 1 && p[1] != '-';
    cfg.kernel_fault_launch = n, p = end;
  }
  if (ok && *p == '@') {
    long r = strtol(p + 1, &end, 10);
    ok = end != p + 1 && r >= 0 && r < 1 << 20;
    cfg.kernel_fault_rank = (int)r, p = end;
  }
  if (!ok || *p) fatal("GPUSIM_KERNEL_FAULT=%s: expected KERNEL[:N][@RANK], e.g. add_kernel:3@1", kf);
  memcpy(cfg.kernel_fault, kf, name);
  cfg.kernel_fault[name] = 0;
}

void init_locked() {
  Core &c = core();
  if (c.ready) return;
  c.page = sysconf(_SC_PAGESIZE);
  Config &cfg = c.cfg;
  memset(&cfg, 0, sizeof cfg);
  const char *rank = getenv("OMPI_COMM_WORLD_RANK");
  cfg.rank = rank ? atoi(rank) : -1;
  int physical = (int)env_size("GPUSIM_DEVICES", 1);
  if (physical > 64) fatal("GPUSIM_DEVICES=%d: at most 64 devices", physical);
  cfg.memory_bytes = env_size("GPUSIM_MEMORY_MIB", 81559) << 20;
  cfg.seed = env_size("GPUSIM_SEED", 1);
  cfg.nccl_fault = getenv("GPUSIM_NCCL_FAULT");
  cfg.kernel_fault_launch = 1, cfg.kernel_fault_rank = -1;
  if (const char *kf = getenv("GPUSIM_KERNEL_FAULT")) parse_kernel_fault(cfg, kf);
  cfg.cc_major = 9, cfg.cc_minor = 0;  // an H100's
  const char *cc = getenv("GPUSIM_CC");
  if (cc && *cc) {
    char rest;
    if (sscanf(cc, "%d.%d%c", &cfg.cc_major, &cfg.cc_minor, &rest) != 2 || cfg.cc_major < 1 || cfg.cc_major > 99 ||
        cfg.cc_minor < 0 || cfg.cc_minor > 9)
      fatal("GPUSIM_CC=%s: expected a compute capability such as 8.0 or 9.0", cc);
  }
  cfg.ptx_version = cfg.cc_major * 10 + cfg.cc_minor;  // as if built for the device
  const char *ptx = getenv("GPUSIM_PTX");
  if (ptx && *ptx) {
    int major = 0, minor = 0;
    char rest;
    if (sscanf(ptx, "%d.%d%c", &major, &minor, &rest) != 2 || major < 1 || minor < 0 || minor > 9 ||
        major * 10 + minor > cfg.cc_major * 10 + cfg.cc_minor)
      fatal("GPUSIM_PTX=%s: expected a compute capability such as 7.5, at most the devices' %d.%d", ptx, cfg.cc_major,
            cfg.cc_minor);
    cfg.ptx_version = major * 10 + minor;
  }
  // CUDA_VISIBLE_DEVICES: a comma list of device numbers; parsing stops at the first invalid one
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  if (vis) {
    const char *p = vis;
    while (*p && cfg.devices < 64) {
      char *end;
      long d = strtol(p, &end, 10);
      if (end == p || d < 0 || d >= physical) break;
      cfg.visible[cfg.devices++] = (int)d;
      p = *end == ',' ? end + 1 : end;
      if (end == p) break;
    }
  } else {
    for (int i = 0; i < physical; i++) cfg.visible[cfg.devices++] = i;
  }
  c.devices.resize((size_t)cfg.devices);
  for (int i = 0; i < cfg.devices; i++) {
    Device &d = c.devices[(size_t)i];
    d.index = i;
    d.physical = cfg.visible[i];
    d.context = false;
    d.used = d.peak = 0;
    d.busy_s = 0;
    d.legacy = nullptr;
  }
  // address space for every device's allocations: 1 TiB, less where a limit (ulimit -v) forbids it
  size_t bytes = kRegionBytes;
  void *r;
  while ((r = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)) == MAP_FAILED &&
         bytes > ((size_t)8 << 30))
    bytes /= 4;
  if (r == MAP_FAILED) fatal("cannot reserve address space for device memory: %s", strerror(errno));
  c.region_lo = (uintptr_t)r;
  c.region_hi = c.region_lo + bytes;
  c.next = c.region_lo + (uintptr_t)c.page;
  install_handler();
  // the stand-in is one executor: its library calls (cuBLAS, cuDNN) use one BLAS thread, so that
  // several ranks on a machine do not oversubscribe its cores
  openblas_set_num_threads(1);
  // registered first, so that it runs last (its _exit skips whatever would run after it)
  const char *leaks = getenv("GPUSIM_LEAK_CHECK");
  if (leaks && *leaks && strcmp(leaks, "0") && atexit(check_leaks)) fatal("atexit failed");
  if (getenv("GPUSIM_MEMORY_REPORT") && atexit(report_memory)) fatal("atexit failed");
  c.ready = true;
}

void vreport(const char *kind, const char *fmt, va_list ap) {
  char msg[4096];
  vsnprintf(msg, sizeof msg, fmt, ap);
  int rank = core().cfg.rank;
  char who[64];
  if (rank >= 0)
    snprintf(who, sizeof who, "rank %d (pid %d)", rank, (int)getpid());
  else
    snprintf(who, sizeof who, "pid %d", (int)getpid());
  fprintf(stderr, "gpusim: %s: %s: %s\n", kind, who, msg);
  fflush(stderr);
}

Allocation *containing(uintptr_t a) {
  Core &c = core();
  auto it = c.by_lo.upper_bound(a);
  if (it == c.by_lo.begin()) return nullptr;
  --it;
  Allocation *al = it->second;
  // include the guard page after the allocation: it belongs to the nearest allocation
  if (a >= al->lo - (uintptr_t)c.page && a < al->hi + (uintptr_t)c.page) return al;
  return nullptr;
}

void protect(Allocation *a, int prot) {
  if (mprotect((void *)a->lo, a->hi - a->lo, prot)) fatal("mprotect of device memory failed: %s", strerror(errno));
}

bool guards_intact(const Allocation *a, size_t *bad_offset) {
  const uint8_t *p = (const uint8_t *)a->lo;
  for (; (uintptr_t)p < a->base; p++)
    if (*p != kGuardByte) {
      *bad_offset = (size_t)(a->base - (uintptr_t)p);
      return false;
    }
  for (p = (const uint8_t *)(a->base + a->size); (uintptr_t)p < a->hi; p++)
    if (*p != kGuardByte) {
      *bad_offset = (size_t)((uintptr_t)p - (a->base + a->size));
      return false;
    }
  return true;
}

void on_fault(int sig, siginfo_t *info, void *uctx) {
  Core &c = core();
  uintptr_t a = (uintptr_t)info->si_addr;
  if (a >= c.region_lo && a < c.region_hi) {
    char kernel[512];
    std::string what = describe_address(info->si_addr);
    Allocation *al = containing(a);
    bool elsewhere = al && al->live && a >= al->base && a < al->base + al->size;  // a live allocation not granted
    if (c.open_depth > 0 && describe_running_kernel(kernel, sizeof kernel))
      fatal("%s accessed %p, %s%s", kernel, info->si_addr, what.c_str(),
            elsewhere ? ", which none of its pointer arguments points into" : "");
    if (c.open_depth > 0) fatal("queued device work accessed %p, %s", info->si_addr, what.c_str());
    fatal(
        "host code dereferenced device memory at %p, %s: device memory is only reachable from kernels and "
        "through cudaMemcpy",
        info->si_addr, what.c_str());
  }
  // not ours: hand the fault to whoever handled it before, or to the default action
  struct sigaction *prev = sig == SIGSEGV ? &c.previous_segv : &c.previous_bus;
  if (prev->sa_flags & SA_SIGINFO && prev->sa_sigaction) {
    prev->sa_sigaction(sig, info, uctx);
    return;
  }
  if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
    prev->sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

bool kernel_faults(const char *name) {
  Core &c = core();
  const Config &cfg = c.cfg;
  if (!cfg.kernel_fault[0] || strcmp(name, cfg.kernel_fault) ||
      (cfg.kernel_fault_rank >= 0 && cfg.kernel_fault_rank != cfg.rank))
    return false;
  if (++c.fault_launches != cfg.kernel_fault_launch) return false;
  warn("GPUSIM_KERNEL_FAULT: launch %llu of %s faults (an illegal address); the context is broken from here on",
       (unsigned long long)c.fault_launches, name);
  c.sticky = cudaErrorIllegalAddress;
  return true;
}

cudaError_t sticky_error() {
  return core().sticky;
}

void reinstall_fault_handler() {
  install_handler();
}

const Config &config() {
  ApiLock lock;
  return core().cfg;
}

// The calling thread's depth of nested entry points: the outermost runs ready work as it ends
// (GPUSIM_STREAM_ORDER=eager), and what that work enters nests inside it.
static thread_local int api_depth;

ApiLock::ApiLock() {
  core().lock.lock();
  api_depth++;
  init_locked();
}
ApiLock::~ApiLock() {
  if (api_depth == 1 && stream_order() == ORDER_EAGER) run_ready_work();
  api_depth--;
  core().lock.unlock();
}

void fatal(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport("error", fmt, ap);
  va_end(ap);
  signal(SIGABRT, SIG_DFL);
  abort();
}

void warn(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport("warning", fmt, ap);
  va_end(ap);
}

// Hashed, not seed * constant + counter: that made seed s+1's stream seed s's shifted by one.
uint64_t next_seed() {
  Core &c = core();
  return Rng(Rng(c.cfg.seed).next() ^ ++c.seeds).next();
}

float to_tf32(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;  // Inf and NaN stay
  u = (u + 0x1000u) & 0xffffe000u;                 // 10 mantissa bits, rounded half away from zero
  memcpy(&x, &u, 4);
  return x;
}

float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (!man) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while (!(man & 0x400));
      u = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000;
    uint32_t shift = (uint32_t)(14 - exp), half = man >> shift, rem = man & ((1u << shift) - 1),
             mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t h = sign | (uint32_t)exp << 10 | man >> 13, rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return (uint16_t)h;
}

float bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return (uint16_t)((u >> 16) | ((u & 0xffff) ? 0x40 : 0));
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

// ---- devices ------------------------------------------------------------------------------------
Device *device(int index) {
  Core &c = core();
  if (index < 0 || index >= (int)c.devices.size()) return nullptr;
  return &c.devices[(size_t)index];
}

int current_index() {
  return current_index_of_thread;
}

void set_current_index(int index) {
  current_index_of_thread = index;
}

Device *current_device() {
  Device *d = device(current_index_of_thread);
  if (d) make_context(d);
  return d;
}

void make_context(Device *d) {
  Core &c = core();
  if (d->context) return;
  if (c.context_device >= 0 && c.context_device != d->index)
    fatal(
        "this process made a CUDA context on device %d after making one on device %d: a rank must touch only the "
        "GPU it selected (each extra context costs hundreds of MiB on that GPU, and exclusive-process mode "
        "refuses it)",
        d->index, c.context_device);
  c.context_device = d->index;
  d->context = true;
  d->used += kContextBytes;
  d->legacy = new Stream;
  d->legacy->dev = d;
  d->legacy->legacy = true;
  d->legacy->rng = Rng(next_seed());
  hazard_stream_created(d->legacy);
  d->streams.push_back(d->legacy);
}

void pci_bus_id(int index, char *buf, size_t cap) {
  Device *d = device(index);
  int phys = d ? d->physical : index;
  static const int bus[] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};  // an HGX H100 board's
  snprintf(buf, cap, "0000:%02x:00.0", phys < 8 ? bus[phys] : 0xe0 + phys);
}

// ---- device memory ------------------------------------------------------------------------------
void *device_alloc(Device *d, size_t bytes) {
  Core &c = core();
  if (bytes > c.cfg.memory_bytes || d->used + bytes > c.cfg.memory_bytes) return nullptr;
  size_t padded = (bytes + 255) & ~(size_t)255;
  size_t page = (size_t)c.page, pages = (padded + page - 1) / page;
  if (pages == 0) pages = 1;
  size_t span = pages * page;
  if (c.next + span + page > c.region_hi) fatal("the stand-in's device address space is exhausted");
  Allocation *a = new Allocation;
  a->lo = c.next;
  a->hi = c.next + span;
  a->base = a->hi - padded;
  a->size = bytes;
  a->device = d->index;
  a->serial = ++c.serial;
  a->live = true;
  a->open = false;
  c.next = a->hi + page;  // the next allocation starts after a guard page
  if (mprotect((void *)a->lo, span, PROT_READ | PROT_WRITE)) fatal("mprotect failed: %s", strerror(errno));
  memset((void *)a->lo, kGuardByte, a->base - a->lo);
  memset((void *)a->base, 0xff, bytes);  // cudaMalloc does not clear: uninitialised floats read as NaN
  memset((void *)(a->base + bytes), kGuardByte, a->hi - a->base - bytes);
  if (mprotect((void *)a->lo, span, PROT_NONE)) fatal("mprotect failed: %s", strerror(errno));
  c.by_lo[a->lo] = a;
  d->used += bytes;
  if (d->used > d->peak) d->peak = d->used;
  return (void *)a->base;
}

bool device_free(void *p) {
  Allocation *a = containing((uintptr_t)p);
  if (!a || !a->live || a->base != (uintptr_t)p) return false;
  protect(a, PROT_READ);
  check_guards(a, "cudaFree");
  a->live = false;
  hazard_forget(a);
  madvise((void *)a->lo, a->hi - a->lo, MADV_DONTNEED);
  if (mprotect((void *)a->lo, a->hi - a->lo, PROT_NONE)) fatal("mprotect failed: %s", strerror(errno));
  Device *d = device(a->device);
  d->used -= a->size;
  return true;
}

const Allocation *find_allocation(const void *p) {
  Allocation *a = containing((uintptr_t)p);
  if (!a || (uintptr_t)p < a->base || (uintptr_t)p > a->base + a->size) return nullptr;
  return a;
}

void device_region(uintptr_t *lo, uintptr_t *hi) {
  *lo = core().region_lo;
  *hi = core().region_hi;
}

bool in_device_region(const void *p) {
  Core &c = core();
  return (uintptr_t)p >= c.region_lo && (uintptr_t)p < c.region_hi;
}

const Allocation *device_range(const void *p, size_t bytes, int dev) {
  const Allocation *a = find_allocation(p);
  if (!a || !a->live || (dev >= 0 && a->device != dev)) return nullptr;
  if ((uintptr_t)p + bytes > a->base + a->size) return nullptr;
  return a;
}

std::string describe_address(const void *p) {
  Core &c = core();
  uintptr_t x = (uintptr_t)p;
  char buf[256];
  if (x < c.region_lo || x >= c.region_hi) {
    snprintf(buf, sizeof buf, "a host address");
    return buf;
  }
  Allocation *a = containing(x);
  if (!a) {
    snprintf(buf, sizeof buf, "device address space that no allocation holds");
    return buf;
  }
  const char *state = a->live ? "" : "freed ";
  if (x >= a->base && x < a->base + a->size)
    snprintf(buf, sizeof buf, "byte %zu of %sallocation #%llu (%zu bytes on device %d)", (size_t)(x - a->base), state,
             (unsigned long long)a->serial, a->size, a->device);
  else if (x >= a->base + a->size)
    snprintf(buf, sizeof buf, "%zu bytes past the end of %sallocation #%llu (%zu bytes on device %d)",
             (size_t)(x - a->base - a->size), state, (unsigned long long)a->serial, a->size, a->device);
  else
    snprintf(buf, sizeof buf, "%zu bytes before %sallocation #%llu (%zu bytes on device %d)", (size_t)(a->base - x),
             state, (unsigned long long)a->serial, a->size, a->device);
  return buf;
}

void open_device_memory() {
  core().open_depth++;
}

void grant(const Allocation *a) {
  Core &c = core();
  Allocation *al = const_cast<Allocation *>(a);
  if (c.open_depth == 0 || !al || !al->live || al->open) return;
  protect(al, PROT_READ | PROT_WRITE);
  al->open = true;
  c.opened.push_back(al);
}

void grant_only(const std::vector<const Allocation *> &uses) {
  Core &c = core();
  for (size_t i = 0; i < c.opened.size();) {  // take back what this op does not declare
    Allocation *a = c.opened[i];
    bool keep = false;
    for (const Allocation *u : uses) keep = keep || u == a;
    if (keep) {
      i++;
      continue;
    }
    a->open = false;
    if (a->live) protect(a, PROT_NONE);
    c.opened[i] = c.opened.back();
    c.opened.pop_back();
  }
  for (const Allocation *u : uses) grant(u);
}

void close_device_memory() {
  Core &c = core();
  if (--c.open_depth > 0) return;
  grant_only({});
}

void check_guards(const Allocation *a, const char *after_what) {
  size_t off = 0;
  if (!a->live || guards_intact(a, &off)) return;
  bool before = true;
  const uint8_t *p = (const uint8_t *)a->lo;
  for (; (uintptr_t)p < a->base; p++)
    if (*p != kGuardByte) break;
  if ((uintptr_t)p >= a->base) before = false;
  fatal("%s wrote outside allocation #%llu (%zu bytes on device %d): %zu bytes %s it", after_what,
        (unsigned long long)a->serial, a->size, a->device, before ? off : off + 1,
        before ? "before" : "past the end of");
}

bool is_pinned(const void *p, size_t bytes) {
  Core &c = core();
  auto it = c.pinned.upper_bound((uintptr_t)p);
  if (it == c.pinned.begin()) return false;
  --it;
  return (uintptr_t)p + bytes <= it->first + it->second;
}

void pinned_add(void *p, size_t bytes) {
  core().pinned[(uintptr_t)p] = bytes;
}

bool pinned_remove(void *p) {
  return core().pinned.erase((uintptr_t)p) > 0;
}

}  // namespace gpusim

// For the NVML stand-in (nvml.c): one device's memory and the seconds it has spent executing.
extern "C" int gpusim_device_reading(const char *bus, size_t *total, size_t *used, double *busy_s) {
  using namespace gpusim;
  ApiLock lock;
  for (int i = 0; Device *d = device(i); i++) {
    char mine[32];
    pci_bus_id(i, mine, sizeof mine);
    if (strcasecmp(mine, bus)) continue;
    *total = config().memory_bytes;
    *used = d->used;
    *busy_s = d->busy_s;
    return 0;
  }
  return -1;
}

// Puts the stand-in's fault handler back in front (a test harness that installs its own SIGSEGV
// handler per test, as cmocka does, would otherwise take device-memory faults for itself).
extern "C" void gpusim_install_fault_handler(void) {
  gpusim::ApiLock lock;
  gpusim::reinstall_fault_handler();
}
