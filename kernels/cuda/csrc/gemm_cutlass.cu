// GEMM1 (ReLU² layers) and GEMM2 on CUTLASS's SM90 ptr-array grouped FP8
// GEMM (gemm_cutlass.h): cooperative kernel, 128x256x128 tile, cluster 1x1
// (cutlass_grouped.cuh defines the types). Built for sm_90a only, with
// NDEBUG (C7510, see cutlass_grouped.cuh).
//
// The experts' problems come from the alignment's device arrays, never from
// the host: a setup kernel derives each expert's rows, operand pointers and
// alpha, for both GEMMs in one launch when both run here, and the grouped
// GEMMs read their problem shapes from device memory alone (host shapes
// null, as vLLM's cutlass_moe_mm passes them), so a call enqueues the same
// launches whatever the routing, which graph capture needs. All num_experts
// experts are groups; an expert with no rows is an empty problem, which the
// tile scheduler skips.
#include "gemm_cutlass.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "cutlass_grouped.cuh"
#include "launch.cuh"

namespace expertd {
namespace {

using cutlass_grouped::Grouped;
using G1 = Grouped<cutlass_grouped::Tile128x256, cutlass_grouped::Cluster1x1, cutlass_grouped::CoopK,
                   cutlass_grouped::CoopE, cutlass_grouped::Relu2FP8>;
using G2 = Grouped<cutlass_grouped::Tile128x256, cutlass_grouped::Cluster1x1, cutlass_grouped::CoopK,
                   cutlass_grouped::CoopE, cutlass_grouped::AlphaBF16>;

constexpr int kPrepThreads = 128;
// The setup kernel's most blocks: enough to write the slot map of the
// largest calls in a few passes.
constexpr int kPrepMaxBlocks = 1024;

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

// Scratch is the carve-up of one GEMM's workspace: per expert its problem
// shape, operand pointers, strides and alpha (with a pointer to it, which
// ptr-array alpha wants), then CUTLASS's workspace.
template <class G>
struct Scratch {
  typename G::GroupShape* shapes;
  const typename G::ElementIn** a;
  const typename G::ElementIn** b;
  typename G::ElementOut** d;
  typename G::StrideA* sa;
  typename G::StrideB* sb;
  typename G::StrideD* sd;
  float* alpha;
  const float** alpha_ptr;
  void* cutlass_ws;
  size_t total;
};

// hardware is what the kernels' persistent grids are sized by.
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

// arguments are G's grouped GEMM over the scratch at sc with the epilogue
// arguments fusion.
template <class G>
typename G::Gemm::Arguments arguments(const Scratch<G>& sc, int experts, const typename G::FusionArguments& fusion,
                                      const cutlass::KernelHardwareInfo& hw) {
  return G::arguments(experts, sc.shapes, nullptr, sc.a, sc.sa, sc.b, sc.sb, sc.d, sc.sd, fusion, hw);
}

// carve lays G's scratch out from base (null: only the size is wanted).
// CUTLASS's workspace size does not depend on the epilogue's arguments.
template <class G>
Scratch<G> carve(void* base, int experts, const cutlass::KernelHardwareInfo& hw) {
  Scratch<G> sc{};
  const size_t E = experts;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    uint8_t* at = static_cast<uint8_t*>(base) + off;
    off += align256(bytes);
    return at;
  };
  sc.shapes = reinterpret_cast<typename G::GroupShape*>(take(E * sizeof(typename G::GroupShape)));
  sc.a = reinterpret_cast<const typename G::ElementIn**>(take(E * sizeof(void*)));
  sc.b = reinterpret_cast<const typename G::ElementIn**>(take(E * sizeof(void*)));
  sc.d = reinterpret_cast<typename G::ElementOut**>(take(E * sizeof(void*)));
  sc.sa = reinterpret_cast<typename G::StrideA*>(take(E * sizeof(typename G::StrideA)));
  sc.sb = reinterpret_cast<typename G::StrideB*>(take(E * sizeof(typename G::StrideB)));
  sc.sd = reinterpret_cast<typename G::StrideD*>(take(E * sizeof(typename G::StrideD)));
  sc.alpha = reinterpret_cast<float*>(take(E * sizeof(float)));
  sc.alpha_ptr = reinterpret_cast<const float**>(take(E * sizeof(void*)));
  sc.cutlass_ws = take(G::Gemm::get_workspace_size(arguments(sc, experts, typename G::FusionArguments{}, hw)));
  sc.total = off;
  return sc;
}

// gemm1_ok and gemm2_ok say whether args are ones the kernels take
// (gemm_cutlass.h): the shapes and scale modes the rule checks, and the
// pipeline's layout of the operands.
bool gemm1_ok(const MoeGemmArgs& g) {
  return gemm1_cutlass_supported(g.k, g.n_out, g.w_mode, g.act) && g.epilogue == GemmEpilogue::kAct1FP8 &&
         !g.bias && !g.route.on && (!g.a_scale_rows || g.a_scale_ld == 1) && g.ld_out == g.n_out &&
         g.w_rows == g.n_out;
}
bool gemm2_ok(const MoeGemmArgs& g) {
  return gemm2_cutlass_supported(g.n_out, g.k, g.w_mode) && !g.a_scale_rows &&
         g.epilogue == GemmEpilogue::kWeightedBF16 && g.ld_out == g.n_out && g.w_rows == g.n_out;
}

// PrepParams are the setup kernel's inputs (the GEMMs' arguments: the
// alignment's arrays, operands and scales) and outputs, for GEMM1 where
// has1 and GEMM2 where has2.
struct PrepParams {
  MoeGemmArgs g1, g2;
  bool has1, has2;
  Scratch<G1> s1;
  Scratch<G2> s2;
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

// set_problem writes expert e's problem into G's scratch: rows sorted rows
// from row0 of A (k wide) into D (n wide), weights w [E, n, k] and alpha.
template <class G>
__device__ void set_problem(const Scratch<G>& sc, int e, int rows, size_t row0, int n, int k, const uint8_t* a,
                            const uint8_t* w, void* d, float alpha) {
  sc.shapes[e] = typename G::GroupShape{rows, n, k};
  sc.a[e] = reinterpret_cast<const typename G::ElementIn*>(a + row0 * k);
  sc.b[e] = reinterpret_cast<const typename G::ElementIn*>(w + size_t(e) * n * k);
  sc.d[e] = static_cast<typename G::ElementOut*>(d) + row0 * n;
  typename G::StrideA sa{};
  cute::get<0>(sa) = k;
  sc.sa[e] = sa;
  typename G::StrideB sb{};
  cute::get<0>(sb) = k;
  sc.sb[e] = sb;
  typename G::StrideD sd{};
  cute::get<0>(sd) = n;
  sc.sd[e] = sd;
  sc.alpha[e] = alpha;
  sc.alpha_ptr[e] = sc.alpha + e;
}

// cutlass_prep_kernel writes pair_row for every sorted row that holds a
// pair (grid-strided; GEMM2 only), and in block e (and e + gridDim.x, ...)
// expert e's problems: its rows are its blocks' rows less the padding,
// which only its last block has, after the pairs. GEMM1's activation scale
// is per tensor (gemm_cutlass.h): a_scale, or the one every row of
// a_scale_rows holds, read at the expert's first row.
__global__ void __launch_bounds__(kPrepThreads) cutlass_prep_kernel(PrepParams p) {
  pdl_wait();
  pdl_trigger();
  // Both GEMMs run over the one alignment.
  const MoeGemmArgs& g = p.has1 ? p.g1 : p.g2;
  const int nb = *g.num_blocks;
  const int BM = g.block_rows;
  const int rows_all = nb * BM;
  if (p.has2) {
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows_all; r += gridDim.x * blockDim.x) {
      const int pair = g.sorted_pairs[r];
      if (pair >= 0) p.pair_row[pair] = r;
    }
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
      if (p.has1) {
        const MoeGemmArgs& g1 = p.g1;
        const float a_scale = g1.a_scale_rows && rows > 0 ? g1.a_scale_rows[row0] : g1.a_scale;
        set_problem(p.s1, e, rows, row0, g1.n_out, g1.k, g1.a, g1.w, g1.out, a_scale * g1.w_scale[e]);
      }
      if (p.has2) {
        const MoeGemmArgs& g2 = p.g2;
        set_problem(p.s2, e, rows, row0, g2.n_out, g2.k, g2.a, g2.w, g2.out, g2.a_scale * g2.w_scale[e]);
      }
    }
  }
}

