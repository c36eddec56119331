// cutlass_grouped_bench: times CUTLASS's SM90 ptr-array grouped FP8 GEMMs
// (TMA warp-specialized cooperative and ping-pong kernels) on the MoE
// layers' prefill shapes, so they can be set beside expertd's hand-written
// kernels (gemm_sm90_ab's SUM lines) on the same card in the same run.
//
// Each group is one expert: A is its tokens' rows [count, K] (FP8 e4m3,
// row-major, the experts' rows back to back), B its weights [N, K] (FP8
// e4m3, K contiguous), D [count, N] BF16 with FP32 accumulation and the
// expert's scale as the epilogue's per-group alpha (ptr-array alpha). The
// kernel types are cutlass_grouped.cuh's, whose 128x256 cooperative one
// (configuration 3) the library's GEMM2 runs (gemm_cutlass.cu); the bench
// passes host problem shapes too, which the library does not.
// Routing is uniform random with a fixed seed per case and M, so per-expert
// counts are the realistic ones; the reference is a naive FP32 kernel over
// every output, compared by relative L2 error.
//
// Built by scripts/cutlass-bench-build.sh: this file compiled once per
// kernel configuration (-DCB_CONFIG=n, so the configurations compile in
// parallel) and once as the driver (no CB_CONFIG).
//
// Environment: CB_CASES=nemotron,qwen3  CB_M=1024,4096,8192
// CB_CONFIGS=1,2,... (configuration numbers)  CB_REPS=30  CB_CHECK=0 (skip
// the reference).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace cb {

// Problem: one grouped GEMM's device arrays, shared by every configuration.
struct Problem {
  int groups = 0;
  std::vector<std::array<int, 3>> shapes;  // per group {M, N, K}
  const void* const* ptr_a = nullptr;      // device [groups] -> FP8 rows
  const void* const* ptr_b = nullptr;      // device [groups] -> FP8 [N, K]
  void* const* ptr_d = nullptr;            // device [groups] -> BF16 rows
  const float* const* ptr_alpha = nullptr;  // device [groups] -> one float
};

// Plan: one configuration initialised for one Problem.
struct Plan {
  virtual ~Plan() = default;
  virtual cudaError_t run(cudaStream_t s) = 0;
};

}  // namespace cb

// The configurations: number, name, CTA tile, cluster, kernel schedule,
// epilogue schedule. FP8FastAccum: the accumulator is never promoted, as
// in expertd's per-expert-scale kernels.
#define CB_CONFIG_LIST(X)                                                \
  X(1, "coop 128x128x128 c1x1", Tile128x128, Cluster1x1, CoopK, CoopE)    \
  X(2, "coop 128x128x128 c2x1", Tile128x128, Cluster2x1, CoopK, CoopE)    \
  X(3, "coop 128x256x128 c1x1", Tile128x256, Cluster1x1, CoopK, CoopE)    \
  X(4, "coop 256x128x128 c1x1", Tile256x128, Cluster1x1, CoopK, CoopE)    \
  X(5, "pingpong 64x128x128 c1x1", Tile64x128, Cluster1x1, PingK, PingE)  \
  X(6, "pingpong 128x128x128 c1x1", Tile128x128, Cluster1x1, PingK, PingE) \
  X(7, "coop 256x128x128 c2x1", Tile256x128, Cluster2x1, CoopK, CoopE)

#define CB_DECLARE(n, name, tile, cluster, ksched, esched) \
  cb::Plan* cb_make_plan_##n(const cb::Problem& p, char* err, size_t err_len);

CB_CONFIG_LIST(CB_DECLARE)

#ifdef CB_CONFIG
// ---------------------------------------------------------------------------
// One configuration's kernel (this file compiled with -DCB_CONFIG=n).

#include "../cutlass_grouped.cuh"

namespace cb {
using namespace expertd::cutlass_grouped;

template <class Tile, class Cluster, class KSched, class ESched>
struct Grouped {
  using T = expertd::cutlass_grouped::Grouped<Tile, Cluster, KSched, ESched>;
  using ProblemShape = typename T::ProblemShape;
  using ElementIn = typename T::ElementIn;
  using ElementOut = typename T::ElementOut;
  using Kernel = typename T::Kernel;
  using Gemm = typename T::Gemm;
  using StrideA = typename T::StrideA;
  using StrideB = typename T::StrideB;
  using StrideD = typename T::StrideD;

