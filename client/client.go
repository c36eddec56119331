package client

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/codec"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// Defaults of a Client; each has an Option.
const (
	// DefaultMaxMessageBytes bounds messages both ways. The daemon's own
	// default is about 290 MB (FP32 requests of 8192 tokens at K = 8192),
	// so the client never refuses what a default server sends.
	DefaultMaxMessageBytes = 1 << 30
	// DefaultChunkBytes is the LoadExperts chunk size: large enough that
	// per-message overhead is noise, small enough to stay far below any
	// sane server message limit.
	DefaultChunkBytes = 2 << 20
	// DefaultMaxAttempts is how often an idempotent call is tried when the
	// server answers Unavailable (a restart, a drain, a lost connection);
	// 5 is gRPC's cap. With backoffs drawn from up to 0.1, 0.25, 0.625 and
	// 1.56 s plus reconnect attempts, a call to a stopped local daemon
	// gives up after a few seconds, which covers most of a
	// restart; WithWaitForReady waits longer.
	DefaultMaxAttempts = 5
	// DefaultKeepaliveTime is how long a connection may be quiet before
	// the client pings it, and DefaultKeepaliveTimeout how long it waits
	// for the answer before it reconnects. The interval is three times
	// the daemon's enforcement minimum (-keepalive-min-time, default
	// 10 s), so the daemon never answers GOAWAY too_many_pings; a dead
	// server or a middlebox that dropped the flow is found within about
	// 40 s rather than by the next call.
	DefaultKeepaliveTime    = 30 * time.Second
	DefaultKeepaliveTimeout = 10 * time.Second
	// retryBufferBytes is how much of a FusedMoE request gRPC keeps for a
	// retry; larger requests are not retried once sent. It covers M = 8192
	// BF16 hidden states at K = 2048 with logits.
	retryBufferBytes = 64 << 20
)

// serviceName is the gRPC name of ExpertService.
var serviceName = pb.ExpertService_ServiceDesc.ServiceName

// Client is a connection to an expertd server. It is safe for concurrent
// use; create it with Dial and release it with Close.
type Client struct {
	conn   *grpc.ClientConn
	rpc    pb.ExpertServiceClient
	health healthpb.HealthClient
	opts   options
	shm    regions

	// limitMu guards serverMaxMsg, the server's message limit once known.
	limitMu      sync.Mutex
	serverMaxMsg int64
}

type options struct {
	creds       credentials.TransportCredentials
	maxMsg      int
	chunkBytes  int
	maxAttempts int
	callTimeout time.Duration
	noWait      bool
	waitReady   bool
	dialOpts    []grpc.DialOption
	token       string
	keepalive   keepalive.ClientParameters
}

// Option configures Dial.
type Option func(*options)

// WithTransportCredentials secures the connection (the default is
// plaintext, as the daemon listens on loopback by default).
func WithTransportCredentials(c credentials.TransportCredentials) Option {
	return func(o *options) { o.creds = c }
}

// WithMaxMessageBytes bounds the messages the client sends and accepts.
func WithMaxMessageBytes(n int) Option { return func(o *options) { o.maxMsg = n } }

// WithChunkBytes sets the LoadExperts chunk size.
func WithChunkBytes(n int) Option { return func(o *options) { o.chunkBytes = n } }

// WithMaxAttempts sets how often ListExperts, GetServerInfo, FusedMoE and
// health checks are tried on Unavailable; 1 disables retries. LoadExperts
// and UnloadExperts are never retried: a repeated load or unload is not
// the same as one.
func WithMaxAttempts(n int) Option { return func(o *options) { o.maxAttempts = n } }

// WithCallTimeout bounds every call whose context has no deadline of its
// own. By default there is none: the context decides.
func WithCallTimeout(d time.Duration) Option { return func(o *options) { o.callTimeout = d } }

// WithoutWaiting makes Dial return at once instead of waiting for the
// connection; the first call then connects.
func WithoutWaiting() Option { return func(o *options) { o.noWait = true } }

// WithWaitForReady makes calls wait for a connection to the server, up to
// their deadline, instead of failing with Unavailable while it is down.
// Pair it with deadlines (or WithCallTimeout): without one a call to a
// server that never comes back waits forever.
func WithWaitForReady() Option { return func(o *options) { o.waitReady = true } }

// reconnect is how fast the connection is re-established after a loss:
// gRPC's default starts at 1 s and grows to 2 minutes, tuned for remote
// fleets; a daemon on the same host is back within a second or two, and
// a quick retry there costs nothing.
var reconnect = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
	MinConnectTimeout: 5 * time.Second,
}

