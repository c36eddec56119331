// CUTLASS's SM90 ptr-array grouped FP8 GEMM as expertd instantiates it: the
// one definition of the kernel types, which the library's GEMMs
// (gemm_cutlass.cu) and the configuration bench
// (tools/cutlass_grouped_bench.cu) both build on.
//
// Each group is one expert: A its tokens' rows [rows, K] (FP8 e4m3,
// row-major), B its weights [N, K] (FP8 e4m3, K contiguous, which is
// CUTLASS's column-major B), D [rows, N] row-major. The accumulator is FP32
// and never promoted (FP8FastAccum), as in expertd's per-expert-scale
// kernels; the epilogue has no C operand and starts from the group's alpha
// times the accumulator (ptr-array alpha, one float per group). Two
// epilogues: AlphaBF16 (GEMM2: D = alpha * acc in BF16) and Relu2FP8
// (GEMM1 of a ReLU² layer: D = e4m3(relu(alpha * acc)^2 * inv_scale)).
//
// Needs CUTLASS's headers (scripts/cutlass-install.sh), sm_90a code and
// NDEBUG: a device assert is a call, and a call inside the mainloop makes
// ptxas serialize the wgmma pipeline (warning C7510).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
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

// The per-group alpha as an epilogue visitor: group l's tiles read
// *alpha[l] (scalar_ptr_arrays).
using GroupAlpha = cutlass::epilogue::fusion::Sm90ScalarBroadcastPtrArray<float, cute::Stride<cute::_0, cute::_0, int64_t>>;

// group_alpha is GroupAlpha's arguments for the alphas alpha points at.
inline GroupAlpha::Arguments group_alpha(const float* const* alpha) {
  GroupAlpha::Arguments a;
  a.scalar_ptr_arrays[0] = alpha;
  a.dScalar[0] = {cute::_0{}, cute::_0{}, 1};
  return a;
}

// AlphaBF16 is GEMM2's epilogue: D = alpha * acc, BF16.
struct AlphaBF16 {
  using ElementOut = cutlass::bfloat16_t;
  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>;
  // fusion is the epilogue's arguments (Args: the callbacks' type, which
  // the collective builder derives from Fusion).
  template <class Args>
  static Args fusion(const float* const* alpha) {
    Args f;
    f.alpha_ptr_array = alpha;
    f.dAlpha = {cute::_0{}, cute::_0{}, 1};  // one alpha per group
    return f;
  }
};

// Relu2Scale is Relu2FP8's arithmetic on one fragment: that of the
// hand-written kernels' kAct1FP8 epilogue for kRelu2 (moe_gemm.h
// gemm1_act, then the quantize in stage_store), in their order, so both
// paths round alike; fmaxf maps a NaN product to 0 there too. The e4m3
// conversion after it is CUTLASS's, cvt.rn.satfinite like theirs. The
// primary template is empty: Sm90Compute looks for an Arguments member on
// Relu2Scale<float>.
template <class T>
struct Relu2Scale {};
template <int N>
struct Relu2Scale<cutlass::Array<float, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<float, N> operator()(const cutlass::Array<float, N>& alpha,
                                                          const cutlass::Array<float, N>& acc,
                                                          const cutlass::Array<float, N>& inv_scale) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      const float g = fmaxf(acc[i] * alpha[i], 0.f);
      out[i] = g * g * inv_scale[i];
    }
    return out;
  }
};

// Relu2FP8 is GEMM1's epilogue for a ReLU² layer with a static output
// scale: D = e4m3(relu(alpha * acc)^2 * inv_scale), inv_scale = 1 /
// a2_scale for every group.
struct Relu2FP8 {
  using ElementOut = cutlass::float_e4m3_t;
  using InvScale = cutlass::epilogue::fusion::Sm90ScalarBroadcast<float>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<Relu2Scale, ElementOut, float, cutlass::FloatRoundStyle::round_to_nearest>,
      GroupAlpha, cutlass::epilogue::fusion::Sm90AccFetch, InvScale>;
  template <class Args>
  static Args fusion(const float* const* alpha, float inv_scale) {
    InvScale::Arguments inv;
    inv.scalars[0] = inv_scale;
    return Args{group_alpha(alpha), {}, inv, {}};
  }
};

// Grouped is one configuration's types.
template <class Tile, class Cluster, class KSched, class ESched, class Epi = AlphaBF16>
struct Grouped {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // per group {M, N, K}
  using GroupShape = typename ProblemShape::UnderlyingProblemShape;
  using ElementIn = cutlass::float_e4m3_t;
  using ElementOut = typename Epi::ElementOut;
  using LayoutA = cutlass::layout::RowMajor;     // tokens' rows, K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // weights [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;
  // 16-byte TMA rows.
  static constexpr int kAlignIn = 16, kAlignOut = 16 / int(sizeof(ElementOut));

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignOut, ElementOut,
      LayoutD*, kAlignOut, ESched, typename Epi::Fusion>::CollectiveOp;
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
  using FusionArguments = typename Epilogue::FusionCallbacks::Arguments;

  // fusion is the epilogue's arguments from Epi's (for AlphaBF16 the
  // alphas, alpha[group] pointing at the group's; for Relu2FP8 those and
  // the inverse output scale).
  template <class... P>
  static FusionArguments fusion(P... p) {
    return Epi::template fusion<FusionArguments>(p...);
  }

  // arguments are the grouped GEMM's: groups problems, their shapes in
  // device memory (and on the host, or null: the kernel then reads them
  // from the device alone and its persistent grid is one CTA per SM), the
  // per-group operand and stride arrays (device) and the epilogue's
  // arguments (fusion).
  static typename Gemm::Arguments arguments(int groups, GroupShape* shapes, const GroupShape* host_shapes,
                                            const ElementIn** a, StrideA* sa, const ElementIn** b, StrideB* sb,
                                            ElementOut** d, StrideD* sd, const FusionArguments& fusion,
                                            const cutlass::KernelHardwareInfo& hw) {
    return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, shapes, host_shapes},
                                    {a, sa, b, sb},
                                    {fusion, nullptr, nullptr, d, sd},
                                    hw};
  }
};

}  // namespace cutlass_grouped
}  // namespace expertd
