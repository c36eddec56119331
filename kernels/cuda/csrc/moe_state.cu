// Process state of the library: see moe_state.h.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gemm_cutlass.h"
#include "moe_state.h"

namespace expertd {

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

namespace {

// Quiet is the state of release(): the lanes open, the releases waiting
// for them to close, and the host ranges whose unregistration is among
// those. Its mutex is held while a release runs, so no lane opens (and
// enqueues waits) while a synchronizing call is in progress.
struct Quiet {
  std::mutex mu;
  int lanes = 0;
  std::vector<std::function<int()>> later;
  std::map<uintptr_t, size_t> unpinning;  // base -> bytes
};
Quiet& quiet() {
  static Quiet q;
  return q;
}
// g_unpinning says whether quiet().unpinning has ranges, so mem_kind asks
// only then.
std::atomic<bool> g_unpinning{false};

// Registered host ranges (base -> bytes), for the range an unregistration
// leaves unusable until it runs.
std::mutex g_pinned_mu;
std::map<uintptr_t, size_t> g_pinned;

// overlaps says whether [p, p+n) meets a range of m.
bool overlaps(const std::map<uintptr_t, size_t>& m, uintptr_t p, size_t n) {
  auto it = m.upper_bound(p);
  if (it != m.end() && it->first < p + n) return true;
  if (it == m.begin()) return false;
  --it;
  return p < it->first + it->second;
}

// unpinning says whether ptr lies in a range whose unregistration waits.
bool unpinning(const void* ptr) {
  if (!g_unpinning.load()) return false;
  std::lock_guard<std::mutex> lk(quiet().mu);
  return overlaps(quiet().unpinning, reinterpret_cast<uintptr_t>(ptr), 1);
}

}  // namespace

LaneHold::LaneHold() {
  std::lock_guard<std::mutex> lk(quiet().mu);
  quiet().lanes++;
}

LaneHold::~LaneHold() {
  Quiet& q = quiet();
  std::lock_guard<std::mutex> lk(q.mu);
  if (--q.lanes > 0) return;
  // Errors here have no caller left to report to.
  for (auto& fn : q.later) fn();
  q.later.clear();
  q.unpinning.clear();
  g_unpinning.store(false);
}

int release(std::function<int()> fn) {
  Quiet& q = quiet();
  std::lock_guard<std::mutex> lk(q.mu);
  if (q.lanes == 0) return fn();
  q.later.push_back(std::move(fn));
  return EXPERTD_OK;
}

namespace {

// release_with releases p with free on device's context.
int release_with(int device, void* p, cudaError_t (*free)(void*), const char* what) {
  if (!p) return EXPERTD_OK;
  return release([device, p, free, what] {
    CK(cudaSetDevice(device));
    if (const cudaError_t err = free(p)) return cuda_fail(err, what);
    return EXPERTD_OK;
  });
}

}  // namespace

int release_device(int device, void* p) { return release_with(device, p, cudaFree, "cudaFree"); }

int release_pinned(int device, void* p) { return release_with(device, p, cudaFreeHost, "cudaFreeHost"); }

namespace {

// pool is the device's stream-ordered pool. It keeps what is freed (no
// release threshold): trimming it is device-wide work a waiting lane could
// hold up, and what a set or a workspace gave back is what the next one
// takes.
int pool(int device, cudaMemPool_t* out) {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lk(mu);
  auto it = pools.find(device);
  if (it == pools.end()) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t p = nullptr;
    CK(cudaMemPoolCreate(&p, &props));
    uint64_t keep = UINT64_MAX;
    if (const cudaError_t err = cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &keep)) {
      cudaMemPoolDestroy(p);
      return cuda_fail(err, "cudaMemPoolSetAttribute(release threshold)");
    }
    it = pools.emplace(device, p).first;
  }
  *out = it->second;
  return EXPERTD_OK;
}

}  // namespace

bool lanes_open() {
  std::lock_guard<std::mutex> lk(quiet().mu);
  return quiet().lanes > 0;
}

int alloc_pooled(int device, size_t bytes, cudaStream_t st, void** p) {
  cudaMemPool_t mp;
  if (int rc = pool(device, &mp)) return rc;
  CK(cudaMallocFromPoolAsync(p, bytes, mp, st));
  return EXPERTD_OK;
}

