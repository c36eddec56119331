// gemm_sm90_check: checks the Hopper grouped GEMMs against a naive GPU
// reference on random data, then times them. A development tool for the
// device machine: build with scripts/cuda-build.sh, run build/gemm_sm90_check.
//
//   gemm_sm90_check            correctness on several shapes, then timing
//   gemm_sm90_check quick      correctness only
//   gemm_sm90_check block ...  the same with [128, 128] block scales (and
//                              DeepSeek-V3 timings)
//   gemm_sm90_check tiles      times each layer of kLayers at each token tile
//                              and prints sm90_tiles.h (stdout; progress on
//                              stderr)
//   gemm_sm90_check ab [block] times the tree's kernels against a baseline
//                              copy linked into the same binary (see
//                              gemm_sm90_base.cu and scripts/sm90-ab-build.sh)
//                              on the same routing and data; ab-only, no check
//                              beyond the tree's own (run "quick" for that)
//
// Timing environment: AB_M=64,256 (token counts), AB_CASES=nemotron,qwen3,
// qwen3-next,gpt-oss,nemotron-3-ultra,deepseek-v3 (per-expert scales),
// deepseek-v3-block (at AB_DS_M, default 8192): names from kLayers,
// TILES_M=1,16 (the tiles run's token counts), BNS=64,128,256 (also time
// the tree's kernels at each forced token tile), BN=n (force the tile
// everywhere), PROFILE_M / PROFILE_CASE,
// EXPERTD_SM90_PAIR=1 (paired 256-token tiles), EXPERTD_SM90_PINGPONG=0
// (two-warpgroup tiles cooperative instead of ping-pong),
// EXPERTD_SM90_GATHER=1 (GEMM1 reads each pair's row of [M, K] token rows
// by token wherever its kernels can, MoeGemmArgs::gather, checked against
// the reference on the rows gathered into sorted order; under ab the
// baseline reads the gathered rows), AB_WARM=1 (an
// untimed run after each L2 flush, so the timed one finds what fits of its
// weights in L2).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../moe_gemm.h"
#include "tool_common.cuh"

// The baseline's entry points (gemm_sm90_base.cu); weak, so the tool links
// without it and "ab" says so.
extern "C" cudaError_t expertd_base_gemm1(const void* args, cudaStream_t s) __attribute__((weak));
extern "C" cudaError_t expertd_base_gemm2(const void* args, cudaStream_t s) __attribute__((weak));
extern "C" int expertd_base_block_rows(int m, int top_k, int num_experts, bool block_scales)
    __attribute__((weak));

using expertd::GemmAct;
using expertd::GemmEpilogue;
using expertd::MoeGemmArgs;
using expertd::WScale;

// Block mode: [kBlockN, kBlockK] weight blocks, activation scales per row
// and K block (gemm_sm90_check block).
bool g_block = false;
constexpr int kBlockN = 128, kBlockK = 128;
int cdiv(int a, int b) { return (a + b - 1) / b; }
// g_base: launch the baseline's kernels (ab); g_force_bn > 0 forces the
// token tile (BN, BNS).
bool g_base = false;
int g_force_bn = 0;
// g_gather (EXPERTD_SM90_GATHER=1): the tree's GEMM1 reads token rows by
// token where sm90_gather_fold allows.
bool g_gather = false;
// g_warm (AB_WARM): time each GEMM after an untimed run of it, so it finds
// what fits of its weights in L2: its time when they are not what bounds it.
bool g_warm = false;
FILE* g_log = stdout;  // timing lines (stderr under "tiles", whose stdout is a header)

