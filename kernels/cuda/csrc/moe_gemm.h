// Internal launch interface for the two grouped FP8 GEMMs of fused MoE.
//
// Both GEMMs run over expert-sorted, block-aligned rows: routing produces
// M*top_k (token, slot) pairs, numbered pair = token*top_k + slot; the align
// step groups them by expert and pads each expert's run to a multiple of
// block_rows, so every block of block_rows consecutive sorted rows belongs to
// one expert (block_expert[block]). Sorted row r holds pair sorted_pairs[r],
// or -1 for padding. The activations are gathered into sorted order before
// GEMM1 (a1q[r] = quantized hidden[token of sorted_pairs[r]]), so both GEMMs
// read A rows contiguously, which TMA and cp.async want; with
// EXPERTD_SM90_GATHER=1 the Hopper GEMM1 may read the hidden rows by token
// instead (MoeGemmArgs::gather).
//
// GEMM1: act[r, :] = epilogue((a1q[r] . W13[e]^T) * a_scale(r) * w_scale[e])
//   written in sorted order, FP8 (static a2) or FP32 (dynamic a2 runs a
//   separate per-row quantize pass, see moe_pipeline.cu).
// GEMM2: y[pair, :] = (a2q[r] . W2[e]^T) * a_scale(r) * w_scale[e] * topk_w[pair]
// With per-channel weight scales w_scale depends on the output channel's
// weight row; in block mode the product is a sum over K blocks of the
// block's partial product times a_scale(r, kblock) * w_scale(e, row block,
// kblock) (see WScale).
//   written per pair (BF16); the combine kernel sums each token's top_k rows
//   in slot order, which keeps the result deterministic.
//
// Two implementations: gemm_portable.cu (any sm_80+, any K and N) and
// gemm_sm90.cu (sm_90a wgmma + TMA; built only where that file exists, which
// the build announces with -DEXPERTD_HAVE_SM90). Plain structs of device
// pointers and ints; no templates leak across the boundary.
#pragma once

#include <atomic>
#include <cstdint>
#include <cuda_runtime.h>

