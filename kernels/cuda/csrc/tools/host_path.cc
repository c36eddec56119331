// host_path: times the host side of expertd_moe on the Nemotron layer, for
// the library's host path (docs/perf-notes.md, "Library host path").
//
//   host_path LIB [ITERS]
//
// It loads LIB with dlopen (so one binary times libraries of this ABI and
// of the previous one, the state before a change included), uploads a
// Nemotron layer of random FP8 weights, and for M = 1 and M = 256 calls
// expertd_moe ITERS times (default 200) with the tensors in three places:
// pageable host memory, page-locked host memory (expertd_host_register,
// as the daemon does for a POSIX shared-memory region) and device memory
// (expertd_dev_alloc, as a CUDA IPC region). It prints the p50 and p90 of
// the call's wall time, its kernel time and the difference, the host
// path's cost. With the library's host trace on, the per-stage lines go to
// stderr, each batch preceded by a "== host_path mode=... m=..." line;
// scripts/cuda-host-path.sh summarises them. HOST_PATH_NO_ROUTING=1 asks
// for no routing results (as the daemon does for calls without
// return_routing), so the two can be timed against each other.
// HOST_PATH_FP8=1 sends the hidden states as FP8 E4M3 (no scale: the
// layer's fallback), the input the bench times, instead of BF16.
//
// Needs only the library and the driver: no CUDA toolkit at run time.
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../expertd_cuda.h"

namespace {

// The entry points of ABI 3: packed parameters.
using MoeV3 = int (*)(uint64_t, const int64_t*, int, const float*, int, const void*, const float*, const void*,
                      const float*, const int32_t*, const float*, void*, int32_t*, float*, float*);
using InitV3 = int (*)(int, int);
// expertd_set_create of ABIs 3 and 4: positional arguments.
using SetCreateV4 = int (*)(int, int, int, int, int, const uint8_t*, const uint8_t*, const float*, int, const float*,
                            int, int, int, float, float, uint64_t*);

// The entry points of this header's ABI.
using InitCur = int (*)(int, const expertd_options*);
using MoeCur = int (*)(uint64_t, const expertd_call*);
using OptionsDefault = void (*)(expertd_options*);
using CallInit = void (*)(expertd_call*);

using SetParamsInit = void (*)(expertd_set_params*);
using SetCreate = int (*)(int, const expertd_set_params*, uint64_t*);

using AbiVersion = int (*)();
using HostRegister = int (*)(int, void*, uint64_t);
using DevAlloc = int (*)(int, uint64_t, uint64_t*);
using Copy = int (*)(int, uint64_t, uint64_t, uint64_t);
using LastError = const char* (*)();

constexpr int kE = 128, kK = 2688, kN = 1856, kTopK = 6;

void* sym(void* h, const char* name) {
  void* p = dlsym(h, name);
  if (!p) {
    fprintf(stderr, "host_path: missing symbol %s\n", name);
    exit(2);
  }
  return p;
}

LastError g_last_error;

void check(int rc, const char* what) {
  if (rc != 0) {
    fprintf(stderr, "host_path: %s: rc=%d: %s\n", what, rc, g_last_error());
    exit(1);
  }
}

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[size_t(q * double(v.size() - 1))];
}

