// GEMM2 on CUTLASS's SM90 grouped FP8 GEMM (gemm_cutlass.cu, sm_90a; built
// where scripts/cuda-build.sh finds that file, which it announces with
// -DEXPERTD_HAVE_CUTLASS). Its large tiles (128 tokens x 256 channels, two
// cooperative consumer warpgroups) beat the hand-written Hopper GEMM2 once
// experts have hundreds of rows; the policy (use_cutlass2 in moe_state.cu)
// says when a call takes it.
//
// Unlike the kWeightedBF16 epilogue it writes each sorted row's unweighted
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
// gemm2_cutlass_supported says whether the kernel takes a layer
// (k = hidden, n = intermediate) with weight scales of mode w_mode: K and
// N multiples of 16 (TMA rows of 16 bytes) and one scale per expert, which
// the epilogue folds with a static activation scale into one alpha per
// expert.
bool gemm2_cutlass_supported(int hidden, int inter, WScale w_mode);

// gemm2_cutlass_workspace is the device scratch one launch needs for
// num_experts experts on device: per-expert shapes, operand pointers,
// strides and alphas, and CUTLASS's own workspace (a TMA descriptor per SM
// and operand).
size_t gemm2_cutlass_workspace(int device, int num_experts);

// launch_gemm2_cutlass runs GEMM2 for args (per-expert weight scales, a
// static activation scale args.a_scale, no a_scale_rows; out BF16 with
// ld_out = n_out) on device: a setup kernel turns the alignment's device
// arrays into the experts' problems and pair_row, then the grouped GEMM
// runs over all num_experts experts (those with no rows as empty problems).
// Nothing is read back to the host, so a stream capture records it.
// workspace holds gemm2_cutlass_workspace(device, num_experts) bytes,
// 256-byte aligned.
cudaError_t launch_gemm2_cutlass(const MoeGemmArgs& args, int device, int32_t* pair_row, void* workspace,
                                 cudaStream_t stream);
#endif

}  // namespace expertd
