// Hopper (sm_90a) grouped FP8 GEMM for fused MoE: TMA loads into 128-byte
// swizzled shared memory, an mbarrier ring, warp-specialized producer and
// wgmma (QGMMA) consumers, and fused epilogues (GEMM1's bias and its gated
// activation or ReLU² (gemm1_act), re-quantization to FP8; or
// router-weighted BF16 output for GEMM2).
//
// Layout choice ("swap AB"): the weights are wgmma's A operand (the M side,
// 64 output channels per consumer warpgroup) and the expert's tokens are the
// B operand (the N side, BN tokens). Decode batches give an expert a handful
// of tokens; with tokens on the N side a tile of 8 tokens wastes nothing,
// while the weights, which are the bytes that matter, stream through every
// SM. Both operands are K-contiguous in memory, which is what FP8 wgmma needs.
//
// Weight scales per expert fold into the per-token row scale. Per-channel
// ones (kPC: one per weight row) are per accumulator row instead: each
// consumer thread holds two weight rows, whose scales it loads when a tile
// starts, while the tile's operands stream in; for gated GEMM1 these are the
// gate and the up row of one channel, scaled before the activation.
//
// Block scales (kBlk: [block_n, 128] weight blocks, activations quantized
// per token and group of 128 K values) promote DeepGEMM-style: a pipeline
// stage is one 128-byte K slice, which is one K block, so each stage's
// wgmma k-steps run into a fresh FP32 partial accumulator, which is then
// added into the main one times w_scale(row's block, k block) x
// a_scale(token, k block). The weight scales are per accumulator row (two
// rows a thread, as with kPC, so any block_n works), read from global
// memory (L1/L2: [E, row blocks, k blocks] floats); the activation scales
// are per accumulator column, and a producer warp stages the tile's BN of
// them for each stage in shared memory with cp.async, which arrive on the
// stage's full barrier when they land. Tiles of at most 128 tokens: two
// accumulator sets of BN/2 registers each.
//
// At 128-token block-mode tiles the operands swap where the scale blocks
// allow it (kTokA): the tokens are wgmma's A operand (64 per consumer
// warpgroup) and the tile's 128 weight rows its B operand. A thread's
// accumulators then span two token rows and the rows of one weight scale
// block (gated: one for the gate rows, one for the up rows), so a stage's
// promotion is four products and one FMA per accumulator instead of an
// FMUL and an FMA each. Decode tiles keep the weights on the M side.
//
// Per-expert and per-channel mainloops keep one wgmma group in flight
// (wait_group 1), and their two-warpgroup tiles of up to 128 tokens run
// ping-pong (kPP: each warpgroup a whole tile, one's epilogue under the
// other's mainloop). With the sm90_pair option, 128-row alignment blocks run as
// 256-token tiles of two blocks of one expert (kPair, see TileScheduler). The
// token tile per layer shape comes from the measured table in sm90_tiles.h.
//
// Prefill GEMM1 tiles may read the FP8 hidden rows by token instead of
// sorted rows a gather pass wrote (kGather, MoeGemmArgs::gather): Hopper's
// TMA has no row gather, so the producer warpgroup's four warps load each
// stage's token tile (a quarter of its rows each) with 16-byte cp.async
// from the rows sorted_pairs names, into the layout TMA's 128-byte swizzle
// writes, and the consumers run as they do on TMA tiles. The hidden rows
// fit in L2, which serves the repeated reads; the gather's write and read
// back of a row per pair go away.
//
// It implements the sm90 half of moe_gemm.h.
#include "moe_gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cudaTypedefs.h>

#include <cstdlib>
#include <cstring>
#include <atomic>
#include <mutex>

#include "launch.cuh"
#include "route.cuh"
#include "sm90_ptx.cuh"
#include "sm90_tiles.h"
#include "wgmma_fp8.cuh"

