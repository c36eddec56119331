// GEMM2, and GEMM1 of ReLU² layers, on CUTLASS's SM90 grouped FP8 GEMM
// (gemm_cutlass.cu, sm_90a; built where scripts/cuda-build.sh finds that
// file, which it announces with -DEXPERTD_HAVE_CUTLASS). Its large tiles
// (128 tokens x 256 channels, two cooperative consumer warpgroups) beat the
// hand-written Hopper GEMM2 once experts have hundreds of rows; the policy
// (use_cutlass1 and use_cutlass2 in moe_state.cu) says when a call takes
// them.
//
// Unlike the kWeightedBF16 epilogue GEMM2 writes each sorted row's unweighted
// output in sorted order (D row = sorted row, y [a_rows, n_out] BF16), and
// the combine applies the router weight: for that it also writes
// pair_row[pair] = the pair's sorted row, for every pair the alignment
// placed (pairs with an out-of-range id have none, and combine skips them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe_gemm.h"

namespace expertd {

#ifdef EXPERTD_HAVE_CUTLASS
// gemm1_cutlass_supported says whether GEMM1 of a layer (k = hidden, n =
// intermediate, activation act, weight scales of mode w_mode) runs here:
// ReLU², whose epilogue is elementwise (no gate and up rows to pair), and
// gemm2_cutlass_supported's shapes and scales.
bool gemm1_cutlass_supported(int hidden, int inter, WScale w_mode, GemmAct act);

// gemm2_cutlass_supported says whether the kernel takes a layer
// (k = hidden, n = intermediate) with weight scales of mode w_mode: K and
// N multiples of 16 (TMA rows of 16 bytes) and one scale per expert, which
// the epilogue folds with a static activation scale into one alpha per
// expert.
bool gemm2_cutlass_supported(int hidden, int inter, WScale w_mode);

// gemm1_cutlass_workspace and gemm2_cutlass_workspace are the device
// scratch of one GEMM for num_experts experts on device: per-expert
// shapes, operand pointers, strides and alphas, and CUTLASS's own
// workspace (a TMA descriptor per SM and operand).
size_t gemm1_cutlass_workspace(int device, int num_experts);
size_t gemm2_cutlass_workspace(int device, int num_experts);

// launch_cutlass_prep enqueues the setup kernel of the GEMMs that run here
// (g1, g2: their arguments, or null for one that runs elsewhere): it turns
// the alignment's device arrays into each expert's problems in that GEMM's
// workspace (gemm1/gemm2_cutlass_workspace bytes, 256-byte aligned) and,
// for GEMM2, pair_row. It goes before the first of those GEMMs, after the
// gather. Nothing is read back to the host, so a stream capture records
// it.
//
// GEMM1's arguments: a ReLU² layer's (kAct1FP8 into out [a_rows, n_out],
// ld_out = n_out, per-expert weight scales, no bias, no DecodeRoute) with a
// per-tensor activation scale: a_scale, or a_scale_rows (a_scale_ld 1)
// holding the same value in every row, as the gather writes a call's one
// FP8 hidden scale. GEMM2's: per-expert weight scales, a static activation
// scale a_scale (no a_scale_rows), out BF16 with ld_out = n_out.
cudaError_t launch_cutlass_prep(const MoeGemmArgs* g1, void* workspace1, const MoeGemmArgs* g2, int32_t* pair_row,
                                void* workspace2, int device, cudaStream_t stream);

// launch_gemm1_cutlass and launch_gemm2_cutlass run the grouped GEMM over
// all num_experts experts (those with no rows as empty problems) with the
// problems launch_cutlass_prep wrote into workspace, on device.
// GEMM1's rows are written to out in sorted order, FP8 e4m3(relu(acc *
// a_scale * w_scale)^2 * out_inv_scale), as the hand-written kAct1FP8
// epilogue writes them; the padding rows are not written.
cudaError_t launch_gemm1_cutlass(const MoeGemmArgs& args, int device, void* workspace, cudaStream_t stream);
cudaError_t launch_gemm2_cutlass(const MoeGemmArgs& args, int device, void* workspace, cudaStream_t stream);
#endif

}  // namespace expertd
