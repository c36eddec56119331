// The fused-MoE pipeline and the C ABI of libexpertd_cuda.so.
//
// One call runs, all on the GPU and on the set's own stream:
//   route (or take precomputed ids) -> align (expert-sorted, block-padded
//   rows) -> gather + quantize hidden into sorted FP8 rows -> GEMM1 with the
//   activation epilogue -> [dynamic a2 only: per-row FP8 requant] -> GEMM2
//   with the router weight -> combine into BF16/FP32.
//
// Dynamic a2 (no static a2 scale): GEMM1 writes the activation as FP32 and a
// small kernel quantizes each pair row with amax/448 (per group of block_k in
// block mode, as the gather kernel does GEMM1's input). That costs one round trip of the
// intermediate (M*top_k*N*4 bytes each way), small next to the weights at
// decode sizes; BF16 would halve it but moves the FP8 roundings off the
// reference's (see moe_gemm.h). With a static a2 scale GEMM1 writes FP8
// directly and nothing extra moves.
//
// Small-M decode would be launch-bound (7 launches), so the host-pointer
// entry captures the pipeline into a CUDA graph per (set, call shape) the
// second time that shape is seen and replays it afterwards; the workspace
// only grows, and a regrow drops the set's graphs.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "expertd_cuda.h"
#include "moe_gemm.h"
#include "moe_kernels.cuh"

namespace expertd {
namespace {

thread_local std::string g_last_error;

int fail(int code, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_last_error = buf;
  return code;
}

int cuda_fail(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  const int code = err == cudaErrorMemoryAllocation ? EXPERTD_ERR_OOM
                   : (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
                      err == cudaErrorInvalidDevice)
                       ? EXPERTD_ERR_NO_DEVICE
                       : EXPERTD_ERR_CUDA;
  return fail(code, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

#define CK(call)                                   \
  do {                                             \
    const cudaError_t err_ = (call);               \
    if (err_ != cudaSuccess) return cuda_fail(err_, #call); \
  } while (0)

// HostTrace prints the host-side stages of one expertd_moe call to stderr
// when EXPERTD_CUDA_HOST_TRACE is set: staging copies in, enqueue, the wait
// for the stream, copies out. It is a diagnostic for the host path (the
// device time is kernel_ms); nothing about the tensors is printed.
struct HostTrace {
  bool on = std::getenv("EXPERTD_CUDA_HOST_TRACE") != nullptr;
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  char buf[256];
  int n = 0;
  void mark(const char* what) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    const double us = std::chrono::duration<double, std::micro>(now - t).count();
    t = now;
    if (n < int(sizeof buf) - 40) n += snprintf(buf + n, sizeof buf - n, " %s=%.1fus", what, us);
  }
  void print(int m) {
    if (on) fprintf(stderr, "expertd_moe host m=%d%s\n", m, buf);
  }
};

size_t align_up(size_t n) { return (n + 255) & ~size_t(255); }

float clamp_scale_host(float s) { return s > kMinScale ? s : kMinScale; }

// Call is the shape of one expertd_moe call: everything that changes kernel
// arguments other than the workspace pointers. It keys the graph cache.
struct Call {
  int m, hidden_dtype, n_hidden_scale, logits_dtype, out_dtype, top_k, renormalize, scoring,
      num_groups, topk_groups, gemm;
  int have_logits, have_bias;
  float scaling;
  bool operator<(const Call& o) const { return std::memcmp(this, &o, sizeof(Call)) < 0; }
};

// Layout is the workspace carve-up for one (M, block_rows).
struct Layout {
  int p, block_rows, max_blocks, max_rows;
  size_t hidden, hscale, logits, bias, ids, w;  // inputs (host path copies into these)
  size_t sorted, block_expert, num_blocks, a1q, a1s, act, a2q, a2s, y, out;
  size_t in_begin, in_end, total;
};

struct Graph {
  cudaGraphExec_t exec = nullptr;
  int seen = 0;  // calls of this shape so far
  bool failed = false;
};

// Lane is what one call in flight on a set needs to itself: a stream, its
// timing events, the device workspace, pinned staging and the graphs that
// bake the workspace's addresses in. A set has up to g_lanes of them, so
// calls on one set overlap (one's copies with another's kernels); each
// call holds one lane from its first copy to its last.
struct Lane {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  uint8_t* ws = nullptr;
  size_t ws_bytes = 0;
  uint8_t* pin_in = nullptr;
  size_t pin_in_bytes = 0;
  uint8_t* pin_out = nullptr;
  size_t pin_out_bytes = 0;
  std::map<Call, Graph> graphs;

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
    cudaFree(ws);
    if (pin_in) cudaFreeHost(pin_in);
    if (pin_out) cudaFreeHost(pin_out);
    if (ev0) cudaEventDestroy(ev0);
    if (ev1) cudaEventDestroy(ev1);
    if (stream) cudaStreamDestroy(stream);
  }
};

// g_lanes is the most calls one set runs at once (expertd_init's streams).
std::atomic<int> g_lanes{2};

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
  bool poison = false;  // EXPERTD_CUDA_POISON=1: NaN-fill outputs and intermediates before each run

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
    dev_lane.reset();
    cudaSetDevice(device);
    cudaFree(w13);
    cudaFree(w2);
    cudaFree(w13_scale);
    cudaFree(w2_scale);
  }
};

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
  // than g_lanes; the caller has made the set's device current.
  int acquire();
  Lane& lane() { return *lane_; }

 private:
  Set& s_;
  Lane* lane_ = nullptr;
};

std::mutex g_sets_mu;
std::map<uint64_t, std::shared_ptr<Set>> g_sets;
uint64_t g_next_handle = 1;

// Mem is where a pointer the caller passed points.
enum class Mem { kPageable, kPinned, kDevice };

Mem mem_kind(const void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return Mem::kPageable;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return Mem::kDevice;
    case cudaMemoryTypeHost:
      return Mem::kPinned;
    default:
      return Mem::kPageable;
  }
}

// IPC mappings by handle bytes: CUDA maps a handle once per process, so
// repeated opens share the mapping and the last close unmaps it.
struct IpcMapping {
  void* ptr;
  size_t bytes;
  int device;
  int refs;
};
std::mutex g_ipc_mu;
std::map<std::string, IpcMapping> g_ipc;

