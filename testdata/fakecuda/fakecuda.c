/* A stand-in for libexpertd_cuda.so with no GPU behind it, built by the
 * fault tests (kernels/cuda, cmd/expertd) with the system C compiler. Each
 * macro picks one way a real library or device can fail:
 *
 *   FAKE_ABI=n        expertd_abi_version returns n (default: the header's ABI)
 *   FAKE_INIT_RC=c    expertd_init returns code c (5: ERR_NO_DEVICE)
 *   FAKE_MOE_RC=c     expertd_moe returns c (4: ERR_CUDA); with 0 it
 *                     "succeeds" without writing its output (a kernel that
 *                     computes garbage, which the self-test must catch)
 *   FAKE_OMIT_MOE     leaves expertd_moe out (a truncated build)
 */
#include <stdint.h>
#include <string.h>

#include "../../kernels/cuda/csrc/expertd_cuda.h"

#ifndef FAKE_ABI
#define FAKE_ABI EXPERTD_ABI_VERSION
#endif
#ifndef FAKE_INIT_RC
#define FAKE_INIT_RC 0
#endif
#ifndef FAKE_MOE_RC
#define FAKE_MOE_RC 0
#endif

static const char* last = "";

int expertd_abi_version(void) { return FAKE_ABI; }

int expertd_init(int device, const expertd_options* opts) {
  (void)device; (void)opts;
  if (FAKE_INIT_RC != 0) last = "fake: no CUDA device";
  return FAKE_INIT_RC;
}

int expertd_device_info(int device, char* buf, int buflen) {
  (void)device;
  strncpy(buf, "fake device", (size_t)buflen - 1);
  return 0;
}

/* The params' header is checked as the real library checks it, so a
 * binding that fills it in wrong fails here too. */
int expertd_set_create(int device, const expertd_set_params* params, uint64_t* out) {
  (void)device;
  if (!params || params->size < sizeof(expertd_set_params) || params->version != EXPERTD_ABI_VERSION) {
    last = "fake: set_create: bad params header";
    return 1;
  }
  *out = 42;
  return 0;
}

int expertd_set_free(uint64_t h) { (void)h; return 0; }

#ifndef FAKE_OMIT_MOE
int expertd_moe(uint64_t h, const expertd_call* call) {
  (void)h;
  if (call->kernel_ms) *call->kernel_ms = 0.01f;
  if (FAKE_MOE_RC != 0) last = "fake: an illegal memory access was encountered";
  return FAKE_MOE_RC;
}
#endif

/* Shared memory: no GPU, so nothing can be pinned, opened or allocated
 * (2: ERR_UNSUPPORTED). */
static int no_gpu(void) {
  last = "fake: no GPU behind this library";
  return 2;
}
int expertd_host_register(int device, void* p, uint64_t n) { (void)device; (void)p; (void)n; return no_gpu(); }
int expertd_host_unregister(int device, void* p) { (void)device; (void)p; return no_gpu(); }
int expertd_ipc_open(int device, const uint8_t* h, int n, uint64_t* ptr, uint64_t* bytes) {
  (void)device; (void)h; (void)n; (void)ptr; (void)bytes;
  return no_gpu();
}
int expertd_ipc_close(uint64_t ptr) { (void)ptr; return no_gpu(); }
int expertd_dev_alloc(int device, uint64_t n, uint64_t* ptr) { (void)device; (void)n; (void)ptr; return no_gpu(); }
int expertd_dev_free(int device, uint64_t ptr) { (void)device; (void)ptr; return no_gpu(); }
int expertd_ipc_export(int device, uint64_t ptr, uint8_t* h, int n) { (void)device; (void)ptr; (void)h; (void)n; return no_gpu(); }
int expertd_copy(int device, uint64_t dst, uint64_t src, uint64_t n) { (void)device; (void)dst; (void)src; (void)n; return no_gpu(); }

const char* expertd_last_error(void) { return last; }
