// doorbell: can a caller's CUDA stream start another process's GPU work and
// resume when it is done, with no host thread of either process on the
// critical path? It is the feasibility probe for a GPU-ordered call path
// (docs/gpu-ordered.md): the real daemon would own the flags and the
// kernels; here one binary forks into a "caller" and a "daemon" process on
// the same GPU so both sides can be timed together.
//
// Protocol (constant flag values, so a caller can capture it in a CUDA graph
// and replay it): two 32-bit flags in caller-owned device memory shared with
// the daemon through CUDA IPC, doorbell and done, both 0 at rest.
//   caller, per layer:  produce<<<>>> (input = previous output; done = 0)
//                       cuStreamWriteValue32(doorbell, 1)  (fenced after produce)
//                       cuStreamWaitValue32(done == 1)
//   daemon, per call:   cuStreamWaitValue32(doorbell == 1)  (memop wait)
//                         or a kernel spinning on doorbell   (spin wait)
//                       work<<<>>> (doorbell = 0; output = input + 1)
//                       cuStreamWriteValue32(done, 1)
// The daemon enqueues all its calls ahead of time, so neither host thread
// takes part while the chain runs. Each layer's output feeds the next
// layer's input, so the final value checks that no call was skipped or read
// stale data.
//
// Usage: doorbell [layers=48] [work_us=30] [reps=30] [daemon_wait=memop|spin]
#include <cuda.h>
#include <cuda_runtime.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                       \
    }                                                                                \
  } while (0)