// allocation_size is the size of the allocation starting at base, from the
// driver's cuMemGetAddressRange (the runtime has no equivalent).
int allocation_size(void* base, size_t* size) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult q;
    void* f = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<Fn>(f);
    }
  });
  if (!fn) return fail(EXPERTD_ERR_CUDA, "cuMemGetAddressRange is not available from the driver");
  CUdeviceptr b = 0;
  size_t n = 0;
  if (fn(&b, &n, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS)
    return fail(EXPERTD_ERR_CUDA, "cuMemGetAddressRange failed on an opened IPC handle");
  if (b != reinterpret_cast<CUdeviceptr>(base))
    return fail(EXPERTD_ERR_INVALID, "the IPC mapping does not start its allocation");
  *size = n;
  return EXPERTD_OK;
}

int LaneLease::acquire() {
  std::unique_lock<std::mutex> lk(s_.mu);
  for (;;) {
    if (!s_.idle.empty()) {
      lane_ = s_.idle.back();
      s_.idle.pop_back();
      return EXPERTD_OK;
    }
    if (int(s_.lanes.size()) < std::max(1, g_lanes.load())) break;
    s_.cv.wait(lk);
  }
  auto l = std::make_unique<Lane>();
  l->device = s_.device;
  CK(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
  CK(cudaEventCreate(&l->ev0));
  CK(cudaEventCreate(&l->ev1));
  lane_ = l.get();
  s_.lanes.push_back(std::move(l));
  return EXPERTD_OK;
}

std::shared_ptr<Set> find_set(uint64_t h) {
  std::lock_guard<std::mutex> lk(g_sets_mu);
  auto it = g_sets.find(h);
  return it == g_sets.end() ? nullptr : it->second;
}

int device_count(int* n) {
  const cudaError_t err = cudaGetDeviceCount(n);
  if (err != cudaSuccess) return cuda_fail(err, "cudaGetDeviceCount");
  if (*n <= 0) return fail(EXPERTD_ERR_NO_DEVICE, "no CUDA device");
  return EXPERTD_OK;
}

int check_device(int device) {
  int n = 0;
  if (int rc = device_count(&n)) return rc;
  if (device < 0 || device >= n) return fail(EXPERTD_ERR_NO_DEVICE, "device %d out of range (have %d)", device, n);
  return EXPERTD_OK;
}

// groups is the number of activation scale groups in a row of n values:
// ceil(n/block_k) in block mode, else one.
int groups(const Set& s, int n) { return s.block_k > 0 ? (n + s.block_k - 1) / s.block_k : 1; }

bool e4m3_mma(const Set& s) {
  // The e4m3 mma.sync lives in the sm_90a cubin only; every other card runs
  // the sm_80 cubin or its PTX, which has the FP16 path.
  return s.cc_major == 9 && s.cc_minor == 0;
}

// sm90_ok says whether the Hopper kernels can run the set: the card, the
// shape, and in block mode the block shape (Bk = 128, any Bn).
bool sm90_ok(const Set& s) {
#ifdef EXPERTD_HAVE_SM90
  return s.cc_major == 9 && s.cc_minor == 0 && sm90_supported(s.K, s.N) &&
         (s.block_k == 0 || sm90_block_supported(s.block_n, s.block_k));
#else
  (void)s;
  return false;
#endif
}

// sm90_block_default says whether AUTO runs block sets on the Hopper
// kernels: yes since their device check of 2026-12-03 (TestCases,
// TestDeepSeekV3Full, compute-sanitizer; 1.7x the portable path's speed
// on the full DeepSeek-V3 layer at M=64); EXPERTD_SM90_BLOCK=0 keeps them
// on the portable path (EXPERTD_GEMM_SM90 takes them either way).
bool sm90_block_default() {
  static const bool on = switch_on("EXPERTD_SM90_BLOCK");
  return on;
}

// use_pdl says whether a set's kernels launch with programmatic dependent
// launch (launch.cuh): on sm_90 and later unless EXPERTD_CUDA_PDL=0, which
// is there to time the chain both ways.
bool use_pdl(const Set& s) {
  static const bool on = switch_on("EXPERTD_CUDA_PDL");
  return on && s.cc_major >= 9;
}

// use_sm90 is the GEMM path a call takes: the Hopper kernels when asked for,
// or by default where the card and shape allow them.
bool use_sm90(const Set& s, const Call& c) {
  return c.gemm == EXPERTD_GEMM_SM90 ||
         (c.gemm == EXPERTD_GEMM_AUTO && sm90_ok(s) && (s.block_k == 0 || sm90_block_default()));
}

int block_rows_for(const Set& s, const Call& c, bool sm90) {
#ifdef EXPERTD_HAVE_SM90
  if (sm90) return sm90_block_rows(c.m, c.top_k, s.E, s.block_k > 0, s.K, s.N, s.act == EXPERTD_ACT_SILU_GATED);
#endif
  (void)sm90;
  return portable_block_rows(c.m, c.top_k, s.E);
}

Layout layout(const Set& s, const Call& c, int block_rows) {
  Layout L;
  L.p = c.m * c.top_k;
  L.block_rows = block_rows;
  L.max_blocks = (L.p + block_rows - 1) / block_rows + (L.p < s.E ? L.p : s.E);
  L.max_rows = L.max_blocks * block_rows;
  const size_t m = c.m, K = s.K, N = s.N, P = L.p, R = L.max_rows;
  const size_t g1 = groups(s, s.K), g2 = groups(s, s.N);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  L.in_begin = off;
  // Inputs in the order the host path copies them: hidden states and their
  // scales, then either bias and logits or precomputed ids and weights.
  L.hidden = take(m * K * 4);
  L.hscale = take(m * g1 * 4);
  L.bias = take(size_t(s.E) * 4);
  L.logits = take(m * s.E * 4);
  L.ids = take(P * 4);
  L.w = take(P * 4);
  L.in_end = off;
  L.out = take(m * K * 4);
  L.sorted = take(R * 4);
  L.block_expert = take(size_t(L.max_blocks) * 4);
  L.num_blocks = take(4);
  L.a1q = take(R * K);
  L.a1s = take(R * g1 * 4);
  L.act = take(R * N * 4);  // FP32 GEMM1 output, dynamic a2 only
  L.a2q = take(R * N);
  L.a2s = take(R * g2 * 4);
  L.y = take(P * K * 2);
  L.total = off;
  return L;
}

int ensure_workspace(Lane& l, const Layout& L) {
  if (L.total <= l.ws_bytes) return EXPERTD_OK;
  CK(cudaStreamSynchronize(l.stream));
  l.drop_graphs();
  cudaFree(l.ws);
  l.ws = nullptr;
  l.ws_bytes = 0;
  const size_t want = L.total + L.total / 4;
  CK(cudaMalloc(&l.ws, want));
  // Padding rows of the GEMM inputs are read but never used; start them finite.
  CK(cudaMemsetAsync(l.ws, 0, want, l.stream));
  l.ws_bytes = want;
  return EXPERTD_OK;
}

int ensure_pinned(uint8_t** p, size_t* have, size_t want) {
  if (want <= *have) return EXPERTD_OK;
  if (*p) cudaFreeHost(*p);
  *p = nullptr;
  *have = 0;
  want = want + want / 4;
  CK(cudaHostAlloc(reinterpret_cast<void**>(p), want, cudaHostAllocDefault));
  *have = want;
  return EXPERTD_OK;
}

// Ptrs are the device buffers one pipeline run reads and writes.
struct Ptrs {
  const void* hidden;
  const float* hidden_scale;
  const void* logits;
  const float* bias;
  int32_t* ids;        // routing output, or the precomputed ids
  float* w;            // likewise for weights
  void* out;
};

int enqueue(Set& s, uint8_t* ws, const Call& c, const Layout& L, const Ptrs& p, cudaStream_t st) {
  int32_t* sorted = reinterpret_cast<int32_t*>(ws + L.sorted);
  int32_t* block_expert = reinterpret_cast<int32_t*>(ws + L.block_expert);
  int32_t* num_blocks = reinterpret_cast<int32_t*>(ws + L.num_blocks);
  uint8_t* a1q = ws + L.a1q;
  float* a1s = reinterpret_cast<float*>(ws + L.a1s);
  uint8_t* a2q = ws + L.a2q;
  float* a2s = reinterpret_cast<float*>(ws + L.a2s);
  void* act = ws + L.act;
  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(ws + L.y);
  const int BM = L.block_rows;
  const bool pdl = use_pdl(s);

  if (s.poison) {
    // 0xFF is NaN in FP32, BF16 and E4M3: anything a kernel forgets to write
    // shows up in the output (padding rows stay NaN and must not leak).
    const size_t m = c.m;
    CK(cudaMemsetAsync(p.out, 0xFF, m * s.K * (c.out_dtype == EXPERTD_DTYPE_FLOAT32 ? 4 : 2), st));
    CK(cudaMemsetAsync(ws + L.a1q, 0xFF, L.y + size_t(L.p) * s.K * 2 - L.a1q, st));
    if (c.have_logits) {
      CK(cudaMemsetAsync(p.ids, 0xFF, size_t(L.p) * 4, st));
      CK(cudaMemsetAsync(p.w, 0xFF, size_t(L.p) * 4, st));
    }
  }

  if (c.have_logits) {
    RouteParams rp{c.m, s.E, c.top_k, c.renormalize, c.scoring, c.num_groups, c.topk_groups, c.scaling,
                   c.logits_dtype};
    const int warps = s.E <= 512 ? 4 : 2;
    const size_t smem = size_t(warps) * route_smem_per_warp(s.E);
    CK(launch_kernel(pdl, route_kernel, (c.m + warps - 1) / warps, warps * 32, smem, st, rp, p.logits, p.bias,
                     p.ids, p.w));
  }
  CK(launch_kernel(pdl, align_kernel, 1, 1024, 2 * s.E * sizeof(int), st, p.ids, L.p, s.E, BM, L.max_blocks,
                   sorted, block_expert, num_blocks));

  GatherParams gp;
  gp.m = c.m;
  gp.k = s.K;
  gp.group = s.block_k > 0 ? s.block_k : s.K;
  gp.top_k = c.top_k;
  gp.hidden_dtype = c.hidden_dtype;
  gp.n_hidden_scale = c.n_hidden_scale;
  gp.fallback_scale = s.a13_scale > 0 ? s.a13_scale : 1.0f;
  gp.static_scale = c.hidden_dtype == EXPERTD_DTYPE_FLOAT8_E4M3FN ? 0.f : s.a13_scale;
  CK(launch_kernel(pdl, gather_quant_kernel, L.max_rows, 128, 0, st, gp, p.hidden, p.hidden_scale, sorted,
                   num_blocks, BM, a1q, a1s));
  const bool a1_rows = !(c.hidden_dtype != EXPERTD_DTYPE_FLOAT8_E4M3FN && s.a13_scale > 0);

  const bool sm90 = use_sm90(s, c);
  const bool f16 = c.gemm == EXPERTD_GEMM_PORTABLE_F16 || !e4m3_mma(s);

  MoeGemmArgs g1{};
  g1.w = s.w13;
  g1.num_experts = s.E;
  g1.act = s.act == EXPERTD_ACT_SILU_GATED ? GemmAct::kSiluGated : GemmAct::kRelu2;
  g1.w_rows = s.act == EXPERTD_ACT_SILU_GATED ? 2 * s.N : s.N;
  g1.k = s.K;
  g1.n_out = s.N;
  g1.a = a1q;
  g1.a_rows = L.max_rows;
  g1.block_rows = BM;
  g1.block_expert = block_expert;
  g1.num_blocks = num_blocks;
  g1.max_blocks = L.max_blocks;
  g1.sorted_pairs = sorted;
  g1.a_scale_rows = a1_rows ? a1s : nullptr;
  g1.a_scale_ld = groups(s, s.K);
  g1.a_scale = s.a13_scale > 0 ? clamp_scale_host(s.a13_scale) : 1.f;
  g1.w_scale = s.w13_scale;
  g1.w_mode = s.w13_mode;
  g1.block_n = s.block_n;
  g1.block_k = s.block_k;
  const bool static_a2 = s.a2_scale > 0;
  // Dynamic a2: FP32 intermediate, quantized per row below (moe_gemm.h says
  // why not BF16).
  g1.epilogue = static_a2 ? GemmEpilogue::kAct1FP8 : GemmEpilogue::kAct1F32;
  g1.out = static_a2 ? static_cast<void*>(a2q) : act;
  g1.ld_out = s.N;
  g1.out_inv_scale = static_a2 ? 1.0f / clamp_scale_host(s.a2_scale) : 1.f;
  g1.pair_weight = p.w;
  g1.pdl = pdl;

  cudaError_t err;
#ifdef EXPERTD_HAVE_SM90
  err = sm90 ? launch_gemm1_sm90(g1, st) : launch_gemm1_portable(g1, f16, st);
#else
  err = launch_gemm1_portable(g1, f16, st);
#endif
  if (err != cudaSuccess) return cuda_fail(err, sm90 ? "gemm1 (sm90)" : "gemm1 (portable)");

  if (!static_a2) {
    const int group2 = s.block_k > 0 ? s.block_k : s.N;
    CK(launch_kernel(pdl, requant_kernel<float>, L.max_rows, 128, 0, st, static_cast<const float*>(act), s.N,
                     group2, sorted, num_blocks, BM, a2q, a2s));
  }

  MoeGemmArgs g2 = g1;
  g2.w = s.w2;
  g2.w_rows = s.K;
  g2.k = s.N;
  g2.n_out = s.K;
  g2.act = GemmAct::kRelu2;  // unused by GEMM2
  g2.a = a2q;
  g2.a_scale_rows = static_a2 ? nullptr : a2s;
  g2.a_scale_ld = groups(s, s.N);
  g2.a_scale = static_a2 ? clamp_scale_host(s.a2_scale) : 1.f;
  g2.w_scale = s.w2_scale;
  g2.w_mode = s.w2_mode;
  g2.epilogue = GemmEpilogue::kWeightedBF16;
  g2.out = y;
  g2.ld_out = s.K;
  g2.out_inv_scale = 1.f;
#ifdef EXPERTD_HAVE_SM90
  err = sm90 ? launch_gemm2_sm90(g2, st) : launch_gemm2_portable(g2, f16, st);
#else
  err = launch_gemm2_portable(g2, f16, st);
#endif
  if (err != cudaSuccess) return cuda_fail(err, sm90 ? "gemm2 (sm90)" : "gemm2 (portable)");

  CK(launch_kernel(pdl, combine_kernel, c.m, 256, 0, st, y, p.ids, c.m, c.top_k, s.K, s.E, c.out_dtype, p.out));
  return EXPERTD_OK;
}

// parse_call validates iparams/fparams against the set.
int parse_call(const Set& s, const int64_t* ip, int nip, const float* fp, int nfp, bool have_logits,
               bool have_topk, bool have_bias, Call* c) {
  if (!ip || nip < EXPERTD_NUM_IPARAMS) return fail(EXPERTD_ERR_INVALID, "iparams: need %d, got %d", EXPERTD_NUM_IPARAMS, nip);
  if (!fp || nfp < EXPERTD_NUM_FPARAMS) return fail(EXPERTD_ERR_INVALID, "fparams: need %d, got %d", EXPERTD_NUM_FPARAMS, nfp);
  std::memset(c, 0, sizeof *c);
  auto get = [&](int i) { return ip[i] > 0x7fffffff || ip[i] < -0x7fffffff ? -1 : int(ip[i]); };
  c->m = get(EXPERTD_P_M);
  c->hidden_dtype = get(EXPERTD_P_HIDDEN_DTYPE);
  c->n_hidden_scale = get(EXPERTD_P_N_HIDDEN_SCALE);
  c->logits_dtype = get(EXPERTD_P_LOGITS_DTYPE);
  c->out_dtype = get(EXPERTD_P_OUT_DTYPE);
  c->top_k = get(EXPERTD_P_TOP_K);
  c->renormalize = get(EXPERTD_P_RENORMALIZE) != 0;
  c->scoring = get(EXPERTD_P_SCORING);
  c->num_groups = get(EXPERTD_P_NUM_GROUPS);
  c->topk_groups = get(EXPERTD_P_TOPK_GROUPS);
  c->gemm = get(EXPERTD_P_GEMM);
  c->have_logits = have_logits && !have_topk;
  c->have_bias = c->have_logits && have_bias;
  c->scaling = fp[EXPERTD_F_SCALING_FACTOR];
  if (c->m < 1 || c->m > (1 << 24)) return fail(EXPERTD_ERR_INVALID, "M=%d out of range", c->m);
  if (c->hidden_dtype != EXPERTD_DTYPE_FLOAT32 && c->hidden_dtype != EXPERTD_DTYPE_BFLOAT16 &&
      c->hidden_dtype != EXPERTD_DTYPE_FLOAT8_E4M3FN)
    return fail(EXPERTD_ERR_UNSUPPORTED, "hidden dtype %d", c->hidden_dtype);
  if (c->hidden_dtype == EXPERTD_DTYPE_FLOAT8_E4M3FN) {
    const int n = c->n_hidden_scale;
    const bool per_group = s.block_k > 0 && int64_t(n) == int64_t(c->m) * groups(s, s.K);
    if (n != 0 && n != 1 && n != c->m && !per_group) {
      if (s.block_k > 0)
        return fail(EXPERTD_ERR_INVALID, "hidden_scale: %d values, want 1, M=%d or M*ceil(K/block_k)=%lld", n, c->m,
                    (long long)c->m * groups(s, s.K));
      return fail(EXPERTD_ERR_INVALID, "hidden_scale: %d values, want 1 or M=%d (per-group scales need a block set)",
                  n, c->m);
    }
  } else {
    c->n_hidden_scale = 0;
  }
  if (c->out_dtype != EXPERTD_DTYPE_FLOAT32 && c->out_dtype != EXPERTD_DTYPE_BFLOAT16)
    return fail(EXPERTD_ERR_UNSUPPORTED, "out dtype %d", c->out_dtype);
  if (c->top_k < 1 || c->top_k > s.E || c->top_k > EXPERTD_MAX_TOP_K)
    return fail(EXPERTD_ERR_INVALID, "top_k=%d with %d experts (max %d)", c->top_k, s.E, EXPERTD_MAX_TOP_K);
  if (c->gemm < EXPERTD_GEMM_AUTO || c->gemm > EXPERTD_GEMM_SM90) return fail(EXPERTD_ERR_INVALID, "gemm=%d", c->gemm);
  if (c->gemm == EXPERTD_GEMM_SM90 && !sm90_ok(s))
    return fail(EXPERTD_ERR_UNSUPPORTED,
                "sm90 GEMM unavailable for this card/shape/scales (K=%d N=%d block %d x %d; it takes K and N "
                "multiples of 16 and block scales with Bk = 128)",
                s.K, s.N, s.block_n, s.block_k);
  if (!have_logits && !have_topk) return fail(EXPERTD_ERR_INVALID, "need logits or topk ids and weights");
  if (c->have_logits) {
    if (c->logits_dtype != EXPERTD_DTYPE_FLOAT32 && c->logits_dtype != EXPERTD_DTYPE_BFLOAT16)
      return fail(EXPERTD_ERR_UNSUPPORTED, "logits dtype %d", c->logits_dtype);
    if (c->scoring != EXPERTD_SCORING_SOFTMAX && c->scoring != EXPERTD_SCORING_SIGMOID)
      return fail(EXPERTD_ERR_INVALID, "scoring %d", c->scoring);
    if (c->num_groups > 1) {
      if (s.E % c->num_groups != 0 || c->topk_groups < 1 || c->topk_groups > c->num_groups ||
          c->top_k > c->topk_groups * (s.E / c->num_groups))
        return fail(EXPERTD_ERR_INVALID, "groups: %d groups, top %d groups, top_k %d, %d experts", c->num_groups,
                    c->topk_groups, c->top_k, s.E);
    } else {
      c->num_groups = 0;
      c->topk_groups = 0;
    }
    if (!(c->scaling > 0)) c->scaling = 1.f;  // the wire's "0 means 1"
  } else {
    c->logits_dtype = 0;
    c->scoring = 0;
    c->renormalize = 0;
    c->num_groups = 0;
    c->topk_groups = 0;
    c->scaling = 0;
  }
  return EXPERTD_OK;
}

}  // namespace
}  // namespace expertd