int alloc_workspace(Lane& l, size_t bytes) {
  Quiet& q = quiet();
  // Held while allocating, so no lane opens during a cudaMalloc.
  std::lock_guard<std::mutex> lk(q.mu);
  void* p = nullptr;
  const bool pooled = q.lanes > 0 && !l.foreign;
  if (pooled) {
    if (int rc = alloc_pooled(l.device, bytes, l.stream, &p)) return rc;
  } else {
    CK(cudaMalloc(&p, bytes));
  }
  l.ws = static_cast<uint8_t*>(p);
  l.ws_pooled = pooled;
  return EXPERTD_OK;
}

void free_workspace(Lane& l) {
  if (!l.ws) return;
  if (l.ws_pooled) {
    // After the stream's work that uses it, on the stream that made it.
    if (cudaFreeAsync(l.ws, l.stream) != cudaSuccess) cudaGetLastError();
  } else {
    release_device(l.device, l.ws);
  }
  l.ws = nullptr;
  l.ws_bytes = 0;
  l.ws_pooled = false;
}

void free_weights(Set& s, bool foreign) {
  void* ps[] = {s.w13, s.w2, s.w13_scale, s.w2_scale, s.w13_bias, s.w2_bias};
  if (!s.pooled) {
    for (void* p : ps) release_device(s.device, p);
    return;
  }
  if (foreign) {
    // Ordered after callers' streams only by synchronizing the device,
    // which waits for the lanes to close.
    const int device = s.device;
    release([device, ps] {
      CK(cudaSetDevice(device));
      CK(cudaDeviceSynchronize());
      for (void* p : ps) {
        if (p) CK(cudaFreeAsync(p, nullptr));
      }
      return EXPERTD_OK;
    });
    return;
  }
  // The set's lanes have finished with them (~Lane synchronizes its
  // stream); a stream of their own, destroyed once its frees are queued.
  cudaSetDevice(s.device);
  cudaStream_t st = nullptr;
  if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  for (void* p : ps) {
    if (p && cudaFreeAsync(p, st) != cudaSuccess) cudaGetLastError();
  }
  cudaStreamDestroy(st);
}

int host_register(int device, void* ptr, size_t bytes) {
  if (!ptr || bytes == 0) return fail(EXPERTD_ERR_INVALID, "host_register: NULL or empty range");
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  {
    // The driver still holds the old pages of a range whose unregistration
    // waits; registering over it would read those.
    std::lock_guard<std::mutex> lk(quiet().mu);
    if (overlaps(quiet().unpinning, p, bytes))
      return fail(EXPERTD_ERR_UNSUPPORTED,
                  "host_register: the range overlaps memory whose unregistration waits for the open lanes to close");
  }
  CK(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  std::lock_guard<std::mutex> lk(g_pinned_mu);
  g_pinned[p] = bytes;
  return EXPERTD_OK;
}

int host_unregister(int device, void* ptr) {
  if (int rc = check_device(device)) return rc;
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lk(g_pinned_mu);
    auto it = g_pinned.find(p);
    if (it == g_pinned.end())
      return fail(EXPERTD_ERR_NOT_FOUND, "host_unregister: %p is not a registered range", ptr);
    bytes = it->second;
    g_pinned.erase(it);
  }
  Quiet& q = quiet();
  std::lock_guard<std::mutex> lk(q.mu);
  auto unpin = [device, ptr] {
    CK(cudaSetDevice(device));
    CK(cudaHostUnregister(ptr));
    return EXPERTD_OK;
  };
  if (q.lanes == 0) return unpin();
  q.later.push_back(unpin);
  q.unpinning[p] = bytes;
  g_unpinning.store(true);
  return EXPERTD_OK;
}

namespace {
// env_switch is a three-way development switch from the environment: 0
// or 1 as set, -1 (the library's rule) when unset or anything else.
int env_switch(const char* name) {
  const char* v = std::getenv(name);
  return !v ? -1 : std::strcmp(v, "0") == 0 ? 0 : std::strcmp(v, "1") == 0 ? 1 : -1;
}
}  // namespace

