// graph.cc: stream capture and CUDA graphs on the stand-in, as the CUDA Runtime API documents them.
// - cudaStreamBeginCapture puts a stream in capture mode: what is enqueued on it (kernels, copies,
//   memsets, cuBLAS and cuDNN calls, NCCL collectives) becomes a node of a graph and does not run.
//   A kernel keeps the argument values it was captured with; memory is read when a launch runs.
// - An event recorded in a capture marks the recording stream's place in the graph; a stream that
//   waits for it joins the capture there. cudaStreamEndCapture ends the capture on every stream
//   that took part, and fails (cudaErrorStreamCaptureUnjoined) unless every node is ordered before
//   the origin stream's end: each fork must have been joined back.
// - Calls that cannot be captured fail with the documented error and invalidate the capture, so
//   that cudaStreamEndCapture returns no graph: synchronising or querying a capturing stream or an
//   event recorded in a capture, a device synchronisation, the legacy stream while a blocking
//   stream captures, copies to or from pageable host memory, and the potentially unsafe calls
//   (cudaMalloc, cudaFree, synchronous copies) as the capture modes of cudaStreamBeginCapture and
//   cudaThreadExchangeStreamCaptureMode decide.
// - cudaGraphLaunch queues one op on the stream that runs every node: in an order consistent with
//   the captured dependencies that varies with GPUSIM_SEED among nodes that do not depend on each
//   other, each node reaching only the allocations it declared, and a node that uses memory freed
//   since the capture stops the program. Collectives are issued anew at every launch.
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "gpusim.h"

namespace gpusim {

struct Node {
  std::shared_ptr<Op> op;    // what runs (Op::relaunch makes a fresh one per launch if it keeps state)
  std::vector<size_t> deps;  // the nodes of its graph that run before it
};

struct Graph {
  int device = 0;
  std::vector<std::unique_ptr<Node>> nodes;  // in the order recorded, which is a topological order
  Capture *capture = nullptr;                // being recorded now
};

namespace {

// Where the last launch of an executable graph was queued: the next launch on another stream waits
// for it. Lives as long as that launch is queued.
struct Mark {
  Stream *stream = nullptr;
  uint64_t seq = 0;
  Clock clock;  // its point in the happens-before order
};

// An executable graph: the nodes as instantiated, shared with its queued launches.
struct Plan {
  int device = 0;
  std::vector<Node> nodes;
  std::vector<const Allocation *> uses;  // every node's
  std::weak_ptr<Mark> last;
  std::vector<std::vector<uint64_t>> reach;  // [j]: a bitset of the nodes that run before node j
};

struct Exec {
  std::shared_ptr<Plan> plan;
};

struct Captures {
  std::vector<Capture *> active;
  uint64_t ids = 0;
  uint64_t instantiated = 0, launches = 0, nodes_launched = 0;  // GPUSIM_PROFILE's graph line
  // cudaStreamGetCaptureInfo's arrays, valid until the stream's next call
  std::map<const Stream *, std::vector<cudaGraphNode_t>> info_nodes;
  std::map<const Stream *, std::vector<cudaGraphEdgeData>> info_edges;
};

Captures &caps() {
  static Captures *c = new Captures;  // lives until the process ends
  return *c;
}

void print_graph_profile() {
  Captures &c = caps();
  fprintf(stderr, "gpusim graphs (pid %d): %llu instantiated, %llu launches, %llu nodes launched\n", (int)getpid(),
          (unsigned long long)c.instantiated, (unsigned long long)c.launches, (unsigned long long)c.nodes_launched);
}

void count_launch(size_t nodes) {
  static bool profiling = getenv("GPUSIM_PROFILE") && atexit(print_graph_profile) == 0;
  if (!profiling) return;
  caps().launches++;
  caps().nodes_launched += nodes;
}

Handles<Graph> graphs;
Handles<Exec> execs;
thread_local cudaStreamCaptureMode thread_mode = cudaStreamCaptureModeGlobal;

cudaGraph_t handle(Graph *g) {
  return reinterpret_cast<cudaGraph_t>(g);
}

Graph *graph_of(cudaGraph_t h) {
  Graph *g = reinterpret_cast<Graph *>(h);
  return graphs.has(g) ? g : nullptr;
}

Exec *exec_of(cudaGraphExec_t h) {
  Exec *x = reinterpret_cast<Exec *>(h);
  return execs.has(x) ? x : nullptr;
}

bool valid_mode(int mode) {
  return mode == cudaStreamCaptureModeGlobal || mode == cudaStreamCaptureModeThreadLocal ||
         mode == cudaStreamCaptureModeRelaxed;
}

// Whether every node runs before the nodes in `ends` (or is one of them).
bool all_joined(const Graph *g, const std::vector<size_t> &ends) {
  std::vector<char> seen(g->nodes.size(), 0);
  std::vector<size_t> todo(ends);
  size_t reached = 0;
  while (!todo.empty()) {
    size_t n = todo.back();
    todo.pop_back();
    if (seen[n]) continue;
    seen[n] = 1;
    reached++;
    for (size_t d : g->nodes[n]->deps) todo.push_back(d);
  }
  return reached == g->nodes.size();
}

// A topological order of the plan's nodes, picking at random among the nodes that are ready.
std::vector<size_t> run_order(const Plan &p, Rng &rng) {
  size_t n = p.nodes.size();
  std::vector<size_t> waiting(n), ready, order;
  std::vector<std::vector<size_t>> after(n);
  for (size_t i = 0; i < n; i++) {
    waiting[i] = p.nodes[i].deps.size();
    for (size_t d : p.nodes[i].deps) after[d].push_back(i);
    if (!waiting[i]) ready.push_back(i);
  }
  while (!ready.empty()) {
    size_t k = rng.below((uint32_t)ready.size()), i = ready[k];
    ready[k] = ready.back();
    ready.pop_back();
    order.push_back(i);
    for (size_t j : after[i])
      if (--waiting[j] == 0) ready.push_back(j);
  }
  return order;
}

// One launch of an executable graph, queued like any other work; or, made with no stream, the
// node a launch on a capturing stream records (each launch of that graph relaunches it).
struct GraphRunOp : Op {
  std::shared_ptr<Plan> plan;
  std::vector<std::shared_ptr<Op>> ops;  // this launch's op of each node, in the order they run
  std::vector<size_t> order;             // their node numbers
  size_t next = 0;                       // the first that has not finished
  std::shared_ptr<Mark> mark;
  uint64_t launch;  // unique: the hazard checker tells this launch's nodes apart by it