namespace expertd {
namespace {

// Act1: how a GEMM1 kernel knows its activation. kPlain: the constant
// SiLU-gated (gated kernels) or ReLU² (the others), no bias; kSwiglu: the
// constant SwiGLU-OAI, bias read at run time (gpt-oss); kAny: the set's
// activation and bias read at run time (the rarer activations).
enum class Act1 { kPlain, kSwiglu, kAny };

constexpr int kBK = 128;           // K bytes per pipeline stage: one 128B swizzle row
constexpr int kWGRows = 64;        // weight rows (wgmma M) per consumer warpgroup
constexpr int kSmemBudget = 227 * 1024;
// DecodeRoute: the layout tables a CTA keeps (one alignment block a pair,
// at most a warp's worth of pairs) and the bound on the routing scratch,
// which borrows the pipeline ring before the first load.
constexpr int kRoutePairs = 32;
constexpr int kRouteScratch = 16 * 1024;
constexpr int kRouteTabBytes = 1280;  // block count, experts, sorted rows of 8-token blocks

// as_pitch is the floats from one column pair's run of a stage's
// activation scales to the next (see as_slot).
template <int BN>
constexpr int as_pitch() { return BN / 4 + 4; }

// Device helpers exist only in the sm_90a pass: the other targets compile
// the kernels to empty bodies (the library never launches them there).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// stage_store writes output channel oc of one staging row in the epilogue's
// element type.
template <GemmEpilogue kEpi>
__device__ __forceinline__ void stage_store(uint8_t* row, int oc, float v, float inv_scale) {
  if (kEpi == GemmEpilogue::kAct1FP8) {
    row[oc] = __nv_cvt_float_to_fp8(v * inv_scale, __NV_SATFINITE, __NV_E4M3);
  } else if (kEpi == GemmEpilogue::kAct1F32) {
    reinterpret_cast<float*>(row)[oc] = v;
  } else {
    reinterpret_cast<__nv_bfloat16*>(row)[oc] = __float2bfloat16_rn(v);
  }
}
// Block mode stages each K block's activation scales in an order that lets
// a consumer thread read its columns with few, conflict-free loads: the
// column 8i + 2q + j (q = lane % 4, the thread's column pair) goes to
// q * as_pitch + 2i + j. The pitch's 4 floats of padding put the four
// column pairs' runs in different banks, so a warp's 16-byte reads, 8
// lanes a run, take one shared-memory wavefront each: BN/16 load
// instructions per thread and stage instead of BN/8.
template <int BN>
__device__ __forceinline__ int as_slot(int col) {
  return (col % 8) / 2 * as_pitch<BN>() + 2 * (col / 8) + col % 2;
}
template <int BN>
__device__ __forceinline__ void load_as(float* as, const float* stage_sc, int q, bool has_as) {
  const float* src = stage_sc + q * as_pitch<BN>();
  if constexpr (BN >= 16) {
#pragma unroll
    for (int m = 0; m < BN / 16; ++m) {
      const float4 v = has_as ? *reinterpret_cast<const float4*>(src + 4 * m) : make_float4(1.f, 1.f, 1.f, 1.f);
      as[4 * m] = v.x;
      as[4 * m + 1] = v.y;
      as[4 * m + 2] = v.z;
      as[4 * m + 3] = v.w;
    }
  } else {
    const float2 v = has_as ? *reinterpret_cast<const float2*>(src) : make_float2(1.f, 1.f);
    as[0] = v.x;
    as[1] = v.y;
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// out_size is the bytes of one output element.
constexpr int out_size(GemmEpilogue e) {
  return e == GemmEpilogue::kAct1FP8 ? 1 : e == GemmEpilogue::kAct1F32 ? 4 : 2;
}

struct Params {
  int k;
  int n_out;
  int w_rows;
  int block_rows;  // rows per alignment block (kPair: half the tile)
  int num_k_iters;
  const int32_t* block_expert;
  const int32_t* num_blocks;
  const int32_t* sorted_pairs;
  const float* a_scale_rows;
  float a_scale;
  const float* w_scale;
  void* out;
  int ld_out;
  float out_inv_scale;
  const float* pair_weight;
  // kBlk only.
  int a_scale_ld;    // activation scales per sorted row (k blocks)
  int block_n;       // weight rows per scale block
  int w_row_blocks;  // ceil(w_rows / block_n)
  int w_k_blocks;    // ceil(k / 128)
  // DecodeRoute (kernels where can_route says so): the layout goes out
  // through these; block_expert up to max_blocks.
  DecodeRoute route;
  int32_t* layout_sorted;
  int32_t* layout_expert;
  int32_t* layout_blocks;
  int max_blocks;
  // GEMM1's activation, bias [E, w_rows] (null: none) and kSwigluOAI's
  // parameters (gemm1_act).
  GemmAct act;
  const float* bias;
  float swiglu_limit, swiglu_alpha;
  // kGather: the FP8 hidden rows [tokens, k] and the call's top_k (a sorted
  // row's token is its pair / top_k).
  const uint8_t* a_tokens;
  int top_k;
};

// Tile is one tile of a CTA's walk: nblk alignment blocks from blk on, all
// of one expert, against weight tile wtile (output channels from wtile x
// the kernel's channels per tile); nth counts the CTA's tiles before it.
struct Tile {
  int blk, nblk, expert, wtile, nth;
};

// TileScheduler is the walk over tiles that every role of a CTA follows:
// the producer loads the tiles' stages in its order, the scale warp stages
// their activation scales in it, and the consumers take the tiles in it
// (kPP: every other one), so the roles agree on what each ring slot holds
// without telling each other. It is built once per CTA from the call's
// layout.
//
// Persistent: each CTA walks units u = blockIdx.x, +gridDim.x, ... of the
// (tile unit, weight tile) grid, weight tiles fastest, so neighbouring
// CTAs read one expert's tokens against its successive weight tiles.
// Without kPair a unit is one block. With kPair (BN-token tiles over
// BN/2-row alignment blocks) unit u covers blocks 2u and 2u+1: one tile of
// both where they belong to the same expert, else one half-width tile
// each. An expert's last block is then the only one that can leave a tile
// half empty, so an expert with 384 tokens fills three 128-token halves
// instead of two 256-token tiles with 128 slots idle, while most tiles
// still read the weights once per 256 tokens. Blocks of no expert (-1)
// have no tile.
//
// for_each runs the walk with a role's body. The walk's steps are public
// for the consumers, whose body the kernel keeps inline (see
// moe_gemm_kernel): for (u = first(); u < num_tiles; u = next(u)) for
// (sub < kSubs) tile(u, sub, t), as for_each does.
template <bool kPair>
struct TileScheduler {
  static constexpr int kSubs = kPair ? 2 : 1;  // tiles per unit

  const int32_t* block_expert;
  int num_blocks;
  int n_wtiles;
  int num_tiles;  // units x weight tiles

  __device__ __forceinline__ TileScheduler(const int32_t* block_expert, int num_blocks, int n_wtiles)
      : block_expert(block_expert),
        num_blocks(num_blocks),
        n_wtiles(n_wtiles),
        num_tiles((kPair ? (num_blocks + 1) / 2 : num_blocks) * n_wtiles) {}

  // idle says whether the walk gives this CTA no tile at all.
  __device__ __forceinline__ bool idle() const { return static_cast<int>(blockIdx.x) >= num_tiles; }

  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int u) const { return u + gridDim.x; }

  // tile names tile sub of the walk's unit u (its blocks, expert and
  // weight tile; not nth), or returns false where there is none.
  __device__ __forceinline__ bool tile(int u, int sub, Tile& t) const {
    t.wtile = u % n_wtiles;
    const int unit = u / n_wtiles;
    if (!kPair) {
      t.blk = unit;
      t.nblk = 1;
      t.expert = block_expert[unit];
      return sub == 0 && t.expert >= 0;
    }
    const int b0 = 2 * unit, b1 = 2 * unit + 1;
    const int e0 = block_expert[b0];
    const int e1 = b1 < num_blocks ? block_expert[b1] : -1;
    if (e0 >= 0 && e0 == e1) {
      t.blk = b0;
      t.nblk = 2;
      t.expert = e0;
      return sub == 0;
    }
    t.blk = sub == 0 ? b0 : b1;
    t.nblk = 1;
    t.expert = sub == 0 ? e0 : e1;
    return t.expert >= 0;
  }

  // for_each calls f(tile) for each of this CTA's tiles, in walk order.
  template <typename F>
  __device__ __forceinline__ void for_each(F&& f) const {
    int nth = 0;
    for (int u = first(); u < num_tiles; u = next(u)) {
      for (int sub = 0; sub < kSubs; ++sub) {
        Tile t;
        if (!tile(u, sub, t)) continue;
        t.nth = nth++;
        f(t);
      }
    }
  }
};

// can_route says whether a kernel can take DecodeRoute: GEMM1's 8-token
// tiles of one consumer warpgroup, per-expert or per-channel scales.
template <int BN, int kNWG, GemmEpilogue kEpi, bool kBlk, bool kTokA, bool kPair>
constexpr bool can_route() {
  return BN == 8 && kNWG == 1 && !kBlk && !kTokA && !kPair && kEpi != GemmEpilogue::kWeightedBF16;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// decode_route (every thread of the CTA) routes the call's one token with
// warp 0, or reads its precomputed ids, and lays its valid pairs out one
// block each in slot order: expert[b] is block b's expert, sorted[b * BN]
// its pair and the block's other rows -1, as the align step would lay out
// blocks of one pair. Blocks hold one pair each even where two slots name
// one expert (precomputed ids may), since every tile reads the token's row
// alone. CTA 0 writes the layout and the routing results for the kernels
// after this one. scratch is route_smem_per_warp(E) + 256 bytes of the ring,
// written through the generic proxy before any TMA load lands there. It
// returns the number of blocks.
template <int BN>
__device__ int decode_route(const Params& p, uint8_t* scratch, int* blocks, int* expert, int* sorted) {
  static_assert(sizeof(int) * (1 + kRoutePairs * (1 + BN)) <= kRouteTabBytes, "route tables");
  const DecodeRoute& r = p.route;
  const int top_k = r.rp.top_k, E = r.rp.e;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int id = -1;
    float w = 0.f;
    if (r.logits != nullptr) {
      int32_t* sid = reinterpret_cast<int32_t*>(scratch + route_smem_per_warp(E));
      float* sw = reinterpret_cast<float*>(sid + kRoutePairs);
      route_token(r.rp, r.logits, r.bias, 0, scratch, sid, sw);
      __syncwarp();
      if (lane < top_k) {
        id = sid[lane];
        w = sw[lane];
      }
    } else if (lane < top_k) {
      id = r.ids[lane];
    }
    const bool valid = lane < top_k && id >= 0 && id < E;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    const int b = __popc(mask & ((1u << lane) - 1));
    const int nb = __popc(mask);
    if (valid) {
      expert[b] = id;
      for (int i = 0; i < BN; ++i) sorted[b * BN + i] = i == 0 ? lane : -1;
    }
    if (blockIdx.x == 0) {
      if (r.logits != nullptr && lane < top_k) {
        r.ids[lane] = id;
        r.weights[lane] = w;
      }
      if (valid) {
        for (int i = 0; i < BN; ++i) p.layout_sorted[b * BN + i] = i == 0 ? lane : -1;
      }
      for (int i = lane; i < p.max_blocks; i += 32) p.layout_expert[i] = -1;
      __syncwarp();
      if (valid) p.layout_expert[b] = id;
      if (lane == 0) *p.layout_blocks = nb;
    }
    if (lane == 0) *blocks = nb;
    // The scratch is ring memory, which TMA (the async proxy) writes next.
    fence_proxy_async_smem();
  }
  __syncthreads();
  return *blocks;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// SmemPlan is a kernel's shared memory: its fixed part (staging tiles, row
// tables, barriers) and as many pipeline stages as fit beside it, at most
// eight: eight keep enough bytes in flight, more do not pay for their
// shared memory (docs/perf-notes.md). The launch sizes the kernel's
// dynamic shared memory by it and the kernel carves it up by it
// (MoeGemm::Smem).
template <int BN, int kNWG, bool kGated, GemmEpilogue kEpi, bool kBlk, bool kPP, bool kGather = false>
struct SmemPlan {
  static constexpr int kWTile = kNWG * kWGRows * kBK;  // bytes of a stage's weight tile
  static constexpr int kATile = BN * kBK;              // bytes of a stage's token tile
  // kBlk: each stage also has BN activation scales, 4 x as_pitch floats.
  static constexpr int kAsStage = 4 * as_pitch<BN>();
  static constexpr int kStageBytes = kWTile + kATile + (kBlk ? kAsStage * 4 : 0);
  static constexpr int kOC = kGated ? kNWG * 32 : kNWG * kWGRows;  // output channels per tile
  static constexpr int kSets = kPP ? kNWG : 1;  // staging tiles and row tables
  static constexpr int kStageRows = BN < 128 ? BN : 128;  // tokens staged at a time
  static constexpr int kPitch = kOC * out_size(kEpi) + 16;  // staging row, padded against bank conflicts
  static constexpr int kStaging = kSets * kStageRows * kPitch;
  static constexpr int kRouteTab = can_route<BN, kNWG, kEpi, kBlk, false, false>() ? kRouteTabBytes : 0;
  static constexpr int kTokRows = kGather ? BN * 8 : 0;  // kGather: the tile's token row addresses
  // The alignment slack, staging, barriers, row tables, and routing tables
  // or token row addresses.
  static constexpr int kFixed = 1024 + kStaging + 256 + kSets * BN * 8 + kRouteTab + kTokRows;
  static constexpr int kStagesMax = (kSmemBudget - kFixed) / kStageBytes;
  static constexpr int kStages = kStagesMax > 8 ? 8 : kStagesMax;
  static constexpr int bytes() { return kFixed + kStages * kStageBytes; }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// MoeGemm is one kernel's traits (its constants, shared-memory plan and
// carve-up, Smem) and the roles of its producer warpgroup, each a function
// the kernel dispatches a thread or warp to: barrier setup, the TMA thread
// or kGather's producer warpgroup (produce) and the scale warp
// (stage_scales), over the CTA's tile walk (TileScheduler). The consumers'
// mainloop and epilogue are the kernel's own body (moe_gemm_kernel says
// why).
template <int BN, int kNWG, int kStages, bool kGated, Act1 kAct, GemmEpilogue kEpi, bool kPC, bool kBlk,
          bool kTokA, bool kPair, bool kPP, bool kGather = false>
struct MoeGemm {
  using Plan = SmemPlan<BN, kNWG, kGated, kEpi, kBlk, kPP, kGather>;
  using Sched = TileScheduler<kPair>;
  static constexpr int kWTile = Plan::kWTile;
  static constexpr int kATile = Plan::kATile;
  static constexpr int kRegs = BN / 2;      // accumulators a thread holds per 64 weight rows
  static constexpr int kHalves = kPP ? 2 : 1;  // 64-row halves of the tile a warpgroup computes
  static constexpr int kSets = Plan::kSets;
  static constexpr int kTileThreads = kPP ? 128 : kNWG * 128;  // consumer threads sharing a tile
  static constexpr int kOC = Plan::kOC;
  static constexpr int kESize = out_size(kEpi);
  static constexpr int kPitch = Plan::kPitch;
  static constexpr int kStageRows = Plan::kStageRows;
  static constexpr int kAsStage = Plan::kAsStage;

  static_assert(!kBlk || BN <= 128, "block mode holds two accumulator sets");
  static_assert(!kTokA || (kBlk && BN == 128 && kNWG == 2), "tokens-as-A is the 128x128 block tile");
  static_assert(!kPair || (!kBlk && BN == 256 && kNWG == 2), "paired blocks are the 256-token tile");
  static_assert(!kPP || (!kBlk && !kPair && kNWG == 2 && BN <= 128), "ping-pong: per-expert/channel, two sets");
  static_assert(!kGather || (!kBlk && !kPair && !kTokA && kEpi != GemmEpilogue::kWeightedBF16),
                "token rows by index: GEMM1 without block scales or paired blocks");
  // kGather: the producer warpgroup's warps all copy token rows (the scale
  // warp of kBlk is why the two do not mix), a quarter of the tile each.
  static constexpr int kGatherWarps = 4;
  static constexpr int kWarpRows = BN / kGatherWarps;
  static_assert(!kGather || (kWarpRows % 8 == 0 && kWarpRows <= 32),
                "token rows by index: whole 8-row swizzle groups, at most a row per lane");

  // Smem is the CTA's shared memory carved up in the plan's order from a
  // 1024-byte aligned start (TMA's 128-byte swizzle needs it): the kernel
  // lays it out, the roles take it.
  struct Smem {
    uint8_t* w;      // kStages weight tiles
    uint8_t* a;      // kStages token tiles
    uint8_t* stage;  // epilogue staging, kSets x kStageRows x kPitch
    uint64_t* full;   // kStages: a stage's operands (and kBlk: scales) have landed
    uint64_t* empty;  // kStages: a stage's consumers are done with it
    uint64_t* order;  // 2, kPP: warpgroup w has issued a tile's last stage
    // Per token row of the current tile: its dequantization factor
    // (activation scale x weight scale, x router weight in GEMM2) and its
    // output row or -1. Gathered while the tile's operands stream in, so
    // the epilogue does no dependent global loads, which would otherwise
    // outlast GEMM2's mainloop (docs/perf-notes.md, "Hopper grouped GEMM").
    float* row_scale;  // kSets x BN
    int* row_dst;      // kSets x BN
    // kBlk: per stage, the activation scales of the tile's BN tokens for
    // the stage's K block (kAsStage floats, see as_slot).
    float* a_sc;
    // kGather (where a_sc would be): the current tile's BN token rows'
    // addresses, null for padding; each producer warp writes and reads its
    // own quarter (kWarpRows).
    const uint8_t** tok_rows;
  };

  // init_barriers (one thread) sets up the ring's barriers and ping-pong's
  // order barriers; a __syncthreads follows.
  __device__ __forceinline__ static void init_barriers(const Smem& sm) {
    for (int s = 0; s < kStages; ++s) {
      // kBlk: the TMA thread and the 32 lanes of the scale warp arrive on
      // full; kGather: the TMA thread and the producer warpgroup's 128
      // threads; every consumer warp on empty (see the mainloop).
      mbar_init(&sm.full[s], kBlk ? 1 + 32 : kGather ? 1 + 32 * kGatherWarps : 1);
      mbar_init(&sm.empty[s], kBlk ? kNWG * 4 : kPP ? 1 : kNWG);
    }
    mbar_init(&sm.order[0], 1);
    mbar_init(&sm.order[1], 1);
    fence_mbar_init();
  }

  // produce (the producer warpgroup's first thread; kGather: all of its
  // threads) loads every stage of the CTA's tiles: the weight tile with
  // TMA, and the tile's token rows with TMA or, kGather, with each warp's
  // cp.async copies (gather_tokens). kGather's warps wait on nothing but
  // the ring's empty barriers, so a warp that has issued its quarter of a
  // stage moves on to the next free stage without waiting for the others.
  // With DecodeRoute (routed) the rows are the token's row of the hidden
  // states. routed and sorted_pairs are the kernel's variables, taken by
  // reference: by value, cicc reorders the routing's address arithmetic
  // ahead of the call (scripts/sass-diff.sh shows it).
  __device__ __forceinline__ static void produce(const CUtensorMap& tm_w, const CUtensorMap& tm_a, const Params& p,
                                                 const Smem& sm, const Sched& sched, const bool& routed,
                                                 const int32_t* const& sorted_pairs) {
    int it = 0;
    sched.for_each([&](const Tile& tr) {
      const int wtile = tr.wtile;
      const int expert = tr.expert;
      // DecodeRoute: the token's row (rows past the token's come in
      // zero-filled or belong to rows whose outputs are dropped).
      const int row0 = routed ? sorted_pairs[tr.blk * p.block_rows] / p.route.rp.top_k : tr.blk * p.block_rows;
      if constexpr (kGather) token_rows(p, sm, sorted_pairs, row0);
      for (int kt = 0; kt < p.num_k_iters; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(&sm.empty[s], ((it / kStages) & 1) ^ 1);
        const int kb = kt * kBK;
        if (!kGather || threadIdx.x % 128 == 0) {
          // kGather: TMA brings the weights' bytes alone, issued before the
          // thread's token copies so the larger load starts first.
          mbar_expect_tx(&sm.full[s], kWTile + (kGather ? 0 : kPair ? tr.nblk * (BN / 2) * kBK : kATile));
          if (kGated) {
            // Box {128 B, 8 rows, gate/up, 4*kNWG row groups}: each 16-row
            // group holds 8 gate channels then the same 8 up channels, so a
            // thread's accumulator rows r and r+8 are a gate/up pair.
            tma_load_5d(sm.w + s * kWTile, &tm_w, &sm.full[s], kb, 0, 0, wtile * 4 * kNWG, expert);
          } else {
            tma_load_3d(sm.w + s * kWTile, &tm_w, &sm.full[s], kb, wtile * kNWG * kWGRows, expert);
          }
          if (kGather) {
            // The token rows come by cp.async, below.
          } else if (kPair) {
            // Box of BN/2 rows: one load per block of the tile.
            for (int h = 0; h < tr.nblk; ++h) {
              tma_load_2d(sm.a + s * kATile + h * (BN / 2) * kBK, &tm_a, &sm.full[s], kb, row0 + h * (BN / 2));
            }
          } else {
            tma_load_2d(sm.a + s * kATile, &tm_a, &sm.full[s], kb, row0);
          }
        }
        if constexpr (kGather) gather_tokens(p, sm, s, kb);
      }
    });
    if constexpr (kGather) cp_async_wait_all();
  }

  // token_rows (kGather, each producer warp, at each tile's start) writes
  // the warp's kWarpRows row addresses to sm.tok_rows, a lane a row: sorted
  // row row0 + r is token sorted_pairs[row0 + r] / top_k's hidden row, or
  // null for padding (-1). A warp reads back only its own rows, so the
  // table needs no barrier wider than the warp; a copy reads its source
  // address when it is issued, so the rows are free to rewrite once every
  // lane of the warp has issued the previous tile's.
  __device__ __forceinline__ static void token_rows(const Params& p, const Smem& sm, const int32_t* sorted_pairs,
                                                    int row0) {
    const int lane = threadIdx.x % 32;
    const int r = (threadIdx.x % 128) / 32 * kWarpRows + lane;
    __syncwarp();
    if (lane < kWarpRows) {
      const int pair = sorted_pairs[row0 + r];
      sm.tok_rows[r] = pair >= 0 ? p.a_tokens + size_t(pair / p.top_k) * p.k : nullptr;
    }
    __syncwarp();
  }

  // gather_tokens (kGather, each producer warp) loads its kWarpRows rows
  // of stage s's token tile, K bytes [kb, kb + 128) of the rows in
  // sm.tok_rows, with 16-byte cp.async into the layout TMA's 128-byte
  // swizzle writes (16-byte chunk c of row r at r * 128 + (c ^ r % 8) * 16
  // of the 1024-byte aligned tile), which the consumers' wgmma descriptors
  // (smem_desc) read. Eight lanes take a row's eight chunks, so each copy
  // instruction reads four rows' 128 contiguous bytes, whole L2 sectors;
  // a lane issues kWarpRows / 4 copies a stage (8 at 128-token tiles).
  // Padding rows and chunks past k are zero-filled: TMA zero-fills the
  // weights past k, and stale bytes there could be FP8 NaNs, which times
  // zero is still NaN. Each thread arrives on full once its copies have
  // landed (the barrier counts the warpgroup's 128), as CUTLASS's cp.async
  // warp-specialized mainloop does, and the wgmmas then read the stage as
  // they read a TMA-loaded one.
  __device__ __forceinline__ static void gather_tokens(const Params& p, const Smem& sm, int s, int kb) {
    const int lane = threadIdx.x % 32;
    const int c = lane % 8;
    const int col = kb + 16 * c;
    const bool in_k = col < p.k;  // k % 16 == 0: a chunk is all in or all out
    uint8_t* tile = sm.a + s * kATile;
    const int r0 = (threadIdx.x % 128) / 32 * kWarpRows + lane / 8;
    // Every row address first: the copies' memory clobber would otherwise
    // hold each table read behind the copy before it, one shared-memory
    // latency per copy.
    const uint8_t* src[kWarpRows / 4];
#pragma unroll
    for (int i = 0; i < kWarpRows / 4; ++i) src[i] = sm.tok_rows[r0 + 4 * i];
#pragma unroll
    for (int i = 0; i < kWarpRows / 4; ++i) {
      const int r = r0 + 4 * i;
      const bool load = in_k && src[i] != nullptr;
      cp_async_16_zfill(tile + r * kBK + (c ^ (r % 8)) * 16, load ? src[i] + col : p.a_tokens, load ? 16 : 0);
    }
    cp_async_mbar_arrive_noinc(&sm.full[s]);
  }

  // stage_scales (kBlk: the producer warpgroup's second warp) follows the
  // TMA thread's walk; for each stage, the activation scales of the tile's
  // tokens for K block kt, gathered with 4-byte cp.async, each lane's
  // arrival on full deferred until its copies land. Lanes without copies
  // (BN < 32, or no per-row scales: a static activation scale, where the
  // consumers use 1) just arrive. No copies are in flight when it returns.
  __device__ __forceinline__ static void stage_scales(const Params& p, const Smem& sm, const Sched& sched) {
    const int lane = threadIdx.x % 32;
    int it = 0;
    sched.for_each([&](const Tile& tr) {
      const int blk = tr.blk;
      for (int kt = 0; kt < p.num_k_iters; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(&sm.empty[s], ((it / kStages) & 1) ^ 1);
        if (p.a_scale_rows != nullptr && lane < BN) {
          for (int r = lane; r < BN; r += 32) {
            const float* src = p.a_scale_rows + size_t(blk * p.block_rows + r) * p.a_scale_ld + kt;
            float* dst = sm.a_sc + s * kAsStage + as_slot<BN>(r);
            cp_async_4(dst, src);
          }
          cp_async_mbar_arrive_noinc(&sm.full[s]);
        } else {
          mbar_arrive(&sm.full[s]);
        }
      }
    });
    cp_async_wait_all();
  }
};
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Persistent: each CTA walks its tiles in TileScheduler's order; a tile is
// kNWG*64 weight rows x BN tokens of one expert. Warpgroups 0..kNWG-1
// consume (wgmma + epilogue); warpgroup kNWG produces (one thread issues
// the TMA loads; kGather: its four warps also copy the token rows). The
// producer's ring runs on across tiles, so while the consumers run a
// tile's epilogue the next tile's operands are already streaming in.
//
// kPP (ping-pong): each consumer warpgroup takes every other tile of the
// CTA whole (both 64-row halves, two accumulator sets), and the two take
// turns at the tensor cores: a warpgroup starts a tile's mainloop once the
// other has issued all of its previous tile's stages (the order barriers),
// so one warpgroup's epilogue runs under the other's mainloop instead of
// idling the tensor cores. The turns also keep a warpgroup from waiting on
// a ring slot more than one fill ahead, which the barriers' phase parity
// could not tell apart. Each warpgroup has its own staging tile and row
// tables.
//
// The kernel is setup (shared memory, the call's layout, the tile walk,
// the barriers), the producer warpgroup's roles (MoeGemm), and the
// consumers' mainloop and epilogue written out here: cicc canonicalizes a
// function's body (a lambda's too) before inlining it, which reorders the
// consumers' address arithmetic and registers (scripts/sass-diff.sh shows
// it), so their code stays in the kernel's own body.
template <int BN, int kNWG, int kStages, bool kGated, Act1 kAct, GemmEpilogue kEpi, bool kPC, bool kBlk,
          bool kTokA, bool kPair, bool kPP, bool kGather>
__global__ void __launch_bounds__((kNWG + 1) * 128, 1)
    moe_gemm_kernel(const __grid_constant__ CUtensorMap tm_w, const __grid_constant__ CUtensorMap tm_a,
                    const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using K = MoeGemm<BN, kNWG, kStages, kGated, kAct, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>;
  constexpr int kWTile = K::kWTile, kATile = K::kATile, kRegs = K::kRegs, kHalves = K::kHalves;
  constexpr int kTileThreads = K::kTileThreads, kOC = K::kOC, kESize = K::kESize, kPitch = K::kPitch;
  constexpr int kStageRows = K::kStageRows, kAsStage = K::kAsStage;
  using Mma = WgmmaE4M3<BN>;
  using MmaHalf = WgmmaE4M3<kPair ? BN / 2 : BN>;  // kPair: a tile of one block
  constexpr bool kRoute = can_route<BN, kNWG, kEpi, kBlk, kTokA, kPair>();

  pdl_wait();
  pdl_trigger();
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // TMA with 128-byte swizzle needs 1024-byte aligned destinations.
  // Offset smem_raw itself rather than round-tripping through an integer:
  // pointers derived from it then stay in the shared address space, so the
  // compiler emits ld.shared for the scale and staging reads instead of
  // generic loads (which wait on the long scoreboard).
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  // The plan's carve-up (K::Smem), as the consumers' own pointers too.
  uint8_t* w_smem = smem;
  uint8_t* a_smem = smem + kStages * kWTile;
  uint8_t* stage = a_smem + kStages * kATile;
  uint64_t* full = reinterpret_cast<uint64_t*>(stage + K::Plan::kStaging);
  uint64_t* empty = full + kStages;
  uint64_t* order = empty + kStages;
  float* row_scale = reinterpret_cast<float*>(order + 2);
  int* row_dst = reinterpret_cast<int*>(row_scale + K::kSets * BN);
  float* a_sc = reinterpret_cast<float*>(row_dst + K::kSets * BN);
  const typename K::Smem sm{w_smem, a_smem, stage, full, empty, order, row_scale, row_dst, a_sc,
                            reinterpret_cast<const uint8_t**>(a_sc)};

  // The call's layout: the align step's, or with DecodeRoute this CTA's
  // own (tables where a_sc would be, which these kernels do not use), and
  // then the tiles read the token's row of the hidden states (tm_a) and
  // take its scale from the row's table entry.
  const int32_t* block_expert = p.block_expert;
  const int32_t* sorted_pairs = p.sorted_pairs;
  float a_scale = p.a_scale;
  bool routed = false;
  int num_blocks;
  if constexpr (kRoute) {
    static_assert(kStages * kWTile >= kRouteScratch, "routing scratch");
    routed = p.route.on;
    if (routed) {
      if (p.route.a_scale != nullptr) a_scale = clamp_scale(__ldg(p.route.a_scale));
      int* rt_blocks = reinterpret_cast<int*>(a_sc);
      int* rt_expert = rt_blocks + 1;
      int* rt_sorted = rt_expert + kRoutePairs;
      num_blocks = decode_route<BN>(p, w_smem, rt_blocks, rt_expert, rt_sorted);
      block_expert = rt_expert;
      sorted_pairs = rt_sorted;
    } else {
      num_blocks = *p.num_blocks;
    }
  } else {
    num_blocks = *p.num_blocks;
  }
  const TileScheduler<kPair> sched(block_expert, num_blocks, (p.n_out + kOC - 1) / kOC);
  if (sched.idle()) return;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) K::init_barriers(sm);
  __syncthreads();

  if (wg == kNWG) {
    setmaxnreg_dec<40>();
    if (kGather || threadIdx.x == kNWG * 128) {
      K::produce(tm_w, tm_a, p, sm, sched, routed, sorted_pairs);
    } else if (kBlk && (threadIdx.x % 128) / 32 == 1) {
      K::stage_scales(p, sm, sched);
    }
    return;
  }

  // Consumers: each of the CTA's tiles (kPP: every other one), its row
  // tables, weight scales, mainloop and epilogue.
  setmaxnreg_inc<232>();
  const int warp = (threadIdx.x % 128) / 32;
  const int lane = threadIdx.x % 32;
  const int tl = kPP ? threadIdx.x % 128 : threadIdx.x;  // thread among the tile's consumers
  if constexpr (kPP) {
    stage += wg * kStageRows * kPitch;
    row_scale += wg * BN;
    row_dst += wg * BN;
  }
  // The consumers of one tile meet at named barrier 1 (kPP: 1 + warpgroup).
  auto tile_sync = [&] {
    if constexpr (kPP) {
      bar_sync<128>(1 + wg);
    } else {
      bar_sync_n<1, kNWG * 128>();
    }
  };
  // The scheduler's steps, as for_each takes them (see the kernel's
  // comment for why not for_each).
  int it = 0;
  int nth = 0;  // the CTA's tiles so far
  for (int u = sched.first(); u < sched.num_tiles; u = sched.next(u)) {
    for (int sub = 0; sub < sched.kSubs; ++sub) {
      Tile tr;
      if (!sched.tile(u, sub, tr)) continue;
      const int wtile = tr.wtile;
      const int nt = nth++;
      if (kPP && nt % 2 != wg) {
        it += p.num_k_iters;  // the other warpgroup's tile: its stages
        continue;
      }
      const int expert = tr.expert;
      const int row0 = tr.blk * p.block_rows;
      // kPair: a tile of one block fills the first BN/2 token columns only.
      const bool half_tile = kPair && tr.nblk == 1;

      // The previous tile's copy-out has read row_dst and the staging tile.
      tile_sync();
      if (half_tile && tl >= BN / 2 && tl < BN) {
        row_scale[tl] = 0.f;
        row_dst[tl] = -1;
      } else if (tl < BN) {
        const int srow = row0 + tl;
        const int pair = sorted_pairs[srow];
        // kBlk: the activation and weight scales are applied per K block.
        float sc = kBlk ? (p.a_scale_rows ? 1.f : a_scale) : p.a_scale_rows ? p.a_scale_rows[srow] : a_scale;
        if (!kPC && !kBlk) sc *= p.w_scale[expert];
        if (kEpi == GemmEpilogue::kWeightedBF16) sc *= pair >= 0 ? p.pair_weight[pair] : 0.f;
        row_scale[tl] = sc;
        row_dst[tl] = pair < 0 ? -1 : (kEpi == GemmEpilogue::kWeightedBF16 ? pair : srow);
      }

      // kPC: the scales of this thread's two accumulator rows (see the
      // epilogue for which weight rows they are); 0 past the last channel,
      // whose outputs are never stored.
      // The 64-row half of the tile behind accumulator set v: the
      // warpgroup's own, or with kPP both in turn.
      auto half_of = [&](int v) { return kPP ? v : wg; };
      const int oc0 = wtile * kOC;  // first output channel of the tile
      // GEMM1's output for staging column oc (gate g, up u); 0 past the
      // last channel, whose outputs are never stored (nor its bias read).
      const float* bias = p.bias ? p.bias + size_t(expert) * p.w_rows : nullptr;
      // Act1::kPlain and kSwiglu make the activation a constant, so the
      // unrolled epilogue holds one activation's math, as the common
      // layers need; with Act1::kAny the set's activation is read at run time,
      // and every activation's code sits in the loop.
      auto act1 = [&](int oc, float g, float u) {
        constexpr GemmAct kConst = kGated ? GemmAct::kSiluGated : GemmAct::kRelu2;
        if constexpr (kAct == Act1::kPlain) {
          return gemm1_act(kConst, nullptr, 0, 0, g, u, 0.f, 0.f);
        } else {
          const int ch = oc0 + oc;
          // kRelu2, the one non-gated activation, as a constant: the gated
          // ones' math would cost the non-gated kernels registers.
          const GemmAct act = kAct == Act1::kSwiglu ? GemmAct::kSwigluOAI : kGated ? p.act : GemmAct::kRelu2;
          return ch < p.n_out ? gemm1_act(act, bias, p.n_out, ch, g, u, p.swiglu_limit, p.swiglu_alpha) : 0.f;
        }
      };
      float wsc[kHalves][2];
#pragma unroll
      for (int v = 0; v < kHalves; ++v) {
        wsc[v][0] = wsc[v][1] = 1.f;
        if (!kPC) continue;
        const float* ws = p.w_scale + size_t(expert) * p.w_rows;
        if (kGated) {
          const int ch = oc0 + half_of(v) * 32 + 8 * warp + lane / 4;
          wsc[v][0] = ch < p.n_out ? ws[ch] : 0.f;
          wsc[v][1] = ch < p.n_out ? ws[p.n_out + ch] : 0.f;
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int ch = oc0 + half_of(v) * kWGRows + 16 * warp + lane / 4 + 8 * h;
            wsc[v][h] = ch < p.n_out ? ws[ch] : 0.f;
          }
        }
      }

      float acc[kHalves * kRegs];
#pragma unroll
      for (int i = 0; i < kHalves * kRegs; ++i) acc[i] = 0.f;
      if constexpr (kBlk) {
        // The scale blocks of this thread's two accumulator rows (the same
        // rows as kPC's), null past the last channel.
        const float* wsb[2];
        if constexpr (kTokA) {
          // Tokens on wgmma's M side: the tile's weight rows are the
          // accumulator's columns and lie in one scale block (the gate's
          // rows in one, the up's in one; launch checks block_n).
          const float* base = p.w_scale + size_t(expert) * p.w_row_blocks * p.w_k_blocks;
          wsb[0] = base + (oc0 / p.block_n) * p.w_k_blocks;
          wsb[1] = kGated ? base + ((p.n_out + oc0) / p.block_n) * p.w_k_blocks : wsb[0];
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            int row, ch;
            if (kGated) {
              ch = oc0 + wg * 32 + 8 * warp + lane / 4;
              row = h == 0 ? ch : p.n_out + ch;
            } else {
              ch = oc0 + wg * kWGRows + 16 * warp + lane / 4 + 8 * h;
              row = ch;
            }
            wsb[h] = ch < p.n_out
                         ? p.w_scale + (size_t(expert) * p.w_row_blocks + row / p.block_n) * p.w_k_blocks
                         : nullptr;
          }
        }
        const bool has_as = p.a_scale_rows != nullptr;
        float part[kRegs];
#pragma unroll
        for (int i = 0; i < kRegs; ++i) part[i] = 0.f;
        for (int kt = 0; kt < p.num_k_iters; ++kt, ++it) {
          const int s = it % kStages;
          const float w0 = wsb[0] ? __ldg(wsb[0] + kt) : 0.f;
          const float w1 = wsb[1] ? __ldg(wsb[1] + kt) : 0.f;
          mbar_wait(&full[s], (it / kStages) & 1);
          // The activation scales this thread needs, read before the wgmmas
          // are issued so the loads' latency hides behind them. kTokA: its
          // two token rows' (tokens are wgmma's A operand); else its token
          // columns' (as[2i + j] is column 8i + 2(lane%4) + j; see as_slot).
          float a0 = 1.f, a1 = 1.f, as[BN / 4];
          uint64_t da, db;  // wgmma's A and B operands
          if constexpr (kTokA) {
            const int r0 = wg * kWGRows + 16 * warp + lane / 4;
            const float* asc = a_sc + s * kAsStage;
            if (has_as) {
              a0 = asc[as_slot<BN>(r0)];
              a1 = asc[as_slot<BN>(r0 + 8)];
            }
            da = smem_desc(a_smem + s * kATile + wg * kWGRows * kBK);
            db = smem_desc(w_smem + s * kWTile);
          } else {
            load_as<BN>(as, a_sc + s * kAsStage, lane % 4, has_as);
            da = smem_desc(w_smem + s * kWTile + wg * kWGRows * kBK);
            db = smem_desc(a_smem + s * kATile);
          }
          fence_acc<kRegs>(part);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBK / 32; ++kk) {
            Mma::mma(part, da + 2 * kk, db + 2 * kk, kk > 0 ? 1 : 0);
          }
          wgmma_commit();
          wgmma_wait<0>();
          fence_acc<kRegs>(part);
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
          if constexpr (kTokA) {
            // Four products a stage, then one FMA per accumulator (against
            // two when tokens are the columns). Gated: column group i holds
            // gate rows (i even) or up rows (odd).
            const float s0g = a0 * w0, s1g = a1 * w0, s0u = a0 * w1, s1u = a1 * w1;
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
              const bool up = kGated && (i & 1);
              const float sa = up ? s0u : s0g, sb = up ? s1u : s1g;
              acc[4 * i + 0] += part[4 * i + 0] * sa;
              acc[4 * i + 1] += part[4 * i + 1] * sa;
              acc[4 * i + 2] += part[4 * i + 2] * sb;
              acc[4 * i + 3] += part[4 * i + 3] * sb;
            }
          } else {
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
              acc[4 * i + 0] += part[4 * i + 0] * (w0 * as[2 * i]);
              acc[4 * i + 1] += part[4 * i + 1] * (w0 * as[2 * i + 1]);
              acc[4 * i + 2] += part[4 * i + 2] * (w1 * as[2 * i]);
              acc[4 * i + 3] += part[4 * i + 3] * (w1 * as[2 * i + 1]);
            }
          }
        }
      } else {
        // One wgmma group stays in flight: stage kt's MMAs are issued before
        // stage kt-1's are waited for, so the tensor cores run on while this
        // warpgroup waits for the next stage and issues it; a stage goes back
        // to the producer once the group that read it has completed. One
        // loop per wgmma shape (kPair's half tiles have their own): ptxas
        // serializes wgmmas of different shapes on one accumulator in one
        // loop.
        auto mainloop = [&](auto mma) {
          using M = decltype(mma);
          // kPP: the other warpgroup's turn (the CTA's previous tile) ends
          // when it has issued that tile's last stage.
          if (kPP && nt > 0) mbar_wait(&order[1 - wg], ((nt - 1) / 2) & 1);
          int prev = -1;
          for (int kt = 0; kt < p.num_k_iters; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(&full[s], (it / kStages) & 1);
            const uint64_t da = smem_desc(a_smem + s * kATile);
            fence_acc<kHalves * kRegs>(acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBK / 32; ++kk) {
#pragma unroll
              for (int v = 0; v < kHalves; ++v) {
                const uint64_t dw = smem_desc(w_smem + s * kWTile + half_of(v) * kWGRows * kBK);
                M::mma(acc + v * kRegs, dw + 2 * kk, da + 2 * kk, (kt > 0 || kk > 0) ? 1 : 0);
              }
            }
            wgmma_commit();
            if (kPP && kt == p.num_k_iters - 1 && tl == 0) mbar_arrive(&order[wg]);
            wgmma_wait<1>();
            fence_acc<kHalves * kRegs>(acc);
            if (prev >= 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[prev]);
            prev = s;
          }
          wgmma_wait<0>();
          fence_acc<kHalves * kRegs>(acc);
          if (prev >= 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[prev]);
        };
        if (half_tile) {
          mainloop(MmaHalf{});
        } else {
          mainloop(Mma{});
        }
      }

