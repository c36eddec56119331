// CUTLASS's SM90 ptr-array grouped FP8 GEMM as expertd instantiates it: the
// one definition of the kernel type, which the library's GEMM2
// (gemm_cutlass.cu) and the configuration bench
// (tools/cutlass_grouped_bench.cu) both build on.
//
// Each group is one expert: A its tokens' rows [rows, K] (FP8 e4m3,
// row-major), B its weights [N, K] (FP8 e4m3, K contiguous, which is
// CUTLASS's column-major B), D [rows, N] BF16. The accumulator is FP32 and
// never promoted (FP8FastAccum), as in expertd's per-expert-scale kernels;
// the epilogue multiplies it by the group's alpha (ptr-array alpha, one
// float per group) and has no C operand.
//
// Needs CUTLASS's headers (scripts/cutlass-install.sh), sm_90a code and
// NDEBUG: a device assert is a call, and a call inside the mainloop makes
// ptxas serialize the wgmma pipeline (warning C7510).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace expertd {
namespace cutlass_grouped {

// Kernel and epilogue schedules, tiles (M tokens x N x K) and clusters the
// bench compares.
using CoopK = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum;
using CoopE = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using PingK = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum;
using PingE = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using Tile128x128 = cute::Shape<cute::_128, cute::_128, cute::_128>;
using Tile128x256 = cute::Shape<cute::_128, cute::_256, cute::_128>;
using Tile256x128 = cute::Shape<cute::_256, cute::_128, cute::_128>;
using Tile64x128 = cute::Shape<cute::_64, cute::_128, cute::_128>;
using Cluster1x1 = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Cluster2x1 = cute::Shape<cute::_2, cute::_1, cute::_1>;  // two M tiles share B (TMA multicast)

// Grouped is one configuration's types.
template <class Tile, class Cluster, class KSched, class ESched>
struct Grouped {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // per group {M, N, K}
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
  using ElementIn = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;     // tokens' rows, K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // weights [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignIn = 16, kAlignOut = 8;  // 16-byte TMA rows

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignOut, ElementOut,
      LayoutD*, kAlignOut, ESched, cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::
      CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn, LayoutB*,
      kAlignIn, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // arguments are the grouped GEMM's: groups problems, their shapes in
  // device memory (and on the host, or null: the kernel then reads them
  // from the device alone and its persistent grid is one CTA per SM), the
  // per-group operand and stride arrays (device) and one alpha per group
  // (alpha[group] points at it).
  static typename Gemm::Arguments arguments(int groups, GroupShape* shapes, const GroupShape* host_shapes,
                                            const ElementIn** a, StrideA* sa, const ElementIn** b, StrideB* sb,
                                            ElementOut** d, StrideD* sd, const float* const* alpha,
                                            const cutlass::KernelHardwareInfo& hw) {
    typename Epilogue::FusionCallbacks::Arguments fusion;
    fusion.alpha_ptr_array = alpha;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};  // one alpha per group
    return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, shapes, host_shapes},
                                    {a, sa, b, sb},
                                    {fusion, nullptr, nullptr, d, sd},
                                    hw};
  }
};

}  // namespace cutlass_grouped
}  // namespace expertd
