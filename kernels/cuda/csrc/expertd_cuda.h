/* expertd_cuda.h: the C ABI of libexpertd_cuda.so, expertd's fused-MoE GPU
 * kernels.
 *
 * The ABI is plain C: ints, floats, uint64 handles, pointers and three
 * structs passed by pointer (expertd_options, expertd_set_params,
 * expertd_call), each starting with its size and the ABI version so that a
 * caller built against another header is refused instead of misread. No callbacks. Host pointers passed
 * in are read (or written) only during the call and never retained. Every
 * function returns an EXPERTD_* code; on failure expertd_last_error()
 * describes the failure for the calling thread. Nothing here exits or
 * aborts.
 *
 * The Go mirror is kernels/cuda/abi.go; abi_test.go checks that every
 * #define below has the same value there and that the Go structs have the
 * layout of the C ones (field order, offsets, sizes). Bump
 * EXPERTD_ABI_VERSION on any change to a signature, a struct or a
 * constant's meaning.
 */
#ifndef EXPERTD_CUDA_H_
#define EXPERTD_CUDA_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with hidden visibility; only these are exported. */
#if defined(__GNUC__)
#define EXPERTD_API __attribute__((visibility("default")))
#else
#define EXPERTD_API
#endif

#define EXPERTD_ABI_VERSION 5

/* Return codes. */
#define EXPERTD_OK 0
#define EXPERTD_ERR_INVALID 1     /* bad argument */
#define EXPERTD_ERR_UNSUPPORTED 2 /* valid, but this library cannot run it */
#define EXPERTD_ERR_OOM 3         /* device or pinned host allocation failed */
#define EXPERTD_ERR_CUDA 4        /* a CUDA call failed */
#define EXPERTD_ERR_NO_DEVICE 5   /* no usable GPU, or the ordinal is out of range */
#define EXPERTD_ERR_NOT_FOUND 6   /* unknown expert-set handle */

/* Element types; the values are kernels.DType's (and expertd.v1.DataType's). */
#define EXPERTD_DTYPE_FLOAT32 1
#define EXPERTD_DTYPE_BFLOAT16 2
#define EXPERTD_DTYPE_FLOAT8_E4M3FN 4

/* Activations and scorings; the values are kernels.Activation's and
 * kernels.Scoring's. */
#define EXPERTD_ACT_SILU_GATED 1
#define EXPERTD_ACT_RELU2 2
#define EXPERTD_ACT_SWIGLU_OAI 3      /* gpt-oss's clamped SwiGLU; gate rows first here (see set_params) */
#define EXPERTD_ACT_GELU_TANH_GATED 4 /* gelu_tanh(gate) * up */
#define EXPERTD_ACT_GELU_GATED 5      /* erf gelu(gate) * up */
#define EXPERTD_SCORING_SOFTMAX 1
#define EXPERTD_SCORING_SIGMOID 2

/* GEMM implementation choice (expertd_call.gemm). AUTO is sm90 where the
 * card and shape allow it, else portable; the others force a path (tests
 * compare them). SM90 on a card or shape without it is UNSUPPORTED. */
#define EXPERTD_GEMM_AUTO 0
#define EXPERTD_GEMM_PORTABLE 1     /* mma.sync e4m3 in the sm_90a cubin, else FP16 mma */
#define EXPERTD_GEMM_PORTABLE_F16 2 /* FP8 decoded to FP16 mma (the sm_80 path) */
#define EXPERTD_GEMM_SM90 3         /* wgmma + TMA (sm_90a builds only) */

/* Where a buffer's bytes are (expertd_buf.mem). UNKNOWN lets the library
 * ask the driver (cudaPointerGetAttributes, about a microsecond); a caller
 * that knows says so and saves the question. A wrong answer is the
 * caller's bug: device memory called host memory is a crash. */
#define EXPERTD_MEM_UNKNOWN 0
#define EXPERTD_MEM_PAGEABLE 1 /* ordinary host memory */
#define EXPERTD_MEM_PINNED 2   /* page-locked host memory (expertd_host_register) */
#define EXPERTD_MEM_DEVICE 3   /* device memory (expertd_ipc_open, expertd_dev_alloc) */

