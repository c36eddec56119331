// gemm_sm90_base: a baseline copy of the Hopper GEMM under another
// namespace, so gemm_sm90_check ab times a candidate against it in one
// process, on the same data and with the same L2 flushes (run-to-run
// spread between processes is as large as the changes being measured).
//
// Built by scripts/sm90-ab-build.sh with -I pointing at the baseline's
// sources first; MoeGemmArgs must have the same layout in both trees
// (the entry points take it by address).
#define expertd expertd_base
#include "gemm_sm90.cu"
#undef expertd

extern "C" cudaError_t expertd_base_gemm1(const void* args, cudaStream_t s) {
  return expertd_base::launch_gemm1_sm90(*static_cast<const expertd_base::MoeGemmArgs*>(args), s);
}
extern "C" cudaError_t expertd_base_gemm2(const void* args, cudaStream_t s) {
  return expertd_base::launch_gemm2_sm90(*static_cast<const expertd_base::MoeGemmArgs*>(args), s);
}
extern "C" int expertd_base_block_rows(int m, int top_k, int num_experts, bool block_scales) {
  return expertd_base::sm90_block_rows(m, top_k, num_experts, block_scales);
}
