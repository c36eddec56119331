// Hopper (sm_90a) PTX wrappers for the grouped GEMM (gemm_sm90.cu), one
// inline-asm statement each, named after the instruction they issue, in
// the spirit of CUTLASS's arch/ barrier and copy wrappers. The kernel
// reads as the pipeline it is (wait on a barrier, load a tile, issue the
// wgmmas) and each instruction's operand constraints are written once.
//
// The set:
//   shared-memory addresses  smem_addr
//   mbarriers                mbar_init, fence_mbar_init, mbar_expect_tx,
//                            mbar_arrive, mbar_wait
//   TMA (async proxy)        tma_load_2d/3d/5d, fence_proxy_async_smem
//   cp.async (gathers)       cp_async_4, cp_async_16_zfill,
//                            cp_async_mbar_arrive_noinc, cp_async_wait_all
//   warpgroup registers      setmaxnreg_dec<N>, setmaxnreg_inc<N>
//   named barriers           bar_sync_n<kId, kThreads>, bar_sync<kThreads>
//   wgmma                    wgmma_fence, wgmma_commit, wgmma_wait<N>,
//                            fence_acc, smem_desc
// The wgmma instructions themselves, one per token-tile width, are
// generated (wgmma_fp8.cuh). Programmatic dependent launch
// (griddepcontrol: pdl_wait, pdl_trigger) is in launch.cuh, since every
// kernel of the chain uses it on every card from sm_90 on.
//
// Every wrapper exists only in the sm_90a pass: the other targets compile
// the Hopper kernels to empty bodies (the library never launches them
// there).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace expertd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// smem_addr is p's address in the shared window, the form the
// shared::cta operands of the instructions below take.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbar_init sets up a barrier whose phase completes after count arrivals
// (and, once a thread has called mbar_expect_tx, that many TMA bytes).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
// fence_mbar_init makes the barriers' initialization visible to the async
// proxy (TMA) and the rest of the CTA; a __syncthreads follows it.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// mbar_expect_tx arrives on bar and adds bytes to the transaction count
// its current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// mbar_wait spins until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// tma_load_Nd copies the box of map at coordinates (c0 innermost, ...) to
// dst, completing its bytes on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                            int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                            int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5, %6, %7}], [%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// fence_proxy_async_smem orders this thread's generic-proxy shared-memory
// writes before later async-proxy (TMA) accesses to the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// cp_async_4 copies 4 bytes from global src to shared dst asynchronously
// (through L1).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// cp_async_16_zfill copies the first src_bytes (0 or 16) of 16 bytes from
// global src to shared dst asynchronously and zero-fills the rest; it
// bypasses L1 (.cg), since each byte is read once per stage. With
// src_bytes 0 nothing is read, but src must still be a global address.
__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
// cp_async_mbar_arrive_noinc arrives on bar once this thread's earlier
// cp.async copies have landed; the arrival counts against the barrier's
// expected count (noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// setmaxnreg_dec / setmaxnreg_inc move a warpgroup's register budget to
// kRegs per thread: producers give registers up, consumers take them.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// bar_sync_n waits at named barrier kId for kThreads threads; bar_sync
// takes the barrier's id at run time.
template <int kId, int kThreads>
__device__ __forceinline__ void bar_sync_n() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads));
}
template <int kThreads>
__device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kThreads));
}

// wgmma_fence orders register and shared-memory accesses before the
// wgmmas that follow; wgmma_commit closes a group of them; wgmma_wait<N>
// waits until at most N groups are in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// fence_acc keeps the compiler from moving reads or writes of the kRegs
// accumulators across it: the wgmmas write them asynchronously, so they
// are touched only between a wait and the next fence.
template <int kRegs>
__device__ __forceinline__ void fence_acc(float* acc) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// smem_desc is the shared-memory matrix descriptor for a K-major tile
// whose rows are 128 bytes, stored with the 128-byte swizzle TMA writes:
// 8-row core groups 1024 bytes apart. Stepping K by 32 bytes inside the
// row adds 2 to the start-address field; the hardware applies the swizzle
// to the sum.
__device__ __forceinline__ uint64_t smem_desc(const void* tile) {
  uint64_t addr = smem_addr(tile);
  uint64_t d = (addr & 0x3FFFF) >> 4;
  d |= uint64_t(1) << 16;           // leading byte offset (unused with swizzle)
  d |= uint64_t(1024 >> 4) << 32;   // stride byte offset: 8 rows x 128 B
  d |= uint64_t(1) << 62;           // 128-byte swizzle
  return d;
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace expertd