int set_options(const expertd_options* o) {
  expertd_options d;
  if (!o) {
    expertd_options_default(&d);
    o = &d;
  }
  if (o->size < sizeof(expertd_options) || o->version != EXPERTD_ABI_VERSION)
    return fail(EXPERTD_ERR_INVALID, "init: options of %u bytes, ABI %u; this library takes %zu bytes, ABI %d",
                o->size, o->version, sizeof(expertd_options), EXPERTD_ABI_VERSION);
  if (o->streams < 1 || o->streams > EXPERTD_MAX_STREAMS)
    return fail(EXPERTD_ERR_INVALID, "init: %d streams per set, want 1..%d", o->streams, EXPERTD_MAX_STREAMS);
  if (o->sync_spin_us < 0 || o->sync_spin_us > EXPERTD_MAX_SPIN_US)
    return fail(EXPERTD_ERR_INVALID, "init: sync_spin_us=%d, want 0..%d", o->sync_spin_us, EXPERTD_MAX_SPIN_US);
  const char* gather = std::getenv("EXPERTD_SM90_GATHER");
  int gather_sw;
  if (!parse_sm90_gather(gather, &gather_sw))
    return fail(EXPERTD_ERR_INVALID, "init: EXPERTD_SM90_GATHER=%.16s: want 0 or 1 (or unset)", gather);
  Switches& s = switches();
  s.sm90_gather = gather_sw;
  s.streams = o->streams;
  s.pdl = o->pdl != 0;
  s.sm90_block = o->sm90_block != 0;
  s.sm90_persistent = o->sm90_persistent != 0;
  s.sm90_toka = o->sm90_toka != 0;
  s.sm90_pair = o->sm90_pair != 0;
  s.poison = o->poison != 0;
  s.host_trace = o->host_trace != 0;
  s.sync_spin_us = o->sync_spin_us;
  // A development switch rather than an option: it picks between two
  // kernels that compute the same thing, for timing them against each
  // other (docs/perf-notes.md).
  s.sm90_cutlass = env_switch("EXPERTD_SM90_CUTLASS");
  s.sm90_cutlass1 = env_switch("EXPERTD_SM90_CUTLASS1");
  return EXPERTD_OK;
}

namespace {
std::mutex g_sets_mu;
std::map<uint64_t, std::shared_ptr<Set>> g_sets;
uint64_t g_next_handle = 1;
}  // namespace


uint64_t add_set(std::shared_ptr<Set> s) {
  std::lock_guard<std::mutex> lk(g_sets_mu);
  const uint64_t h = g_next_handle++;
  g_sets[h] = std::move(s);
  return h;
}