// run_grouped runs G's grouped GEMM over the scratch at workspace.
// Launched without programmatic dependent launch: the kernel does not wait
// on its predecessor's grid (CUTLASS leaves that out of the ptr-array
// kernels), so it must start after the setup kernel and the GEMM before it
// complete.
template <class G, class... P>
cudaError_t run_grouped(int experts, int device, void* workspace, cudaStream_t stream, P... fusion) {
  const cutlass::KernelHardwareInfo hw = hardware(device);
  if (hw.sm_count <= 0) return cudaErrorInvalidDevice;
  const Scratch<G> sc = carve<G>(workspace, experts, hw);
  const typename G::Gemm::Arguments args = arguments(sc, experts, G::fusion(sc.alpha_ptr, fusion...), hw);
  typename G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, sc.cutlass_ws, stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaSuccess;
}

}  // namespace

bool gemm1_cutlass_supported(int hidden, int inter, WScale w_mode, GemmAct act) {
  return act == GemmAct::kRelu2 && gemm2_cutlass_supported(hidden, inter, w_mode);
}

bool gemm2_cutlass_supported(int hidden, int inter, WScale w_mode) {
  return hidden % 16 == 0 && inter % 16 == 0 && w_mode == WScale::kPerExpert;
}

size_t gemm1_cutlass_workspace(int device, int num_experts) {
  return carve<G1>(nullptr, num_experts, hardware(device)).total;
}