/* Limits of this build. */
#define EXPERTD_MAX_EXPERTS 1024
#define EXPERTD_MAX_TOP_K 32
#define EXPERTD_MAX_STREAMS 16 /* expertd_init's streams per set */

/* Bytes in a CUDA IPC handle (cudaIpcMemHandle_t). */
#define EXPERTD_IPC_HANDLE_BYTES 64

/* expertd_buf is one tensor of a call: its address (NULL: absent), its
 * element type where the call lets it vary (else 0) and where it lives. */
typedef struct expertd_buf {
  void* data;
  int32_t dtype; /* EXPERTD_DTYPE_* */
  int32_t mem;   /* EXPERTD_MEM_* */
} expertd_buf;

/* expertd_call is one fused MoE call. expertd_call_init fills in size and
 * version and zeroes the rest; a zero field is its default.
 *
 * hidden is [M, K] of hidden.dtype (FP8, BF16 or FP32); hidden_scale has
 * n_hidden_scale floats (FP8 hidden only, else absent): [1], [M] or, for
 * block sets, [M, ceil(K/block_k)] row-major. FP8 hidden with no scale uses
 * the static a13_scale, else 1. Either logits [M, E] of logits.dtype (FP32
 * or BF16), with correction_bias [E] floats or absent, or topk_ids_in
 * (int32) and topk_weights_in (float) [M, top_k] are given. out is [M, K]
 * of out.dtype (BF16 or FP32); topk_ids_out, topk_weights_out [M, top_k]
 * and kernel_ms (the device time of the pipeline, one float, host memory)
 * may be absent. */
typedef struct expertd_call {
  uint32_t size;    /* sizeof(expertd_call) */
  uint32_t version; /* EXPERTD_ABI_VERSION */
  int32_t m;        /* tokens, >= 1 */
  int32_t top_k;
  int32_t renormalize; /* 0 or 1 */
  int32_t scoring;     /* EXPERTD_SCORING_*; logits only */
  int32_t num_groups;  /* 0 or 1: no grouping */
  int32_t topk_groups;
  int32_t gemm;      /* EXPERTD_GEMM_* */
  int32_t use_graph; /* 1: capture and replay a CUDA graph per (set, call shape) */
  float routed_scaling_factor; /* > 0; 0 means 1 */
  int32_t n_hidden_scale;
  expertd_buf hidden;
  expertd_buf hidden_scale;
  expertd_buf logits;
  expertd_buf correction_bias;
  expertd_buf topk_ids_in;
  expertd_buf topk_weights_in;
  expertd_buf out;
  expertd_buf topk_ids_out;
  expertd_buf topk_weights_out;
  float* kernel_ms;
  uint64_t stream; /* expertd_moe_device: a cudaStream_t; 0 is the legacy default stream */
} expertd_call;

#define EXPERTD_CALL_BYTES 208
#define EXPERTD_BUF_BYTES 16

/* expertd_options are the library's switches, given at expertd_init.
 * expertd_options_default fills in size, version and the defaults (noted
 * below); the daemon sets each from its configuration. */
typedef struct expertd_options {
  uint32_t size;    /* sizeof(expertd_options) */
  uint32_t version; /* EXPERTD_ABI_VERSION */
  int32_t streams;  /* calls on one set at once, 1..EXPERTD_MAX_STREAMS (2) */
  int32_t pdl;      /* 1: programmatic dependent launch on sm_90+ (1) */
  int32_t sm90_block;      /* 1: AUTO runs block-scaled sets on the sm90 GEMM (1) */
  int32_t sm90_persistent; /* 1: persistent sm90 grid; 0: one CTA per tile (1) */
  int32_t sm90_toka;       /* 1: tokens on wgmma's M side for 128-token block tiles (1) */
  int32_t poison;          /* 1: NaN-fill outputs and intermediates before each run (0; tests) */
  int32_t host_trace;      /* 1: print each host-path call's stage times to stderr (0) */
  int32_t sync_spin_us;    /* host path: poll completion this long before blocking, 0..EXPERTD_MAX_SPIN_US (0) */
  int32_t sm90_pair;       /* 1: two 128-row blocks of one expert run as one 256-token sm90 tile (0) */
} expertd_options;

#define EXPERTD_OPTIONS_BYTES 44
#define EXPERTD_MAX_SPIN_US 10000