      // Epilogue, kStageRows tokens at a time: registers -> staging tile
      // [token][channel] -> coalesced 16-byte stores.
#pragma unroll
      for (int half = 0; half < BN / kStageRows; ++half) {
        if (half_tile && half > 0) break;  // uniform across the consumers
        tile_sync();
        if constexpr (kTokA) {
          // Accumulator (token row r0 + 8h, column 8i + 2(lane%4) + j); gated
          // columns pair gate group 2g with up group 2g + 1 (see the TMA box).
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int tr = wg * kWGRows + 16 * warp + lane / 4 + 8 * h;
            const float sc = row_scale[tr];
            uint8_t* row = stage + tr * kPitch;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              if (kGated) {
#pragma unroll
                for (int g = 0; g < BN / 16; ++g) {
                  const float gv = acc[4 * (2 * g) + 2 * h + j] * sc;
                  const float uv = acc[4 * (2 * g + 1) + 2 * h + j] * sc;
                  const int oc = 8 * g + 2 * (lane % 4) + j;
                  stage_store<kEpi>(row, oc, act1(oc, gv, uv), p.out_inv_scale);
                }
              } else {
#pragma unroll
                for (int i = 0; i < BN / 8; ++i) {
                  float v = acc[4 * i + 2 * h + j] * sc;
                  const int oc = 8 * i + 2 * (lane % 4) + j;
                  if (kEpi != GemmEpilogue::kWeightedBF16) v = act1(oc, v, 0.f);
                  stage_store<kEpi>(row, oc, v, p.out_inv_scale);
                }
              }
            }
          }
        } else {
#pragma unroll
          for (int hv = 0; hv < kHalves; ++hv) {
            const float* a = acc + hv * kRegs;
            const float* ws = wsc[hv];
#pragma unroll
            for (int i = half * (kStageRows / 8); i < (half + 1) * (kStageRows / 8); ++i) {
#pragma unroll
              for (int c2 = 0; c2 < 2; ++c2) {
                const int tr = 8 * i + 2 * (lane % 4) + c2;  // token row in tile
                const float sc = row_scale[tr];
                uint8_t* row = stage + (tr - half * kStageRows) * kPitch;
                if (kGated) {
                  const float g = kPC ? a[4 * i + c2] * sc * ws[0] : a[4 * i + c2] * sc;
                  const float u = kPC ? a[4 * i + 2 + c2] * sc * ws[1] : a[4 * i + 2 + c2] * sc;
                  const int oc = half_of(hv) * 32 + 8 * warp + lane / 4;
                  stage_store<kEpi>(row, oc, act1(oc, g, u), p.out_inv_scale);
                } else {
#pragma unroll
                  for (int h = 0; h < 2; ++h) {
                    float v = kPC ? a[4 * i + 2 * h + c2] * sc * ws[h] : a[4 * i + 2 * h + c2] * sc;
                    const int oc = half_of(hv) * kWGRows + 16 * warp + lane / 4 + 8 * h;
                    if (kEpi != GemmEpilogue::kWeightedBF16) v = act1(oc, v, 0.f);
                    stage_store<kEpi>(row, oc, v, p.out_inv_scale);
                  }
                }
              }
            }
          }
        }
        tile_sync();