using namespace expertd;

extern "C" {

int expertd_abi_version(void) { return EXPERTD_ABI_VERSION; }

const char* expertd_last_error(void) { return g_last_error.c_str(); }

int expertd_init(int device, int streams) {
  g_last_error.clear();
  if (streams < 1 || streams > EXPERTD_MAX_STREAMS)
    return fail(EXPERTD_ERR_INVALID, "init: %d streams per set, want 1..%d", streams, EXPERTD_MAX_STREAMS);
  g_lanes = streams;
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  CK(cudaFree(nullptr));  // creates the primary context now, not in the first call
  return EXPERTD_OK;
}

int expertd_device_info(int device, char* buf, int buflen) {
  g_last_error.clear();
  if (!buf || buflen <= 0) return fail(EXPERTD_ERR_INVALID, "device_info: no buffer");
  if (int rc = check_device(device)) return rc;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  const bool hopper = prop.major == 9 && prop.minor == 0;
#ifdef EXPERTD_HAVE_SM90
  const char* gemm = hopper ? "sm90" : "portable-f16";
#else
  const char* gemm = hopper ? "portable-e4m3" : "portable-f16";
#endif
  snprintf(buf, size_t(buflen), "%s (sm_%d%d, %d SMs, %.0f GiB, gemm=%s)", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, double(prop.totalGlobalMem) / double(1ull << 30), gemm);
  return EXPERTD_OK;
}

int expertd_set_create(int device, int num_experts, int hidden, int inter, int activation, const uint8_t* w13,
                       const uint8_t* w2, const float* w13_scale, int n_w13_scale, const float* w2_scale,
                       int n_w2_scale, int block_n, int block_k, float a13_scale, float a2_scale,
                       uint64_t* out_handle) {
  g_last_error.clear();
  if (!out_handle) return fail(EXPERTD_ERR_INVALID, "set_create: out_handle is NULL");
  *out_handle = 0;
  if (num_experts < 1 || num_experts > EXPERTD_MAX_EXPERTS)
    return fail(EXPERTD_ERR_UNSUPPORTED, "num_experts=%d (1..%d)", num_experts, EXPERTD_MAX_EXPERTS);
  if (hidden < 1 || inter < 1 || hidden > (1 << 20) || inter > (1 << 20))
    return fail(EXPERTD_ERR_INVALID, "hidden=%d inter=%d", hidden, inter);
  if (activation != EXPERTD_ACT_SILU_GATED && activation != EXPERTD_ACT_RELU2)
    return fail(EXPERTD_ERR_UNSUPPORTED, "activation %d", activation);
  if (!w13 || !w2 || !w13_scale || !w2_scale) return fail(EXPERTD_ERR_INVALID, "set_create: NULL weights or scales");
  const int64_t E = num_experts, rows1 = activation == EXPERTD_ACT_SILU_GATED ? 2 * int64_t(inter) : inter;
  WScale m13, m2;
  if (block_n < 0 || block_k < 0 || (block_n > 0) != (block_k > 0))
    return fail(EXPERTD_ERR_INVALID, "block %d x %d: want both > 0 (block mode) or both 0", block_n, block_k);
  if (block_n > 0) {
    auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
    const int64_t want13 = E * cdiv(rows1, block_n) * cdiv(hidden, block_k);
    const int64_t want2 = E * cdiv(hidden, block_n) * cdiv(inter, block_k);
    if (n_w13_scale != want13 || n_w2_scale != want2)
      return fail(EXPERTD_ERR_INVALID,
                  "block %d x %d: weight scales have %d and %d values, want [E, ceil(rows/%d), ceil(cols/%d)] = %lld "
                  "and %lld",
                  block_n, block_k, n_w13_scale, n_w2_scale, block_n, block_k, (long long)want13, (long long)want2);
    m13 = m2 = WScale::kBlock;
  } else {
    // Per-tensor (1) and per-expert (E) scales both become [E]; E*rows is
    // per-channel (when rows is 1 the two agree).
    auto mode = [&](int n, int64_t rows, WScale* m) {
      if (n == 1 || n == E) {
        *m = WScale::kPerExpert;
      } else if (n == E * rows) {
        *m = WScale::kPerChannel;
      } else {
        return false;
      }
      return true;
    };
    if (!mode(n_w13_scale, rows1, &m13) || !mode(n_w2_scale, hidden, &m2))
      return fail(EXPERTD_ERR_INVALID,
                  "weight scales: %d and %d values, want 1, E=%lld or E*rows (%lld and %lld) without a block",
                  n_w13_scale, n_w2_scale, (long long)E, (long long)(E * rows1), (long long)(E * hidden));
  }
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));

  auto s = std::make_shared<Set>();
  s->device = device;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  s->cc_major = prop.major;
  s->cc_minor = prop.minor;
  if (prop.major < 8) return fail(EXPERTD_ERR_UNSUPPORTED, "%s is sm_%d%d; need sm_80 or newer", prop.name, prop.major, prop.minor);
  s->E = num_experts;
  s->K = hidden;
  s->N = inter;
  s->act = activation;
  s->w13_mode = m13;
  s->w2_mode = m2;
  s->block_n = block_n;
  s->block_k = block_k;
  s->a13_scale = a13_scale;
  s->a2_scale = a2_scale;
  const char* poison = getenv("EXPERTD_CUDA_POISON");
  s->poison = poison && poison[0] == '1';
  const size_t n13 = size_t(num_experts) * rows1 * hidden, n2 = size_t(num_experts) * hidden * inter;
  CK(cudaMalloc(&s->w13, n13));
  CK(cudaMalloc(&s->w2, n2));
  CK(cudaMemcpy(s->w13, w13, n13, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s->w2, w2, n2, cudaMemcpyHostToDevice));
  // upload_scale copies a scale to the device, a per-tensor one expanded to
  // one per expert so the kernels index per-expert scales alike.
  auto upload_scale = [&](float** dst, const float* src, int n, WScale m) -> int {
    std::vector<float> sc;
    if (m == WScale::kPerExpert && n == 1) {
      sc.assign(num_experts, src[0]);
    } else {
      sc.assign(src, src + n);
    }
    CK(cudaMalloc(dst, sc.size() * sizeof(float)));
    CK(cudaMemcpy(*dst, sc.data(), sc.size() * sizeof(float), cudaMemcpyHostToDevice));
    return EXPERTD_OK;
  };
  if (int rc = upload_scale(&s->w13_scale, w13_scale, n_w13_scale, m13)) return rc;
  if (int rc = upload_scale(&s->w2_scale, w2_scale, n_w2_scale, m2)) return rc;

  std::lock_guard<std::mutex> lk(g_sets_mu);
  const uint64_t h = g_next_handle++;
  g_sets[h] = std::move(s);
  *out_handle = h;
  return EXPERTD_OK;
}

