package codec

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
