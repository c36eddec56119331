// tool_common.cuh: what the GEMM tools (gemm_sm90_check, cutlass_grouped_bench)
// share: error checks, FP8 decoding and random FP8 data, list parsing.
#pragma once
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

static __device__ float fp8f(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return float(v);
}

// fill_fp8 writes FP8 codes of N(0, sd) values from a counter-based hash, on
// the GPU: generating a Nemotron layer's 1.3 G weights on the host takes
// longer than the whole check.
static __global__ void fill_fp8(uint8_t* p, size_t n, uint32_t seed, float sd) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  float u1 = ((x & 0xFFFFFF) + 1) * (1.f / 16777217.f), u2 = ((x >> 24) & 0xFFFFFF) * (1.f / 16777216.f);
  float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
  p[i] = __nv_fp8_e4m3(z * sd).__x;
}

// split parses a comma-separated list (an environment variable's value, or
// dflt where it is unset).
inline std::vector<std::string> split(const char* list, const char* dflt) {
  std::vector<std::string> out;
  std::string v = list ? list : dflt, cur;
  for (char ch : v + ",") {
    if (ch == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  return out;
}
