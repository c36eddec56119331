// Portable grouped FP8 GEMMs for fused MoE (any sm_80+ GPU, any K and N).
//
// One CTA computes TM sorted rows (one expert block) by 64 weight rows, with
// K streamed through shared memory in 64-byte slices, double-buffered with
// cp.async when rows are 16-byte aligned (K % 16 == 0) and with plain byte
// loads otherwise. Tails in K are zero-filled, so any K works; tails in N
// are masked at the store.
//
// The inner product is mma.sync m16n8k32 with E4M3 operands on cards that
// have it (sm_89+; here only sm_90 runs this cubin), or FP8 decoded to FP16
// (exact: every E4M3 value is an FP16 value) and mma.sync m16n8k16 on sm_80
// class cards. Both accumulate in FP32.
//
// Gated GEMM1 puts gate rows [c0, c0+32) and the matching up rows
// [N+c0, N+c0+32) in one 64-row weight tile, so the thread that holds gate
// accumulator (row, c) also holds up accumulator (row, c) and the SiLU-and-
// mul epilogue needs no shuffle.
//
// Block scales (kBlock): K is walked one scale block of block_k columns at
// a time, each in 64-byte stages whose bytes past the block's end are
// zero-filled, so the mma accumulators hold exactly that block's partial
// product; after its last stage each is added into an FP32 total times
// a_scale(row, block) * w_scale(row block, block), as kernels/cpu does per
// segment. A block_k that is not a multiple of 64 wastes the zero-filled
// part of its last stage; one that is not a multiple of 16 also takes the
// byte loads. Per-channel scales run as blocks of one weight row by all of
// K: one K block, so the same single scaling at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "launch.cuh"
#include "moe_gemm.h"