/* expertd_set_params describes one MoE layer for expertd_set_create.
 * expertd_set_params_init fills in size, version and the defaults (noted
 * below) and zeroes the rest. Every pointer is host memory, read during
 * expertd_set_create only.
 *
 * w13 is FP8 [E, rows1, K] with rows1 = 2N (the gated activations: gate
 * rows [0, N), up rows [N, 2N), for SWIGLU_OAI too, whose interleaved
 * checkpoint rows the caller reorders) or N (RELU2); w2 is FP8 [E, K, N].
 *
 * block_n = block_k = 0: no block mode. n_w13_scale is 1 (per-tensor), E
 * (per-expert) or E*rows1 (per-channel: one per w13 row, [E, rows1]);
 * n_w2_scale is 1, E or E*K ([E, K]). Activations are quantized per token
 * (or with the static scale).
 *
 * block_n, block_k > 0: block mode (DeepSeek-V3 style, usually 128, 128).
 * w13_scale is [E, ceil(rows1/block_n), ceil(K/block_k)] and w2_scale
 * [E, ceil(K/block_n), ceil(N/block_k)], row-major; n_w13_scale and
 * n_w2_scale must be those element counts. Activations are quantized per
 * (token, group of block_k) and the GEMMs apply the scales per K block.
 * Per-channel scales are block scales with block_n = 1 (repeat each row's
 * value over its K blocks); per-tensor/per-expert ones are constant blocks.
 * The portable GEMM takes any block_k (multiples of 16 run its vector
 * loads); the sm90 GEMM takes block_k = 128 (any block_n) with K and N
 * multiples of 16, and EXPERTD_GEMM_SM90 on other block sets is
 * EXPERTD_ERR_UNSUPPORTED. AUTO runs block sets on the sm90 GEMM where it
 * takes them (the portable one with the sm90_block option off). The sm90
 * GEMM runs per-channel scales outside block mode.
 *
 * a13_scale and a2_scale are static activation scales, used for every token
 * (and every group in block mode); <= 0 means dynamic quantization (amax /
 * 448 per token, or per token and group of block_k).
 *
 * w13_bias [E, rows1] floats (in w13's row order) is added to GEMM1's
 * dequantized output before the activation, w2_bias [E, K] floats to
 * GEMM2's before the router weight; NULL means none. swiglu_limit and
 * swiglu_alpha (finite, > 0) are SWIGLU_OAI's clamp limit and sigmoid
 * slope; the other activations ignore them. */
typedef struct expertd_set_params {
  uint32_t size;    /* sizeof(expertd_set_params) */
  uint32_t version; /* EXPERTD_ABI_VERSION */
  int32_t num_experts; /* E, 1..EXPERTD_MAX_EXPERTS */
  int32_t hidden;      /* K */
  int32_t inter;       /* N */
  int32_t activation;  /* EXPERTD_ACT_* */
  int32_t n_w13_scale;
  int32_t n_w2_scale;
  int32_t block_n;
  int32_t block_k;
  float a13_scale;    /* (-1: dynamic) */
  float a2_scale;     /* (-1: dynamic) */
  float swiglu_limit; /* (7) */
  float swiglu_alpha; /* (1.702) */
  const uint8_t* w13;
  const uint8_t* w2;
  const float* w13_scale;
  const float* w2_scale;
  const float* w13_bias;
  const float* w2_bias;
} expertd_set_params;

#define EXPERTD_SET_PARAMS_BYTES 104

#ifdef __cplusplus
static_assert(sizeof(expertd_buf) == EXPERTD_BUF_BYTES, "expertd_buf layout");
static_assert(sizeof(expertd_call) == EXPERTD_CALL_BYTES, "expertd_call layout");
static_assert(sizeof(expertd_options) == EXPERTD_OPTIONS_BYTES, "expertd_options layout");
static_assert(sizeof(expertd_set_params) == EXPERTD_SET_PARAMS_BYTES, "expertd_set_params layout");
#else
_Static_assert(sizeof(expertd_buf) == EXPERTD_BUF_BYTES, "expertd_buf layout");
_Static_assert(sizeof(expertd_call) == EXPERTD_CALL_BYTES, "expertd_call layout");
_Static_assert(sizeof(expertd_options) == EXPERTD_OPTIONS_BYTES, "expertd_options layout");
_Static_assert(sizeof(expertd_set_params) == EXPERTD_SET_PARAMS_BYTES, "expertd_set_params layout");
#endif