// Naive reference: one thread per (sorted row, output channel).
__global__ void ref_gemm(const uint8_t* w, int w_rows, int k, bool gated, int n_out, const uint8_t* a,
                         int rows, int block_rows, const int32_t* block_expert,
                         const int32_t* sorted_pairs, const float* a_scale_rows, float a_scale,
                         const float* w_scale, int epi, float out_inv_scale, const float* pair_weight,
                         float* out, bool block) {
  int r = blockIdx.x;
  int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (r >= rows || c >= n_out) return;
  int e = block_expert[r / block_rows];
  int pair = sorted_pairs[r];
  if (e < 0 || pair < 0) return;
  const uint8_t* ar = a + size_t(r) * k;
  auto dot = [&](int row) {
    const uint8_t* wr = w + (size_t(e) * w_rows + row) * k;
    if (block) {
      const int kb_n = (k + kBlockK - 1) / kBlockK, rb_n = (w_rows + kBlockN - 1) / kBlockN;
      float s = 0;
      for (int kb = 0; kb < kb_n; ++kb) {
        float p = 0;
        for (int i = kb * kBlockK; i < min(k, (kb + 1) * kBlockK); ++i) p += fp8f(ar[i]) * fp8f(wr[i]);
        const float as = a_scale_rows ? a_scale_rows[size_t(r) * kb_n + kb] : a_scale;
        s += p * as * w_scale[(size_t(e) * rb_n + row / kBlockN) * kb_n + kb];
      }
      return s;
    }
    const float sc = (a_scale_rows ? a_scale_rows[r] : a_scale) * w_scale[e];
    float s = 0;
    for (int i = 0; i < k; ++i) s += fp8f(ar[i]) * fp8f(wr[i]);
    return s * sc;
  };
  float v;
  if (epi == 2) {
    v = dot(c) * pair_weight[pair];
    out[size_t(pair) * n_out + c] = v;
    return;
  }
  if (gated) {
    float g = dot(c), u = dot(c + w_rows / 2);
    v = g / (1.f + expf(-g)) * u;
  } else {
    v = fmaxf(dot(c), 0.f);
    v = v * v;
  }
  if (epi == 0) v = float(__nv_fp8_e4m3(v * out_inv_scale));
  out[size_t(r) * n_out + c] = v;
}

__global__ void decode_out(const void* src, int epi, size_t n, float* dst) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (epi == 0) {
    dst[i] = fp8f(static_cast<const uint8_t*>(src)[i]);
  } else if (epi == 3) {
    dst[i] = static_cast<const float*>(src)[i];
  } else {
    dst[i] = __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
  }
}

struct Case {
  const char* name;
  int E, K, N, M, topk;
  bool gated;
  int skew;  // 0 uniform, 1 all pairs on expert 0, 2 random with empty experts
};

// kLayers: every layer shape the benchmark runs, and Nemotron-3-Ultra's,
// which it does not (512 experts of N = 640), for the tiles run, ab
// (AB_CASES) and PROFILE_CASE alike. The tile table is keyed by hidden,
// inter, gated and block scales; E and top_k only set the tokens per expert
// that a token count gives. gpt-oss's layer runs the SiLU-gated epilogue: a
// tile trades weight passes against idle token slots, which its clamped
// SwiGLU and biases (per-row epilogue work) do not change.
// nemotron-3-ultra is a LatentMoE layer: its experts see the 2048-wide
// latent, not the model's 8192-wide hidden state, so hidden is 2048.
struct Layer {
  Case c;  // M unset
  bool block;
};
const Layer kLayers[] = {
    {{"nemotron", 128, 2688, 1856, 0, 6, false, 0}, false},
    {{"qwen3", 128, 2048, 768, 0, 8, true, 0}, false},
    {{"qwen3-next", 512, 2048, 512, 0, 10, true, 0}, false},
    {{"gpt-oss", 128, 2880, 2880, 0, 4, true, 0}, false},
    {{"nemotron-3-ultra", 512, 2048, 640, 0, 22, false, 0}, false},
    {{"deepseek-v3", 256, 7168, 2048, 0, 8, true, 0}, false},
    {{"deepseek-v3-block", 256, 7168, 2048, 0, 8, true, 0}, true},
};

// find_layer is kLayers' entry of that name; an unknown name ends the run
// with the list, so a typo in AB_CASES or PROFILE_CASE times nothing else.
const Layer& find_layer(const std::string& name) {
  for (const Layer& l : kLayers)
    if (name == l.c.name) return l;
  std::fprintf(stderr, "unknown layer %s; one of:", name.c_str());
  for (const Layer& l : kLayers) std::fprintf(stderr, " %s", l.c.name);
  std::fprintf(stderr, "\n");
  std::exit(2);
}

struct Layout {
  int block_rows, max_blocks, rows, num_blocks, pairs;
  std::vector<int32_t> block_expert, sorted_pairs;
};