  GraphRunOp(std::shared_ptr<Plan> p, Stream *s) : plan(std::move(p)) {
    static uint64_t launches = 0;
    launch = ++launches;
    uses = plan->uses;
    char buf[96];
    snprintf(buf, sizeof buf, "a launch of a graph of %zu node%s", plan->nodes.size(),
             plan->nodes.size() == 1 ? "" : "s");
    what = buf;
    if (!s) return;
    Rng rng(next_seed());
    order = run_order(*plan, rng);
    for (size_t i : order) {
      std::unique_ptr<Op> fresh = plan->nodes[i].op->relaunch(s);
      ops.push_back(fresh ? std::shared_ptr<Op>(std::move(fresh)) : plan->nodes[i].op);
    }
  }
  std::unique_ptr<Op> relaunch(Stream *s) override { return std::unique_ptr<Op>(new GraphRunOp(plan, s)); }
  bool run() override {
    for (; next < ops.size(); next++) {
      Op *op = ops[next].get();
      for (const Allocation *a : op->uses)
        if (!a->live)
          fatal(
              "a launch of a graph: node %zu of %zu (%s) uses allocation #%llu (%zu bytes on device %d), freed since "
              "the graph was captured: a graph keeps the pointers it was captured with",
              order[next] + 1, ops.size(), op->what.c_str(), (unsigned long long)a->serial, a->size, a->device);
      for (const auto &h : op->pinned)
        if (!is_pinned(h.first, h.second))
          fatal(
              "a launch of a graph: node %zu of %zu (%s) copies to or from host memory at %p (%zu bytes) that is no "
              "longer pinned: freed with cudaFreeHost since the graph was captured",
              order[next] + 1, ops.size(), op->what.c_str(), h.first, h.second);
      op->stamp = stamp;  // a node runs at its launch's place in the order
      LaunchCtx ctx{launch, &plan->reach, order[next]};
      if (!run_checked(op, &ctx)) return false;
    }
    grant_only(uses);  // as the stream granted them: it checks the guards of all of them next
    return true;
  }
};

// The captures that forbid the calling thread a potentially unsafe call, by the rules of
// cudaThreadExchangeStreamCaptureMode: its own captures unless begun relaxed, and in global mode
// also other threads' global captures.
std::vector<Capture *> forbidding() {
  std::vector<Capture *> out;
  if (thread_mode == cudaStreamCaptureModeRelaxed) return out;
  std::thread::id me = std::this_thread::get_id();
  for (Capture *c : caps().active)
    if (c->thread == me ? c->mode != cudaStreamCaptureModeRelaxed
                        : thread_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal)
      out.push_back(c);
  return out;
}

void end_capture(Capture *c) {
  Captures &cs = caps();
  for (Stream *s : c->streams) {
    s->capture = nullptr;
    s->deps.clear();
    cs.info_nodes.erase(s);
    cs.info_edges.erase(s);
  }
  cs.active.erase(std::find(cs.active.begin(), cs.active.end(), c));
  c->graph->capture = nullptr;
  delete c;
}

}  // namespace

cudaError_t capture_op(Stream *s, std::unique_ptr<Op> op) {
  Capture *c = s->capture;
  if (c->invalidated) return cudaErrorStreamCaptureInvalidated;
  Graph *g = c->graph;
  std::unique_ptr<Node> n(new Node);
  n->op = std::shared_ptr<Op>(std::move(op));
  n->deps = s->deps;
  s->deps.assign(1, g->nodes.size());
  g->nodes.push_back(std::move(n));
  return cudaSuccess;
}

cudaError_t capture_wait(Stream *s, Capture *c, const std::vector<size_t> &nodes) {
  if (s->capture && s->capture != c) {
    refuse(s->capture, cudaErrorStreamCaptureMerge);
    return refuse(c, cudaErrorStreamCaptureMerge);
  }
  if (s->legacy) return refuse(c, cudaErrorStreamCaptureUnsupported);  // it cannot capture
  if (c->invalidated) return cudaErrorStreamCaptureInvalidated;
  if (!s->capture) {
    s->capture = c;
    s->deps.clear();
    c->streams.push_back(s);
  }
  for (size_t n : nodes)
    if (std::find(s->deps.begin(), s->deps.end(), n) == s->deps.end()) s->deps.push_back(n);
  return cudaSuccess;
}

Capture *find_capture(uint64_t id) {
  for (Capture *c : caps().active)
    if (c->id == id) return c;
  return nullptr;
}

cudaError_t refuse(Capture *c, cudaError_t e) {
  if (c) c->invalidated = true;
  return e;
}

bool blocking_stream_captures(const Device *d) {
  for (Capture *c : caps().active)
    for (Stream *s : c->streams)
      if (s->dev == d && s->blocking) return true;
  return false;
}

cudaError_t check_legacy_use(const Device *d) {
  cudaError_t e = cudaSuccess;
  for (Capture *c : caps().active)
    for (Stream *s : c->streams)
      if (s->dev == d && s->blocking) e = refuse(c, cudaErrorStreamCaptureImplicit);
  return e;
}

cudaError_t check_unsafe_call() {
  cudaError_t e = cudaSuccess;
  for (Capture *c : forbidding()) e = refuse(c, cudaErrorStreamCaptureUnsupported);
  return e;
}

cudaError_t check_device_sync(const Device *d) {
  cudaError_t e = cudaSuccess;
  for (Capture *c : caps().active)
    for (Stream *s : c->streams)
      if (s->dev == d) e = refuse(c, cudaErrorStreamCaptureUnsupported);
  return e;
}

}  // namespace gpusim