std::shared_ptr<Set> take_set(uint64_t h) {
  std::lock_guard<std::mutex> lk(g_sets_mu);
  auto it = g_sets.find(h);
  if (it == g_sets.end()) return nullptr;
  std::shared_ptr<Set> s = std::move(it->second);
  g_sets.erase(it);
  return s;
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
      // A range whose unregistration waits is the caller's pageable memory.
      return unpinning(p) ? Mem::kPageable : Mem::kPinned;
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
namespace {
std::mutex g_ipc_mu;
std::map<std::string, IpcMapping> g_ipc;
}  // namespace

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
    if (int(s_.lanes.size()) < std::max(1, switches().streams.load())) break;
    s_.cv.wait(lk);
  }
  auto l = std::make_unique<Lane>();
  l->device = s_.device;
  CK(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
  CK(cudaEventCreate(&l->ev0));
  CK(cudaEventCreate(&l->ev1));
  CK(cudaEventCreateWithFlags(&l->ev_done, cudaEventDisableTiming));
  lane_ = l.get();
  s_.lanes.push_back(std::move(l));
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
// kernels (EXPERTD_GEMM_SM90 takes them either way); off keeps them on the
// portable path.
bool sm90_block_default() {
  return switches().sm90_block.load(std::memory_order_relaxed);
}

// use_pdl says whether a set's kernels launch with programmatic dependent
// launch (launch.cuh): on sm_90 and later unless switched off, which times
// the chain both ways.
bool use_pdl(const Set& s) {
  return switches().pdl.load(std::memory_order_relaxed) && s.cc_major >= 9;
}

// use_sm90 is the GEMM path a call takes: the Hopper kernels when asked for,
// or by default where the card and shape allow them.
bool use_sm90(const Set& s, const Call& c) {
  return c.gemm == EXPERTD_GEMM_SM90 ||
         (c.gemm == EXPERTD_GEMM_AUTO && sm90_ok(s) && (s.block_k == 0 || sm90_block_default()));
}

#ifdef EXPERTD_HAVE_CUTLASS
namespace {
// cutlass_size says whether a call is large enough for CUTLASS's grouped
// GEMMs by the default rule, or sw (a sm90_cutlass switch) says always:
// from kMinRows mean rows per expert (M * top_k / E) on.
bool cutlass_size(int sw, const Set& s, const Call& c) {
  // Below 128 an expert's rows fill less than one of CUTLASS's 128-token
  // tiles, while the hand-written kernel's token tile follows the call's
  // size; kMinRows is the least mean the library's whole call has been
  // timed faster at with CUTLASS's GEMM2 (docs/perf-notes.md, "CUTLASS
  // GEMM2 in the library"), so no unmeasured size changes kernel.
  constexpr int64_t kMinRows = 192;
  return sw == 1 || int64_t(c.m) * c.top_k >= kMinRows * s.E;
}
}  // namespace

// use_cutlass1 says whether a call's GEMM1 runs on CUTLASS's grouped GEMM
// (gemm_cutlass.h): on the Hopper path, for a ReLU² layer with no expert
// bias, one weight scale per expert, one activation scale for all of the
// call's rows (a static a13 scale, or FP8 hidden states with at most one
// scale) and a static a2 scale, at cutlass_size's sizes. Off unless the
// sm90_cutlass1 switch says always, until a device run times the whole
// call faster with it (docs/perf-notes.md, "CUTLASS GEMM1 for ReLU²
// layers"); kByDefault then turns on the size rule.
bool use_cutlass1(const Set& s, const Call& c) {
  constexpr bool kByDefault = false;
  const int sw = switches().sm90_cutlass1.load(std::memory_order_relaxed);
  // An FP8 call's per-token or per-group scales differ within an expert's
  // rows, and the epilogue has one alpha per expert.
  const bool one_a1_scale =
      c.hidden_dtype == EXPERTD_DTYPE_FLOAT8_E4M3FN ? c.n_hidden_scale <= 1 : s.a13_scale > 0;
  if (sw == 0 || (sw == -1 && !kByDefault) || !use_sm90(s, c) || s.w13_bias || !one_a1_scale ||
      !(s.a2_scale > 0) || !gemm1_cutlass_supported(s.K, s.N, s.w13_mode, gemm_act(s.act)))
    return false;
  return cutlass_size(sw, s, c);
}

// use_cutlass2 says whether a call's GEMM2 runs on CUTLASS's grouped GEMM
// (gemm_cutlass.h): on the Hopper path, with one weight scale per expert and
// a static a2 scale, whose product is the expert's epilogue alpha, at
// cutlass_size's sizes unless the sm90_cutlass switch says never or always.
bool use_cutlass2(const Set& s, const Call& c) {
  const int sw = switches().sm90_cutlass.load(std::memory_order_relaxed);
  if (sw == 0 || !use_sm90(s, c) || !(s.a2_scale > 0) || !gemm2_cutlass_supported(s.K, s.N, s.w2_mode)) return false;
  return cutlass_size(sw, s, c);
}
#else
// Without the CUTLASS unit every GEMM runs on the library's own kernels.
bool use_cutlass1(const Set&, const Call&) { return false; }
bool use_cutlass2(const Set&, const Call&) { return false; }
#endif

int block_rows_for(const Set& s, const Call& c, bool sm90) {
#ifdef EXPERTD_HAVE_SM90
  if (sm90) return sm90_block_rows(c.m, c.top_k, s.E, s.block_k > 0, s.K, s.N, act_gated(s.act));
#endif
  (void)sm90;
  return portable_block_rows(c.m, c.top_k, s.E);
}

int set_create(int device, const expertd_set_params* params, uint64_t* out_handle) {
  if (!out_handle) return fail(EXPERTD_ERR_INVALID, "set_create: out_handle is NULL");
  *out_handle = 0;
  if (!params) return fail(EXPERTD_ERR_INVALID, "set_create: NULL params");
  if (params->size < sizeof(expertd_set_params) || params->version != EXPERTD_ABI_VERSION)
    return fail(EXPERTD_ERR_INVALID, "set_create: params of %u bytes, ABI %u; this library takes %zu bytes, ABI %d",
                params->size, params->version, sizeof(expertd_set_params), EXPERTD_ABI_VERSION);
  const expertd_set_params& q = *params;
  const int num_experts = q.num_experts, hidden = q.hidden, inter = q.inter, activation = q.activation;
  const int n_w13_scale = q.n_w13_scale, n_w2_scale = q.n_w2_scale, block_n = q.block_n, block_k = q.block_k;
  if (num_experts < 1 || num_experts > EXPERTD_MAX_EXPERTS)
    return fail(EXPERTD_ERR_UNSUPPORTED, "num_experts=%d (1..%d)", num_experts, EXPERTD_MAX_EXPERTS);
  if (hidden < 1 || inter < 1 || hidden > (1 << 20) || inter > (1 << 20))
    return fail(EXPERTD_ERR_INVALID, "hidden=%d inter=%d", hidden, inter);
  if (activation < EXPERTD_ACT_SILU_GATED || activation > EXPERTD_ACT_GELU_GATED)
    return fail(EXPERTD_ERR_UNSUPPORTED, "activation %d", activation);
  if (!q.w13 || !q.w2 || !q.w13_scale || !q.w2_scale)
    return fail(EXPERTD_ERR_INVALID, "set_create: NULL weights or scales");
  if (activation == EXPERTD_ACT_SWIGLU_OAI &&
      (!(q.swiglu_limit > 0) || !(q.swiglu_alpha > 0) || std::isinf(q.swiglu_limit) || std::isinf(q.swiglu_alpha)))
    return fail(EXPERTD_ERR_INVALID, "set_create: swiglu_limit %g, swiglu_alpha %g: want finite and > 0",
                double(q.swiglu_limit), double(q.swiglu_alpha));
  const int64_t E = num_experts, rows1 = act_gated(activation) ? 2 * int64_t(inter) : inter;
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
  s->a13_scale = q.a13_scale;
  s->a2_scale = q.a2_scale;
  s->swiglu_limit = q.swiglu_limit;
  s->swiglu_alpha = q.swiglu_alpha;
  s->poison = switches().poison.load();
  const size_t n13 = size_t(num_experts) * rows1 * hidden, n2 = size_t(num_experts) * hidden * inter;
  // While a lane is open the weights come from the pool, copied on a stream
  // of the set-up's own, so that freeing them later does not synchronize.
  s->pooled = lanes_open();
  struct Up {
    cudaStream_t st = nullptr;
    ~Up() {
      if (!st) return;
      cudaStreamSynchronize(st);  // a failed set's ~Set frees what it copies to
      cudaStreamDestroy(st);
    }
  } up;
  if (s->pooled) CK(cudaStreamCreateWithFlags(&up.st, cudaStreamNonBlocking));
  // put copies n bytes to new device memory (none where src is null: an
  // absent bias).
  auto put = [&](void** dst, const void* src, size_t n) -> int {
    if (!src) return EXPERTD_OK;
    if (!s->pooled) {
      CK(cudaMalloc(dst, n));
      CK(cudaMemcpy(*dst, src, n, cudaMemcpyHostToDevice));
      return EXPERTD_OK;
    }
    if (int rc = alloc_pooled(device, n, up.st, dst)) return rc;
    // From pageable memory: it returns once src is staged.
    CK(cudaMemcpyAsync(*dst, src, n, cudaMemcpyHostToDevice, up.st));
    return EXPERTD_OK;
  };
  if (int rc = put(reinterpret_cast<void**>(&s->w13), q.w13, n13)) return rc;
  if (int rc = put(reinterpret_cast<void**>(&s->w2), q.w2, n2)) return rc;
  // upload copies n floats; upload_scale a scale, a per-tensor one
  // expanded to one per expert so the kernels index per-expert scales alike.
  auto upload = [&](float** dst, const float* src, size_t n) -> int {
    return put(reinterpret_cast<void**>(dst), src, n * sizeof(float));
  };
  auto upload_scale = [&](float** dst, const float* src, int n, WScale m) -> int {
    std::vector<float> sc;
    if (m == WScale::kPerExpert && n == 1) {
      sc.assign(num_experts, src[0]);
    } else {
      sc.assign(src, src + n);
    }
    return upload(dst, sc.data(), sc.size());
  };
  if (int rc = upload_scale(&s->w13_scale, q.w13_scale, n_w13_scale, m13)) return rc;
  if (int rc = upload_scale(&s->w2_scale, q.w2_scale, n_w2_scale, m2)) return rc;
  if (int rc = upload(&s->w13_bias, q.w13_bias, size_t(E) * rows1)) return rc;
  if (int rc = upload(&s->w2_bias, q.w2_bias, size_t(E) * hidden)) return rc;
  if (up.st) CK(cudaStreamSynchronize(up.st));

  *out_handle = add_set(std::move(s));
  return EXPERTD_OK;
}

int set_free(uint64_t handle) {
  if (!take_set(handle)) return fail(EXPERTD_ERR_NOT_FOUND, "set_free: unknown handle %llu", (unsigned long long)handle);
  return EXPERTD_OK;  // ~Set frees when the last call in flight lets go of it
}

int ipc_map(int device, const uint8_t* handle, int handle_len, uint64_t* dev_ptr, uint64_t* bytes) {
  if (!handle || !dev_ptr || !bytes) return fail(EXPERTD_ERR_INVALID, "ipc_open: NULL argument");
  if (handle_len != EXPERTD_IPC_HANDLE_BYTES)
    return fail(EXPERTD_ERR_INVALID, "ipc_open: handle has %d bytes, want %d", handle_len, EXPERTD_IPC_HANDLE_BYTES);
  *dev_ptr = *bytes = 0;
  if (int rc = check_device(device)) return rc;
  CK(cudaSetDevice(device));
  const std::string key(reinterpret_cast<const char*>(handle), size_t(handle_len));
  std::unique_lock<std::mutex> lk(g_ipc_mu);
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
      lk.unlock();  // release() may wait on a close that takes g_ipc_mu
      release([p] {
        CK(cudaIpcCloseMemHandle(p));
        return EXPERTD_OK;
      });
      return rc;
    }
    it = g_ipc.emplace(key, IpcMapping{p, size, device, 0}).first;
  }
  it->second.refs++;
  *dev_ptr = reinterpret_cast<uint64_t>(it->second.ptr);
  *bytes = it->second.bytes;
  return EXPERTD_OK;
}

