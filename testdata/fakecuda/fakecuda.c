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
 *   FAKE_LANE_RC=c    expertd_lane_open returns c (2: ERR_UNSUPPORTED)
 *
 * Lanes work on host memory: the flag allocation is malloc'ed, its "IPC
 * handle" is "fakelane" and its address, and a thread plays the lane's
 * stream, taking each doorbell (1 -> 0, done = 1) and counting the call,
 * until close sets the doorbell to EXPERTD_LANE_STOP.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../kernels/cuda/csrc/expertd_cuda.h"

#ifndef FAKE_ABI
#define FAKE_ABI EXPERTD_ABI_VERSION
#endif
#ifndef FAKE_INIT_RC
#define FAKE_INIT_RC 0
#endif
#ifndef FAKE_LANE_RC
#define FAKE_LANE_RC 0
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

struct fake_lane {
  _Atomic uint32_t* doorbell;
  _Atomic uint32_t* done;
  void* flags;
  _Atomic uint64_t served;
  pthread_t thread;
};

static void* fake_lane_run(void* arg) {
  struct fake_lane* l = arg;
  const struct timespec tick = {0, 50000};
  for (;;) {
    uint32_t v = atomic_load(l->doorbell);
    if (v == EXPERTD_LANE_STOP) return NULL;
    if (v == 1 && atomic_compare_exchange_strong(l->doorbell, &v, 0)) {
      atomic_fetch_add(&l->served, 1);
      atomic_store(l->done, 1);
      continue;
    }
    nanosleep(&tick, NULL);
  }
}

int expertd_lane_open(uint64_t set, const expertd_call* call, int depth, uint64_t* lane, uint8_t* handle, int n) {
  (void)set;
  if (FAKE_LANE_RC != 0) {
    last = "fake: no stream memory operations";
    return FAKE_LANE_RC;
  }
  if (!call || !lane || !handle || n != EXPERTD_IPC_HANDLE_BYTES || depth < 1 || depth > EXPERTD_MAX_LANE_DEPTH ||
      !call->hidden.data || !call->logits.data || !call->out.data) {
    last = "fake: lane_open: bad argument";
    return EXPERTD_ERR_INVALID;
  }
  struct fake_lane* l = calloc(1, sizeof *l);
  l->flags = aligned_alloc(64, EXPERTD_LANE_FLAGS_BYTES);
  memset(l->flags, 0, EXPERTD_LANE_FLAGS_BYTES);
  l->doorbell = (_Atomic uint32_t*)((char*)l->flags + EXPERTD_LANE_DOORBELL);
  l->done = (_Atomic uint32_t*)((char*)l->flags + EXPERTD_LANE_DONE);
  pthread_create(&l->thread, NULL, fake_lane_run, l);
  memset(handle, 0, (size_t)n);
  memcpy(handle, "fakelane", 8);
  uint64_t addr = (uint64_t)(uintptr_t)l->flags;
  memcpy(handle + 8, &addr, sizeof addr);
  *lane = (uint64_t)(uintptr_t)l;
  return 0;
}

int expertd_lane_stats(uint64_t lane, uint64_t* served, int32_t* mode) {
  struct fake_lane* l = (struct fake_lane*)(uintptr_t)lane;
  *served = atomic_load(&l->served);
  *mode = EXPERTD_LANE_SKIPS;
  return 0;
}

int expertd_lane_close(uint64_t lane) {
  struct fake_lane* l = (struct fake_lane*)(uintptr_t)lane;
  atomic_store(l->doorbell, EXPERTD_LANE_STOP);
  pthread_join(l->thread, NULL);
  free(l->flags);
  free(l);
  return 0;
}

/* fakecuda_lane_call is a caller's side of one call, for tests: done = 0,
 * doorbell = 1, then wait (up to 10 s) for done. handle and the offsets
 * are what lane_open's caller was given. Returns 0 when done was set. */
int fakecuda_lane_call(const uint8_t* handle, int64_t doorbell_off, int64_t done_off) {
  uint64_t addr;
  if (memcmp(handle, "fakelane", 8) != 0) return 1;
  memcpy(&addr, handle + 8, sizeof addr);
  char* base = (char*)(uintptr_t)addr;
  _Atomic uint32_t* doorbell = (_Atomic uint32_t*)(base + doorbell_off);
  _Atomic uint32_t* done = (_Atomic uint32_t*)(base + done_off);
  atomic_store(done, 0);
  atomic_store(doorbell, 1);
  const struct timespec tick = {0, 50000};
  for (int i = 0; i < 200000; ++i) {
    if (atomic_load(done) == 1) return 0;
    nanosleep(&tick, NULL);
  }
  return 2;
}

const char* expertd_last_error(void) { return last; }
