// Bridge from the moe_gemm.h interface to the Hopper kernels' own argument
// struct (gemm_sm90.cuh). Built only while gemm_sm90.cu does not define the
// moe_gemm.h entry points itself (scripts/cuda-build.sh decides).
#include "gemm_sm90.cuh"
#include "moe_gemm.h"

namespace expertd {
namespace {

expertd_sm90::GemmArgs to_sm90(const MoeGemmArgs& a) {
  expertd_sm90::GemmArgs g{};
  g.w = a.w;
  g.num_experts = a.num_experts;
  g.w_rows = a.w_rows;
  g.k = a.k;
  g.gated = a.act == GemmAct::kSiluGated && a.epilogue != GemmEpilogue::kWeightedBF16;
  g.n_out = a.n_out;
  g.a = a.a;
  g.a_rows = a.a_rows;
  g.block_rows = a.block_rows;
  g.block_expert = a.block_expert;
  g.num_blocks = a.num_blocks;
  g.max_blocks = a.max_blocks;
  g.sorted_pairs = a.sorted_pairs;
  g.a_scale_rows = a.a_scale_rows;
  g.a_scale = a.a_scale;
  g.w_scale = a.w_scale;
  switch (a.epilogue) {
    case GemmEpilogue::kAct1FP8:
      g.epilogue = expertd_sm90::Epilogue::kAct1FP8;
      break;
    case GemmEpilogue::kAct1BF16:
      g.epilogue = expertd_sm90::Epilogue::kAct1BF16;
      break;
    case GemmEpilogue::kWeightedBF16:
      g.epilogue = expertd_sm90::Epilogue::kWeightedBF16;
      break;
  }
  g.out = a.out;
  g.ld_out = a.ld_out;
  g.out_inv_scale = a.out_inv_scale;
  g.pair_weight = a.pair_weight;
  return g;
}

}  // namespace

cudaError_t launch_gemm1_sm90(const MoeGemmArgs& a, cudaStream_t s) {
  if (a.epilogue == GemmEpilogue::kWeightedBF16) return cudaErrorInvalidValue;
  return expertd_sm90::Launch(to_sm90(a), s);
}

cudaError_t launch_gemm2_sm90(const MoeGemmArgs& a, cudaStream_t s) {
  if (a.epilogue != GemmEpilogue::kWeightedBF16) return cudaErrorInvalidValue;
  return expertd_sm90::Launch(to_sm90(a), s);
}

bool sm90_supported(int hidden, int inter) { return expertd_sm90::Supported(hidden, inter, hidden); }

int sm90_block_rows(int m, int top_k, int num_experts) {
  return expertd_sm90::BlockRows(m, top_k, num_experts);
}

}  // namespace expertd