int expertd_set_free(uint64_t handle) {
  g_last_error.clear();
  std::shared_ptr<Set> s;
  {
    std::lock_guard<std::mutex> lk(g_sets_mu);
    auto it = g_sets.find(handle);
    if (it == g_sets.end()) return fail(EXPERTD_ERR_NOT_FOUND, "set_free: unknown handle %llu", (unsigned long long)handle);
    s = std::move(it->second);
    g_sets.erase(it);
  }
  return EXPERTD_OK;  // ~Set frees when the last call in flight lets go of it
}

int expertd_moe(uint64_t handle, const int64_t* iparams, int n_iparams, const float* fparams, int n_fparams,
                const void* hidden, const float* hidden_scale, const void* logits, const float* correction_bias,
                const int32_t* topk_ids_in, const float* topk_w_in, void* out, int32_t* topk_ids_out,
                float* topk_w_out, float* kernel_ms) {
  g_last_error.clear();
  auto sp = find_set(handle);
  if (!sp) return fail(EXPERTD_ERR_NOT_FOUND, "moe: unknown handle %llu", (unsigned long long)handle);
  Set& s = *sp;
  const bool have_topk = topk_ids_in && topk_w_in;
  Call c;
  if (int rc = parse_call(s, iparams, n_iparams, fparams, n_fparams, logits != nullptr, have_topk,
                          correction_bias != nullptr, &c))
    return rc;
  if (!hidden || !out) return fail(EXPERTD_ERR_INVALID, "moe: NULL hidden or out");
  if (c.n_hidden_scale > 0 && !hidden_scale) return fail(EXPERTD_ERR_INVALID, "moe: NULL hidden_scale");
  CK(cudaSetDevice(s.device));
  HostTrace tr;
  LaneLease lease(s);
  if (int rc = lease.acquire()) return rc;
  Lane& ln = lease.lane();
  tr.mark("lane");

  const bool sm90 = use_sm90(s, c);
  const Layout L = layout(s, c, block_rows_for(s, c, sm90));
  if (int rc = ensure_workspace(ln, L)) return rc;

  const size_t hsz = c.hidden_dtype == EXPERTD_DTYPE_FLOAT32 ? 4 : c.hidden_dtype == EXPERTD_DTYPE_BFLOAT16 ? 2 : 1;
  const size_t osz = c.out_dtype == EXPERTD_DTYPE_FLOAT32 ? 4 : 2;
  const size_t m = c.m, K = s.K, P = L.p;
  const size_t lsz = c.logits_dtype == EXPERTD_DTYPE_BFLOAT16 ? 2 : 4;
  if (int rc = ensure_pinned(&ln.pin_in, &ln.pin_in_bytes, L.in_end)) return rc;
  if (int rc = ensure_pinned(&ln.pin_out, &ln.pin_out_bytes, align_up(m * K * 4) + 2 * align_up(P * 4))) return rc;
  cudaStream_t st = ln.stream;

  // Inputs in workspace order. Device memory (a CUDA IPC region) and
  // page-locked host memory (a registered shared-memory region) are copied
  // straight into the workspace; pageable memory goes through the lane's
  // pinned staging, where consecutive staged inputs share one copy. Copying
  // even device inputs keeps the workspace addresses the graphs baked in.
  struct In {
    size_t off;
    const void* src;
    size_t bytes;
  } ins[4];
  int nin = 0;
  ins[nin++] = {L.hidden, hidden, m * K * hsz};
  if (c.n_hidden_scale > 0) ins[nin++] = {L.hscale, hidden_scale, size_t(c.n_hidden_scale) * 4};
  if (c.have_logits) {
    if (c.have_bias) ins[nin++] = {L.bias, correction_bias, size_t(s.E) * 4};
    ins[nin++] = {L.logits, logits, m * s.E * lsz};
  } else {
    ins[nin++] = {L.ids, topk_ids_in, P * 4};
    ins[nin++] = {L.w, topk_w_in, P * 4};
  }
  uint8_t* pin = ln.pin_in;
  size_t lo = 0, hi = 0;  // the staged range not yet copied
  auto flush = [&]() -> int {
    if (hi > lo) CK(cudaMemcpyAsync(ln.ws + lo, pin + lo, hi - lo, cudaMemcpyHostToDevice, st));
    lo = hi = 0;
    return EXPERTD_OK;
  };
  for (int i = 0; i < nin; ++i) {
    const In& x = ins[i];
    if (mem_kind(x.src) == Mem::kPageable) {
      std::memcpy(pin + x.off, x.src, x.bytes);
      if (hi == 0) lo = x.off;
      hi = x.off + x.bytes;
    } else {
      if (int rc = flush()) return rc;
      CK(cudaMemcpyAsync(ln.ws + x.off, x.src, x.bytes, cudaMemcpyDefault, st));
    }
  }
  if (int rc = flush()) return rc;
  tr.mark("stage_in");

  Ptrs p;
  p.hidden = ln.ws + L.hidden;
  p.hidden_scale = reinterpret_cast<const float*>(ln.ws + L.hscale);
  p.logits = ln.ws + L.logits;
  p.bias = c.have_bias ? reinterpret_cast<const float*>(ln.ws + L.bias) : nullptr;
  p.ids = reinterpret_cast<int32_t*>(ln.ws + L.ids);
  p.w = reinterpret_cast<float*>(ln.ws + L.w);
  p.out = ln.ws + L.out;

  const bool use_graph = iparams[EXPERTD_P_USE_GRAPH] != 0;
  CK(cudaEventRecord(ln.ev0, st));
  Graph* g = nullptr;
  if (use_graph) {
    if (ln.graphs.size() >= 64 && !ln.graphs.count(c)) ln.drop_graphs();
    g = &ln.graphs[c];
    g->seen++;
  }
  if (g && g->exec) {
    CK(cudaGraphLaunch(g->exec, st));
  } else if (g && g->seen >= 2 && !g->failed) {
    // Second call of this shape: capture it. The first ran uncaptured, so
    // one-time setup (function attributes, driver entry points) is done.
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const int rc = enqueue(s, ln.ws, c, L, p, st);
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(st, &graph);
    if (rc != EXPERTD_OK) {
      if (graph) cudaGraphDestroy(graph);
      return rc;
    }
    cudaError_t err = end;
    if (err == cudaSuccess) err = cudaGraphInstantiate(&g->exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (err != cudaSuccess) {
      cudaGetLastError();
      g->failed = true;
      g->exec = nullptr;
      if (int rc2 = enqueue(s, ln.ws, c, L, p, st)) return rc2;
    } else {
      CK(cudaGraphLaunch(g->exec, st));
    }
  } else {
    if (int rc = enqueue(s, ln.ws, c, L, p, st)) return rc;
  }
  CK(cudaEventRecord(ln.ev1, st));

  // Outputs: as the inputs, straight to device or page-locked memory, else
  // through pinned staging and a host copy after the stream is done.
  uint8_t* po = ln.pin_out;
  struct Out {
    void* dst;
    const void* src;
    size_t bytes, pin_off;
    bool staged;
  } outs[3];
  int nout = 0;
  outs[nout++] = {out, p.out, m * K * osz, 0, false};
  if (topk_ids_out) outs[nout++] = {topk_ids_out, p.ids, P * 4, align_up(m * K * osz), false};
  if (topk_w_out) outs[nout++] = {topk_w_out, p.w, P * 4, align_up(m * K * osz) + align_up(P * 4), false};
  for (int i = 0; i < nout; ++i) {
    Out& o = outs[i];
    o.staged = mem_kind(o.dst) == Mem::kPageable;
    CK(cudaMemcpyAsync(o.staged ? po + o.pin_off : o.dst, o.src, o.bytes, cudaMemcpyDefault, st));
  }
  tr.mark("enqueue");
  CK(cudaStreamSynchronize(st));
  tr.mark("sync");
  for (int i = 0; i < nout; ++i) {
    if (outs[i].staged) std::memcpy(outs[i].dst, po + outs[i].pin_off, outs[i].bytes);
  }
  if (kernel_ms) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ln.ev0, ln.ev1));
    *kernel_ms = ms;
  }
  tr.mark("copy_out");
  tr.print(c.m);
  return EXPERTD_OK;
}

