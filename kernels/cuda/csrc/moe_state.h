// The library's process state: expert sets and their lanes (stream,
// workspace, staging and graphs of one call in flight), CUDA IPC mappings,
// the thread's last error, and the per-set policy that picks kernels. The
// C ABI (expertd_abi.cu) and the pipeline (moe_pipeline.cu) share it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "expertd_cuda.h"
#include "moe_gemm.h"

namespace expertd {

// g_last_error is the calling thread's expertd_last_error().
extern thread_local std::string g_last_error;

// fail records a formatted message for the thread and returns code.
int fail(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// cuda_fail maps a CUDA error to a return code and records it with what.
int cuda_fail(cudaError_t err, const char* what);

#define CK(call)                                   \
  do {                                             \
    const cudaError_t err_ = (call);               \
    if (err_ != cudaSuccess) return cuda_fail(err_, #call); \
  } while (0)

// Releases while lanes are open (docs/gpu-ordered.md, "Lanes and
// synchronizing calls"). An open lane's stream holds stream memory waits
// that only its caller's next ring completes, and a CUDA call that
// synchronizes the device (cudaFree, cudaFreeHost, cudaHostUnregister,
// cudaIpcCloseMemHandle) waits for them: called from the daemon while the
// caller waits for the daemon, it never returns. So every such release in
// the library goes through release(): it runs at once while no lane is
// open, and otherwise waits, with the memory it holds, until the last lane
// closes.

// LaneHold counts an open lane for as long as it lives; the last one to go
// runs the releases that waited for it.
struct LaneHold {
  LaneHold();
  ~LaneHold();
  LaneHold(const LaneHold&) = delete;
  LaneHold& operator=(const LaneHold&) = delete;
};

// release runs fn and returns its code while no lane is open; otherwise it
// keeps fn for the last lane's close and returns EXPERTD_OK (an error then
// has no caller to go to and is dropped).
int release(std::function<int()> fn);

// release_device and release_pinned free a cudaMalloc or cudaHostAlloc
// allocation (null: nothing) through release.
int release_device(int device, void* p);
int release_pinned(int device, void* p);

// host_register and host_unregister are the page-locking entry points:
// unregistering goes through release, and until it runs, the range reads
// as pageable memory (mem_kind) and cannot be registered again.
int host_register(int device, void* ptr, size_t bytes);
int host_unregister(int device, void* ptr);

// Memory made while a lane is open comes from the device's stream-ordered
// pool, which frees without synchronizing and keeps what is freed for the
// next allocation (memory made before goes through release). lanes_open
// says whether one is; alloc_pooled allocates on st.
bool lanes_open();
int alloc_pooled(int device, size_t bytes, cudaStream_t st, void** p);

// alloc_workspace gives l (which has none) a workspace of bytes, from the
// pool while a lane is open (unless l is foreign), else from cudaMalloc;
// free_workspace frees it the way it was made.
struct Lane;
int alloc_workspace(Lane& l, size_t bytes);
void free_workspace(Lane& l);

// free_weights frees a set's device memory (~Set) the way it was made;
// foreign says whether its calls ran on callers' streams too
// (expertd_moe_device), which no stream of the library's is ordered after.
struct Set;
void free_weights(Set& s, bool foreign);

// Call is the shape of one expertd_moe call: everything that changes kernel
// arguments other than the buffer addresses.
struct Call {
  int m, hidden_dtype, n_hidden_scale, logits_dtype, out_dtype, top_k, renormalize, scoring,
      num_groups, topk_groups, gemm;
  int have_logits, have_bias;
  float scaling;
};

// Layout is the workspace carve-up for one (M, block_rows).
struct Layout {
  int p, block_rows, max_blocks, max_rows;
  size_t hidden, hscale, logits, bias, ids, w;  // inputs (host path copies into these)
  size_t sorted, block_expert, num_blocks, align, a1q, a1s, hq, hqs, act, a2q, a2s, y, out;
  // GEMM2 on CUTLASS (use_cutlass2): y then holds max_rows sorted rows, and
  // the call has pair_row [p] and the GEMM's scratch (gemm_cutlass.h).
  // GEMM1 on CUTLASS (use_cutlass1): its scratch.
  bool cutlass1, cutlass2;
  size_t pair_row, cutlass2_ws, cutlass1_ws;
  size_t in_begin, in_end, out_end, total;
};

// GraphKey is what a captured graph bakes in: the call's shape and the
// caller's device buffers the pipeline reads or writes in place (null for
// buffers in the workspace).
struct GraphKey {
  Call call;
  const void* in[4];  // hidden, hidden_scale, bias or topk ids, logits or topk weights
  const void* out;
  bool operator<(const GraphKey& o) const { return std::memcmp(this, &o, sizeof(GraphKey)) < 0; }
};

// kMaxGraphs bounds a lane's graph cache; past it the cache starts over.
constexpr size_t kMaxGraphs = 64;

struct Graph {
  cudaGraphExec_t exec = nullptr;
  int seen = 0;  // calls of this shape so far
  bool failed = false;
};

// Span is a byte range [lo, hi) of a lane's workspace; empty when lo >= hi.
struct Span {
  size_t lo = 0, hi = 0;
  bool holds(size_t a, size_t b) const { return lo <= a && b <= hi && a < b; }
  // add joins [a, b) to the span when they overlap or touch; otherwise the
  // span becomes [a, b) (a span is one range, so it forgets the rest).
  void add(size_t a, size_t b) {
    if (lo < hi && a <= hi && lo <= b) {
      lo = std::min(lo, a);
      hi = std::max(hi, b);
    } else {
      lo = a;
      hi = b;
    }
  }
  // cut takes [a, b) out of the span, keeping the larger side of a hole.
  void cut(size_t a, size_t b) {
    if (b <= lo || hi <= a) return;
    if (a - std::min(a, lo) >= hi - std::min(hi, b)) {
      hi = std::min(hi, a);
    } else {
      lo = std::max(lo, b);
    }
  }
  // keep narrows the span to [a, b).
  void keep(size_t a, size_t b) {
    lo = std::max(lo, a);
    hi = std::min(hi, b);
  }
};

// Lane is what one call in flight on a set needs to itself: a stream, its
// timing events, the device workspace, pinned staging and the graphs that
// bake its addresses in. A set has up to switches().streams of them, so
// calls on one set overlap (one's copies with another's kernels); each call
// holds one lane from its first copy to its last.
struct Lane {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;  // kernel_ms
  cudaEvent_t ev_done = nullptr;             // the call's last copy, untimed
  uint8_t* ws = nullptr;
  size_t ws_bytes = 0;
  bool ws_pooled = false;  // ws came from the stream-ordered pool
  // foreign: the lane's calls run on callers' streams (expertd_moe_device),
  // so only a synchronizing free is sure to come after them.
  bool foreign = false;
  uint8_t* pin_in = nullptr;
  size_t pin_in_bytes = 0;
  // sent: where the workspace holds the same bytes as pin_in (inputs staged
  // and sent by earlier calls, not written since), so a staged input whose
  // bytes match pin_in's there need not be sent again. A call takes it and
  // gives it back only when it succeeds; a new workspace or pin_in empties it.
  Span sent;
  uint8_t* pin_out = nullptr;
  size_t pin_out_bytes = 0;
  std::map<GraphKey, Graph> graphs;

  void drop_graphs() {
    for (auto& kv : graphs) {
      if (kv.second.exec) cudaGraphExecDestroy(kv.second.exec);
    }
    graphs.clear();
  }
  ~Lane() {
    cudaSetDevice(device);
    if (stream) cudaStreamSynchronize(stream);
    drop_graphs();
    free_workspace(*this);
    release_pinned(device, pin_in);
    release_pinned(device, pin_out);
    if (ev0) cudaEventDestroy(ev0);
    if (ev1) cudaEventDestroy(ev1);
    if (ev_done) cudaEventDestroy(ev_done);
    if (stream) cudaStreamDestroy(stream);
  }
};

struct Set {
  int device, cc_major, cc_minor;
  int E, K, N, act;  // act: EXPERTD_ACT_*
  uint8_t* w13 = nullptr;
  uint8_t* w2 = nullptr;
  // Per-expert scales are [E] (a per-tensor one expanded), per-channel
  // [E, rows], block [E, row blocks, K blocks]; see WScale.
  float* w13_scale = nullptr;
  float* w2_scale = nullptr;
  WScale w13_mode, w2_mode;
  int block_n = 0, block_k = 0;  // block mode when > 0 (then both modes are kBlock)
  float a13_scale, a2_scale;   // <= 0: dynamic
  // Optional biases, [E, rows1] and [E, K] (null: none), and SWIGLU_OAI's
  // parameters (expertd_set_params).
  float* w13_bias = nullptr;
  float* w2_bias = nullptr;
  float swiglu_limit, swiglu_alpha;
  bool pooled = false;  // the weights came from the pool (alloc_pooled)
  bool poison = false;  // the poison option when the set was made: NaN-fill before each run

  // Lanes, created on first need; idle holds those no call holds.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Lane>> lanes;
  std::vector<Lane*> idle;
  // expertd_moe_device's lane (its workspace), under dev_mu.
  std::mutex dev_mu;
  std::unique_ptr<Lane> dev_lane;

  ~Set() {
    lanes.clear();  // each waits for its stream
    const bool foreign = dev_lane != nullptr;
    dev_lane.reset();
    free_weights(*this, foreign);
  }
};

// gemm_act is an EXPERTD_ACT_* activation as the GEMMs name it.
inline GemmAct gemm_act(int act) {
  switch (act) {
    case EXPERTD_ACT_RELU2:
      return GemmAct::kRelu2;
    case EXPERTD_ACT_SWIGLU_OAI:
      return GemmAct::kSwigluOAI;
    case EXPERTD_ACT_GELU_TANH_GATED:
      return GemmAct::kGeluTanhGated;
    case EXPERTD_ACT_GELU_GATED:
      return GemmAct::kGeluGated;
  }
  return GemmAct::kSiluGated;
}

// act_gated says whether an EXPERTD_ACT_* activation has gate and up rows.
inline bool act_gated(int act) { return gemm_act_gated(gemm_act(act)); }

// rows1 is GEMM1's weight rows per expert.
inline int64_t rows1(const Set& s) { return act_gated(s.act) ? 2 * int64_t(s.N) : s.N; }

// LaneLease holds one of a set's lanes for a call and gives it back.
class LaneLease {
 public:
  explicit LaneLease(Set& s) : s_(s) {}
  LaneLease(const LaneLease&) = delete;
  LaneLease& operator=(const LaneLease&) = delete;
  ~LaneLease() {
    if (!lane_) return;
    {
      std::lock_guard<std::mutex> lk(s_.mu);
      s_.idle.push_back(lane_);
    }
    s_.cv.notify_one();
  }
  // acquire waits for an idle lane, creating one while the set has fewer
  // than switches().streams; the caller has made the set's device current.
  int acquire();
  Lane& lane() { return *lane_; }

 private:
  Set& s_;
  Lane* lane_ = nullptr;
};

// Mem is where a pointer the caller passed points.
enum class Mem { kPageable, kPinned, kDevice };

// mem_kind asks the driver where p points.
Mem mem_kind(const void* p);

// find_set is the set named by handle, or null; add_set names a new set;
// take_set removes one (it is freed when the last call holding it ends).
std::shared_ptr<Set> find_set(uint64_t h);
uint64_t add_set(std::shared_ptr<Set> s);
std::shared_ptr<Set> take_set(uint64_t h);

// check_device fails unless device is a usable ordinal.
int check_device(int device);

// Policy: which kernels run a set's calls.
int groups(const Set& s, int n);
bool e4m3_mma(const Set& s);
bool sm90_ok(const Set& s);
bool use_pdl(const Set& s);
bool use_sm90(const Set& s, const Call& c);
bool use_cutlass1(const Set& s, const Call& c);
bool use_cutlass2(const Set& s, const Call& c);
int block_rows_for(const Set& s, const Call& c, bool sm90);

// The bodies of the C entry points of the same names (expertd_cuda.h
// documents them); the entry points clear the thread's error first.
int set_create(int device, const expertd_set_params* params, uint64_t* out_handle);
int set_free(uint64_t handle);
int ipc_map(int device, const uint8_t* handle, int handle_len, uint64_t* dev_ptr, uint64_t* bytes);
int ipc_unmap(uint64_t dev_ptr);
int set_options(const expertd_options* opts);
int run_host(uint64_t handle, const expertd_call* call);
int run_device(uint64_t handle, const expertd_call* call);

// The device path's pieces, shared by run_device and the lanes (lane.cu):
// check_device_call validates a call and finds its set (op names the entry
// point in errors); call_layout is the workspace a call needs;
// ensure_workspace grows a lane's workspace to it (synchronizing its
// stream); enqueue_device enqueues the call, its buffers in device memory,
// on st with no host synchronization, so it may be captured.
int check_device_call(uint64_t handle, const expertd_call* call, const char* op, std::shared_ptr<Set>* sp, Call* c);
Layout call_layout(const Set& s, const Call& c);
int ensure_workspace(Lane& l, const Layout& L);
int enqueue_device(Set& s, uint8_t* ws, const Call& c, const Layout& L, const expertd_call& k, cudaStream_t st);

// The GPU-ordered lanes (lane.cu; expertd_cuda.h documents the entry
// points of the same names).
int lane_open(uint64_t set, const expertd_call* call, int depth, uint64_t* lane, uint8_t* flags_handle,
              int handle_len);
int lane_stats(uint64_t lane, uint64_t* served, int32_t* mode);
int lane_close(uint64_t lane);

}  // namespace expertd
