// GPU-ordered lanes (expertd_cuda.h, docs/gpu-ordered.md): a caller's
// stream rings a doorbell in device memory and waits for done; the lane's
// stream already holds the call, enqueued ahead, so no host thread of
// either process is on the call's path.
//
// Per call, on the lane's stream:
//   cuStreamWaitValue32(doorbell >= 1)
//   the lane's graph: gate kernel (doorbell 1 -> 0 and run; STOP stays and
//     skips), then, in a conditional node, the MoE call captured once
//   cuStreamWriteValue32(done, 1)
//   an event the launcher thread waits on before it enqueues the next call
// The caller's done = 0 happens before its doorbell = 1, and the lane's
// reset before its MoE work, so one pair of flags carries any number of
// calls in order. STOP is sticky: written once by close from a side
// stream, it releases every call still enqueued, and a caller that rings
// after close cannot re-arm the lane.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "moe_state.h"

namespace expertd {
namespace {

using MemOpFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// MemOps are the driver's stream memory operations, which have no runtime
// twin; taken from the driver through the runtime so the library links no
// libcuda.
struct MemOps {
  MemOpFn wait = nullptr, write = nullptr;
};

int memops(MemOps* out) {
  static MemOps ops;
  static int rc = EXPERTD_OK;
  static std::string msg;
  static std::once_flag once;
  std::call_once(once, [] {
    auto get = [](const char* name, MemOpFn* fn) {
      cudaDriverEntryPointQueryResult q;
      void* f = nullptr;
      if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return false;
      }
      *fn = reinterpret_cast<MemOpFn>(f);
      return true;
    };
    if (!get("cuStreamWaitValue32", &ops.wait) || !get("cuStreamWriteValue32", &ops.write)) {
      rc = EXPERTD_ERR_UNSUPPORTED;
      msg = "the driver has no stream memory operations (cuStreamWaitValue32, cuStreamWriteValue32)";
    }
  });
  if (rc != EXPERTD_OK) return fail(rc, "lane: %s", msg.c_str());
  *out = ops;
  return EXPERTD_OK;
}

int cu_fail(CUresult r, const char* what) { return fail(EXPERTD_ERR_CUDA, "%s: CUresult %d", what, int(r)); }

// lane_gate takes one doorbell: a ring (1) is reset to 0 and runs the
// call; STOP is left for the calls after it and skips the call.
__global__ void lane_gate(unsigned* doorbell, cudaGraphConditionalHandle run) {
  const unsigned v = *reinterpret_cast<volatile unsigned*>(doorbell);
  if (v == 1u) *doorbell = 0u;
  cudaGraphSetConditional(run, v == 1u ? 1u : 0u);
}

// lane_gate_plain is lane_gate for a graph without a conditional node: the
// call that follows runs either way.
__global__ void lane_gate_plain(unsigned* doorbell) {
  if (*reinterpret_cast<volatile unsigned*>(doorbell) == 1u) *doorbell = 0u;
}

// side_stream is the device's stream for the stop writes that close
// lanes: one for all of them, since every stream may take one of the
// device's hardware queues, which a lane's blocked stream must not share.
int side_stream(int device, cudaStream_t* out) {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lk(mu);
  auto it = streams.find(device);
  if (it == streams.end()) {
    cudaStream_t st = nullptr;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    it = streams.emplace(device, st).first;
  }
  *out = it->second;
  return EXPERTD_OK;
}

struct GpuLane {
  // First, so it goes last: what the lane's and its set's frees left to
  // release() runs once no lane is open.
  LaneHold hold;
  std::shared_ptr<Set> set;
  Lane ws;  // the lane's stream and workspace (~Lane synchronizes and frees them)
  cudaStream_t side = nullptr;  // side_stream's, not the lane's to destroy
  uint8_t* flags = nullptr;
  float* bias = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaEvent_t> ev;
  MemOps ops;
  int32_t mode = 0;
  std::atomic<uint64_t> served{0};
  std::atomic<bool> stop{false};
  // finished is set, under mu, when the launcher thread ends.
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::thread launcher;

