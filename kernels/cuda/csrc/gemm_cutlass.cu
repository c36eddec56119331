// GEMM2 on CUTLASS's SM90 ptr-array grouped FP8 GEMM (gemm_cutlass.h):
// cooperative kernel, 128x256x128 tile, cluster 1x1 (cutlass_grouped.cuh
// defines the type). Built for sm_90a only, with NDEBUG (C7510, see
// cutlass_grouped.cuh).
//
// The experts' problems come from the alignment's device arrays, never from
// the host: a setup kernel derives each expert's rows, operand pointers and
// alpha, and the grouped GEMM reads its problem shapes from device memory
// alone (host shapes null, as vLLM's cutlass_moe_mm passes them), so a call
// enqueues the same launches whatever the routing, which graph capture
// needs. All num_experts experts are groups; an expert with no rows is an
// empty problem, which the tile scheduler skips.
#include "gemm_cutlass.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "cutlass_grouped.cuh"
#include "launch.cuh"

namespace expertd {
namespace {

using G = cutlass_grouped::Grouped<cutlass_grouped::Tile128x256, cutlass_grouped::Cluster1x1, cutlass_grouped::CoopK,
                                   cutlass_grouped::CoopE>;

constexpr int kPrepThreads = 128;
// The setup kernel's most blocks: enough to write the slot map of the
// largest calls in a few passes.
constexpr int kPrepMaxBlocks = 1024;

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// Scratch is the carve-up of the launch's workspace: per expert its
// problem shape, operand pointers, strides and alpha (with a pointer to
// it, which ptr-array alpha wants), then CUTLASS's workspace.
struct Scratch {
  G::GroupShape* shapes;
  const G::ElementIn** a;
  const G::ElementIn** b;
  G::ElementOut** d;
  G::StrideA* sa;
  G::StrideB* sb;
  G::StrideD* sd;
  float* alpha;
  const float** alpha_ptr;
  void* cutlass_ws;
  size_t total;
};

// hardware is what the kernel's persistent grid is sized by.
cutlass::KernelHardwareInfo hardware(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    sms = 0;
  }
  hw.sm_count = sms;
  return hw;
}

// arguments are the grouped GEMM's over the scratch at sc.
G::Gemm::Arguments arguments(const Scratch& sc, int experts, const cutlass::KernelHardwareInfo& hw) {
  return G::arguments(experts, sc.shapes, nullptr, sc.a, sc.sa, sc.b, sc.sb, sc.d, sc.sd, sc.alpha_ptr, hw);
}

// carve lays the scratch out from base (null: only the size is wanted).
Scratch carve(void* base, int experts, const cutlass::KernelHardwareInfo& hw) {
  Scratch sc{};
  const size_t E = experts;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    uint8_t* at = static_cast<uint8_t*>(base) + off;
    off += align256(bytes);
    return at;
  };
  sc.shapes = reinterpret_cast<G::GroupShape*>(take(E * sizeof(G::GroupShape)));
  sc.a = reinterpret_cast<const G::ElementIn**>(take(E * sizeof(void*)));
  sc.b = reinterpret_cast<const G::ElementIn**>(take(E * sizeof(void*)));
  sc.d = reinterpret_cast<G::ElementOut**>(take(E * sizeof(void*)));
  sc.sa = reinterpret_cast<G::StrideA*>(take(E * sizeof(G::StrideA)));
  sc.sb = reinterpret_cast<G::StrideB*>(take(E * sizeof(G::StrideB)));
  sc.sd = reinterpret_cast<G::StrideD*>(take(E * sizeof(G::StrideD)));
  sc.alpha = reinterpret_cast<float*>(take(E * sizeof(float)));
  sc.alpha_ptr = reinterpret_cast<const float**>(take(E * sizeof(void*)));
  sc.cutlass_ws = take(G::Gemm::get_workspace_size(arguments(sc, experts, hw)));
  sc.total = off;
  return sc;
}

// PrepParams are the setup kernel's inputs (GEMM2's arguments: the
// alignment's arrays, operands and scales) and outputs.
struct PrepParams {
  MoeGemmArgs g;
  Scratch sc;
  int32_t* pair_row;
};

// first_block is the first of blocks [0, nb) whose expert is at least e,
// or nb: block_expert is non-decreasing there, since the alignment lays
// the experts' runs out in expert order. The block's threads probe at once
// (a k-ary search), so a search is a few dependent loads at any nb. Every
// thread of the block calls it and gets the same answer.
__device__ int first_block(const int32_t* block_expert, int nb, int e) {
  int lo = 0, hi = nb;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + int(blockDim.x) - 1) / int(blockDim.x);
    const int probes = (hi - lo + step - 1) / step;
    const int at = lo + int(threadIdx.x) * step;
    // The probes below e are a prefix of them.
    const int below = __syncthreads_count(int(threadIdx.x) < probes && block_expert[at] < e);
    if (below == 0) return lo;
    const int next_lo = lo + (below - 1) * step + 1;
    if (below < probes) hi = lo + below * step;
    lo = next_lo;
  }
  return lo;
}