using namespace gpusim;

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t h, cudaStreamCaptureMode mode) {
  ApiLock lock;
  if (cudaError_t e = sticky_error()) return set_error(e);  // a broken context (kernel_faults)
  Stream *s = stream_of(h);
  if (!s) return set_error(cudaErrorInvalidResourceHandle);
  // the legacy stream cannot capture (cudaStreamPerThread is the legacy stream here)
  if (s->legacy || s->capture || !valid_mode(mode)) return set_error(cudaErrorInvalidValue);
  Capture *c = new Capture;
  c->id = ++caps().ids;
  c->origin = s;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->invalidated = false;
  c->graph = graphs.add(new Graph);
  c->graph->device = s->dev->index;
  c->graph->capture = c;
  c->streams.push_back(s);
  caps().active.push_back(c);
  s->capture = c;
  s->deps.clear();
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t h, cudaGraph_t *out) {
  ApiLock lock;
  if (cudaError_t e = sticky_error()) return set_error(e);  // a broken context (kernel_faults)
  Stream *s = stream_of(h);
  if (!s) return set_error(cudaErrorInvalidResourceHandle);
  if (!out) return set_error(cudaErrorInvalidValue);
  *out = nullptr;
  Capture *c = s->capture;
  if (!c) return set_error(cudaErrorInvalidValue);
  if (c->origin != s) return set_error(refuse(c, cudaErrorStreamCaptureUnmatched));
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
    return set_error(cudaErrorStreamCaptureWrongThread);
  Graph *g = c->graph;
  cudaError_t e = c->invalidated            ? cudaErrorStreamCaptureInvalidated
                  : !all_joined(g, s->deps) ? cudaErrorStreamCaptureUnjoined
                                            : cudaSuccess;
  end_capture(c);
  if (e != cudaSuccess) {
    graphs.remove(g);
    delete g;
    return set_error(e);
  }
  *out = handle(g);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t h, cudaStreamCaptureStatus *status) {
  ApiLock lock;
  Stream *s = stream_of(h);
  if (!s) return set_error(cudaErrorInvalidResourceHandle);
  if (!status) return set_error(cudaErrorInvalidValue);
  // the documented answer for the legacy stream; the capture is not invalidated
  if (s->legacy && blocking_stream_captures(s->dev)) return set_error(cudaErrorStreamCaptureImplicit);
  *status = !s->capture               ? cudaStreamCaptureStatusNone
            : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                      : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t h, cudaStreamCaptureStatus *status, unsigned long long *id,
                                     cudaGraph_t *graph, const cudaGraphNode_t **deps, const cudaGraphEdgeData **edges,
                                     size_t *ndeps) {
  ApiLock lock;
  Stream *s = stream_of(h);
  if (!s) return set_error(cudaErrorInvalidResourceHandle);
  if (!status || (edges && !deps)) return set_error(cudaErrorInvalidValue);
  if (s->legacy && blocking_stream_captures(s->dev)) return set_error(cudaErrorStreamCaptureImplicit);
  cudaError_t e = cudaStreamIsCapturing(h, status);
  if (e != cudaSuccess || *status != cudaStreamCaptureStatusActive) return e;
  Capture *c = s->capture;
  if (id) *id = c->id;
  if (graph) *graph = handle(c->graph);
  std::vector<cudaGraphNode_t> &nodes = caps().info_nodes[s];
  nodes.clear();
  for (size_t n : s->deps) nodes.push_back(reinterpret_cast<cudaGraphNode_t>(c->graph->nodes[n].get()));
  if (deps) *deps = nodes.data();
  if (edges) {
    caps().info_edges[s].assign(nodes.size(), cudaGraphEdgeData());  // every edge is a full dependency
    *edges = caps().info_edges[s].data();
  }
  if (ndeps) *ndeps = nodes.size();
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode *mode) {
  ApiLock lock;
  if (!mode || !valid_mode(*mode)) return set_error(cudaErrorInvalidValue);
  std::swap(thread_mode, *mode);
  return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t h, cudaGraphNode_t *nodes, size_t *count) {
  ApiLock lock;
  Graph *g = graph_of(h);
  if (!g || !count) return set_error(cudaErrorInvalidValue);
  if (nodes) {
    for (size_t i = 0; i < *count; i++)
      nodes[i] = i < g->nodes.size() ? reinterpret_cast<cudaGraphNode_t>(g->nodes[i].get()) : nullptr;
    *count = std::min(*count, g->nodes.size());
  } else {
    *count = g->nodes.size();
  }
  return cudaSuccess;
}