// WithKeepalive replaces the client's keepalive parameters (by default a
// ping after DefaultKeepaliveTime of quiet, also on idle connections,
// answered within DefaultKeepaliveTimeout). A server enforces a minimum
// interval (expertd's -keepalive-min-time; grpc-go's default is 5
// minutes, without pings on idle connections) and closes the connection
// of a client pinging more often with GOAWAY too_many_pings, so p.Time
// must not be below it. A zero Time turns keepalive pings off; grpc-go
// raises a Time below 10 s to 10 s.
func WithKeepalive(p keepalive.ClientParameters) Option {
	return func(o *options) { o.keepalive = p }
}

// WithDialOptions passes extra options to grpc.NewClient, for example
// grpc.WithContextDialer for an in-memory listener.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

// retryServiceConfig is the gRPC service config that retries the
// idempotent methods on Unavailable with exponential backoff. FusedMoE is
// a pure function of its request, so it is idempotent too.
func retryServiceConfig(attempts int) string {
	if attempts < 2 {
		return `{}`
	}
	return fmt.Sprintf(`{"methodConfig": [{
  "name": [
    {"service": %[1]q, "method": "ListExperts"},
    {"service": %[1]q, "method": "GetServerInfo"},
    {"service": %[1]q, "method": "FusedMoE"},
    {"service": "grpc.health.v1.Health", "method": "Check"}
  ],
  "retryPolicy": {
    "maxAttempts": %[2]d,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2.5,
    "retryableStatusCodes": ["UNAVAILABLE"]
  }
}]}`, serviceName, attempts)
}

// Dial connects to the expertd server at addr ("host:port", a Unix socket
// as "unix:///absolute/path" or "unix:path", or any gRPC target such as
// "dns:///name:port"). It returns once the connection is
// ready, or with an error when ctx ends first (see WithoutWaiting).
func Dial(ctx context.Context, addr string, opts ...Option) (*Client, error) {
	o := options{
		creds:       insecure.NewCredentials(),
		maxMsg:      DefaultMaxMessageBytes,
		chunkBytes:  DefaultChunkBytes,
		maxAttempts: DefaultMaxAttempts,
		keepalive:   keepalive.ClientParameters{Time: DefaultKeepaliveTime, Timeout: DefaultKeepaliveTimeout, PermitWithoutStream: true},
	}
	for _, opt := range opts {
		opt(&o)
	}
	if o.chunkBytes < 1 || o.maxMsg < 1 {
		return nil, fmt.Errorf("expertd client: chunk bytes %d and max message bytes %d must be >= 1", o.chunkBytes, o.maxMsg)
	}
	if o.token != "" {
		b := bearer{token: o.token, secure: !isLoopbackTarget(addr)}
		if b.secure && o.creds.Info().SecurityProtocol == "insecure" {
			return nil, fmt.Errorf("expertd client: %s: WithBearerToken needs WithTransportCredentials (TLS) for a non-loopback address", addr)
		}
		o.dialOpts = append([]grpc.DialOption{grpc.WithPerRPCCredentials(b)}, o.dialOpts...)
	}
	dialOpts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(o.creds),
		// The codec sends tensors without copying them into the message
		// and returns outputs that alias the received message.
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(o.maxMsg), grpc.MaxCallSendMsgSize(o.maxMsg), grpc.WaitForReady(o.waitReady),
			grpc.ForceCodecV2(codec.Codec{})),
		grpc.WithConnectParams(reconnect),
		// Windows and buffers sized for tensor messages, as the server's.
		grpc.WithInitialWindowSize(codec.StreamWindowBytes),
		grpc.WithInitialConnWindowSize(codec.ConnWindowBytes),
		grpc.WithReadBufferSize(codec.IOBufferBytes),
		grpc.WithWriteBufferSize(codec.IOBufferBytes),
		experimental.WithBufferPool(codec.BufferPool()),
		// The retry policy is the SDK's, not whatever a resolver serves.
		grpc.WithDisableServiceConfig(),
		grpc.WithDefaultServiceConfig(retryServiceConfig(o.maxAttempts)),
	}, o.dialOpts...)
	if o.keepalive.Time > 0 {
		// grpc-go would raise a zero Time to its 10 s minimum rather than
		// read it as off.
		dialOpts = append(dialOpts, grpc.WithKeepaliveParams(o.keepalive))
	}
	if o.maxAttempts < 2 {
		dialOpts = append(dialOpts, grpc.WithDisableRetry())
	} else {
		dialOpts = append(dialOpts, grpc.WithMaxCallAttempts(o.maxAttempts))
	}
	conn, err := grpc.NewClient(addr, dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("expertd client: %s: %w", addr, err)
	}
	c := &Client{conn: conn, rpc: pb.NewExpertServiceClient(conn), health: healthpb.NewHealthClient(conn), opts: o}
	if o.noWait {
		return c, nil
	}
	conn.Connect()
	for {
		s := conn.GetState()
		if s == connectivity.Ready {
			return c, nil
		}
		if !conn.WaitForStateChange(ctx, s) {
			conn.Close()
			return nil, fmt.Errorf("expertd client: connecting to %s (last state %v): %w", addr, s, ctx.Err())
		}
	}
}

