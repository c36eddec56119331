// Hopper (sm_90a) grouped FP8 GEMM for fused MoE: TMA loads into 128-byte
// swizzled shared memory, an mbarrier ring, warp-specialized producer and
// wgmma (QGMMA) consumers, and fused epilogues (SiLU-and-mul or ReLU²,
// re-quantization to FP8; or router-weighted BF16 output for GEMM2).
//
// Layout choice ("swap AB"): the weights are wgmma's A operand (the M side,
// 64 output channels per consumer warpgroup) and the expert's tokens are the
// B operand (the N side, BN tokens). Decode batches give an expert a handful
// of tokens; with tokens on the N side a tile of 8 tokens wastes nothing,
// while the weights, which are the bytes that matter, stream through every
// SM. Both operands are K-contiguous in memory, which is what FP8 wgmma needs.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace expertd_sm90 {

// Epilogue is what a GEMM does with its FP32 accumulators.
enum class Epilogue : int {
  // GEMM1: dequantize, activation, quantize to FP8 with out_inv_scale; the
  // output is [sorted row, n_out] FP8.
  kAct1FP8 = 0,
  // GEMM1: dequantize, activation, BF16 out (dynamic requant runs after).
  kAct1BF16 = 1,
  // GEMM2: dequantize, times the pair's router weight, BF16 out at
  // [pair, n_out].
  kWeightedBF16 = 2,
};

// GemmArgs describes one grouped GEMM launch over expert-sorted token rows
// padded to blocks of block_rows tokens (one expert per block).
struct GemmArgs {
  // Weights: FP8 [E, w_rows, k], k contiguous. For gated GEMM1 w_rows = 2N
  // with gate rows [0,N) and up rows [N,2N).
  const uint8_t* w;
  int num_experts;
  int w_rows;
  int k;
  bool gated;
  // Output channels: N for GEMM1, K (hidden) for GEMM2.
  int n_out;
  // Tokens: FP8 [a_rows, k] in sorted order (row = block * block_rows + i).
  const uint8_t* a;
  int a_rows;
  int block_rows;
  // Per block: expert id, or -1 for an unused block. num_blocks is a device
  // scalar (routing decides it); max_blocks bounds the grid.
  const int32_t* block_expert;
  const int32_t* num_blocks;
  int max_blocks;
  // Per sorted row: the (token * top_k + slot) pair, or -1 for padding.
  const int32_t* sorted_pairs;
  // Dequantization: a_scale_rows[sorted row] if non-null, else a_scale; times
  // w_scale[expert].
  const float* a_scale_rows;
  float a_scale;
  const float* w_scale;
  // Output.
  Epilogue epilogue;
  void* out;
  int ld_out;            // elements between output rows
  float out_inv_scale;   // kAct1FP8: 1 / a2_scale
  const float* pair_weight;  // kWeightedBF16: router weight per pair
  int* debug = nullptr;      // progress counters (EXPERTD_SM90_DEBUG builds only)
};

// Supported reports whether the sm90 path can run a GEMM of this shape: TMA
// needs 16-byte row strides, and the gated layout 8-row channel groups.
inline bool Supported(int k, int n, int hidden) {
  return k % 16 == 0 && n % 16 == 0 && hidden % 16 == 0;
}

// BlockRows picks the token tile for a call: small tiles when experts see a
// few tokens each (decode), large ones when the GEMMs are compute-bound.
int BlockRows(int m, int top_k, int num_experts);

// Launch enqueues the GEMM on stream. It returns the CUDA error of the
// launch (or of tensor-map encoding) and never synchronizes.
cudaError_t Launch(const GemmArgs& args, cudaStream_t stream);

}  // namespace expertd_sm90
