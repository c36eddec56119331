// Routing device code, one warp a token (route_token): shared by the
// routing kernels (moe_kernels.cuh) and the Hopper GEMM1, which routes a
// one-token call itself (gemm_sm90.cu, DecodeRoute). Semantics follow
// kernels/cpu/routing.go, which follows MOE_SPEC.md section 1.
#pragma once

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>

#include "moe_gemm.h"

namespace expertd {

// load_elem reads element i of a row of dtype dt (1 FP32, 2 BF16) as float.
__device__ __forceinline__ float load_float(const void* p, size_t i, int dt) {
  if (dt == 2) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// better says whether score a beats b: NaN loses to everything (also NaN).
__device__ __forceinline__ bool better(float a, float b) {
  if (isnan(a)) return false;
  if (isnan(b)) return true;
  return a > b;
}

// warp_argbest reduces (value, index) candidates over a warp: the better
// value wins, ties (and NaN against NaN) go to the lower index, index -1 is
// no candidate.
__device__ __forceinline__ void warp_argbest(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, off);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, off);
    const bool take = i < 0 || (i2 >= 0 && (better(v2, v) || (!better(v, v2) && i2 < i)));
    if (take) {
      v = v2;
      i = i2;
    }
  }
}

// warp_pick (a whole warp) marks and returns the best unmarked of v[0, n)
// in better()'s order, ties to the lower index, or -1 when every one is
// marked.
__device__ __forceinline__ int warp_pick(const float* v, uint8_t* marked, int n) {
  const int lane = threadIdx.x % 32;
  float bv = NAN;
  int bi = -1;
  for (int i = lane; i < n; i += 32) {
    if (marked[i]) continue;
    if (bi < 0 || better(v[i], bv)) {
      bv = v[i];
      bi = i;
    }
  }
  warp_argbest(bv, bi);
  if (lane == 0 && bi >= 0) marked[bi] = 1;
  __syncwarp();
  return bi;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// kRouteKeysPerLane bounds the experts (32 per key) whose top-k selection
// runs on warp reductions of register keys; larger E takes the
// shared-memory scan.
constexpr int kRouteKeysPerLane = 16;

// select_key maps a selection score to an unsigned key whose order is
// better()'s: larger floats give larger keys, every NaN gives 1 (below
// every number, equal to each other), and 0 is left for "no candidate".
// -0 is folded into +0 first, since better() finds them equal.
__device__ __forceinline__ unsigned select_key(float v) {
  if (isnan(v)) return 1u;
  const unsigned u = __float_as_uint(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// route_smem_per_warp is route_kernel's shared memory per warp, rounded so
// every warp's float arrays stay aligned.
__host__ __device__ inline size_t route_smem_per_warp(int e) { return (size_t(e) * 14 + 15) & ~size_t(15); }

// route_token routes token tok with one warp; base is the warp's
// route_smem_per_warp(E) bytes of shared memory.
__device__ __forceinline__ void route_token(const RouteParams& p, const void* logits, const float* bias, int tok,
                                            uint8_t* base, int32_t* ids, float* weights) {
  const int lane = threadIdx.x % 32;
  const int E = p.e;
  float* score = reinterpret_cast<float*>(base);
  float* sel = score + E;
  float* group = sel + E;
  uint8_t* taken = reinterpret_cast<uint8_t*>(group + E);
  uint8_t* keep = taken + E;

  const size_t row = size_t(tok) * E;
  if (p.scoring == 2) {
    for (int i = lane; i < E; i += 32) {
      const float x = load_float(logits, row + i, p.logits_dtype);
      score[i] = 1.0f / (1.0f + expf(-x));
    }
  } else {
    float mx = -INFINITY;
    for (int i = lane; i < E; i += 32) mx = fmaxf(mx, load_float(logits, row + i, p.logits_dtype));
    mx = warp_max(mx);
    if (mx == -INFINITY) {
      // Every expert masked (the service refuses such a row, but device
      // logits go unscanned): score 0 like the CPU backend, never 0/0.
      // mx is warp-uniform, so the whole warp takes this branch.
      for (int i = lane; i < E; i += 32) score[i] = 0.f;
    } else {
      float sum = 0.f;
      for (int i = lane; i < E; i += 32) {
        const float v = expf(load_float(logits, row + i, p.logits_dtype) - mx);
        score[i] = v;
        sum += v;
      }
      sum = warp_sum(sum);
      const float inv = 1.0f / sum;
      for (int i = lane; i < E; i += 32) score[i] *= inv;
    }
  }
  for (int i = lane; i < E; i += 32) {
    sel[i] = score[i] + (bias ? bias[i] : 0.f);
    taken[i] = 0;
  }
  __syncwarp();

  if (p.num_groups > 1) {
    const int G = p.num_groups, size = E / G;
    for (int gi = lane; gi < G; gi += 32) {
      float a = NAN, b = NAN;
      for (int i = gi * size; i < (gi + 1) * size; ++i) {
        const float x = sel[i];
        if (better(x, a)) {
          b = a;
          a = x;
        } else if (better(x, b)) {
          b = x;
        }
      }
      group[gi] = size == 1 ? a : a + b;
      keep[gi] = 0;
    }
    __syncwarp();
    for (int r = 0; r < p.topk_groups; ++r) warp_pick(group, keep, G);
    for (int i = lane; i < E; i += 32) {
      if (!keep[i / size]) taken[i] = 1;
    }
    __syncwarp();
  }

  float sum = 0.f;
  int my_id = -1;  // lane j keeps slot j's id
  if (E <= 32 * kRouteKeysPerLane) {
    // Each lane holds the selection keys of experts lane, lane + 32, ...
    // in registers (0 where taken); a round is a lane-local best, then
    // one warp max of the keys and one warp min of the ids that have it.
    unsigned key[kRouteKeysPerLane];
#pragma unroll
    for (int q = 0; q < kRouteKeysPerLane; ++q) {
      const int i = q * 32 + lane;
      key[q] = i < E && !taken[i] ? select_key(sel[i]) : 0u;
    }
    for (int j = 0; j < p.top_k; ++j) {
      unsigned kb = 0;
      int ib = INT_MAX;
#pragma unroll
      for (int q = 0; q < kRouteKeysPerLane; ++q) {
        if (key[q] > kb) {  // strict: among equal keys the lower id stays
          kb = key[q];
          ib = q * 32 + lane;
        }
      }
      const unsigned best = __reduce_max_sync(0xffffffffu, kb);
      int bi = int(__reduce_min_sync(0xffffffffu, kb == best && best != 0u ? unsigned(ib) : unsigned(INT_MAX)));
      if (bi >= E) bi = 0;  // unreachable: the Go side checks top_k against the kept experts
      const bool mine = bi % 32 == lane;
#pragma unroll
      for (int q = 0; q < kRouteKeysPerLane; ++q) {
        key[q] = mine && q == bi / 32 ? 0u : key[q];
      }
      sum += score[bi];
      if (lane == j) my_id = bi;
    }
  } else {
    for (int j = 0; j < p.top_k; ++j) {
      int bi = warp_pick(sel, taken, E);
      if (bi < 0) bi = 0;  // unreachable: the Go side checks top_k against the kept experts
      sum += score[bi];
      if (lane == j) my_id = bi;
    }
  }
  if (lane < p.top_k) {
    float w = score[my_id];
    if (p.renormalize && sum > 0.f) w /= sum;
    ids[size_t(tok) * p.top_k + lane] = my_id;
    weights[size_t(tok) * p.top_k + lane] = w * p.scaling;
  }
}

}  // namespace expertd