// Buffers of one call: in the mode's memory, with host mirrors to fill
// them from.
struct Tensors {
  void* hidden;
  void* logits;
  void* bias;
  void* out;
  int32_t* ids;
  float* w;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: host_path LIB [ITERS]\n");
    return 2;
  }
  const int iters = argc > 2 ? atoi(argv[2]) : 200;
  const bool routing_out = getenv("HOST_PATH_NO_ROUTING") == nullptr;
  const bool fp8 = getenv("HOST_PATH_FP8") != nullptr;
  const int hdtype = fp8 ? EXPERTD_DTYPE_FLOAT8_E4M3FN : EXPERTD_DTYPE_BFLOAT16;
  const size_t hsize = fp8 ? 1 : 2;
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "host_path: dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  g_last_error = reinterpret_cast<LastError>(sym(h, "expertd_last_error"));
  const int abi = reinterpret_cast<AbiVersion>(sym(h, "expertd_abi_version"))();
  // ABI 4 differs from 5 in expertd_set_create (and in what this tool does
  // not call).
  if (abi != 3 && abi != 4 && abi != EXPERTD_ABI_VERSION) {
    fprintf(stderr, "host_path: library speaks ABI %d; this tool knows 3, 4 and %d\n", abi, EXPERTD_ABI_VERSION);
    return 2;
  }
  if (abi == 3) {
    check(reinterpret_cast<InitV3>(sym(h, "expertd_init"))(0, 2), "init");
  } else {
    expertd_options o;
    reinterpret_cast<OptionsDefault>(sym(h, "expertd_options_default"))(&o);
    // The tool's own switches (the daemon's are flags): the trace, and the
    // completion spin to time against the blocking wait.
    o.host_trace = getenv("EXPERTD_CUDA_HOST_TRACE") != nullptr;
    if (const char* v = getenv("HOST_PATH_SPIN_US")) o.sync_spin_us = atoi(v);
    check(reinterpret_cast<InitCur>(sym(h, "expertd_init"))(0, &o), "init");
  }
  auto host_register = reinterpret_cast<HostRegister>(sym(h, "expertd_host_register"));
  auto dev_alloc = reinterpret_cast<DevAlloc>(sym(h, "expertd_dev_alloc"));
  auto copy = reinterpret_cast<Copy>(sym(h, "expertd_copy"));
  // Resolved once: the timed loop calls the entry point and nothing else.
  void* moe = sym(h, "expertd_moe");
  auto call_init = abi == 3 ? nullptr : reinterpret_cast<CallInit>(sym(h, "expertd_call_init"));

  std::mt19937_64 rng(7);
  std::vector<uint8_t> w13(size_t(kE) * kN * kK), w2(size_t(kE) * kK * kN);
  // Exponent top bit clear: |v| < 2, never NaN.
  for (auto& b : w13) b = uint8_t(rng()) & 0xBF;
  for (auto& b : w2) b = uint8_t(rng()) & 0xBF;
  const float scale = 0.05f;
  uint64_t set = 0;
  if (abi < EXPERTD_ABI_VERSION) {
    check(reinterpret_cast<SetCreateV4>(sym(h, "expertd_set_create"))(0, kE, kK, kN, EXPERTD_ACT_RELU2, w13.data(),
                                                                       w2.data(), &scale, 1, &scale, 1, 0, 0, -1.f,
                                                                       -1.f, &set),
          "set_create");
  } else {
    expertd_set_params sp;
    reinterpret_cast<SetParamsInit>(sym(h, "expertd_set_params_init"))(&sp);
    sp.num_experts = kE;
    sp.hidden = kK;
    sp.inter = kN;
    sp.activation = EXPERTD_ACT_RELU2;
    sp.w13 = w13.data();
    sp.w2 = w2.data();
    sp.w13_scale = &scale;
    sp.n_w13_scale = 1;
    sp.w2_scale = &scale;
    sp.n_w2_scale = 1;
    check(reinterpret_cast<SetCreate>(sym(h, "expertd_set_create"))(0, &sp, &set), "set_create");
  }
  std::normal_distribution<float> nd(0.f, 0.1f);

  printf("%-8s %5s %10s %10s %10s %10s %10s\n", "mode", "M", "wall p50", "wall p90", "kernel p50", "host p50",
         "host p90");
  for (int m : {1, 256}) {
    const size_t hb = size_t(m) * kK * hsize, lb = size_t(m) * kE * 4, bb = size_t(kE) * 4, ob = size_t(m) * kK * 2;
    std::vector<uint8_t> hidden(hb), logits(lb), bias(bb);
    for (size_t i = 0; i < hb / hsize; ++i) {
      if (fp8) {
        hidden[i] = uint8_t(rng()) & 0xBF;  // as the weights: |v| < 2, never NaN
        continue;
      }
      const uint16_t v = bf16(nd(rng));
      std::memcpy(&hidden[2 * i], &v, 2);
    }
    for (size_t i = 0; i < lb / 4; ++i) {
      const float v = nd(rng) * 10;
      std::memcpy(&logits[4 * i], &v, 4);
    }
    for (size_t i = 0; i < bb / 4; ++i) {
      const float v = nd(rng);
      std::memcpy(&bias[4 * i], &v, 4);
    }
    for (const char* mode : {"pageable", "pinned", "device"}) {
      Tensors t;
      std::vector<int32_t> ids(size_t(m) * kTopK);
      std::vector<float> w(size_t(m) * kTopK);
      t.ids = ids.data();
      t.w = w.data();
      std::vector<uint8_t> ph, pl, pbias, po;
      if (!strcmp(mode, "pageable")) {
        ph = hidden, pl = logits, pbias = bias, po.resize(ob);
        t.hidden = ph.data(), t.logits = pl.data(), t.bias = pbias.data(), t.out = po.data();
      } else if (!strcmp(mode, "pinned")) {
        // One mapping, as a registered shared-memory region is.
        const size_t total = hb + lb + bb + ob + 4 * 4096;
        uint8_t* r = static_cast<uint8_t*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
        if (r == MAP_FAILED) {
          perror("mmap");
          return 1;
        }
        check(host_register(0, r, total), "host_register");
        size_t off = 0;
        auto take = [&](size_t n) {
          uint8_t* p = r + off;
          off += (n + 4095) & ~size_t(4095);
          return p;
        };
        t.hidden = take(hb), t.logits = take(lb), t.bias = take(bb), t.out = take(ob);
        std::memcpy(t.hidden, hidden.data(), hb);
        std::memcpy(t.logits, logits.data(), lb);
        std::memcpy(t.bias, bias.data(), bb);
      } else {
        uint64_t base = 0;
        const size_t total = hb + lb + bb + ob + 4 * 256;
        check(dev_alloc(0, total, &base), "dev_alloc");
        size_t off = 0;
        auto take = [&](size_t n) {
          const uint64_t p = base + off;
          off += (n + 255) & ~size_t(255);
          return p;
        };
        const uint64_t dh = take(hb), dl = take(lb), db = take(bb), dout = take(ob);
        check(copy(0, dh, uint64_t(uintptr_t(hidden.data())), hb), "copy");
        check(copy(0, dl, uint64_t(uintptr_t(logits.data())), lb), "copy");
        check(copy(0, db, uint64_t(uintptr_t(bias.data())), bb), "copy");
        t.hidden = reinterpret_cast<void*>(dh), t.logits = reinterpret_cast<void*>(dl);
        t.bias = reinterpret_cast<void*>(db), t.out = reinterpret_cast<void*>(dout);
      }
      fprintf(stderr, "== host_path mode=%s m=%d\n", mode, m);
      fflush(stderr);
      std::vector<double> wall, kern, host;
      for (int i = 0; i < iters + 5; ++i) {
        float ms = 0;
        const auto t0 = std::chrono::steady_clock::now();
        int rc;
        if (abi == 3) {
          int64_t ip[12] = {m, hdtype, 0, EXPERTD_DTYPE_FLOAT32, EXPERTD_DTYPE_BFLOAT16, kTopK, 1,
                            EXPERTD_SCORING_SIGMOID, 0, 0, EXPERTD_GEMM_AUTO, 1};
          const float fp[1] = {2.5f};
          rc = reinterpret_cast<MoeV3>(moe)(set, ip, 12, fp, 1, t.hidden, nullptr, t.logits,
                                                              static_cast<const float*>(t.bias), nullptr, nullptr,
                                                              t.out, t.ids, t.w, &ms);
        } else {
          expertd_call c;
          call_init(&c);
          c.m = m;
          c.hidden.data = t.hidden;
          c.hidden.dtype = hdtype;
          c.logits.data = t.logits;
          c.logits.dtype = EXPERTD_DTYPE_FLOAT32;
          c.correction_bias.data = t.bias;
          c.out.data = t.out;
          c.out.dtype = EXPERTD_DTYPE_BFLOAT16;
          if (routing_out) {
            c.topk_ids_out.data = t.ids;
            c.topk_ids_out.mem = EXPERTD_MEM_PAGEABLE;
            c.topk_weights_out.data = t.w;
            c.topk_weights_out.mem = EXPERTD_MEM_PAGEABLE;
          }
          c.top_k = kTopK;
          c.renormalize = 1;
          c.scoring = EXPERTD_SCORING_SIGMOID;
          c.routed_scaling_factor = 2.5f;
          c.use_graph = 1;
          c.kernel_ms = &ms;
          rc = reinterpret_cast<MoeCur>(moe)(set, &c);
        }
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        check(rc, "moe");
        if (i < 5) continue;  // first calls allocate and capture
        wall.push_back(us);
        kern.push_back(ms * 1e3);
        host.push_back(us - ms * 1e3);
      }
      printf("%-8s %5d %8.1fus %8.1fus %8.1fus %8.1fus %8.1fus\n", mode, m, pct(wall, .5), pct(wall, .9),
             pct(kern, .5), pct(host, .5), pct(host, .9));
      fflush(stdout);
    }
  }
  return 0;
}