  unsigned* doorbell() { return reinterpret_cast<unsigned*>(flags + EXPERTD_LANE_DOORBELL); }
  unsigned* done() { return reinterpret_cast<unsigned*>(flags + EXPERTD_LANE_DONE); }

  // enqueue puts one call, slot i of the ring of events, on the stream.
  int enqueue(int i) {
    const CUstream st = reinterpret_cast<CUstream>(ws.stream);
    if (CUresult r = ops.wait(st, CUdeviceptr(doorbell()), 1, CU_STREAM_WAIT_VALUE_GEQ))
      return cu_fail(r, "cuStreamWaitValue32(doorbell)");
    CK(cudaGraphLaunch(exec, ws.stream));
    if (CUresult r = ops.write(st, CUdeviceptr(done()), 1, CU_STREAM_WRITE_VALUE_DEFAULT))
      return cu_fail(r, "cuStreamWriteValue32(done)");
    CK(cudaEventRecord(ev[i], ws.stream));
    return EXPERTD_OK;
  }

  // run is the launcher thread: it waits for the oldest call enqueued and
  // enqueues one in its place, off every call's path, until close; then it
  // waits for the calls still enqueued, which STOP releases.
  void run(int pending) {
    cudaSetDevice(set->device);
    const int depth = int(ev.size());
    for (int i = 0; pending > 0; i = (i + 1) % depth) {
      // A blocking-sync event: the thread sleeps until the call ends.
      if (cudaEventSynchronize(ev[i]) != cudaSuccess) {
        cudaGetLastError();
        break;  // a device fault; close frees what it can
      }
      --pending;
      if (stop.load()) continue;
      served.fetch_add(1, std::memory_order_relaxed);
      if (enqueue(i) == EXPERTD_OK) ++pending;
    }
    std::lock_guard<std::mutex> lk(mu);
    finished = true;
    cv.notify_all();
  }

  // release stops the launcher: STOP from the side stream, repeated until
  // the thread ends, since a caller that rings meanwhile overwrites it.
  void release() {
    stop.store(true);
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu);
        if (finished) break;
      }
      if (ops.write(reinterpret_cast<CUstream>(side), CUdeviceptr(doorbell()), EXPERTD_LANE_STOP,
                    CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS ||
          cudaStreamSynchronize(side) != cudaSuccess) {
        cudaGetLastError();
      }
      std::unique_lock<std::mutex> lk(mu);
      if (cv.wait_for(lk, std::chrono::milliseconds(10), [&] { return finished; })) break;
    }
    if (launcher.joinable()) launcher.join();
  }

  ~GpuLane() {
    if (!set) return;  // the call named no set: nothing was made
    if (launcher.joinable()) release();
    cudaSetDevice(set->device);
    if (ws.stream) cudaStreamSynchronize(ws.stream);
    // Destroying an executable graph waits for the device while another
    // lane's graph sits at its doorbell: it goes with the frees that wait
    // for the last lane to close.
    if (exec) {
      expertd::release([dev = set->device, e = exec] {
        cudaSetDevice(dev);
        cudaGraphExecDestroy(e);
        return EXPERTD_OK;
      });
    }
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    release_device(set->device, flags);
    release_device(set->device, bias);
  }
};