// Close releases the connection; calls in flight fail.
func (c *Client) Close() error { return c.conn.Close() }

// Conn is the underlying connection, for services the SDK does not wrap.
func (c *Client) Conn() grpc.ClientConnInterface { return c.conn }

// RPC is the generated stub on the same connection, for fields the SDK
// does not cover yet.
func (c *Client) RPC() pb.ExpertServiceClient { return c.rpc }

// callContext applies the default call timeout when ctx has no deadline.
func (c *Client) callContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || c.opts.callTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.opts.callTimeout)
}

// invalid is a request the client refuses before sending: the same code
// the server would answer with.
func invalid(method string, err error) error {
	return wrap(method, status.Error(codes.InvalidArgument, err.Error()))
}

// FusedMoE runs one MoE layer on the server. It is retried on Unavailable
// (it has no side effects), and on ResourceExhausted when the server says
// when to retry (google.rpc.RetryInfo: a full queue), up to the client's
// attempts; the context's deadline bounds all attempts.
func (c *Client) FusedMoE(ctx context.Context, req *FusedMoERequest) (*FusedMoEResult, error) {
	p, err := req.proto()
	if err != nil {
		return nil, invalid("FusedMoE", err)
	}
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	var resp *pb.FusedMoEResponse
	recv := &codec.Receiver{}
	for attempt := 1; ; attempt++ {
		resp, err = c.rpc.FusedMoE(ctx, p, grpc.MaxRetryRPCBufferSize(retryBufferBytes), grpc.ForceCodecV2(recv))
		if err != nil && c.reregister(ctx, err) {
			resp, err = c.rpc.FusedMoE(ctx, p, grpc.MaxRetryRPCBufferSize(retryBufferBytes), grpc.ForceCodecV2(recv))
		}
		if err == nil || attempt >= c.opts.maxAttempts || status.Code(err) != codes.ResourceExhausted || !retryAfter(ctx, err) {
			break
		}
	}
	if err != nil {
		return nil, wrap("FusedMoE", err)
	}
	res, err := resultFromProto(resp)
	if err != nil {
		recv.Take().Release()
		return nil, wrap("FusedMoE", fmt.Errorf("malformed response: %w", err))
	}
	res.recv = recv.Take()
	c.viewOutputs(res)
	return res, nil
}

// ListExperts reports the loaded expert sets, sorted by name.
func (c *Client) ListExperts(ctx context.Context) ([]ExpertSetInfo, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.rpc.ListExperts(ctx, &pb.ListExpertsRequest{})
	if err != nil {
		return nil, wrap("ListExperts", err)
	}
	sets := make([]ExpertSetInfo, 0, len(resp.GetExpertSets()))
	for _, s := range resp.GetExpertSets() {
		sets = append(sets, setInfoFromProto(s))
	}
	return sets, nil
}

// UnloadExperts frees the named set and returns the bytes released. Calls
// already running on it finish first. It is not retried.
func (c *Client) UnloadExperts(ctx context.Context, name string) (int64, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.rpc.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: name})
	if err != nil {
		return 0, wrap("UnloadExperts", err)
	}
	return resp.GetFreedBytes(), nil
}

// ServerInfo reports the server's version, backends, devices and limits.
func (c *Client) ServerInfo(ctx context.Context) (*ServerInfo, error) {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.rpc.GetServerInfo(ctx, &pb.GetServerInfoRequest{})
	if err != nil {
		return nil, wrap("GetServerInfo", err)
	}
	return serverInfoFromProto(resp), nil
}

// Health asks the standard gRPC health service about ExpertService and
// returns nil when it is SERVING.
func (c *Client) Health(ctx context.Context) error {
	ctx, cancel := c.callContext(ctx)
	defer cancel()
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: serviceName})
	if err != nil {
		return wrap("Health", err)
	}
	if s := resp.GetStatus(); s != healthpb.HealthCheckResponse_SERVING {
		return wrap("Health", status.Errorf(codes.Unavailable, "%s is %v", serviceName, s))
	}
	return nil
}