#define CU(x)                                                                  \
  do {                                                                         \
    CUresult r_ = (x);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                  \
      fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #x, (int)r_); \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

typedef CUresult (*MemOpFn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
static MemOpFn g_wait, g_write;

// The driver's stream memory operations have no runtime-API twin; take them
// from the driver through the runtime so the binary links no libcuda.
static void load_memops() {
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", (void**)&g_wait, 12000,
                                      cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) { fprintf(stderr, "no cuStreamWaitValue32\n"); exit(2); }
  CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", (void**)&g_write, 12000,
                                      cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) { fprintf(stderr, "no cuStreamWriteValue32\n"); exit(2); }
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A stand-in for one MoE layer's kernels: every SM busy for work_ns, then a
// dependent element-wise step so the chain carries data.
__global__ void work(const float* in, float* out, int n, unsigned long long work_ns,
                     unsigned* doorbell) {
  if (doorbell && blockIdx.x == 0 && threadIdx.x == 0) *doorbell = 0;
  unsigned long long t0 = now_ns();
  if (threadIdx.x == 0)
    while (now_ns() - t0 < work_ns) {
    }
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = in[i] + 1.0f;
}

// The caller's own step before each MoE call: the next layer's input is the
// previous output; it also re-arms done for this call.
__global__ void produce(float* in, const float* out, int n, unsigned* done) {
  if (done && blockIdx.x == 0 && threadIdx.x == 0) *done = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    in[i] = out[i];
}

// The daemon's alternative to a memop wait: one tiny kernel that spins on
// the doorbell. It only makes progress when the caller's context runs at the
// same time (MPS); the timeout turns a stall into a counted failure.
__global__ void spin_wait(volatile unsigned* doorbell, unsigned* timeouts) {
  unsigned long long t0 = now_ns();
  while (*doorbell != 1u) {
    if (now_ns() - t0 > 200000000ull) {
      atomicAdd(timeouts, 1u);
      return;
    }
  }
}

struct Shared {
  cudaIpcMemHandle_t buf;  // [0, n) input, [n, 2n) output, then the two flags
  int n, calls;
  long long work_ns;
  int spin;
};

static const int kThreads = 128;

static int daemon_main(int rfd, int wfd) {
  Shared sh;
  if (read(rfd, &sh, sizeof sh) != (ssize_t)sizeof sh) return 3;
  CK(cudaSetDevice(0));
  load_memops();
  void* base;
  CK(cudaIpcOpenMemHandle(&base, sh.buf, cudaIpcMemLazyEnablePeerAccess));
  float* in = (float*)base;
  float* out = in + sh.n;
  unsigned* flags = (unsigned*)(out + sh.n);
  unsigned* timeouts;
  CK(cudaMalloc(&timeouts, 4));
  CK(cudaMemset(timeouts, 0, 4));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  char ok = 1;
  if (write(wfd, &ok, 1) != 1) return 3;
  for (int c = 0; c < sh.calls; ++c) {
    if (sh.spin)
      spin_wait<<<1, 1, 0, s>>>(flags, timeouts);
    else
      CU(g_wait((CUstream)s, (CUdeviceptr)&flags[0], 1, CU_STREAM_WAIT_VALUE_EQ));
    work<<<sms, kThreads, 0, s>>>(in, out, sh.n, sh.work_ns, &flags[0]);
    CU(g_write((CUstream)s, (CUdeviceptr)&flags[1], 1, CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  CK(cudaStreamSynchronize(s));
  unsigned t = 0;
  CK(cudaMemcpy(&t, timeouts, 4, cudaMemcpyDeviceToHost));
  CK(cudaIpcCloseMemHandle(base));
  if (t) fprintf(stderr, "daemon: %u spin waits timed out\n", t);
  return t ? 4 : 0;
}

static double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  int layers = argc > 1 ? atoi(argv[1]) : 48;
  double work_us = argc > 2 ? atof(argv[2]) : 30;
  int reps = argc > 3 ? atoi(argv[3]) : 30;
  int spin = argc > 4 && !strcmp(argv[4], "spin");
  const int warm = 3, n = 2688;
  Shared sh{};
  sh.n = n;
  sh.work_ns = (long long)(work_us * 1000);
  sh.spin = spin;
  sh.calls = 2 * (warm + reps) * layers;  // the stream chain, then the graph chain

  int to_d[2], from_d[2];
  if (pipe(to_d) || pipe(from_d)) return 3;
  // Fork before either side touches CUDA: a CUDA context does not survive fork.
  pid_t pid = fork();
  if (pid == 0) {
    close(to_d[1]);
    close(from_d[0]);
    _exit(daemon_main(to_d[0], from_d[1]));
  }
  close(to_d[0]);
  close(from_d[1]);

  CK(cudaSetDevice(0));
  load_memops();
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int sms = prop.multiProcessorCount;
  float* buf;
  size_t bytes = 2 * n * sizeof(float) + 64;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMemset(buf, 0, bytes));
  float* in = buf;
  float* out = buf + n;
  unsigned* flags = (unsigned*)(out + n);
  CK(cudaIpcGetMemHandle(&sh.buf, buf));
  if (write(to_d[1], &sh, sizeof sh) != (ssize_t)sizeof sh) return 3;
  char ok;
  if (read(from_d[0], &ok, 1) != 1) return 3;

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timed = [&](auto&& enqueue_chain) {
    std::vector<float> ms;
    for (int r = 0; r < warm + reps; ++r) {
      CK(cudaEventRecord(e0, s));
      enqueue_chain();
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (r >= warm) ms.push_back(t);
    }
    return median(ms);
  };

  // In-process: the same kernels back to back, the bound a remote chain is
  // compared with.
  double local = timed([&] {
    for (int l = 0; l < layers; ++l) {
      produce<<<sms, kThreads, 0, s>>>(in, out, n, nullptr);
      work<<<sms, kThreads, 0, s>>>(in, out, n, sh.work_ns, nullptr);
    }
  });
  CK(cudaMemset(out, 0, n * sizeof(float)));
  CK(cudaDeviceSynchronize());

  auto remote_layer = [&](cudaStream_t st) {
    produce<<<sms, kThreads, 0, st>>>(in, out, n, &flags[1]);
    CU(g_write((CUstream)st, (CUdeviceptr)&flags[0], 1, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU(g_wait((CUstream)st, (CUdeviceptr)&flags[1], 1, CU_STREAM_WAIT_VALUE_EQ));
  };
  double remote = timed([&] {
    for (int l = 0; l < layers; ++l) remote_layer(s);
  });

  // The same chain captured once into a CUDA graph and replayed.
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < layers; ++l) remote_layer(s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  double graph = timed([&] { CK(cudaGraphLaunch(ge, s)); });

  float got;
  CK(cudaMemcpy(&got, out + n - 1, 4, cudaMemcpyDeviceToHost));
  int status;
  waitpid(pid, &status, 0);
  int want = 2 * (warm + reps) * layers;
  printf("%s, %d layers, work %.1f us, daemon wait %s\n", prop.name, layers, work_us,
         spin ? "spin kernel" : "memop");
  printf("in-process chain   %8.3f ms  %7.2f us/layer\n", local, local * 1e3 / layers);
  printf("remote, stream     %8.3f ms  %7.2f us/layer  %.3fx in-process\n", remote,
         remote * 1e3 / layers, remote / local);
  printf("remote, CUDA graph %8.3f ms  %7.2f us/layer  %.3fx in-process\n", graph,
         graph * 1e3 / layers, graph / local);
  printf("chain value %.0f (want %d), daemon exit %d\n", got, want,
         WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return (got == want && WIFEXITED(status) && WEXITSTATUS(status) == 0) ? 0 : 1;
}