size_t gemm2_cutlass_workspace(int device, int num_experts) {
  return carve<G2>(nullptr, num_experts, hardware(device)).total;
}

cudaError_t launch_cutlass_prep(const MoeGemmArgs* g1, void* workspace1, const MoeGemmArgs* g2, int32_t* pair_row,
                                void* workspace2, int device, cudaStream_t stream) {
  if ((!g1 && !g2) || (g1 && !gemm1_ok(*g1)) || (g2 && !gemm2_ok(*g2))) return cudaErrorInvalidValue;
  const cutlass::KernelHardwareInfo hw = hardware(device);
  if (hw.sm_count <= 0) return cudaErrorInvalidDevice;
  PrepParams pp{};
  pp.has1 = g1 != nullptr;
  pp.has2 = g2 != nullptr;
  if (g1) {
    pp.g1 = *g1;
    pp.s1 = carve<G1>(workspace1, g1->num_experts, hw);
  }
  if (g2) {
    pp.g2 = *g2;
    pp.s2 = carve<G2>(workspace2, g2->num_experts, hw);
    pp.pair_row = pair_row;
  }
  const MoeGemmArgs& g = g1 ? *g1 : *g2;
  if (g1 && g2 && (g1->num_experts != g2->num_experts || g1->num_blocks != g2->num_blocks)) return cudaErrorInvalidValue;
  const int grid = std::max(g.num_experts, std::min(kPrepMaxBlocks, (g.a_rows + kPrepThreads - 1) / kPrepThreads));
  return launch_kernel(g.pdl, cutlass_prep_kernel, grid, kPrepThreads, 0, stream, pp);
}

cudaError_t launch_gemm1_cutlass(const MoeGemmArgs& g, int device, void* workspace, cudaStream_t stream) {
  if (!gemm1_ok(g)) return cudaErrorInvalidValue;
  return run_grouped<G1>(g.num_experts, device, workspace, stream, g.out_inv_scale);
}

cudaError_t launch_gemm2_cutlass(const MoeGemmArgs& g, int device, void* workspace, cudaStream_t stream) {
  if (!gemm2_ok(g)) return cudaErrorInvalidValue;
  return run_grouped<G2>(g.num_experts, device, workspace, stream);
}

}  // namespace expertd