  struct PlanImpl : Plan {
    Gemm gemm;
    std::vector<typename ProblemShape::UnderlyingProblemShape> host_shapes;
    void* dev = nullptr;  // shapes, strides and workspace in one allocation
    ~PlanImpl() override { cudaFree(dev); }
    cudaError_t run(cudaStream_t s) override {
      return gemm.run(s) == cutlass::Status::kSuccess ? cudaSuccess : cudaErrorLaunchFailure;
    }
  };

  static Plan* make(const Problem& p, char* err, size_t err_len) {
    auto* plan = new PlanImpl;
    std::vector<StrideA> sa;
    std::vector<StrideB> sb;
    std::vector<StrideD> sd;
    for (const auto& s : p.shapes) {
      const int m = s[0], n = s[1], k = s[2];
      plan->host_shapes.push_back({m, n, k});
      sa.push_back(cutlass::make_cute_packed_stride(StrideA{}, {m, k, 1}));
      sb.push_back(cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1}));
      sd.push_back(cutlass::make_cute_packed_stride(StrideD{}, {m, n, 1}));
    }
    const size_t g = p.groups;
    auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t o_shape = 0, o_a = up(g * sizeof(plan->host_shapes[0])), o_b = o_a + up(g * sizeof(StrideA)),
                 o_d = o_b + up(g * sizeof(StrideB)), o_ws = o_d + up(g * sizeof(StrideD));
    char* base = nullptr;
    auto fail = [&](const char* what) -> Plan* {
      std::snprintf(err, err_len, "%s", what);
      delete plan;
      return nullptr;
    };

    cutlass::KernelHardwareInfo hw = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(0);
    // The strides' device addresses are only known after the allocation,
    // whose size needs the workspace size: ask with placeholders first.
    auto args_at = [&](char* b) {
      return T::arguments(p.groups, reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(b + o_shape),
                          plan->host_shapes.data(), reinterpret_cast<const ElementIn**>(const_cast<const void**>(p.ptr_a)),
                          reinterpret_cast<StrideA*>(b + o_a),
                          reinterpret_cast<const ElementIn**>(const_cast<const void**>(p.ptr_b)),
                          reinterpret_cast<StrideB*>(b + o_b), reinterpret_cast<ElementOut**>(const_cast<void**>(p.ptr_d)),
                          reinterpret_cast<StrideD*>(b + o_d), T::fusion(p.ptr_alpha), hw);
    };
    const size_t ws = Gemm::get_workspace_size(args_at(reinterpret_cast<char*>(256)));
    if (cudaMalloc(&plan->dev, o_ws + ws + 256) != cudaSuccess) return fail("cudaMalloc");
    base = static_cast<char*>(plan->dev);
    cudaMemcpy(base + o_shape, plan->host_shapes.data(), g * sizeof(plan->host_shapes[0]), cudaMemcpyHostToDevice);
    cudaMemcpy(base + o_a, sa.data(), g * sizeof(StrideA), cudaMemcpyHostToDevice);
    cudaMemcpy(base + o_b, sb.data(), g * sizeof(StrideB), cudaMemcpyHostToDevice);
    cudaMemcpy(base + o_d, sd.data(), g * sizeof(StrideD), cudaMemcpyHostToDevice);
    auto args = args_at(base);
    if (plan->gemm.can_implement(args) != cutlass::Status::kSuccess) return fail("can_implement refused");
    if (plan->gemm.initialize(args, base + o_ws) != cutlass::Status::kSuccess) return fail("initialize failed");
    return plan;
  }
};

}  // namespace cb

#define CB_DEFINE(n, name, tile, cluster, ksched, esched)                                \
  cb::Plan* cb_make_plan_##n(const cb::Problem& p, char* err, size_t err_len) {        \
    return cb::Grouped<cb::tile, cb::cluster, cb::ksched, cb::esched>::make(p, err, err_len); \
  }
#define CB_PICK(n, name, tile, cluster, ksched, esched) \
  CB_PICK_IF(n, CB_DEFINE(n, name, tile, cluster, ksched, esched))