namespace expertd {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWRows = 64;     // weight rows per CTA
constexpr int kBK = 64;        // K bytes per stage
constexpr int kPitch = kBK + 16;  // smem row pitch: 20 words, conflict-free fragment loads

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // src-size 0 zero-fills the 16 bytes
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mma_e4m3 is D += A(16x32 e4m3, row) * B(32x8 e4m3, col).
__device__ __forceinline__ void mma_e4m3(float* d, const uint32_t* a, const uint32_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // Never launched: the dispatcher picks the FP16 path below sm_89.
  __trap();
#endif
}

// mma_f16 is D += A(16x16 f16, row) * B(16x8 f16, col).
__device__ __forceinline__ void mma_f16(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// fp8x2_to_half2 decodes two E4M3 bytes (low byte first) to a packed half2.
__device__ __forceinline__ uint32_t fp8x2_to_half2(const uint8_t* p) {
  const __nv_fp8x2_storage_t v = *reinterpret_cast<const uint16_t*>(p);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// store_out writes one finished output element in the epilogue's format.
template <GemmEpilogue kEpi>
__device__ __forceinline__ void store_out(const MoeGemmArgs& p, size_t idx, float v) {
  if (kEpi == GemmEpilogue::kAct1FP8) {
    static_cast<uint8_t*>(p.out)[idx] = __nv_cvt_float_to_fp8(v * p.out_inv_scale, __NV_SATFINITE, __NV_E4M3);
  } else if (kEpi == GemmEpilogue::kAct1F32) {
    static_cast<float*>(p.out)[idx] = v;
  } else {
    static_cast<__nv_bfloat16*>(p.out)[idx] = __float2bfloat16_rn(v);
  }
}

template <int TM, bool kGated, GemmEpilogue kEpi, bool kF16, bool kVec, bool kBlock>
__global__ void __launch_bounds__(kThreads) moe_gemm_portable_kernel(const MoeGemmArgs p) {
  pdl_wait();
  pdl_trigger();
  const int blk = blockIdx.y;
  if (blk >= *p.num_blocks) return;
  const int expert = p.block_expert[blk];
  if (expert < 0 || expert >= p.num_experts) return;

  // Output channels this CTA covers: 32 gated (gate+up fill 64 rows), else 64.
  constexpr int kOC = kGated ? kWRows / 2 : kWRows;
  const int c0 = blockIdx.x * kOC;

  __shared__ __align__(16) uint8_t a_s[2][TM][kPitch];
  __shared__ __align__(16) uint8_t w_s[2][kWRows][kPitch];

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int k = p.k;
  const uint8_t* wexp = p.w + size_t(expert) * p.w_rows * k;
  const uint8_t* arow0 = p.a + size_t(blk) * TM * k;

  // Weight row of tile row r, or -1 past the end of the channels.
  auto w_row = [&](int r) -> int {
    if (kGated) {
      const int c = c0 + (r & 31);
      if (c >= p.n_out) return -1;
      return r < 32 ? c : p.n_out + c;
    }
    const int c = c0 + r;
    return c < p.w_rows ? c : -1;
  };

  // Stage it covers K columns [k0, k0 + kBK) of its scale block, which ends
  // at kend (K itself outside block mode).
  const int bk = kBlock ? p.block_k : k;
  const int spb = (bk + kBK - 1) / kBK;  // stages per K block
  const int nkb = kBlock ? (k + bk - 1) / bk : 1;
  auto stage_cols = [&](int it, int& k0, int& kend) {
    if (!kBlock) {
      k0 = it * kBK;
      kend = k;
      return;
    }
    const int kb = it / spb;
    k0 = kb * bk + (it - kb * spb) * kBK;
    kend = min(kb * bk + bk, k);
  };

  auto load_stage = [&](int stage, int it) {
    int k0, kend;
    stage_cols(it, k0, kend);
    if (kVec) {
      // 16-byte chunks: 4 per row.
      for (int i = tid; i < kWRows * 4; i += kThreads) {
        const int r = i / 4, ch = i % 4;
        const int wr = w_row(r);
        const int kk = k0 + ch * 16;
        const bool ok = wr >= 0 && kk < kend;
        cp_async16(&w_s[stage][r][ch * 16], ok ? wexp + size_t(wr) * k + kk : p.w, ok);
      }
      for (int i = tid; i < TM * 4; i += kThreads) {
        const int r = i / 4, ch = i % 4;
        const int kk = k0 + ch * 16;
        const bool ok = kk < kend;
        cp_async16(&a_s[stage][r][ch * 16], ok ? arow0 + size_t(r) * k + kk : p.a, ok);
      }
    } else {
      // Unaligned rows: bytes, zero past K. Slow but only for odd shapes.
      for (int i = tid; i < kWRows * kBK; i += kThreads) {
        const int r = i / kBK, c = i % kBK;
        const int wr = w_row(r);
        const int kk = k0 + c;
        w_s[stage][r][c] = (wr >= 0 && kk < kend) ? wexp[size_t(wr) * k + kk] : 0;
      }
      for (int i = tid; i < TM * kBK; i += kThreads) {
        const int r = i / kBK, c = i % kBK;
        const int kk = k0 + c;
        a_s[stage][r][c] = kk < kend ? arow0[size_t(r) * k + kk] : 0;
      }
    }
  };

  // Warp w owns two 8-row weight slices: gate/up pair for gated, else two
  // adjacent slices.
  const int o0 = kGated ? 8 * warp : 16 * warp;
  const int o1 = kGated ? 32 + 8 * warp : 16 * warp + 8;

  // acc is the mma accumulator; in block mode it holds one K block's partial
  // product and tot the scaled sum of the finished blocks.
  float acc[TM / 16][2][4];
  float tot[TM / 16][2][4];
#pragma unroll
  for (int mi = 0; mi < TM / 16; ++mi)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][j][c] = tot[mi][j][c] = 0.f;

  // Block mode: where this thread's four weight rows (j, column pair cc of
  // the mma tile) find their scales, w_scale[wso[j][cc] + kblock], or -1
  // past the last channel.
  int wso[2][2];
  if (kBlock) {
    const int nrb = (p.w_rows + p.block_n - 1) / p.block_n;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        int row;
        if (kGated) {
          const int ch = c0 + 8 * warp + t * 2 + cc;
          row = ch < p.n_out ? (j == 0 ? ch : p.n_out + ch) : -1;
        } else {
          const int ch = c0 + (j == 0 ? o0 : o1) + t * 2 + cc;
          row = ch < p.w_rows ? ch : -1;
        }
        wso[j][cc] = row < 0 ? -1 : (expert * nrb + row / p.block_n) * nkb;
      }
  }

  const int nk = nkb * spb;
  load_stage(0, 0);
  cp_async_commit();
  for (int it = 0; it < nk; ++it) {
    const int s = it & 1;
    if (it + 1 < nk) {
      load_stage(s ^ 1, it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 32) {
      if (!kF16) {
        uint32_t b[2][2];
        b[0][0] = *reinterpret_cast<const uint32_t*>(&w_s[s][o0 + g][kk + t * 4]);
        b[0][1] = *reinterpret_cast<const uint32_t*>(&w_s[s][o0 + g][kk + 16 + t * 4]);
        b[1][0] = *reinterpret_cast<const uint32_t*>(&w_s[s][o1 + g][kk + t * 4]);
        b[1][1] = *reinterpret_cast<const uint32_t*>(&w_s[s][o1 + g][kk + 16 + t * 4]);
#pragma unroll
        for (int mi = 0; mi < TM / 16; ++mi) {
          uint32_t a[4];
          a[0] = *reinterpret_cast<const uint32_t*>(&a_s[s][mi * 16 + g][kk + t * 4]);
          a[1] = *reinterpret_cast<const uint32_t*>(&a_s[s][mi * 16 + g + 8][kk + t * 4]);
          a[2] = *reinterpret_cast<const uint32_t*>(&a_s[s][mi * 16 + g][kk + 16 + t * 4]);
          a[3] = *reinterpret_cast<const uint32_t*>(&a_s[s][mi * 16 + g + 8][kk + 16 + t * 4]);
          mma_e4m3(acc[mi][0], a, b[0]);
          mma_e4m3(acc[mi][1], a, b[1]);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < 32; ks += 16) {
          const int kb = kk + ks;
          uint32_t b[2][2];
          b[0][0] = fp8x2_to_half2(&w_s[s][o0 + g][kb + t * 2]);
          b[0][1] = fp8x2_to_half2(&w_s[s][o0 + g][kb + 8 + t * 2]);
          b[1][0] = fp8x2_to_half2(&w_s[s][o1 + g][kb + t * 2]);
          b[1][1] = fp8x2_to_half2(&w_s[s][o1 + g][kb + 8 + t * 2]);
#pragma unroll
          for (int mi = 0; mi < TM / 16; ++mi) {
            uint32_t a[4];
            a[0] = fp8x2_to_half2(&a_s[s][mi * 16 + g][kb + t * 2]);
            a[1] = fp8x2_to_half2(&a_s[s][mi * 16 + g + 8][kb + t * 2]);
            a[2] = fp8x2_to_half2(&a_s[s][mi * 16 + g][kb + 8 + t * 2]);
            a[3] = fp8x2_to_half2(&a_s[s][mi * 16 + g + 8][kb + 8 + t * 2]);
            mma_f16(acc[mi][0], a, b[0]);
            mma_f16(acc[mi][1], a, b[1]);
          }
        }
      }
    }
    if (kBlock && (it + 1) % spb == 0) {
      // The last stage of K block kb: scale its partial product into tot.
      const int kb = it / spb;
      float ws[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) ws[j][cc] = wso[j][cc] >= 0 ? p.w_scale[wso[j][cc] + kb] : 0.f;
#pragma unroll
      for (int mi = 0; mi < TM / 16; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int srow = blk * TM + mi * 16 + g + 8 * h;
          const float as = p.a_scale_rows ? p.a_scale_rows[size_t(srow) * p.a_scale_ld + kb] : p.a_scale;
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
              tot[mi][j][2 * h + cc] += acc[mi][j][2 * h + cc] * (as * ws[j][cc]);
              acc[mi][j][2 * h + cc] = 0.f;
            }
        }
    }
    __syncthreads();
  }
  if (kBlock) {
    // The scales are applied: the epilogue below multiplies by 1 (or the
    // router weight).
#pragma unroll
    for (int mi = 0; mi < TM / 16; ++mi)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mi][j][c] = tot[mi][j][c];
  }