Layout make_layout(const Case& c, std::mt19937& rng) {
  Layout L;
  L.pairs = c.M * c.topk;
  std::vector<int> counts(c.E, 0);
  std::uniform_int_distribution<int> pick(0, c.E - 1);
  for (int i = 0; i < L.pairs; ++i) {
    int e = pick(rng);
    if (c.skew == 1) e = 0;
    if (c.skew == 2) e = (e / 2) * 2;  // odd experts get nothing
    counts[e]++;
  }
  L.block_rows = g_base ? expertd_base_block_rows(c.M, c.topk, c.E, g_block)
                       : expertd::sm90_block_rows(c.M, c.topk, c.E, g_block, c.K, c.N, c.gated);
  if (g_force_bn > 0) L.block_rows = g_force_bn;  // force a tile, for timing
  int bound = std::min(c.E, L.pairs) + L.pairs / L.block_rows;
  L.max_blocks = bound;
  L.rows = bound * L.block_rows;
  L.block_expert.assign(bound, -1);
  L.sorted_pairs.assign(L.rows, -1);
  std::vector<int> perm(L.pairs);
  for (int i = 0; i < L.pairs; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  int blk = 0, next = 0;
  for (int e = 0; e < c.E; ++e) {
    int left = counts[e];
    while (left > 0) {
      L.block_expert[blk] = e;
      int take = std::min(left, L.block_rows);
      for (int i = 0; i < take; ++i) L.sorted_pairs[blk * L.block_rows + i] = perm[next++];
      left -= take;
      blk++;
    }
  }
  L.num_blocks = blk;
  return L;
}

// gather_rows copies token rows into sorted order (one block a sorted row;
// padding rows stay as they are), as the library's gather pass does: the
// reference's input for a GEMM1 that reads the token rows itself.
__global__ void gather_rows(const uint8_t* tokens, int k, int top_k, const int32_t* sorted_pairs, uint8_t* rows) {
  const int r = blockIdx.x;
  const int pair = sorted_pairs[r];
  if (pair < 0) return;
  for (int i = threadIdx.x; i < k; i += blockDim.x) rows[size_t(r) * k + i] = tokens[size_t(pair / top_k) * k + i];
}

uint8_t* rand_fp8_dev(size_t n, float sd, std::mt19937& rng) {
  uint8_t* d;
  CK(cudaMalloc(&d, n + 16));
  fill_fp8<<<(n + 255) / 256, 256>>>(d, n, rng(), sd);
  CK(cudaGetLastError());
  return d;
}

template <class T>
T* to_dev(const std::vector<T>& h) {
  T* d;
  CK(cudaMalloc(&d, h.size() * sizeof(T) + 16));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// run checks GEMM1 (both epilogues) and GEMM2 of case c; with time_it it
// also times each and prints TFLOP/s and weight bandwidth.
double g_sum_ms, g_sum_flops, g_sum_bytes;  // GEMM1 + GEMM2 of the last timed run
bool run(const Case& c, bool check, bool time_it, std::mt19937& rng) {
  g_sum_ms = g_sum_flops = g_sum_bytes = 0;
  Layout L = make_layout(c, rng);
  const int w1_rows = c.gated ? 2 * c.N : c.N;
  uint8_t* dw1 = rand_fp8_dev(size_t(c.E) * w1_rows * c.K, 1.f, rng);
  uint8_t* dw2 = rand_fp8_dev(size_t(c.E) * c.K * c.N, 1.f, rng);
  uint8_t* da = rand_fp8_dev(size_t(L.rows) * c.K, 4.f, rng);
  // g_gather: the token rows GEMM1 reads where it can, and da their copies
  // in sorted order (the reference's and the baseline's input). The rows
  // are drawn whether or not the tree's GEMM1 takes them, so ab's baseline
  // and tree runs see the same data.
  uint8_t* dtok = g_gather && !g_block ? rand_fp8_dev(size_t(c.M) * c.K, 4.f, rng) : nullptr;
  uint8_t* di = rand_fp8_dev(size_t(L.rows) * c.N, 4.f, rng);
  // Block mode: weight scales [E, row blocks, K blocks], activation scales
  // [rows, K blocks] for both GEMMs; else per expert, and per row for GEMM1.
  const size_t nws1 = g_block ? size_t(c.E) * cdiv(w1_rows, kBlockN) * cdiv(c.K, kBlockK) : c.E;
  const size_t nws2 = g_block ? size_t(c.E) * cdiv(c.K, kBlockN) * cdiv(c.N, kBlockK) : c.E;
  std::vector<float> ws1(nws1), ws2(nws2), asr(size_t(L.rows) * (g_block ? cdiv(c.K, kBlockK) : 1)),
      asr2(size_t(L.rows) * cdiv(c.N, kBlockK)), pw(L.pairs);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (auto& x : ws1) x = u(rng) / std::sqrt(float(c.K)) / 8;
  for (auto& x : ws2) x = u(rng) / std::sqrt(float(c.N)) / 8;
  for (auto& x : asr) x = u(rng) * 0.05f;
  for (auto& x : asr2) x = u(rng) * 0.05f;
  for (auto& x : pw) x = u(rng) / c.topk;

  float *dws1 = to_dev(ws1), *dws2 = to_dev(ws2), *dasr = to_dev(asr), *dasr2 = to_dev(asr2), *dpw = to_dev(pw);
  int32_t *dbe = to_dev(L.block_expert), *dsp = to_dev(L.sorted_pairs);
  std::vector<int32_t> nb{L.num_blocks};
  int32_t* dnb = to_dev(nb);
  const bool gather = dtok && expertd::sm90_gather_fold(L.block_rows, WScale::kPerExpert, c.K, dtok, c.gated, L.block_rows);
  if (gather) {
    gather_rows<<<L.rows, 128>>>(dtok, c.K, c.topk, dsp, da);
    CK(cudaGetLastError());
  }
  size_t out1 = size_t(L.rows) * c.N, out2 = size_t(L.pairs) * c.K;
  void* dout;
  CK(cudaMalloc(&dout, std::max(out1, out2) * 4));
  float *dref, *dgot;
  CK(cudaMalloc(&dref, std::max(out1, out2) * 4));
  CK(cudaMalloc(&dgot, std::max(out1, out2) * 4));

  bool ok = true;
  // Epilogues as in moe_gemm.h: 0 GEMM1 to FP8, 2 GEMM2, 3 GEMM1 to FP32
  // (1 is unassigned: no path asks for a BF16 GEMM1).
  for (int epi = 0; epi < 4; ++epi) {
    if (epi == 1) continue;
    MoeGemmArgs g{};
    const bool second = epi == 2;
    g.w = second ? dw2 : dw1;
    g.num_experts = c.E;
    g.w_rows = second ? c.K : w1_rows;
    g.k = second ? c.N : c.K;
    g.act = c.gated ? GemmAct::kSiluGated : GemmAct::kRelu2;
    const bool gated = !second && c.gated;
    g.n_out = second ? c.K : c.N;
    g.a = second ? di : da;
    g.a_rows = L.rows;
    g.block_rows = L.block_rows;
    g.block_expert = dbe;
    g.num_blocks = dnb;
    g.max_blocks = L.max_blocks;
    g.sorted_pairs = dsp;
    g.a_scale_rows = second ? (g_block ? dasr2 : nullptr) : dasr;
    g.a_scale_ld = g_block ? cdiv(g.k, kBlockK) : 1;
    g.a_scale = 0.02f;
    g.w_scale = second ? dws2 : dws1;
    g.w_mode = g_block ? WScale::kBlock : WScale::kPerExpert;
    g.block_n = g_block ? kBlockN : 0;
    g.block_k = g_block ? kBlockK : 0;
    g.epilogue = GemmEpilogue(epi);
    g.out = dout;
    g.ld_out = g.n_out;
    g.out_inv_scale = 1.f / 0.01f;
    g.pair_weight = dpw;
    if (gather && !second && !g_base) {
      g.a = dtok;
      g.a_rows = c.M;
      g.gather = true;
      g.top_k = c.topk;
    }
    size_t nout = second ? out2 : out1;
    auto launch = [&] {
      if (g_base) return second ? expertd_base_gemm2(&g, 0) : expertd_base_gemm1(&g, 0);
      return second ? expertd::launch_gemm2_sm90(g, 0) : expertd::launch_gemm1_sm90(g, 0);
    };
    if (check) {
    CK(cudaMemset(dout, 0xFF, nout * 4));  // poison: NaN in FP8, BF16 and FP32
    CK(cudaMemset(dref, 0, nout * 4));
    CK(launch());
    CK(cudaGetLastError());
    // Watchdog: a pipeline bug shows up as a hang; say where it stopped.
    for (int spin = 0; cudaStreamQuery(0) == cudaErrorNotReady; ++spin) {
      if (spin > 20000) {
        std::printf("HANG %s epi=%d (k iters %d)\n", c.name, epi, (g.k + 127) / 128);
        std::_Exit(2);
      }
      struct timespec ts = {0, 500000};
      nanosleep(&ts, nullptr);
    }
    CK(cudaGetLastError());
    dim3 rg(L.rows, (g.n_out + 127) / 128);
    ref_gemm<<<rg, 128>>>(g.w, g.w_rows, g.k, gated, g.n_out, second ? di : da, L.rows, L.block_rows, dbe, dsp,
                          g.a_scale_rows, g.a_scale, g.w_scale, epi, g.out_inv_scale, dpw, dref, g_block);
    CK(cudaGetLastError());
    decode_out<<<(nout + 255) / 256, 256>>>(dout, epi, nout, dgot);
    CK(cudaDeviceSynchronize());
    std::vector<float> got(nout), ref(nout);
    CK(cudaMemcpy(got.data(), dgot, nout * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ref.data(), dref, nout * 4, cudaMemcpyDeviceToHost));
    // Rows that hold no pair were never written (and stay poisoned); all
    // others must be finite and close.
    double num = 0, den = 0;
    long bad = 0, checked = 0;
    for (int r = 0; r < (second ? L.pairs : L.rows); ++r) {
      if (!second && L.sorted_pairs[r] < 0) continue;
      for (int j = 0; j < g.n_out; ++j) {
        size_t i = size_t(r) * g.n_out + j;
        if (!std::isfinite(got[i])) {
          bad++;
          continue;
        }
        num += (got[i] - ref[i]) * double(got[i] - ref[i]);
        den += double(ref[i]) * ref[i];
        checked++;
      }
    }
    double rel = std::sqrt(num / std::max(den, 1e-30));
    // FP8 outputs may differ by one code where the FP32 sums differ in the
    // last bits; BF16 outputs only by rounding.
    double tol = epi == 0 ? 3e-2 : 1e-2;
    bool pass = bad == 0 && rel <= tol && den > 0;
    ok = ok && pass;
    std::printf("%-28s epi=%d BN=%3d blocks=%4d%s rel_l2=%.3e nonfinite=%ld checked=%ld %s\n", c.name, epi,
                L.block_rows, L.num_blocks, g.gather ? " by-token" : "", rel, bad, checked, pass ? "ok" : "FAIL");
    }

    if (time_it && (epi == 0 || epi == 2) && ok) {
      cudaEvent_t t0, t1;
      CK(cudaEventCreate(&t0));
      CK(cudaEventCreate(&t1));
      // Flush L2 (60 MB on an H200) before each timed launch so weights
      // come from HBM, as they do when a layer runs once per step. The
      // flush also keeps the stream busy while the host enqueues the GEMM.
      static void* flush = nullptr;
      const size_t flush_bytes = 256 << 20;
      if (!flush) CK(cudaMalloc(&flush, flush_bytes));
      for (int i = 0; i < 5; ++i) CK(launch());
      std::vector<float> ms;
      for (int i = 0; i < 30; ++i) {
        CK(cudaMemsetAsync(flush, i, flush_bytes));
        if (g_warm) CK(launch());
        CK(cudaEventRecord(t0));
        CK(launch());
        CK(cudaEventRecord(t1));
        CK(cudaEventSynchronize(t1));
        float m;
        CK(cudaEventElapsedTime(&m, t0, t1));
        ms.push_back(m);
      }
      std::sort(ms.begin(), ms.end());
      float med = ms[ms.size() / 2];
      int hit = 0;
      for (int b = 0; b < L.num_blocks; ++b)
        if (b == 0 || L.block_expert[b] != L.block_expert[b - 1]) hit++;
      double flops = 2.0 * L.pairs * g.k * (second ? c.K : w1_rows);
      double wbytes = double(hit) * g.w_rows * g.k;
      std::fprintf(g_log, "  time %-4s %-12s epi=%d M=%5d BN=%3d%s  %.4f ms  %7.1f TFLOP/s (%.0f%% of 1471)  %5.2f TB/s weights (%.0f%% of 4.28)\n",
                  g_base ? "base" : "new", c.name, epi, c.M, L.block_rows, g.gather ? " by-token" : "", med, flops / med / 1e9,
                  flops / med / 1e9 / 14.71, wbytes / med / 1e9, wbytes / med / 1e6 / 42.8);
      g_sum_ms += med;
      g_sum_flops += flops;
      g_sum_bytes += wbytes;
    }
  }
  cudaFree(dw1); cudaFree(dw2); cudaFree(da); cudaFree(di); cudaFree(dws1); cudaFree(dws2);
  cudaFree(dasr); cudaFree(dasr2); cudaFree(dpw); cudaFree(dbe); cudaFree(dsp); cudaFree(dnb); cudaFree(dout);
  cudaFree(dref); cudaFree(dgot); cudaFree(dtok);
  return ok;
}

// time_ab times, per case and M, the baseline's kernels and the tree's at
// their own token tiles, then the tree's at each tile of BNS, all on the same
// routing counts and data (one seed per point), and prints GEMM1 + GEMM2.
bool time_ab(std::mt19937& rng) {
  const auto cases = split(std::getenv("AB_CASES"), "nemotron,qwen3,deepseek-v3-block");
  const auto ms = split(std::getenv("AB_M"), "64,256,1024,4096,8192");
  const auto ds_ms = split(std::getenv("AB_DS_M"), "8192");  // deepseek-v3-block
  const auto bns = split(std::getenv("BNS"), "");
  const int forced = g_force_bn;  // BN, for both the baseline and the tree
  for (const auto& name : cases) {
    const Layer& layer = find_layer(name);
    Case c = layer.c;
    const bool block = layer.block;
    for (const auto& mstr : block ? ds_ms : ms) {
      c.M = std::atoi(mstr.c_str());
      const unsigned point_seed = rng();
      struct Variant {
        bool base;
        int bn;
      };
      std::vector<Variant> vs{{true, forced}, {false, forced}};
      // Block tiles are at most 128 tokens and were swept before (perf-notes).
      if (!block)
        for (const auto& b : bns) vs.push_back({false, std::atoi(b.c_str())});
      double base_ms = 0;
      for (const auto& v : vs) {
        g_base = v.base;
        g_force_bn = v.bn;
        g_block = block;
        std::mt19937 r(point_seed);
        run(c, false, true, r);
        if (v.base) base_ms = g_sum_ms;
        std::printf("SUM %-4s %-17s M=%5d BN=%-4s GEMM1+GEMM2 %.4f ms  %6.1f TFLOP/s  %5.2f TB/s  x%.3f of base\n",
                    v.base ? "base" : "new", name.c_str(), c.M, v.bn > 0 ? std::to_string(v.bn).c_str() : "auto",
                    g_sum_ms, g_sum_flops / g_sum_ms / 1e9, g_sum_bytes / g_sum_ms / 1e9, g_sum_ms / base_ms);
      }
      g_base = false;
    }
  }
  return true;
}

// tiles_table sweeps the token tile for every layer of kLayers over the M
// of TILES_M and prints the generated sm90_tiles.h: per shape and mean
// tokens per expert, the tile with the least GEMM1 + GEMM2 time. Candidates
// are the tiles from a quarter of the mean to 16x it (and the rule's own
// choice: 64-token tiles won at 4 per expert for Qwen3), so the sweep skips
// tiles that re-read every expert's weights dozens of times.
int tiles_table(std::mt19937& rng) {
  const auto ms = split(std::getenv("TILES_M"), "1,16,64,256,512,1024,2048,4096,8192");
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::string rows;
  for (const Layer& sh : kLayers) {
    g_block = sh.block;
    int last_pe = -1;
    std::string last_row;
    for (const auto& mstr : ms) {
      Case c = sh.c;
      c.M = std::atoi(mstr.c_str());
      const int pe = (c.M * c.topk + c.E - 1) / c.E;
      const int rule = expertd::sm90_block_rows(c.M, c.topk, c.E, sh.block);
      const unsigned point_seed = rng();
      int best = 0;
      double best_ms = 1e30, rule_ms = 0;
      std::string tried;
      for (int bn : {8, 16, 32, 64, 128, 256}) {
        if (sh.block && bn > 128) continue;
        if (bn != rule && ((bn > 16 * pe && bn > 8) || 4 * bn < pe)) continue;
        g_force_bn = bn;
        std::mt19937 r(point_seed);
        run(c, false, true, r);
        tried += " " + std::to_string(bn) + ":" + std::to_string(g_sum_ms).substr(0, 6);
        if (bn == rule) rule_ms = g_sum_ms;
        if (g_sum_ms < best_ms) best_ms = g_sum_ms, best = bn;
      }
      std::fprintf(stderr, "tiles %s M=%d per_expert=%d best %d (%.4f ms), rule %d (%.4f ms);%s\n", c.name, c.M, pe,
                   best, best_ms, rule, rule_ms, tried.c_str());
      char row[256];
      // The timings stay in the log (stderr, above): the table says what
      // was picked for which layer and M, not how long it took.
      std::snprintf(row, sizeof row, "    {%d, %d, %s, %s, %d, %d},  // %s M=%d\n", c.K, c.N,
                    c.gated ? "true" : "false", sh.block ? "true" : "false", pe, best, c.name, c.M);
      // Equal means (M=1 and M=16 for 128 experts): the larger M decides.
      if (pe == last_pe) {
        last_row = row;
        continue;
      }
      rows += last_row;
      last_row = row;
      last_pe = pe;
    }
    rows += last_row;
  }
  g_force_bn = 0;
  // The command as run: the variables that change what is timed, then the
  // tool, so the header says how to reproduce this very table.
  std::string cmd;
  for (const char* v : {"TILES_M", "EXPERTD_SM90_PAIR", "EXPERTD_SM90_PINGPONG", "EXPERTD_SM90_GATHER", "AB_WARM"})
    if (const char* x = std::getenv(v)) cmd += std::string(v) + "=" + x + " ";
  cmd += "build/gemm_sm90_check tiles > kernels/cuda/csrc/sm90_tiles.h";
  std::printf("// Code generated by gemm_sm90_check tiles. DO NOT EDIT.\n");
  std::printf("// Command: %s\n", cmd.c_str());
  std::printf("// Card: %s (sm_%d%d, %d SMs, %.0f GiB).\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30));
  for (const Layer& l : kLayers)
    std::printf("// Layer %s: E=%d, top_k=%d, hidden=%d, inter=%d, %s%s.\n", l.c.name, l.c.E, l.c.topk, l.c.K, l.c.N,
                l.c.gated ? "gated" : "ReLU2", l.block ? ", [128, 128] block scales" : "");
  std::printf("#pragma once\nnamespace expertd {\n");
  std::printf("// Sm90TileRow: for a layer shape, the fastest token tile (GEMM1 + GEMM2,\n");
  std::printf("// L2 flushed, uniform random routing) at a mean of per_expert tokens per\n");
  std::printf("// expert (ceil(M * top_k / E)); rows of a shape ascend in per_expert.\n");
  std::printf("struct Sm90TileRow {\n  int hidden, inter;\n  bool gated, block;\n  int per_expert, tile;\n};\n");
  std::printf("constexpr Sm90TileRow kSm90Tiles[] = {\n%s", rows.c_str());
  std::printf("    {-1, -1, false, false, 0, 0},  // end (matches no shape)\n};\n}  // namespace expertd\n");
  return 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  bool quick = false, ab = false, tiles = false;
  for (int i = 1; i < argc; ++i) {
    quick = quick || std::strcmp(argv[i], "quick") == 0;
    ab = ab || std::strcmp(argv[i], "ab") == 0;
    tiles = tiles || std::strcmp(argv[i], "tiles") == 0;
    g_block = g_block || std::strcmp(argv[i], "block") == 0;
  }
  if (const char* bn = std::getenv("BN")) g_force_bn = std::atoi(bn);
  g_warm = std::getenv("AB_WARM") != nullptr;
  // The library takes its switches from expertd_init's options; this tool
  // links the GEMM alone, so it sets the one it times from the environment.
  if (const char* pair = std::getenv("EXPERTD_SM90_PAIR")) expertd::switches().sm90_pair = std::strcmp(pair, "1") == 0;
  if (const char* pp = std::getenv("EXPERTD_SM90_PINGPONG")) expertd::switches().sm90_pingpong = std::strcmp(pp, "0") != 0;
  int gather_sw;
  if (!expertd::parse_sm90_gather(std::getenv("EXPERTD_SM90_GATHER"), &gather_sw)) {
    std::fprintf(stderr, "EXPERTD_SM90_GATHER: want 0 or 1\n");
    return 2;
  }
  // The tool checks the by-token GEMM1 only when asked (1), not by the rule.
  g_gather = gather_sw == 1;
  expertd::switches().sm90_gather = gather_sw == 1 ? 1 : 0;
  if (ab && (expertd_base_gemm1 == nullptr || expertd_base_block_rows == nullptr)) {
    std::fprintf(stderr, "ab: this binary has no baseline linked (scripts/sm90-ab-build.sh builds one)\n");
    return 2;
  }
  std::random_device rd;
  unsigned seed = rd();
  std::mt19937 rng(seed);
  // The table goes to stdout as a header: nothing else may.
  if (tiles) {
    g_log = stderr;
    std::fprintf(stderr, "seed %u\n", seed);
    return tiles_table(rng);
  }
  std::printf("seed %u\n", seed);
  // PROFILE_M=m: only time one layer of kLayers (PROFILE_CASE, default
  // deepseek-v3) at M=m, for a profiler to pick its kernels; "block" gives
  // any layer block scales, as deepseek-v3-block has.
  if (const char* pm = std::getenv("PROFILE_M")) {
    const char* pc = std::getenv("PROFILE_CASE");
    const Layer& layer = find_layer(pc ? pc : "deepseek-v3");
    Case c = layer.c;
    c.M = std::atoi(pm);
    g_block = g_block || layer.block;
    run(c, false, true, rng);
    return 0;
  }
  Case checks[] = {
      {"relu2 small", 8, 256, 128, 5, 2, false, 0},
      {"gated small", 8, 256, 128, 5, 2, true, 0},
      {"relu2 tail K=272 N=144", 6, 272, 144, 40, 3, false, 2},
      {"gated tail K=208 N=80", 6, 208, 80, 40, 3, true, 2},
      {"relu2 one expert", 4, 512, 256, 300, 2, false, 1},
      {"gated M=1", 16, 384, 192, 1, 4, true, 0},
      {"nemotron M=64", 128, 2688, 1856, 64, 6, false, 0},
      {"qwen3 M=256", 128, 2048, 768, 256, 8, true, 0},
      {"nemotron M=2048", 128, 2688, 1856, 2048, 6, false, 0},
      // 128-token tiles (block mode puts the tokens on wgmma's M side where
      // the scale blocks allow): gated, and ReLU² with N and K tails.
      {"gated 128-token tiles", 4, 384, 192, 300, 2, true, 0},
      {"relu2 128-token tails K=272 N=208", 4, 272, 208, 300, 2, false, 0},
      {"qwen3 M=2048", 128, 2048, 768, 2048, 8, true, 0},
      // 128-row blocks run as 256-token tiles of two blocks where both are
      // one expert's, else as half tiles: odd block counts and empty experts
      // shift which blocks pair up.
      {"relu2 paired tiles, empty experts", 8, 256, 144, 700, 2, false, 2},
      {"gated paired tiles, empty experts", 8, 272, 80, 700, 2, true, 2},
  };
  bool ok = true;
  for (auto& c : checks) ok = run(c, true, false, rng) && ok;
  if (g_block) ok = run({"deepseek-v3 M=64", 256, 7168, 2048, 64, 8, true, 0}, true, false, rng) && ok;
  std::printf(ok ? "CHECK PASSED\n" : "CHECK FAILED\n");
  if (quick || !ok) return ok ? 0 : 1;
  if (ab) return time_ab(rng) ? 0 : 1;
  int ms[] = {1, 16, 64, 256, 1024, 4096, 8192};
  // DeepSeek-V3 timings: block scales, or per-expert ones with
  // DEEPSEEK=1 (the promotion's cost at the same tiles).
  if (g_block || std::getenv("DEEPSEEK")) {
    for (int m : ms) run({"deepseek-v3", 256, 7168, 2048, m, 8, true, 0}, false, true, rng);
  }
  for (int m : ms) run({"nemotron", 128, 2688, 1856, m, 6, false, 0}, false, true, rng);
  for (int m : ms) run({"qwen3", 128, 2048, 768, m, 8, true, 0}, false, true, rng);
  return 0;
}
