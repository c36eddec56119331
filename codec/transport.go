package codec

import "google.golang.org/grpc/mem"

// HTTP/2 flow control and socket buffers for tensor-sized messages, used
// by the server (service.Server.ServerOptions) and the Go SDK alike.
//
// grpc-go starts every stream and connection with a 64 KiB window and
// grows it by estimating the bandwidth-delay product, so the first
// megabytes of a call wait for window updates, and a connection that
// alternates small and large calls keeps re-learning. A FusedMoE request
// at M=256 on Nemotron is 0.7-1.5 MB and its response 1.4 MB; windows of
// that order let a whole request or response be in flight at once on a
// loopback or datacenter link. Windows are credit, not allocations: a
// stream only holds memory for bytes actually sent and not yet read.
const (
	// StreamWindowBytes is the initial (and fixed) per-stream window.
	StreamWindowBytes = 8 << 20
	// ConnWindowBytes is the initial (and fixed) per-connection window,
	// room for several concurrent calls' requests.
	ConnWindowBytes = 32 << 20
	// IOBufferBytes sizes gRPC's read and write buffers per connection
	// (32 KiB by default), so a large message moves in fewer syscalls.
	IOBufferBytes = 256 << 10
)

// BufferPool is the pool grpc-go's transport takes its buffers from on
// the server (experimental.BufferPool) and the SDK
// (experimental.WithBufferPool): every HTTP/2 data frame read. Unlike grpc-go's
// default pool it does not zero a buffer it hands out again: each user
// writes a buffer whole before reading it (a frame is read into exactly
// its length), and zeroing
// is a third pass over every received byte, besides the socket read and
// the copy out of the read buffer. It places the frames of a message
// back to back where it can, so that Codec and Receiver parse a
// recycled message where it lies (framePool).
func BufferPool() mem.BufferPool { return &frames }