  // Epilogue straight from registers: accumulator c of tile (mi, j) sits at
  // row mi*16 + g + 8*(c/2), column t*2 + c%2 of the tile's 8 channels.
  const float ws = kBlock ? 1.f : p.w_scale[expert];
  const float* bias = kEpi != GemmEpilogue::kWeightedBF16 && p.bias ? p.bias + size_t(expert) * p.w_rows : nullptr;
#pragma unroll
  for (int mi = 0; mi < TM / 16; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int srow = blk * TM + mi * 16 + g + 8 * h;
      const int pair = p.sorted_pairs[srow];
      if (pair < 0) continue;
      float sc = kBlock ? 1.f : (p.a_scale_rows ? p.a_scale_rows[srow] : p.a_scale) * ws;
      if (kEpi == GemmEpilogue::kWeightedBF16) sc *= p.pair_weight[pair];
      const size_t orow = kEpi == GemmEpilogue::kWeightedBF16 ? size_t(pair) : size_t(srow);
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int c = 2 * h + cc;
        if (kGated) {
          const int ch = c0 + 8 * warp + t * 2 + cc;
          if (ch >= p.n_out) continue;
          const float v = gemm1_act(p.act, bias, p.n_out, ch, acc[mi][0][c] * sc, acc[mi][1][c] * sc, p.swiglu_limit,
                                    p.swiglu_alpha);
          store_out<kEpi>(p, orow * p.ld_out + ch, v);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int ch = c0 + (j == 0 ? o0 : o1) + t * 2 + cc;
            if (ch >= p.n_out) continue;
            float v = acc[mi][j][c] * sc;
            if (kEpi != GemmEpilogue::kWeightedBF16) {
              // kRelu2, the one non-gated activation, as a constant: the
              // gated ones' math would cost this kernel registers.
              v = gemm1_act(GemmAct::kRelu2, bias, p.n_out, ch, v, 0.f, 0.f, 0.f);
            }
            store_out<kEpi>(p, orow * p.ld_out + ch, v);
          }
        }
      }
    }
  }
}