// Only the configuration named by CB_CONFIG is defined in this unit.
#define CB_PICK_IF(n, ...) CB_PICK_IF_##n(__VA_ARGS__)
#define CB_ON(...) __VA_ARGS__
#define CB_OFF(...)
#if CB_CONFIG == 1
#define CB_PICK_IF_1 CB_ON
#else
#define CB_PICK_IF_1 CB_OFF
#endif
#if CB_CONFIG == 2
#define CB_PICK_IF_2 CB_ON
#else
#define CB_PICK_IF_2 CB_OFF
#endif
#if CB_CONFIG == 3
#define CB_PICK_IF_3 CB_ON
#else
#define CB_PICK_IF_3 CB_OFF
#endif
#if CB_CONFIG == 4
#define CB_PICK_IF_4 CB_ON
#else
#define CB_PICK_IF_4 CB_OFF
#endif
#if CB_CONFIG == 5
#define CB_PICK_IF_5 CB_ON
#else
#define CB_PICK_IF_5 CB_OFF
#endif
#if CB_CONFIG == 6
#define CB_PICK_IF_6 CB_ON
#else
#define CB_PICK_IF_6 CB_OFF
#endif
#if CB_CONFIG == 7
#define CB_PICK_IF_7 CB_ON
#else
#define CB_PICK_IF_7 CB_OFF
#endif
CB_CONFIG_LIST(CB_PICK)

#else  // !CB_CONFIG
// ---------------------------------------------------------------------------
// The driver: data, reference, timing.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "tool_common.cuh"

namespace {

struct Config {
  int id;
  const char* name;
  cb::Plan* (*make)(const cb::Problem&, char*, size_t);
};
#define CB_ENTRY(n, name, tile, cluster, ksched, esched) {n, name, cb_make_plan_##n},
const Config kConfigs[] = {CB_CONFIG_LIST(CB_ENTRY)};

// ref_gemm: FP32 sums of decoded FP8. A block is kRefRows rows of one
// expert by 128 output columns, so each thread decodes a weight chunk once
// for all its rows (a thread per output would re-read every weight row
// once per token, seconds per GEMM at M = 8192).
constexpr int kRefRows = 32;
__global__ void ref_gemm(const uint8_t* a, const uint8_t* w, const int* first_row, const int* count,
                         const float* alpha, int n, int k, float* out) {
  const int e = blockIdx.z, r0 = blockIdx.y * kRefRows, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (r0 >= count[e] || c >= n) return;
  const int rows = min(kRefRows, count[e] - r0);
  const size_t row0 = size_t(first_row[e]) + r0;
  const uint8_t* wr = w + (size_t(e) * n + c) * k;
  float acc[kRefRows] = {};
  for (int kk = 0; kk < k; kk += 16) {
    const uint4 wv = *reinterpret_cast<const uint4*>(wr + kk);
    const uint32_t wu[4] = {wv.x, wv.y, wv.z, wv.w};
    float wf[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) wf[j] = fp8f((wu[j / 4] >> (8 * (j % 4))) & 0xFF);
#pragma unroll
    for (int r = 0; r < kRefRows; ++r) {
      if (r >= rows) break;
      const uint4 av = *reinterpret_cast<const uint4*>(a + (row0 + r) * k + kk);
      const uint32_t au[4] = {av.x, av.y, av.z, av.w};
      float s = 0;
#pragma unroll
      for (int j = 0; j < 16; ++j) s += fp8f((au[j / 4] >> (8 * (j % 4))) & 0xFF) * wf[j];
      acc[r] += s;
    }
  }
  for (int r = 0; r < rows; ++r) out[(row0 + r) * n + c] = acc[r] * alpha[e];
}

// compare accumulates sum (got - ref)^2, sum ref^2 and the non-finite count.
__global__ void compare(const __nv_bfloat16* got, const float* ref, size_t n, double* acc) {
  double num = 0, den = 0, bad = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(got[i]), r = ref[i];
    if (!isfinite(g)) {
      bad += 1;
      continue;
    }
    num += double(g - r) * (g - r);
    den += double(r) * r;
  }
  atomicAdd(&acc[0], num);
  atomicAdd(&acc[1], den);
  atomicAdd(&acc[2], bad);
}