namespace expertd {

// kMaxDevices bounds the GPU ordinals whose per-device state the GEMMs keep.
constexpr int kMaxDevices = 64;

// Switches are the library's options (expertd_options, set by
// expertd_init) as the kernels and the pipeline read them: relaxed atomics,
// since a call may read them while another thread initializes.
struct Switches {
  std::atomic<int> streams{2};
  std::atomic<bool> pdl{true};
  std::atomic<bool> sm90_block{true};
  std::atomic<bool> sm90_persistent{true};
  std::atomic<bool> sm90_toka{true};
  std::atomic<bool> sm90_pair{false};
  // Ping-pong consumer warpgroups for two-warpgroup tiles; off only in the
  // GEMM check tool (EXPERTD_SM90_PINGPONG=0), to time both schedules in
  // one process.
  std::atomic<bool> sm90_pingpong{true};
  // GEMM2 on CUTLASS (use_cutlass2 in moe_state.cu): -1 by the rule, 0
  // never, 1 wherever the set and call allow it. The environment's
  // EXPERTD_SM90_CUTLASS (0 or 1) sets it at each expertd_init, so one
  // process can time both with two copies of the library.
  std::atomic<int> sm90_cutlass{-1};
  // GEMM1 reading FP8 hidden rows by token (sm90_gather_fold): -1 by the
  // rule, 0 never, 1 wherever the kernels can; EXPERTD_SM90_GATHER (see
  // parse_sm90_gather) sets it at each expertd_init.
  std::atomic<int> sm90_gather{-1};
  // GEMM1 of ReLU² layers on CUTLASS (use_cutlass1), the same three ways
  // from EXPERTD_SM90_CUTLASS1; the rule itself is off (kByDefault).
  std::atomic<int> sm90_cutlass1{-1};
  std::atomic<bool> poison{false};
  std::atomic<bool> host_trace{false};
  std::atomic<int> sync_spin_us{0};
};

// switches is the process's one set of them (an inline function's static:
// one object however many files include this, the GEMM check tool's
// included).
inline Switches& switches() {
  static Switches s;
  return s;
}

// parse_sm90_gather reads EXPERTD_SM90_GATHER's value v (null where unset)
// into *sw for Switches::sm90_gather: unset -1 (the rule), "0" 0, "1" 1;
// any other value is refused (false). The variable rather than an option,
// so one library is timed every way (a device A/B) without a new ABI field.
inline bool parse_sm90_gather(const char* v, int* sw) {
  if (v == nullptr) {
    *sw = -1;
  } else if ((v[0] == '0' || v[0] == '1') && v[1] == 0) {
    *sw = v[0] - '0';
  } else {
    return false;
  }
  return true;
}

constexpr float kMinScale = 1e-10f;  // MOE_SPEC: near-zero scales give NaN on Hopper

// mean_rows_per_expert is a call's routed rows per expert on average,
// rounded up: what the token-tile rules key on.
inline int mean_rows_per_expert(int m, int top_k, int num_experts) {
  return int((int64_t(m) * top_k + num_experts - 1) / num_experts);
}

// clamp_scale is the one floor on scales, for the host's static ones and
// the kernels' dynamic ones alike.
__host__ __device__ inline float clamp_scale(float s) { return s > kMinScale ? s : kMinScale; }

// GemmEpilogue is what a GEMM does with its FP32 accumulators.
enum class GemmEpilogue : int {
  // GEMM1: dequantize, activation, quantize to FP8 E4M3 (satfinite) with
  // out_inv_scale = 1/a2_scale; out is FP8 [sorted row, ld_out].
  kAct1FP8 = 0,
  // GEMM2: dequantize, times pair_weight[pair], BF16 out [pair, ld_out].
  kWeightedBF16 = 2,
  // GEMM1: dequantize, activation, FP32 out [sorted row, ld_out], for the
  // dynamic a2 path: quantizing the FP32 intermediate per row keeps the FP8
  // roundings the reference's, which a BF16 intermediate would move
  // (docs/perf-notes.md has the error figures).
  kAct1F32 = 3,
};

// GemmAct is GEMM1's nonlinearity (ignored by GEMM2).
enum class GemmAct : int {
  // silu(gate) * up over w_rows = 2*n_out rows: gate rows [0, n_out), up
  // rows [n_out, 2*n_out) (vLLM order). Every gated activation below has
  // this layout too.
  kSiluGated = 0,
  // relu(h)^2 over w_rows = n_out rows.
  kRelu2 = 1,
  // gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit,
  // limit), g * sigmoid(alpha * g) * (u + 1).
  kSwigluOAI = 2,
  // gelu_tanh(gate) * up (GeGLU, tanh approximation).
  kGeluTanhGated = 3,
  // gelu(gate) * up with the exact, erf-based gelu.
  kGeluGated = 4,
};

// gemm_act_gated says whether act reads a gate and an up row per channel.
inline bool gemm_act_gated(GemmAct act) { return act != GemmAct::kRelu2; }

#ifdef __CUDACC__
// gemm1_act is GEMM1's epilogue for output channel ch < n_out: the
// dequantized gate g and up u (u unused by kRelu2) plus the expert's bias
// row (bias, w_rows floats in weight-row order, or null), through the
// activation. Both GEMM implementations call it, so they agree on the math.
__device__ __forceinline__ float gemm1_act(GemmAct act, const float* bias, int n_out, int ch, float g, float u,
                                           float limit, float alpha) {
  if (bias) {
    g += bias[ch];
    if (act != GemmAct::kRelu2) u += bias[n_out + ch];
  }
  switch (act) {
    case GemmAct::kRelu2:
      g = fmaxf(g, 0.f);
      return g * g;
    case GemmAct::kSwigluOAI:
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
      return g / (1.0f + __expf(-alpha * g)) * (u + 1.f);
    case GemmAct::kGeluTanhGated:
      return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    case GemmAct::kGeluGated:
      return 0.5f * g * (1.f + erff(g * 0.7071067811865476f)) * u;
    default:
      return g / (1.0f + __expf(-g)) * u;
  }
}
#endif

// WScale is the layout of a GEMM's weight scales.
enum class WScale : int {
  // w_scale[expert] (a per-tensor scale is expanded to [E] at upload).
  kPerExpert = 0,
  // w_scale[expert * w_rows + weight row]: one per output channel (gated
  // GEMM1: gate and up rows have their own).
  kPerChannel = 1,
  // w_scale[(expert * ceil(w_rows/block_n) + row/block_n) * ceil(k/block_k)
  // + kcol/block_k]. The activation scale is then per (sorted row, K block).
  kBlock = 2,
};

// RouteParams are one call's routing settings.
struct RouteParams {
  int m, e, top_k;
  int renormalize;
  int scoring;  // 1 softmax, 2 sigmoid
  int num_groups, topk_groups;
  float scaling;
  int logits_dtype;
};

// DecodeRoute lets the Hopper GEMM1 of a one-token call do the steps
// before it (sm90_decode_route says when): route the token, or read its
// precomputed ids, and lay its pairs out one alignment block each in slot
// order; the tiles then read the token's FP8 hidden row itself (a is the
// hidden states, a_rows 1). No routing, align or gather launch runs ahead
// of GEMM1, and each of those is a chain of dependent round trips at
// decode sizes. Every CTA computes the same layout, and CTA 0 writes it
// (sorted_pairs, block_expert up to max_blocks, num_blocks) and the
// routing results for the kernels after GEMM1.
struct DecodeRoute {
  bool on;
  RouteParams rp;
  const void* logits;  // null: ids (and weights) are the caller's
  const float* bias;
  int32_t* ids;
  float* weights;
  // The token's activation scale in device memory (clamped as the gather
  // clamps it), or null for MoeGemmArgs::a_scale.
  const float* a_scale;
};

// MoeGemmArgs describes one grouped GEMM launch. All pointers are device
// pointers; the launch reads num_blocks from device memory, so one capture
// serves any routing outcome.
struct MoeGemmArgs {
  // Weights: FP8 E4M3 [num_experts, w_rows, k], k contiguous.
  const uint8_t* w;
  int num_experts;
  int w_rows;
  int k;
  GemmAct act;
  // Output channels: N for GEMM1, K (hidden) for GEMM2.
  int n_out;