// build_graph captures the lane's call behind its gate. With conditional,
// the call sits in an IF node the gate sets, so a call released by STOP
// does nothing; without, it runs.
int build_graph(GpuLane& g, const Call& c, const Layout& L, const expertd_call& k, bool conditional) {
  cudaGraph_t graph = nullptr;
  CK(cudaGraphCreate(&graph, 0));
  struct Drop {
    cudaGraph_t g;
    ~Drop() { cudaGraphDestroy(g); }
  } drop{graph};
  unsigned* db = g.doorbell();
  cudaGraphNode_t gate;
  cudaKernelNodeParams kp = {};
  kp.gridDim = dim3(1);
  kp.blockDim = dim3(1);
  cudaGraph_t body = graph;
  const cudaGraphNode_t* deps = &gate;
  size_t ndeps = 1;
  if (conditional) {
    cudaGraphConditionalHandle h;
    CK(cudaGraphConditionalHandleCreate(&h, graph, 0, 0));
    void* args[] = {&db, &h};
    kp.func = reinterpret_cast<void*>(lane_gate);
    kp.kernelParams = args;
    CK(cudaGraphAddKernelNode(&gate, graph, nullptr, 0, &kp));
    cudaGraphNodeParams cp = {};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = h;
    cp.conditional.type = cudaGraphCondTypeIf;
    cp.conditional.size = 1;
    cudaGraphNode_t cond;
    CK(cudaGraphAddNode(&cond, graph, &gate, nullptr, 1, &cp));
    body = cp.conditional.phGraph_out[0];
    deps = nullptr;
    ndeps = 0;
  } else {
    void* args[] = {&db};
    kp.func = reinterpret_cast<void*>(lane_gate_plain);
    kp.kernelParams = args;
    CK(cudaGraphAddKernelNode(&gate, graph, nullptr, 0, &kp));
  }
  CK(cudaStreamBeginCaptureToGraph(g.ws.stream, body, deps, nullptr, ndeps, cudaStreamCaptureModeThreadLocal));
  const int rc = enqueue_device(*g.set, g.ws.ws, c, L, k, g.ws.stream);
  cudaGraph_t captured = nullptr;
  const cudaError_t end = cudaStreamEndCapture(g.ws.stream, &captured);
  if (rc) return rc;
  if (end != cudaSuccess) return cuda_fail(end, "cudaStreamEndCapture(lane)");
  CK(cudaGraphInstantiate(&g.exec, graph, 0));
  return EXPERTD_OK;
}

std::mutex g_lanes_mu;
std::map<uint64_t, std::shared_ptr<GpuLane>> g_lanes;
uint64_t g_next_lane = 1;

}  // namespace