int expertd_moe_device(uint64_t handle, const int64_t* iparams, int n_iparams, const float* fparams,
                       int n_fparams, const void* hidden, const float* hidden_scale, const void* logits,
                       const float* correction_bias, const int32_t* topk_ids_in, const float* topk_w_in, void* out,
                       int32_t* topk_ids_out, float* topk_w_out, uintptr_t stream) {
  g_last_error.clear();
  auto sp = find_set(handle);
  if (!sp) return fail(EXPERTD_ERR_NOT_FOUND, "moe_device: unknown handle %llu", (unsigned long long)handle);
  Set& s = *sp;
  const bool have_topk = topk_ids_in && topk_w_in;
  Call c;
  if (int rc = parse_call(s, iparams, n_iparams, fparams, n_fparams, logits != nullptr, have_topk,
                          correction_bias != nullptr, &c))
    return rc;
  if (!hidden || !out) return fail(EXPERTD_ERR_INVALID, "moe_device: NULL hidden or out");
  if (c.n_hidden_scale > 0 && !hidden_scale) return fail(EXPERTD_ERR_INVALID, "moe_device: NULL hidden_scale");
  CK(cudaSetDevice(s.device));
  // Its own lane, apart from the host entry's: the caller orders these
  // calls (one stream at a time), and the work may be captured into the
  // caller's graph, so nothing here may wait on or join other streams.
  std::lock_guard<std::mutex> lk(s.dev_mu);
  if (!s.dev_lane) {
    s.dev_lane = std::make_unique<Lane>();
    s.dev_lane->device = s.device;
    CK(cudaStreamCreateWithFlags(&s.dev_lane->stream, cudaStreamNonBlocking));
  }
  Lane& ln = *s.dev_lane;
  const bool sm90 = use_sm90(s, c);
  const Layout L = layout(s, c, block_rows_for(s, c, sm90));
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (L.total > ln.ws_bytes) {
    // Growing frees the old workspace, which work queued on the caller's
    // stream may still read.
    CK(cudaStreamSynchronize(st));
    if (int rc = ensure_workspace(ln, L)) return rc;
    CK(cudaStreamSynchronize(ln.stream));
  }
  const size_t P = L.p;
  Ptrs p;
  p.hidden = hidden;
  p.hidden_scale = hidden_scale;
  p.logits = logits;
  p.bias = c.have_bias ? correction_bias : nullptr;
  if (have_topk) {
    p.ids = const_cast<int32_t*>(topk_ids_in);
    p.w = const_cast<float*>(topk_w_in);
  } else {
    p.ids = topk_ids_out ? topk_ids_out : reinterpret_cast<int32_t*>(ln.ws + L.ids);
    p.w = topk_w_out ? topk_w_out : reinterpret_cast<float*>(ln.ws + L.w);
  }
  p.out = out;
  if (int rc = enqueue(s, ln.ws, c, L, p, st)) return rc;
  if (have_topk) {
    if (topk_ids_out) CK(cudaMemcpyAsync(topk_ids_out, topk_ids_in, P * 4, cudaMemcpyDeviceToDevice, st));
    if (topk_w_out) CK(cudaMemcpyAsync(topk_w_out, topk_w_in, P * 4, cudaMemcpyDeviceToDevice, st));
  }
  return EXPERTD_OK;
}