        constexpr int kChunks = kOC * kESize / 16;  // 16-byte chunks per row
        for (int idx = tl; idx < kStageRows * kChunks; idx += kTileThreads) {
          const int tr = idx / kChunks;
          const int ch = idx % kChunks;
          const int orow = row_dst[half * kStageRows + tr];
          if (orow < 0) continue;
          const int c = oc0 + ch * (16 / kESize);
          if (c >= p.n_out) continue;  // n_out % 16 == 0, so chunks never straddle the end
          const uint4 v = *reinterpret_cast<const uint4*>(stage + tr * kPitch + ch * 16);
          uint8_t* dst = static_cast<uint8_t*>(p.out) + (size_t(orow) * p.ld_out + c) * kESize;
          *reinterpret_cast<uint4*>(dst) = v;
        }
      }
    }
  }
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult q;
    void* f = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    }
  });
  return fn;
}

// encode builds a tensor map for FP8 data with 128-byte swizzle.
cudaError_t encode(CUtensorMap* map, const void* base, int rank, const cuuint64_t* dims,
                   const cuuint64_t* strides_bytes, const cuuint32_t* box) {
  auto fn = encode_fn();
  if (!fn) return cudaErrorNotSupported;
  cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(base), dims, strides_bytes,
                  box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

bool persistent_grid() { return switches().sm90_persistent.load(std::memory_order_relaxed); }

// act1_of picks GEMM1's epilogue kernel for the set's activation and bias.
Act1 act1_of(const MoeGemmArgs& a, bool gated) {
  if (!a.bias && (a.act == GemmAct::kSiluGated || a.act == GemmAct::kRelu2)) return Act1::kPlain;
  return gated && a.act == GemmAct::kSwigluOAI ? Act1::kSwiglu : Act1::kAny;
}

template <int BN, int kNWG, bool kGated, Act1 kAct, GemmEpilogue kEpi, bool kPC, bool kBlk, bool kTokA,
          bool kPair, bool kPP, bool kGather>
cudaError_t launch_plan(const MoeGemmArgs& a, cudaStream_t stream) {
  using Plan = SmemPlan<BN, kNWG, kGated, kEpi, kBlk, kPP, kGather>;
  constexpr int kOC = Plan::kOC;
  constexpr int kStages = Plan::kStages;
  static_assert(kStages >= 3, "tile too large for shared memory");
  const int smem = Plan::bytes();

  CUtensorMap tm_w, tm_a;
  cudaError_t err;
  if (kGated) {
    const int n = a.w_rows / 2;
    cuuint64_t dims[5] = {cuuint64_t(a.k), 8, 2, cuuint64_t(n / 8), cuuint64_t(a.num_experts)};
    cuuint64_t strides[4] = {cuuint64_t(a.k), cuuint64_t(n) * a.k, 8ull * a.k,
                             cuuint64_t(a.w_rows) * a.k};
    cuuint32_t box[5] = {kBK, 8, 2, cuuint32_t(4 * kNWG), 1};
    err = encode(&tm_w, a.w, 5, dims, strides, box);
  } else {
    cuuint64_t dims[3] = {cuuint64_t(a.k), cuuint64_t(a.w_rows), cuuint64_t(a.num_experts)};
    cuuint64_t strides[2] = {cuuint64_t(a.k), cuuint64_t(a.w_rows) * a.k};
    cuuint32_t box[3] = {kBK, cuuint32_t(kNWG * kWGRows), 1};
    err = encode(&tm_w, a.w, 3, dims, strides, box);
  }
  if (err != cudaSuccess) return err;
  if constexpr (kGather) {
    // The producer warp reads the token rows by address instead.
    std::memset(&tm_a, 0, sizeof tm_a);
  } else {
    cuuint64_t dims[2] = {cuuint64_t(a.k), cuuint64_t(a.a_rows)};
    cuuint64_t strides[1] = {cuuint64_t(a.k)};
    cuuint32_t box[2] = {kBK, kPair ? BN / 2 : BN};
    err = encode(&tm_a, a.a, 2, dims, strides, box);
  }
  if (err != cudaSuccess) return err;

  auto kernel = moe_gemm_kernel<BN, kNWG, kStages, kGated, kAct, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;

  Params p;
  p.k = a.k;
  p.n_out = a.n_out;
  p.w_rows = a.w_rows;
  p.block_rows = kPair ? BN / 2 : BN;
  p.num_k_iters = (a.k + kBK - 1) / kBK;
  p.block_expert = a.block_expert;
  p.num_blocks = a.num_blocks;
  p.sorted_pairs = a.sorted_pairs;
  p.a_scale_rows = a.a_scale_rows;
  p.a_scale = a.a_scale;
  p.w_scale = a.w_scale;
  p.out = a.out;
  p.ld_out = a.ld_out;
  p.out_inv_scale = a.out_inv_scale;
  p.pair_weight = a.pair_weight;
  p.route = a.route;
  // DecodeRoute writes the layout the align step would have: the args
  // point at it as the GEMMs' input.
  p.layout_sorted = const_cast<int32_t*>(a.sorted_pairs);
  p.layout_expert = const_cast<int32_t*>(a.block_expert);
  p.layout_blocks = const_cast<int32_t*>(a.num_blocks);
  p.max_blocks = a.max_blocks;
  p.act = a.act;
  p.bias = kEpi == GemmEpilogue::kWeightedBF16 ? nullptr : a.bias;
  p.swiglu_limit = a.swiglu_limit;
  p.swiglu_alpha = a.swiglu_alpha;
  p.a_scale_ld = a.a_scale_ld;
  p.block_n = kBlk ? a.block_n : 1;
  p.w_row_blocks = kBlk ? (a.w_rows + a.block_n - 1) / a.block_n : 0;
  p.w_k_blocks = kBlk ? (a.k + a.block_k - 1) / a.block_k : 0;
  p.a_tokens = kGather ? a.a : nullptr;
  p.top_k = kGather ? a.top_k : 0;

  // Persistent grid: as many CTAs as fit on the current device at once,
  // never more than the largest possible tile count (the real count is on
  // the device). Computed once per device; racing threads store the same.
  static std::atomic<int> resident_by_device[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  int resident = resident_by_device[dev].load(std::memory_order_relaxed);
  if (resident <= 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (kNWG + 1) * 128, smem) == cudaSuccess) {
      resident = sms * per_sm;
      resident_by_device[dev].store(resident, std::memory_order_relaxed);
    }
  }
  if (resident <= 0) return cudaErrorInvalidConfiguration;
  const long tiles = long((a.n_out + kOC - 1) / kOC) * (kPair ? (a.max_blocks + 1) / 2 : a.max_blocks);
  // sm90_persistent off gives one CTA per tile instead, for timing the two
  // schedules against each other.
  const int grid = int(tiles < resident || !persistent_grid() ? tiles : resident);
  err = launch_kernel(a.pdl, kernel, grid, (kNWG + 1) * 128, smem, stream, tm_w, tm_a, p);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <int BN, int kNWG, bool kGated, Act1 kAct, GemmEpilogue kEpi, bool kPC, bool kBlk, bool kTokA = false,
          bool kPair = false, bool kPP = false, bool kGather = false>
cudaError_t launch_cfg(const MoeGemmArgs& a, cudaStream_t stream) {
  // Ping-pong's second staging tile must leave four stages: one is held by
  // the wgmma group in flight, and the rest stream the next tile while a
  // warpgroup runs its epilogue. Tiles where it does not (FP32 staging of
  // 128 tokens) run cooperatively.
  constexpr bool kRunPP = kPP && SmemPlan<BN, kNWG, kGated, kEpi, kBlk, true, kGather>::kStages >= 4;
  return launch_plan<BN, kNWG, kGated, kAct, kEpi, kPC, kBlk, kTokA, kPair, kRunPP, kGather>(a, stream);
}

// launch_epi picks the kernel for one epilogue and weight-scale layout.
// GEMM1's activation: gated or not, and which Act1 (act1_of).
template <int BN, int kNWG, GemmEpilogue kEpi, bool kPC, bool kBlk, bool kTokA, bool kPair, bool kPP, bool kGather>
cudaError_t launch_act(const MoeGemmArgs& a, bool gated, cudaStream_t s) {
  switch (act1_of(a, gated)) {
    case Act1::kPlain:
      return gated ? launch_cfg<BN, kNWG, true, Act1::kPlain, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, s)
                   : launch_cfg<BN, kNWG, false, Act1::kPlain, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, s);
    case Act1::kSwiglu:
      return launch_cfg<BN, kNWG, true, Act1::kSwiglu, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, s);
    default:
      return gated ? launch_cfg<BN, kNWG, true, Act1::kAny, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, s)
                   : launch_cfg<BN, kNWG, false, Act1::kAny, kEpi, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, s);
  }
}