int lane_open(uint64_t set, const expertd_call* call, int depth, uint64_t* lane, uint8_t* flags_handle,
              int handle_len) {
  if (!lane || !flags_handle) return fail(EXPERTD_ERR_INVALID, "lane_open: NULL lane or flags_handle");
  *lane = 0;
  if (handle_len != EXPERTD_IPC_HANDLE_BYTES)
    return fail(EXPERTD_ERR_INVALID, "lane_open: flags_handle has %d bytes, want %d", handle_len,
                EXPERTD_IPC_HANDLE_BYTES);
  if (depth < 1 || depth > EXPERTD_MAX_LANE_DEPTH)
    return fail(EXPERTD_ERR_INVALID, "lane_open: depth %d, want 1..%d", depth, EXPERTD_MAX_LANE_DEPTH);
  Call c;
  auto g = std::make_shared<GpuLane>();
  if (int rc = check_device_call(set, call, "lane_open", &g->set, &c)) return rc;
  const expertd_call& in = *call;
  if (c.n_hidden_scale > 0 || in.topk_ids_in.data || in.topk_weights_in.data || in.topk_ids_out.data ||
      in.topk_weights_out.data)
    return fail(EXPERTD_ERR_INVALID, "lane_open: a lane takes no hidden_scale and no precomputed or returned routing");
  if (!in.logits.data) return fail(EXPERTD_ERR_INVALID, "lane_open: NULL logits");
  Set& s = *g->set;
  CK(cudaSetDevice(s.device));
  if (mem_kind(in.hidden.data) != Mem::kDevice || mem_kind(in.logits.data) != Mem::kDevice ||
      mem_kind(in.out.data) != Mem::kDevice)
    return fail(EXPERTD_ERR_INVALID, "lane_open: hidden, logits and out must be device memory");
  if (int rc = memops(&g->ops)) return rc;
  int mps = 0;
  if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, s.device) != cudaSuccess) {
    cudaGetLastError();
    mps = 0;
  }
  if (mps) g->mode |= EXPERTD_LANE_MPS;

  g->ws.device = s.device;
  CK(cudaStreamCreateWithFlags(&g->ws.stream, cudaStreamNonBlocking));
  if (int rc = side_stream(s.device, &g->side)) return rc;
  CK(cudaMalloc(&g->flags, EXPERTD_LANE_FLAGS_BYTES));
  CK(cudaMemset(g->flags, 0, EXPERTD_LANE_FLAGS_BYTES));
  expertd_call k = in;
  if (c.have_bias) {
    // The routing bias is part of the lane's fixed call: a device copy the
    // graph reads, so the caller's host buffer is not retained.
    CK(cudaMalloc(&g->bias, size_t(s.E) * sizeof(float)));
    CK(cudaMemcpy(g->bias, in.correction_bias.data, size_t(s.E) * sizeof(float), cudaMemcpyDefault));
    k.correction_bias.data = g->bias;
    k.correction_bias.mem = EXPERTD_MEM_DEVICE;
  }
  const Layout L = call_layout(s, c);
  if (int rc = ensure_workspace(g->ws, L)) return rc;
  CK(cudaStreamSynchronize(g->ws.stream));
  // The conditional graph, launched once with the doorbell at rest (its
  // gate skips the call), proves the driver runs it.
  if (build_graph(*g, c, L, k, true) == EXPERTD_OK && cudaGraphLaunch(g->exec, g->ws.stream) == cudaSuccess &&
      cudaStreamSynchronize(g->ws.stream) == cudaSuccess) {
    g->mode |= EXPERTD_LANE_SKIPS;
  } else {
    if (g->exec) cudaGraphExecDestroy(g->exec);
    g->exec = nullptr;
    // A driver without conditional nodes in captured graphs: closing runs
    // the calls still enqueued once more.
    g_last_error.clear();
    cudaGetLastError();
    if (int rc = build_graph(*g, c, L, k, false)) return rc;
  }
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, g->flags));
  g->ev.resize(size_t(depth));
  for (cudaEvent_t& e : g->ev) CK(cudaEventCreateWithFlags(&e, cudaEventBlockingSync | cudaEventDisableTiming));
  for (int i = 0; i < depth; ++i) {
    if (int rc = g->enqueue(i)) {
      // The calls enqueued wait for a doorbell: release them before ~GpuLane
      // synchronizes the stream.
      g->launcher = std::thread([gp = g.get(), i] { gp->run(i); });
      g->release();
      return rc;
    }
  }
  g->launcher = std::thread([gp = g.get(), depth] { gp->run(depth); });
  std::memcpy(flags_handle, &h, sizeof h);
  std::lock_guard<std::mutex> lk(g_lanes_mu);
  *lane = g_next_lane++;
  g_lanes[*lane] = std::move(g);
  return EXPERTD_OK;
}

int lane_stats(uint64_t lane, uint64_t* served, int32_t* mode) {
  if (!served || !mode) return fail(EXPERTD_ERR_INVALID, "lane_stats: NULL served or mode");
  std::lock_guard<std::mutex> lk(g_lanes_mu);
  auto it = g_lanes.find(lane);
  if (it == g_lanes.end()) return fail(EXPERTD_ERR_NOT_FOUND, "lane_stats: unknown lane %llu", (unsigned long long)lane);
  *served = it->second->served.load();
  *mode = it->second->mode;
  return EXPERTD_OK;
}

int lane_close(uint64_t lane) {
  std::shared_ptr<GpuLane> g;
  {
    std::lock_guard<std::mutex> lk(g_lanes_mu);
    auto it = g_lanes.find(lane);
    if (it == g_lanes.end()) return fail(EXPERTD_ERR_NOT_FOUND, "lane_close: unknown lane %llu", (unsigned long long)lane);
    g = std::move(it->second);
    g_lanes.erase(it);
  }
  CK(cudaSetDevice(g->set->device));
  g->release();
  g.reset();  // ~GpuLane frees the lane; the set goes with its last holder
  return EXPERTD_OK;
}

}  // namespace expertd