int ipc_unmap(uint64_t dev_ptr) {
  std::string key;
  {
    std::lock_guard<std::mutex> lk(g_ipc_mu);
    auto it = g_ipc.begin();
    // A mapping of no refs waits for its close; it is no longer open.
    while (it != g_ipc.end() && (reinterpret_cast<uint64_t>(it->second.ptr) != dev_ptr || it->second.refs == 0)) ++it;
    if (it == g_ipc.end())
      return fail(EXPERTD_ERR_NOT_FOUND, "ipc_close: 0x%llx is not an opened handle", (unsigned long long)dev_ptr);
    if (--it->second.refs > 0) return EXPERTD_OK;
    key = it->first;
  }
  // Outside g_ipc_mu, which the release takes after release()'s own lock;
  // an open of the same handle meanwhile keeps the mapping.
  return release([key] {
    std::lock_guard<std::mutex> lk(g_ipc_mu);
    auto it = g_ipc.find(key);
    if (it == g_ipc.end() || it->second.refs > 0) return int(EXPERTD_OK);
    const IpcMapping m = it->second;
    g_ipc.erase(it);
    CK(cudaSetDevice(m.device));
    CK(cudaIpcCloseMemHandle(m.ptr));
    return int(EXPERTD_OK);
  });
}

}  // namespace expertd