  // Activations: FP8 E4M3 [a_rows, k] in sorted order; a_rows is
  // max_blocks * block_rows (rows of padding are finite but meaningless).
  const uint8_t* a;
  int a_rows;
  int block_rows;

  // Per block: expert id or -1. num_blocks (device scalar) <= max_blocks,
  // and max_blocks sizes the grid; blocks at or past *num_blocks exit.
  const int32_t* block_expert;
  const int32_t* num_blocks;
  int max_blocks;
  // Per sorted row: pair index or -1 (padding; nothing is written for it).
  const int32_t* sorted_pairs;

  // Dequantization: a_scale_rows[sorted row * a_scale_ld + kblock] when
  // non-null (dynamic per token, or per token and K group in block mode,
  // where a_scale_ld = ceil(k/block_k); else a_scale_ld = 1), else a_scale;
  // times the weight scale laid out as w_mode says.
  const float* a_scale_rows;
  int a_scale_ld;
  float a_scale;
  const float* w_scale;
  WScale w_mode;
  int block_n, block_k;  // kBlock only

  // Output.
  GemmEpilogue epilogue;
  void* out;
  int ld_out;               // elements between output rows
  float out_inv_scale;      // kAct1FP8
  const float* pair_weight; // kWeightedBF16: router weight per pair

  // Launch with programmatic dependent launch (launch.cuh).
  bool pdl;

  // GEMM1 only, Hopper only; appended last so the GEMM check tool's base
  // tree keeps the layout of the fields above.
  DecodeRoute route;