/* expertd_abi_version returns EXPERTD_ABI_VERSION of the built library. */
EXPERTD_API int expertd_abi_version(void);

/* expertd_options_default, expertd_set_params_init and expertd_call_init
 * fill in a struct's size, version and defaults. */
EXPERTD_API void expertd_options_default(expertd_options* opts);
EXPERTD_API void expertd_set_params_init(expertd_set_params* params);
EXPERTD_API void expertd_call_init(expertd_call* call);

/* expertd_init makes device current for the calling thread, creates its
 * context and sets the library's options (NULL: the defaults). streams is
 * how many expertd_moe calls on one set run at once, each with its own
 * stream, workspace and pinned staging, so one call's copies overlap
 * another's kernels. The options apply to the whole process (the last init
 * wins; sets created before keep their poison switch). Any thread may call
 * the library. Unless the environment sets CUDA_DEVICE_MAX_CONNECTIONS,
 * the first init sets it to 32 (for the lanes below: a stream blocked on
 * its doorbell must not share a hardware queue with other streams), and,
 * unless it sets CUDA_MODULE_LOADING, sets that to EAGER: a kernel loaded on
 * its first launch may wait for the whole context, which a waiting lane
 * keeps busy (both take effect only if that init creates the process's
 * CUDA context).
 * EXPERTD_SM90_GATHER, read by each init, sets whether the Hopper GEMM1
 * reads FP8 hidden rows by token instead of after a gather pass: "1"
 * wherever its kernels can, "0" never; unset, by the library's rule (64-token
 * tiles; 128-token tiles of non-gated layers, and of gated ones at 96 routed
 * rows per expert or fewer); any other value fails the init.
 * Each init also reads EXPERTD_SM90_CUTLASS from the environment, a development
 * switch for timing GEMM2 on CUTLASS's grouped GEMM against the library's
 * own: 0 never, 1 wherever the set allows it (Hopper path, static a2
 * scale, one weight scale per expert); unset, from 192 rows per expert. */
EXPERTD_API int expertd_init(int device, const expertd_options* opts);

/* expertd_device_info writes a NUL-terminated description of device into buf
 * (at most buflen bytes, truncated), e.g.
 * "NVIDIA H200 (sm_90, 132 SMs, 139 GiB, gemm=sm90)". */
EXPERTD_API int expertd_device_info(int device, char* buf, int buflen);

/* expertd_set_create uploads the MoE layer params describes (see
 * expertd_set_params) to device memory; on success *out_handle names the
 * set. */
EXPERTD_API int expertd_set_create(int device, const expertd_set_params* params, uint64_t* out_handle);

/* expertd_set_free releases a set's device memory and cached graphs. */
EXPERTD_API int expertd_set_free(uint64_t handle);

/* expertd_moe runs one fused MoE call, synchronously, on one of the set's
 * streams (waiting for one when all are busy).
 * Each buffer may be pageable host memory (staged through pinned memory),
 * page-locked host memory (expertd_host_register; copied by DMA, small
 * buffers staged) or device memory (e.g. from expertd_ipc_open; read and
 * written in place, the addresses keying the call's graph), as its mem
 * says or the driver answers. Routing results and a host output come back
 * in one copy. call->stream is ignored. */
EXPERTD_API int expertd_moe(uint64_t handle, const expertd_call* call);

/* expertd_moe_device is expertd_moe with device buffers (the routing
 * results too), enqueued on call->stream with no host synchronization and
 * no graph, so it may be captured into the caller's graph; use_graph and
 * kernel_ms are ignored. These calls share one workspace per set (apart
 * from expertd_moe's), so the caller must not overlap them on one set
 * across streams. */
EXPERTD_API int expertd_moe_device(uint64_t handle, const expertd_call* call);

/* expertd_host_register page-locks [ptr, ptr+bytes) of host memory (e.g. a
 * POSIX shared-memory mapping) for every device, so expertd_moe copies it
 * by DMA; expertd_host_unregister undoes it (ptr as registered). */
EXPERTD_API int expertd_host_register(int device, void* ptr, uint64_t bytes);
EXPERTD_API int expertd_host_unregister(int device, void* ptr);