template <int BN, int kNWG, bool kPC, bool kBlk, bool kTokA = false, bool kPair = false, bool kPP = false,
          bool kGather = false>
cudaError_t launch_epi(const MoeGemmArgs& a, bool gated, cudaStream_t s) {
  switch (a.epilogue) {
    case GemmEpilogue::kAct1FP8:
      return launch_act<BN, kNWG, GemmEpilogue::kAct1FP8, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, gated, s);
    case GemmEpilogue::kAct1F32:
      return launch_act<BN, kNWG, GemmEpilogue::kAct1F32, kPC, kBlk, kTokA, kPair, kPP, kGather>(a, gated, s);
    case GemmEpilogue::kWeightedBF16:
      if constexpr (kGather) {
        return cudaErrorInvalidValue;  // GEMM2 reads GEMM1's sorted rows
      } else {
        return launch_cfg<BN, kNWG, false, Act1::kPlain, GemmEpilogue::kWeightedBF16, kPC, kBlk, kTokA, kPair, kPP>(a, s);
      }
  }
  return cudaErrorInvalidValue;
}

// toka_ok says whether a block-scaled 128-token tile can put the tokens on
// wgmma's M side (kTokA): each tile's weight rows (128, or 64 gate and 64
// up channels) must lie in one scale block. The sm90_toka option turns it
// off, to time the two layouts against each other.
bool toka_ok(const MoeGemmArgs& a, bool gated) {
  if (!switches().sm90_toka.load(std::memory_order_relaxed)) return false;
  return gated ? a.block_n % 64 == 0 && a.n_out % 64 == 0 : a.block_n % 128 == 0;
}