int expertd_host_register(int device, void* ptr, uint64_t bytes) {
  g_last_error.clear();
  if (!ptr || bytes == 0) return fail(EXPERTD_ERR_INVALID, "host_register: NULL or empty range");
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  CK(cudaHostRegister(ptr, size_t(bytes), cudaHostRegisterPortable));
  return EXPERTD_OK;
}

int expertd_host_unregister(int device, void* ptr) {
  g_last_error.clear();
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  CK(cudaHostUnregister(ptr));
  return EXPERTD_OK;
}

int expertd_ipc_open(int device, const uint8_t* handle, int handle_len, uint64_t* dev_ptr, uint64_t* bytes) {
  g_last_error.clear();
  if (!handle || !dev_ptr || !bytes) return fail(EXPERTD_ERR_INVALID, "ipc_open: NULL argument");
  if (handle_len != EXPERTD_IPC_HANDLE_BYTES)
    return fail(EXPERTD_ERR_INVALID, "ipc_open: handle has %d bytes, want %d", handle_len, EXPERTD_IPC_HANDLE_BYTES);
  *dev_ptr = *bytes = 0;
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  const std::string key(reinterpret_cast<const char*>(handle), size_t(handle_len));
  std::lock_guard<std::mutex> lk(g_ipc_mu);
  auto it = g_ipc.find(key);
  if (it == g_ipc.end()) {
    // One mapping per handle per process (CUDA refuses to map a handle
    // twice in one process); later opens share it.
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, sizeof h);
    void* p = nullptr;
    CK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    size_t size = 0;
    if (int rc = allocation_size(p, &size)) {
      cudaIpcCloseMemHandle(p);
      return rc;
    }
    it = g_ipc.emplace(key, IpcMapping{p, size, device, 0}).first;
  }
  it->second.refs++;
  *dev_ptr = reinterpret_cast<uint64_t>(it->second.ptr);
  *bytes = it->second.bytes;
  return EXPERTD_OK;
}

