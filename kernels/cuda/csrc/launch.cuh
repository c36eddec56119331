// Kernel launches with programmatic dependent launch (PDL, sm_90+).
//
// One FusedMoE call is a chain of dependent kernels on one stream (route,
// align, gather, GEMM1, requantize, GEMM2, combine). Launched plainly, each
// waits for its predecessor to drain and for the launch that follows;
// at decode sizes the kernels are a few microseconds each, so those gaps
// are a large share of the call. With PDL the next kernel is launched
// while its predecessor finishes and parks in pdl_wait until the
// predecessor's writes are visible. Every kernel of the chain starts with
// pdl_wait() and then pdl_trigger(): it touches no global memory before
// its predecessor is complete, so the ordering is the same as without PDL.
// CUDA graphs keep the programmatic edges when a stream is captured.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace expertd {

// pdl_wait blocks until the kernel launched before this one on the stream
// has completed and its memory operations are visible. A no-op without PDL
// and before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// pdl_trigger lets the next kernel on the stream launch once every block of
// this one has called it or exited.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// launch_kernel launches kernel<<<grid, block, smem, stream>>>(args...),
// allowing it to overlap its predecessor's tail when pdl is set (the set's
// card is sm_90 or later and the pdl option is on).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace expertd