struct Layer {
  const char* name;
  int E, K, N, topk;
  bool gated;
};

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const auto cases = split(std::getenv("CB_CASES"), "nemotron,qwen3");
  const auto ms = split(std::getenv("CB_M"), "1024,4096,8192");
  const auto picked = split(std::getenv("CB_CONFIGS"), "");
  const int reps = std::max(20, std::atoi(std::getenv("CB_REPS") ? std::getenv("CB_REPS") : "30"));
  const bool check = !(std::getenv("CB_CHECK") && std::strcmp(std::getenv("CB_CHECK"), "0") == 0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("cutlass_grouped_bench on %s (%d SMs), L2 flushed, median of %d\n", prop.name,
              prop.multiProcessorCount, reps);

  const size_t flush_bytes = size_t(256) << 20;
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  double* dacc;
  CK(cudaMalloc(&dacc, 3 * sizeof(double)));
  bool all_ok = true;

  for (const auto& cname : cases) {
    Layer L{"nemotron", 128, 2688, 1856, 6, false};
    if (cname == "qwen3") L = {"qwen3", 128, 2048, 768, 8, true};
    for (const auto& mstr : ms) {
      const int M = std::atoi(mstr.c_str());
      const int pairs = M * L.topk;
      std::mt19937 rng(1234u + unsigned(M) * 7u + (L.gated ? 1u : 0u));
      std::vector<int> counts(L.E, 0);
      std::uniform_int_distribution<int> pick(0, L.E - 1);
      for (int i = 0; i < pairs; ++i) counts[pick(rng)]++;
      std::vector<int> first_row(L.E, 0);  // then counts at [E, 2E)
      for (int e = 1; e < L.E; ++e) first_row[e] = first_row[e - 1] + counts[e - 1];
      first_row.insert(first_row.end(), counts.begin(), counts.end());
      const int max_count = *std::max_element(counts.begin(), counts.end());
      int* d_first_row;
      CK(cudaMalloc(&d_first_row, 2 * L.E * sizeof(int)));
      CK(cudaMemcpy(d_first_row, first_row.data(), 2 * L.E * sizeof(int), cudaMemcpyHostToDevice));
      double best_sum = 0, best_flops = 0;
      std::string best_names;
      for (int gemm = 1; gemm <= 2; ++gemm) {
        // GEMM1 [pairs, K] x [N1, K]^T (N1 = 2N gated); GEMM2 [pairs, N] x [K, N]^T.
        const int kin = gemm == 1 ? L.K : L.N;
        const int nout = gemm == 1 ? (L.gated ? 2 * L.N : L.N) : L.K;
        uint8_t *da, *dw;
        __nv_bfloat16* dd;
        float *dref, *dalpha;
        CK(cudaMalloc(&da, size_t(pairs) * kin));
        CK(cudaMalloc(&dw, size_t(L.E) * nout * kin));
        CK(cudaMalloc(&dd, size_t(pairs) * nout * 2));
        CK(cudaMalloc(&dref, check ? size_t(pairs) * nout * 4 : 4));
        CK(cudaMalloc(&dalpha, L.E * sizeof(float)));
        fill_fp8<<<(size_t(pairs) * kin + 255) / 256, 256>>>(da, size_t(pairs) * kin, rng(), 1.f);
        fill_fp8<<<(size_t(L.E) * nout * kin + 255) / 256, 256>>>(dw, size_t(L.E) * nout * kin, rng(), 1.f);
        CK(cudaGetLastError());
        std::vector<float> alpha(L.E);
        std::uniform_real_distribution<float> u(0.5f, 1.5f);
        for (auto& x : alpha) x = u(rng) / std::sqrt(float(kin));
        CK(cudaMemcpy(dalpha, alpha.data(), L.E * sizeof(float), cudaMemcpyHostToDevice));

        cb::Problem p;
        p.groups = L.E;
        std::vector<const void*> pa(L.E), pb(L.E);
        std::vector<void*> pd(L.E);
        std::vector<const float*> pal(L.E);
        size_t row = 0;
        for (int e = 0; e < L.E; ++e) {
          p.shapes.push_back({counts[e], nout, kin});
          pa[e] = da + row * kin;
          pb[e] = dw + size_t(e) * nout * kin;
          pd[e] = dd + row * nout;
          pal[e] = dalpha + e;
          row += counts[e];
        }
        void** dptrs;
        CK(cudaMalloc(&dptrs, 4 * L.E * sizeof(void*)));
        CK(cudaMemcpy(dptrs, pa.data(), L.E * sizeof(void*), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dptrs + L.E, pb.data(), L.E * sizeof(void*), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dptrs + 2 * L.E, pd.data(), L.E * sizeof(void*), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dptrs + 3 * L.E, pal.data(), L.E * sizeof(void*), cudaMemcpyHostToDevice));
        p.ptr_a = dptrs;
        p.ptr_b = dptrs + L.E;
        p.ptr_d = dptrs + 2 * L.E;
        p.ptr_alpha = reinterpret_cast<const float* const*>(dptrs + 3 * L.E);
        if (check) {
          const dim3 grid((nout + 127) / 128, (max_count + kRefRows - 1) / kRefRows, L.E);
          ref_gemm<<<grid, 128>>>(da, dw, d_first_row, d_first_row + L.E, dalpha, nout, kin, dref);
          CK(cudaGetLastError());
        }
        const double flops = 2.0 * pairs * nout * kin;
        double best = 1e30;
        const char* best_name = "none";
        for (const auto& cfg : kConfigs) {
          if (!picked.empty() && std::find(picked.begin(), picked.end(), std::to_string(cfg.id)) == picked.end())
            continue;
          char err[128] = "";
          cb::Plan* plan = cfg.make(p, err, sizeof err);
          if (!plan) {
            std::printf("%-8s M=%5d GEMM%d [%d,%d]x[%d,%d]^T  #%d %-26s  skipped: %s\n", L.name, M, gemm, pairs,
                        kin, nout, kin, cfg.id, cfg.name, err);
            continue;
          }
          double rel = -1, bad = 0;
          CK(cudaMemset(dd, 0xFF, size_t(pairs) * nout * 2));  // poison: NaN in BF16
          if (plan->run(0) != cudaSuccess) {
            std::printf("%-8s M=%5d GEMM%d  #%d %-26s  skipped: launch refused\n", L.name, M, gemm, cfg.id, cfg.name);
            delete plan;
            all_ok = false;
            continue;
          }
          if (check) {
            CK(cudaDeviceSynchronize());
            CK(cudaMemset(dacc, 0, 3 * sizeof(double)));
            compare<<<1024, 256>>>(dd, dref, size_t(pairs) * nout, dacc);
            double acc[3];
            CK(cudaMemcpy(acc, dacc, sizeof acc, cudaMemcpyDeviceToHost));
            rel = std::sqrt(acc[0] / std::max(acc[1], 1e-30));
            bad = acc[2];
          }
          const bool ok = !check || (bad == 0 && rel < 1e-2);
          all_ok = all_ok && ok;
          for (int i = 0; i < 3; ++i) CK(plan->run(0));
          std::vector<float> t;
          for (int i = 0; i < reps; ++i) {
            CK(cudaMemsetAsync(flush, i, flush_bytes));
            CK(cudaEventRecord(t0));
            CK(plan->run(0));
            CK(cudaEventRecord(t1));
            CK(cudaEventSynchronize(t1));
            float v;
            CK(cudaEventElapsedTime(&v, t0, t1));
            t.push_back(v);
          }
          std::sort(t.begin(), t.end());
          const double med = t[t.size() / 2];
          std::printf("%-8s M=%5d GEMM%d [%d,%d]x[%d,%d]^T  #%d %-26s  %.4f ms  %7.1f TFLOP/s  rel_l2=%.2e %s\n",
                      L.name, M, gemm, pairs, kin, nout, kin, cfg.id, cfg.name, med, flops / med / 1e9, rel,
                      !check ? "unchecked" : ok ? "ok" : "FAIL");
          if (ok && med < best) best = med, best_name = cfg.name;
          delete plan;
        }
        best_sum += best;
        best_flops += flops;
        best_names += std::string(gemm == 1 ? "" : " + ") + best_name;
        cudaFree(da); cudaFree(dw); cudaFree(dd); cudaFree(dref); cudaFree(dalpha); cudaFree(dptrs);
      }
      std::printf("SUM cutlass %-8s M=%5d GEMM1+GEMM2 %.4f ms  %6.1f TFLOP/s  (best: %s)\n", L.name, M, best_sum,
                  best_flops / best_sum / 1e9, best_names.c_str());
      cudaFree(d_first_row);
    }
  }
  std::printf(all_ok ? "CUTLASS BENCH OK\n" : "CUTLASS BENCH FAILED\n");
  return all_ok ? 0 : 1;
}

#endif  // CB_CONFIG