// The graph as it is now: later changes to it (a capture still recording) do not reach the
// executable graph. Flags that need what the stand-in does not model (upload, device launch) are
// refused.
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *out, cudaGraph_t h, unsigned long long flags) {
  ApiLock lock;
  if (cudaError_t e = sticky_error()) return set_error(e);  // a broken context (kernel_faults)
  Graph *g = graph_of(h);
  if (!out || !g) return set_error(cudaErrorInvalidValue);
  if (flags & ~(unsigned long long)(cudaGraphInstantiateFlagAutoFreeOnLaunch | cudaGraphInstantiateFlagUseNodePriority))
    return set_error(cudaErrorInvalidValue);
  std::shared_ptr<Plan> plan = std::make_shared<Plan>();
  plan->device = g->device;
  const size_t words = (g->nodes.size() + 63) / 64;
  for (const std::unique_ptr<Node> &n : g->nodes) {
    plan->nodes.push_back(*n);
    for (const Allocation *a : n->op->uses)
      if (std::find(plan->uses.begin(), plan->uses.end(), a) == plan->uses.end()) plan->uses.push_back(a);
    // nodes are in a topological order: a node's ancestors are its dependencies' and them
    std::vector<uint64_t> bits(words, 0);
    for (size_t d : n->deps) {
      const std::vector<uint64_t> &up = plan->reach[d];
      for (size_t w = 0; w < words; w++) bits[w] |= up[w];
      bits[d / 64] |= (uint64_t)1 << (d % 64);
    }
    plan->reach.push_back(std::move(bits));
  }
  Exec *x = execs.add(new Exec);
  x->plan = plan;
  caps().instantiated++;
  *out = reinterpret_cast<cudaGraphExec_t>(x);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *out, cudaGraph_t h, unsigned long long flags) {
  return cudaGraphInstantiate(out, h, flags);
}