// pair_tiles says whether 128-row alignment blocks run as 256-token tiles
// of two blocks (kPair; per-expert and per-channel scales): the sm90_pair
// option, off by default until its timing beats 128- and 256-token tiles.
bool pair_tiles(WScale w_mode) {
  return switches().sm90_pair.load(std::memory_order_relaxed) && w_mode != WScale::kBlock;
}

bool ping_pong() { return switches().sm90_pingpong.load(std::memory_order_relaxed); }

// gather_tiles says whether the kernels can read a GEMM1's token rows by
// token (kGather): the prefill tiles of 64 and 128 tokens, two consumer
// warpgroups under the default ping-pong schedule, without block scales
// (whose scale warp has the producer warpgroup's second warp; their tiles
// would need kGather's own kernels too) or paired blocks; rows of whole
// 16-byte chunks at 16-byte aligned addresses, as cp.async copies them.
bool gather_tiles(int block_rows, WScale w_mode, int k, const void* rows) {
  return (block_rows == 64 || block_rows == 128) && w_mode != WScale::kBlock &&
         !(block_rows == 128 && pair_tiles(w_mode)) && ping_pong() && k % 16 == 0 &&
         (reinterpret_cast<uintptr_t>(rows) & 15) == 0;
}

template <int BN, int kNWG>
cudaError_t launch_scales(const MoeGemmArgs& a, bool gated, cudaStream_t s) {
  if constexpr (BN == 64 || BN == 128) {
    // Ping-pong kernels (launch_cfg runs them cooperatively where their
    // staging leaves too few stages), as the tiles without kGather.
    if (a.gather) {
      return a.w_mode == WScale::kPerChannel ? launch_epi<BN, kNWG, true, false, false, false, true, true>(a, gated, s)
                                             : launch_epi<BN, kNWG, false, false, false, false, true, true>(a, gated, s);
    }
  }
  if constexpr (BN == 128) {
    if (pair_tiles(a.w_mode)) {
      return a.w_mode == WScale::kPerChannel ? launch_epi<256, 2, true, false, false, true>(a, gated, s)
                                             : launch_epi<256, 2, false, false, false, true>(a, gated, s);
    }
  }
  // Two-warpgroup tiles of per-expert and per-channel scales run ping-pong
  // (kPP) where both warpgroups' accumulators fit: up to 128 tokens.
  constexpr bool kPP = kNWG == 2 && BN <= 128;
  switch (a.w_mode) {
    case WScale::kPerExpert:
      return ping_pong() ? launch_epi<BN, kNWG, false, false, false, false, kPP>(a, gated, s)
                         : launch_epi<BN, kNWG, false, false>(a, gated, s);
    case WScale::kPerChannel:
      return ping_pong() ? launch_epi<BN, kNWG, true, false, false, false, kPP>(a, gated, s)
                         : launch_epi<BN, kNWG, true, false>(a, gated, s);
    case WScale::kBlock:
      // Two accumulator sets: tiles of at most 128 tokens (sm90_block_rows).
      if constexpr (BN > 128) {
        return cudaErrorInvalidValue;
      } else if constexpr (BN == 128 && kNWG == 2) {
        return toka_ok(a, gated) ? launch_epi<BN, kNWG, false, true, true>(a, gated, s)
                                 : launch_epi<BN, kNWG, false, true>(a, gated, s);
      } else {
        return launch_epi<BN, kNWG, false, true>(a, gated, s);
      }
  }
  return cudaErrorInvalidValue;
}