/* expertd_ipc_open maps the device allocation another process exported as
 * the EXPERTD_IPC_HANDLE_BYTES-byte handle (cudaIpcGetMemHandle, or
 * PyTorch's storage._share_cuda_()) on device, and reports its address and
 * its size in bytes. Opening a handle again shares the mapping;
 * expertd_ipc_close(address) undoes one open, and the last unmaps it. */
EXPERTD_API int expertd_ipc_open(int device, const uint8_t* handle, int handle_len, uint64_t* dev_ptr,
                     uint64_t* bytes);
EXPERTD_API int expertd_ipc_close(uint64_t dev_ptr);

/* Device memory for same-host callers that have the library and no CUDA
 * framework (the Go SDK's tests and expertbench): allocate, free, export
 * as an IPC handle (handle_len == EXPERTD_IPC_HANDLE_BYTES), and copy
 * synchronously between any two addresses (host or device). */
EXPERTD_API int expertd_dev_alloc(int device, uint64_t bytes, uint64_t* dev_ptr);
EXPERTD_API int expertd_dev_free(int device, uint64_t dev_ptr);
EXPERTD_API int expertd_ipc_export(int device, uint64_t dev_ptr, uint8_t* handle, int handle_len);
EXPERTD_API int expertd_copy(int device, uint64_t dst, uint64_t src, uint64_t bytes);

/* GPU-ordered lanes (docs/gpu-ordered.md). A lane serves one call shape
 * on one set for a caller whose tensors live on the same GPU, with no host
 * thread of either process on a call's path. Its two 32-bit flags live in
 * an allocation of EXPERTD_LANE_FLAGS_BYTES the library makes and exports
 * as a CUDA IPC handle: doorbell at byte EXPERTD_LANE_DOORBELL, done at
 * EXPERTD_LANE_DONE, both 0 at rest. The caller, per call, on its stream:
 * cuStreamWriteValue32(done, 0), cuStreamWriteValue32(doorbell, 1),
 * cuStreamWaitValue32(done == 1); the values are constants, so its side
 * may be captured into a CUDA graph and replayed. The library keeps depth
 * calls enqueued on the lane's own stream, each waiting for the doorbell
 * (>= 1), resetting it, running the call and writing done = 1; a thread
 * of the library enqueues the next as each completes. Closing sets the
 * doorbell to EXPERTD_LANE_STOP, which the calls still enqueued pass
 * without running (where the mode has EXPERTD_LANE_SKIPS; otherwise they
 * run once more on the buffers, which the caller must keep until close
 * returns).
 *
 * expertd_lane_open takes a call as expertd_moe_device does (hidden,
 * logits and out in device memory; no hidden_scale, no precomputed or
 * returned routing); correction_bias, if any, is host memory copied at
 * open. Its addresses and shape serve every call of the lane; call->stream
 * is ignored. depth is 1..EXPERTD_MAX_LANE_DEPTH; flags_handle receives
 * the flags' EXPERTD_IPC_HANDLE_BYTES-byte IPC handle. expertd_lane_stats
 * reports the calls the lane ran and its mode (EXPERTD_LANE_* bits).
 * expertd_lane_close releases the enqueued calls, waits for them and frees
 * the lane; the set stays loaded until its lanes are closed. */
#define EXPERTD_MAX_LANE_DEPTH 64
#define EXPERTD_LANE_FLAGS_BYTES 256
#define EXPERTD_LANE_DOORBELL 0
#define EXPERTD_LANE_DONE 128
#define EXPERTD_LANE_STOP 2
#define EXPERTD_LANE_MPS 1   /* mode: the device's contexts are shared through MPS */
#define EXPERTD_LANE_SKIPS 2 /* mode: calls released by close skip the MoE work */

EXPERTD_API int expertd_lane_open(uint64_t set, const expertd_call* call, int depth, uint64_t* lane,
                                  uint8_t* flags_handle, int handle_len);
EXPERTD_API int expertd_lane_stats(uint64_t lane, uint64_t* served, int32_t* mode);
EXPERTD_API int expertd_lane_close(uint64_t lane);

/* expertd_last_error describes the calling thread's last failure ("" if
 * none). The string stays valid until that thread's next call. */
EXPERTD_API const char* expertd_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* EXPERTD_CUDA_H_ */