  // GEMM1 only, appended for the same reason: the per-expert bias
  // [num_experts, w_rows] added before the activation (null: none), and
  // kSwigluOAI's limit and alpha.
  const float* bias;
  float swiglu_limit, swiglu_alpha;

  // GEMM1 only, Hopper only, appended for the same reason. With gather set
  // (sm90_gather_fold says when), a is the FP8 hidden rows themselves
  // [a_rows = tokens, k] and sorted row r is token sorted_pairs[r] / top_k's
  // row (zeros for -1): the tiles read the rows by token, so no pass copies
  // them into sorted order first. a_scale_rows stays per sorted row.
  bool gather;
  int top_k;
};

// Portable path (gemm_portable.cu), every epilogue: mma.sync m16n8k32 e4m3 on sm_89+, or
// FP8 decoded to FP16 and mma.sync m16n8k16 on sm_80..sm_88. Any k, n_out;
// block_rows must be one of PortableBlockRows' answers (16, 32 or 64).
// Every WScale, any block_n and block_k.
// use_f16 forces the FP16 inner product on sm_89+ too (tests use it to cover
// the sm_80 code path on a Hopper card).
cudaError_t launch_gemm1_portable(const MoeGemmArgs& args, bool use_f16, cudaStream_t stream);
cudaError_t launch_gemm2_portable(const MoeGemmArgs& args, bool use_f16, cudaStream_t stream);

// PortableBlockRows picks the portable kernel's token tile for a call.
int portable_block_rows(int m, int top_k, int num_experts);

#ifdef EXPERTD_HAVE_SM90
// Hopper path (gemm_sm90.cu, sm_90a): wgmma (QGMMA) fed by TMA. It returns
// cudaErrorInvalidValue for shapes it cannot take, so callers check
// sm90_supported first and use the portable path otherwise.
cudaError_t launch_gemm1_sm90(const MoeGemmArgs& args, cudaStream_t stream);
cudaError_t launch_gemm2_sm90(const MoeGemmArgs& args, cudaStream_t stream);
// sm90_supported says whether the Hopper kernels take this layer shape
// (k = hidden, n = intermediate). They take every WScale; kBlock when
// sm90_block_supported(block_n, block_k) too.
bool sm90_supported(int hidden, int inter);
// sm90_block_supported says whether the Hopper kernels take block scales
// of this shape: block_k = 128 (one pipeline stage), any block_n.
bool sm90_block_supported(int block_n, int block_k);
// sm90_block_rows picks the Hopper kernels' token tile for a call
// (block_scales: a set in block mode, whose tiles are at most 128 tokens).
// A layer shape (hidden, inter, gated) with rows in the measured tile table
// (sm90_tiles.h, which gemm_sm90_check tiles regenerates) takes its tile
// from there; other shapes, and callers that pass no shape, a rule of the
// mean tokens per expert.
int sm90_block_rows(int m, int top_k, int num_experts, bool block_scales, int hidden = 0, int inter = 0,
                    bool gated = false);
// sm90_decode_route says whether GEMM1 can take a call's steps before it
// (DecodeRoute): one token with FP8 hidden states at a 16-byte aligned
// address, 8-token tiles, per-expert or per-channel weight scales, top_k
// within a warp and the routing scratch within the kernel's ring.
bool sm90_decode_route(int m, int top_k, int num_experts, int block_rows, WScale w_mode, const void* hidden);
// sm90_gather_fold says whether a call's GEMM1 reads its FP8 hidden rows
// (rows, [tokens, k]) by token (MoeGemmArgs::gather) instead of from rows a
// gather pass has copied into sorted order: where the kernels can (token
// tiles of 64 or 128 without block scales or paired blocks, k % 16 == 0,
// 16-byte aligned rows) and Switches::sm90_gather or its rule says so;
// rows_per_expert is the call's mean routed rows per expert, rounded up.
bool sm90_gather_fold(int block_rows, WScale w_mode, int k, const void* rows, bool gated, int rows_per_expert);
#endif

}  // namespace expertd