// gemm2_prep_kernel writes pair_row for every sorted row that holds a pair
// (grid-strided), and in block e (and e + gridDim.x, ...) expert e's
// problem: its rows are its blocks' rows less the padding, which only its
// last block has, after the pairs.
__global__ void __launch_bounds__(kPrepThreads) gemm2_prep_kernel(PrepParams p) {
  pdl_wait();
  pdl_trigger();
  const MoeGemmArgs& g = p.g;
  const int nb = *g.num_blocks;
  const int BM = g.block_rows;
  const int rows_all = nb * BM;
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows_all; r += gridDim.x * blockDim.x) {
    const int pair = g.sorted_pairs[r];
    if (pair >= 0) p.pair_row[pair] = r;
  }
  for (int e = blockIdx.x; e < g.num_experts; e += gridDim.x) {
    const int first = first_block(g.block_expert, nb, e);
    const int end = first_block(g.block_expert, nb, e + 1);
    int rows = 0;
    if (end > first) {
      const int32_t* last = g.sorted_pairs + size_t(end - 1) * BM;
      int in_last = 0;
      for (int i0 = 0; i0 < BM; i0 += blockDim.x) {
        const int i = i0 + int(threadIdx.x);
        in_last += __syncthreads_count(i < BM && last[i] >= 0);
      }
      rows = (end - 1 - first) * BM + in_last;
    }
    if (threadIdx.x == 0) {
      const size_t row0 = size_t(first) * BM;
      const Scratch& sc = p.sc;
      sc.shapes[e] = G::GroupShape{rows, g.n_out, g.k};
      sc.a[e] = reinterpret_cast<const G::ElementIn*>(g.a + row0 * g.k);
      sc.b[e] = reinterpret_cast<const G::ElementIn*>(g.w + size_t(e) * g.n_out * g.k);
      sc.d[e] = reinterpret_cast<G::ElementOut*>(static_cast<__nv_bfloat16*>(g.out) + row0 * g.n_out);
      G::StrideA sa{};
      cute::get<0>(sa) = g.k;
      sc.sa[e] = sa;
      G::StrideB sb{};
      cute::get<0>(sb) = g.k;
      sc.sb[e] = sb;
      G::StrideD sd{};
      cute::get<0>(sd) = g.n_out;
      sc.sd[e] = sd;
      sc.alpha[e] = g.a_scale * g.w_scale[e];
      sc.alpha_ptr[e] = sc.alpha + e;
    }
  }
}

}  // namespace

bool gemm2_cutlass_supported(int hidden, int inter, WScale w_mode) {
  return hidden % 16 == 0 && inter % 16 == 0 && w_mode == WScale::kPerExpert;
}

size_t gemm2_cutlass_workspace(int device, int num_experts) {
  return carve(nullptr, num_experts, hardware(device)).total;
}

cudaError_t launch_gemm2_cutlass(const MoeGemmArgs& g, int device, int32_t* pair_row, void* workspace,
                                 cudaStream_t stream) {
  if (!gemm2_cutlass_supported(g.n_out, g.k, g.w_mode) || g.a_scale_rows || g.epilogue != GemmEpilogue::kWeightedBF16 ||
      g.ld_out != g.n_out || g.w_rows != g.n_out)
    return cudaErrorInvalidValue;
  const cutlass::KernelHardwareInfo hw = hardware(device);
  if (hw.sm_count <= 0) return cudaErrorInvalidDevice;
  PrepParams pp{g, carve(workspace, g.num_experts, hw), pair_row};
  const int grid = std::max(g.num_experts, std::min(kPrepMaxBlocks, (g.a_rows + kPrepThreads - 1) / kPrepThreads));
  if (cudaError_t err = launch_kernel(g.pdl, gemm2_prep_kernel, grid, kPrepThreads, 0, stream, pp)) return err;

  // Launched without programmatic dependent launch: this kernel does not
  // wait on its predecessor's grid (CUTLASS leaves that out of the
  // ptr-array kernels), so it must start after the setup kernel completes.
  const G::Gemm::Arguments args = arguments(pp.sc, g.num_experts, hw);
  G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, pp.sc.cutlass_ws, stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaSuccess;
}

}  // namespace expertd