int expertd_ipc_close(uint64_t dev_ptr) {
  g_last_error.clear();
  std::lock_guard<std::mutex> lk(g_ipc_mu);
  for (auto it = g_ipc.begin(); it != g_ipc.end(); ++it) {
    if (reinterpret_cast<uint64_t>(it->second.ptr) != dev_ptr) continue;
    if (--it->second.refs > 0) return EXPERTD_OK;
    CK(cudaSetDevice(it->second.device));
    const cudaError_t err = cudaIpcCloseMemHandle(it->second.ptr);
    g_ipc.erase(it);
    if (err != cudaSuccess) return cuda_fail(err, "cudaIpcCloseMemHandle");
    return EXPERTD_OK;
  }
  return fail(EXPERTD_ERR_NOT_FOUND, "ipc_close: 0x%llx is not an opened handle", (unsigned long long)dev_ptr);
}

int expertd_dev_alloc(int device, uint64_t bytes, uint64_t* dev_ptr) {
  g_last_error.clear();
  if (!dev_ptr || bytes == 0) return fail(EXPERTD_ERR_INVALID, "dev_alloc: NULL out or zero bytes");
  *dev_ptr = 0;
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  void* p = nullptr;
  CK(cudaMalloc(&p, size_t(bytes)));
  *dev_ptr = reinterpret_cast<uint64_t>(p);
  return EXPERTD_OK;
}

int expertd_dev_free(int device, uint64_t dev_ptr) {
  g_last_error.clear();
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  CK(cudaFree(reinterpret_cast<void*>(dev_ptr)));
  return EXPERTD_OK;
}

int expertd_ipc_export(int device, uint64_t dev_ptr, uint8_t* handle, int handle_len) {
  g_last_error.clear();
  if (!handle || handle_len != EXPERTD_IPC_HANDLE_BYTES)
    return fail(EXPERTD_ERR_INVALID, "ipc_export: want a %d-byte handle buffer", EXPERTD_IPC_HANDLE_BYTES);
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(dev_ptr)));
  std::memcpy(handle, &h, sizeof h);
  return EXPERTD_OK;
}

int expertd_copy(int device, uint64_t dst, uint64_t src, uint64_t bytes) {
  g_last_error.clear();
  if (bytes == 0) return EXPERTD_OK;
  if (!dst || !src) return fail(EXPERTD_ERR_INVALID, "copy: NULL pointer");
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  CK(cudaMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size_t(bytes), cudaMemcpyDefault));
  return EXPERTD_OK;
}

}  // extern "C"