// launch runs either GEMM; gated is GEMM1 of a SiLU-gated layer.
cudaError_t launch(const MoeGemmArgs& a, bool gated, cudaStream_t stream) {
  const int n = gated ? a.w_rows / 2 : a.w_rows;
  if (a.k % 16 != 0 || n % 16 != 0 || a.n_out % 16 != 0 || a.max_blocks <= 0) return cudaErrorInvalidValue;
  // Block scales: K blocks of one stage (128), any block_n.
  if (a.w_mode == WScale::kBlock && (a.block_k != kBK || a.block_n <= 0)) return cudaErrorInvalidValue;
  // kGather: GEMM1's tiles that gather_tiles names.
  if (a.gather && (a.epilogue == GemmEpilogue::kWeightedBF16 || a.route.on || a.top_k < 1 ||
                   !gather_tiles(a.block_rows, a.w_mode, a.k, a.a))) {
    return cudaErrorInvalidValue;
  }
  // DecodeRoute: only the kernels can_route names take it.
  if (a.route.on && (a.epilogue == GemmEpilogue::kWeightedBF16 || a.a_rows != 1 ||
                     !sm90_decode_route(a.route.rp.m, a.route.rp.top_k, a.route.rp.e, a.block_rows, a.w_mode, a.a))) {
    return cudaErrorInvalidValue;
  }
  // Few tokens per expert: one consumer warpgroup per CTA doubles the CTAs
  // streaming weights; many tokens: two warpgroups share each token tile.
  switch (a.block_rows) {
    case 8:
      return launch_scales<8, 1>(a, gated, stream);
    case 16:
      return launch_scales<16, 1>(a, gated, stream);
    case 32:
      return launch_scales<32, 1>(a, gated, stream);
    case 64:
      return launch_scales<64, 2>(a, gated, stream);
    case 128:
      return launch_scales<128, 2>(a, gated, stream);
    case 256:
      return launch_scales<256, 2>(a, gated, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_gemm1_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  if (args.epilogue == GemmEpilogue::kWeightedBF16) return cudaErrorInvalidValue;
  return launch(args, gemm_act_gated(args.act), stream);
}

cudaError_t launch_gemm2_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  if (args.epilogue != GemmEpilogue::kWeightedBF16) return cudaErrorInvalidValue;
  return launch(args, false, stream);
}

// TMA needs 16-byte global strides (K and N bytes), and the gated layout
// whole 8-row channel groups.
bool sm90_supported(int hidden, int inter) { return hidden % 16 == 0 && inter % 16 == 0; }

bool sm90_block_supported(int block_n, int block_k) { return block_n > 0 && block_k == kBK; }

bool sm90_decode_route(int m, int top_k, int num_experts, int block_rows, WScale w_mode, const void* hidden) {
  return m == 1 && block_rows == 8 && w_mode != WScale::kBlock && top_k >= 1 && top_k <= kRoutePairs &&
         route_smem_per_warp(num_experts) + 256 <= kRouteScratch && (reinterpret_cast<uintptr_t>(hidden) & 15) == 0;
}

// sm90_gather_fold's rule: the by-token GEMM1 wherever it times faster
// than the gather pass and the TMA-fed GEMM1 together (docs/perf-notes.md,
// "The gather folded into GEMM1, on"): at 64-token tiles, at 128-token
// tiles of non-gated layers, and where a gated layer's tiles are at least
// a quarter padding on average (by token, padding rows cost no reads). A
// gated layer's fuller 128-token tiles are as fast or faster fed by TMA.
bool sm90_gather_fold(int block_rows, WScale w_mode, int k, const void* rows, bool gated, int rows_per_expert) {
  const int sw = switches().sm90_gather.load(std::memory_order_relaxed);
  if (sw == 0 || !gather_tiles(block_rows, w_mode, k, rows)) return false;
  return sw == 1 || block_rows == 64 || !gated || 4 * rows_per_expert <= 3 * block_rows;
}

int sm90_block_rows(int m, int top_k, int num_experts, bool block_scales, int hidden, int inter, bool gated) {
  const int per_expert = mean_rows_per_expert(m, top_k, num_experts);
  // The measured table: the row of the shape with the least per_expert at
  // or above this call's (its last row past the end); below the shape's
  // first row, which is where no tile was timed, the rule. A row's tile
  // must be one the call can take (block mode: at most 128).
  int tile = 0;
  bool first = true;
  for (const Sm90TileRow& r : kSm90Tiles) {
    if (r.hidden != hidden || r.inter != inter || r.gated != gated || r.block != block_scales) continue;
    if (first && per_expert < r.per_expert) break;
    first = false;
    tile = r.tile;
    if (r.per_expert >= per_expert) break;
  }
  if (tile > 0 && !(block_scales && tile > 128)) return tile;
  // Routing is not uniform: an expert with more tokens than one tile runs
  // two tiles and streams its weights twice, so decode tiles hold about
  // twice the mean (docs/perf-notes.md, "Token tiles", has the timings).
  if (per_expert <= 4) return 8;
  if (per_expert <= 8) return 16;
  if (per_expert <= 16) return 32;
  // Up to 64 per expert a 64-token tile wastes less of the tile than 128.
  if (per_expert <= 64) return 64;
  // Block scales hold two accumulator sets: at most 128 tokens a tile.
  // 256-token tiles halve the weight traffic per FLOP but leave up to 255
  // slots idle per expert, so they pay only well above 256 per expert.
  // Paired 128-row blocks (pair_tiles) read the weights once per 256
  // tokens where an expert has them and leave at most 127 slots idle per
  // expert instead of 255, so they replace the 256-token tile.
  if (block_scales || per_expert <= 256 || switches().sm90_pair.load(std::memory_order_relaxed)) return 128;
  return 256;
}

}  // namespace expertd