template <int TM, bool kGated, GemmEpilogue kEpi, bool kBlock>
cudaError_t launch_cfg(const MoeGemmArgs& a, bool f16, cudaStream_t stream) {
  constexpr int kOC = kGated ? kWRows / 2 : kWRows;
  const dim3 grid((a.n_out + kOC - 1) / kOC, a.max_blocks);
  // 16-byte copies need every stage to start and end on 16-byte boundaries:
  // K and, in block mode, the K blocks.
  const bool vec = a.k % 16 == 0 && (!kBlock || a.block_k % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(a.w) % 16) == 0 && (reinterpret_cast<uintptr_t>(a.a) % 16) == 0;
  auto kernel = f16 ? (vec ? moe_gemm_portable_kernel<TM, kGated, kEpi, true, true, kBlock>
                            : moe_gemm_portable_kernel<TM, kGated, kEpi, true, false, kBlock>)
                      : (vec ? moe_gemm_portable_kernel<TM, kGated, kEpi, false, true, kBlock>
                             : moe_gemm_portable_kernel<TM, kGated, kEpi, false, false, kBlock>);
  const cudaError_t err = launch_kernel(a.pdl, kernel, grid, kThreads, 0, stream, a);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <bool kGated, GemmEpilogue kEpi, bool kBlock>
cudaError_t launch_tm(const MoeGemmArgs& a, bool f16, cudaStream_t s) {
  switch (a.block_rows) {
    case 16:
      return launch_cfg<16, kGated, kEpi, kBlock>(a, f16, s);
    case 32:
      return launch_cfg<32, kGated, kEpi, kBlock>(a, f16, s);
    case 64:
      return launch_cfg<64, kGated, kEpi, kBlock>(a, f16, s);
  }
  return cudaErrorInvalidValue;
}

// launch_epi picks the kernel for one epilogue. Per-channel scales run as
// the block kernel with blocks of one row by all of K.
template <GemmEpilogue kEpi>
cudaError_t launch_epi(MoeGemmArgs a, bool gated, bool f16, cudaStream_t s) {
  if (a.w_mode == WScale::kPerChannel) {
    a.w_mode = WScale::kBlock;
    a.block_n = 1;
    a.block_k = a.k;
    a.a_scale_ld = 1;
  }
  if (a.w_mode == WScale::kPerExpert) {
    return gated ? launch_tm<true, kEpi, false>(a, f16, s) : launch_tm<false, kEpi, false>(a, f16, s);
  }
  return gated ? launch_tm<true, kEpi, true>(a, f16, s) : launch_tm<false, kEpi, true>(a, f16, s);
}

bool args_ok(const MoeGemmArgs& a) {
  if (a.w_mode == WScale::kBlock) {
    if (a.block_n < 1 || a.block_k < 1) return false;
    if (a.a_scale_rows && a.a_scale_ld < (a.k + a.block_k - 1) / a.block_k) return false;
  } else if (a.w_mode != WScale::kPerExpert && a.w_mode != WScale::kPerChannel) {
    return false;
  }
  return a.w && a.a && a.out && a.block_expert && a.num_blocks && a.sorted_pairs && a.w_scale &&
         a.k > 0 && a.n_out > 0 && a.max_blocks > 0 && a.num_experts > 0 &&
         a.a_rows >= a.max_blocks * a.block_rows;
}

}  // namespace

int portable_block_rows(int m, int top_k, int num_experts) {
  const int per_expert = mean_rows_per_expert(m, top_k, num_experts);
  if (per_expert <= 16) return 16;
  if (per_expert <= 32) return 32;
  return 64;
}

cudaError_t launch_gemm1_portable(const MoeGemmArgs& a, bool use_f16, cudaStream_t stream) {
  if (!args_ok(a)) return cudaErrorInvalidValue;
  const bool gated = gemm_act_gated(a.act);
  if (a.w_rows != (gated ? 2 * a.n_out : a.n_out)) return cudaErrorInvalidValue;
  switch (a.epilogue) {
    case GemmEpilogue::kAct1FP8:
      return launch_epi<GemmEpilogue::kAct1FP8>(a, gated, use_f16, stream);
    case GemmEpilogue::kAct1F32:
      return launch_epi<GemmEpilogue::kAct1F32>(a, gated, use_f16, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_gemm2_portable(const MoeGemmArgs& a, bool use_f16, cudaStream_t stream) {
  if (!args_ok(a) || a.epilogue != GemmEpilogue::kWeightedBF16 || !a.pair_weight ||
      a.w_rows != a.n_out) {
    return cudaErrorInvalidValue;
  }
  return launch_epi<GemmEpilogue::kWeightedBF16>(a, false, use_f16, stream);
}

}  // namespace expertd
