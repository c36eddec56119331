package kernels

// Lane is a GPU-ordered call path a backend serves for one caller on its
// GPU (docs/gpu-ordered.md): one expert set, one call shape and the
// caller's device buffers, fixed when it opens. The caller starts each call
// from its own CUDA stream by writing a doorbell in device memory the
// backend shares through CUDA IPC, and its stream waits for the done flag
// next to it; no host thread of either process takes part in a call.
type Lane interface {
	// Flags is the shared flag allocation: its IPC handle and where in it
	// the doorbell and done flags are.
	Flags() LaneFlags
	// Served is the number of calls the lane has run.
	Served() uint64
	// MPS says whether the GPU's contexts are shared through MPS; without
	// it each call costs a context switch of the time-sliced GPU.
	MPS() bool
	// SkipsOnClose says whether calls still enqueued when the lane closes
	// are released without running; otherwise they run once more on the
	// caller's buffers before Close returns.
	SkipsOnClose() bool
	// Close releases the calls enqueued, waits for them and frees the
	// lane; the caller's buffers are no longer touched once it returns.
	Close() error
}

// LaneFlags locates a lane's two 32-bit flags.
type LaneFlags struct {
	// Handle is the allocation's 64-byte cudaIpcMemHandle_t.
	Handle []byte
	// Bytes is the allocation's size; Doorbell and Done are the flags'
	// byte offsets in it.
	Bytes, Doorbell, Done int64
}