// Queues the whole graph as one piece of work on the stream, after the stream's earlier work and
// after the previous launch of the same executable graph. On a capturing stream the launch itself
// is recorded (a child graph).
cudaError_t cudaGraphLaunch(cudaGraphExec_t h, cudaStream_t sh) {
  ApiLock lock;
  if (cudaError_t e = sticky_error()) return set_error(e);  // a broken context (kernel_faults)
  Exec *x = exec_of(h);
  if (!x) return set_error(cudaErrorInvalidValue);
  Stream *s = stream_of(sh);
  if (!s) return set_error(cudaErrorInvalidResourceHandle);
  if (s->dev->index != x->plan->device) return set_error(cudaErrorInvalidValue);
  if (s->capture) return set_error(capture_op(s, std::unique_ptr<Op>(new GraphRunOp(x->plan, nullptr))));
  if (s->legacy)
    if (cudaError_t e = check_legacy_use(s->dev)) return set_error(e);
  // checked before the launch is made: making it issues its collectives
  std::shared_ptr<Mark> last = x->plan->last.lock();
  if (last && last->stream != s) enqueue_wait(s, last->stream, last->seq, last->clock);
  std::unique_ptr<GraphRunOp> op(new GraphRunOp(x->plan, s));
  std::shared_ptr<Mark> mark = std::make_shared<Mark>();
  op->mark = mark;
  if (cudaError_t e = enqueue(s, std::move(op))) return set_error(e);
  count_launch(x->plan->nodes.size());
  mark->stream = s;
  mark->seq = s->enqueued;
  mark->clock = hazard_clock_of(s);
  x->plan->last = mark;
  return cudaSuccess;
}

// Queued launches keep what they run: they complete.
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t h) {
  ApiLock lock;
  Exec *x = exec_of(h);
  if (!x) return set_error(cudaErrorInvalidValue);
  execs.remove(x);
  delete x;
  return cudaSuccess;
}

// Executable graphs made from it stay usable. A graph still being captured into cannot be destroyed.
cudaError_t cudaGraphDestroy(cudaGraph_t h) {
  ApiLock lock;
  Graph *g = graph_of(h);
  if (!g || g->capture) return set_error(cudaErrorInvalidValue);
  graphs.remove(g);
  delete g;
  return cudaSuccess;
}

}  // extern "C"
