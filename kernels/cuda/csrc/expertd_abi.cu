// The C ABI of libexpertd_cuda.so (expertd_cuda.h): argument checks
// that need no set, and the entry points, each of which clears the calling
// thread's error and calls into the state (moe_state.cu) or the pipeline
// (moe_pipeline.cu).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "expertd_cuda.h"
#include "moe_state.h"

using namespace expertd;

extern "C" {

int expertd_abi_version(void) { return EXPERTD_ABI_VERSION; }

const char* expertd_last_error(void) { return g_last_error.c_str(); }

void expertd_options_default(expertd_options* o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->version = EXPERTD_ABI_VERSION;
  o->streams = 2;
  o->pdl = 1;
  o->sm90_block = 1;
  o->sm90_persistent = 1;
  o->sm90_toka = 1;
}

void expertd_call_init(expertd_call* c) {
  if (!c) return;
  std::memset(c, 0, sizeof *c);
  c->size = sizeof *c;
  c->version = EXPERTD_ABI_VERSION;
}

int expertd_init(int device, const expertd_options* opts) {
  g_last_error.clear();
  if (int rc = set_options(opts)) return rc;
  // A lane's stream blocks on a stream memory wait until its caller rings;
  // streams beyond the device's hardware queues share one, and work queued
  // behind such a wait on a shared queue waits with it (another lane's, a
  // set's, the stop write that closes a lane). The most queues the driver
  // gives, unless the process asked for a number, before the context exists.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  // Loading a kernel on its first launch (the driver's lazy loading) may
  // wait for the whole context to go idle, and a waiting lane keeps it
  // busy until its caller rings: a call that launches a kernel for the
  // first time (a new token tile at a new M) would wait on a lane whose
  // caller waits on that call. Every kernel is loaded with the context,
  // unless the process chose a loading mode itself.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
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
  // Whether prefill GEMM2 may run on CUTLASS (gemm_cutlass.h), which the
  // GPU tests read to know which kernels their large calls checked.
#if defined(EXPERTD_HAVE_SM90) && defined(EXPERTD_HAVE_CUTLASS)
  const char* gemm2 = hopper ? ", gemm2=cutlass" : "";
#else
  const char* gemm2 = "";
#endif
  snprintf(buf, size_t(buflen), "%s (sm_%d%d, %d SMs, %.0f GiB, gemm=%s%s)", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, double(prop.totalGlobalMem) / double(1ull << 30), gemm, gemm2);
  return EXPERTD_OK;
}

void expertd_set_params_init(expertd_set_params* p) {
  if (!p) return;
  std::memset(p, 0, sizeof *p);
  p->size = sizeof *p;
  p->version = EXPERTD_ABI_VERSION;
  p->a13_scale = -1.f;
  p->a2_scale = -1.f;
  // gpt-oss's SwiGLU clamp limit and sigmoid slope.
  p->swiglu_limit = 7.f;
  p->swiglu_alpha = 1.702f;
}

int expertd_set_create(int device, const expertd_set_params* params, uint64_t* out_handle) {
  g_last_error.clear();
  return set_create(device, params, out_handle);
}

int expertd_set_free(uint64_t handle) {
  g_last_error.clear();
  return set_free(handle);
}

int expertd_moe(uint64_t handle, const expertd_call* call) {
  g_last_error.clear();
  return run_host(handle, call);
}

int expertd_moe_device(uint64_t handle, const expertd_call* call) {
  g_last_error.clear();
  return run_device(handle, call);
}

int expertd_ipc_open(int device, const uint8_t* handle, int handle_len, uint64_t* dev_ptr, uint64_t* bytes) {
  g_last_error.clear();
  return ipc_map(device, handle, handle_len, dev_ptr, bytes);
}

int expertd_ipc_close(uint64_t dev_ptr) {
  g_last_error.clear();
  return ipc_unmap(dev_ptr);
}

int expertd_host_register(int device, void* ptr, uint64_t bytes) {
  g_last_error.clear();
  return host_register(device, ptr, size_t(bytes));
}

int expertd_host_unregister(int device, void* ptr) {
  g_last_error.clear();
  return host_unregister(device, ptr);
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
  return release_device(device, reinterpret_cast<void*>(dev_ptr));
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

int expertd_lane_open(uint64_t set, const expertd_call* call, int depth, uint64_t* lane, uint8_t* flags_handle,
                      int handle_len) {
  g_last_error.clear();
  return lane_open(set, call, depth, lane, flags_handle, handle_len);
}

int expertd_lane_stats(uint64_t lane, uint64_t* served, int32_t* mode) {
  g_last_error.clear();
  return lane_stats(lane, served, mode);
}

int expertd_lane_close(uint64_t lane) {
  g_last_error.clear();
  return lane_close(lane);
}

}  // extern "C"
