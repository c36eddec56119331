package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/kernels/cuda"
	"github.com/expertd/expertd/service"
)

// Config is every knob of the daemon, parsed once at start. Each field is
// set by a flag or, when the flag is absent, by its EXPERTD_* environment
// variable, else by its default.
type Config struct {
	// Listen is the gRPC address (-listen, EXPERTD_LISTEN): host:port for
	// TCP, or unix:///absolute/path or unix:path for a Unix socket.
	Listen string
	// UnixMode is the permission bits of a Unix-socket listener's file:
	// who may connect (-unix-mode, EXPERTD_UNIX_MODE, octal).
	UnixMode os.FileMode
	// Backend is auto, cpu or cuda (-backend, EXPERTD_BACKEND). auto tries
	// cuda and falls back to cpu with a warning.
	Backend string
	// LibraryPath locates the CUDA kernel library (-library-path,
	// EXPERTD_LIBRARY_PATH); empty lets the backend search.
	LibraryPath string
	// Device is the GPU ordinal (-device, EXPERTD_DEVICE).
	Device int
	// CUDA are the cuda backend's switches, each a flag and a variable:
	// -cuda-gemm, -cuda-streams, -cuda-pdl, -cuda-sm90-block,
	// -cuda-sm90-grid, -cuda-sm90-toka, -cuda-sm90-pair, -cuda-sync-spin, -cuda-host-trace
	// (EXPERTD_CUDA_GEMM, ...). They reach the backend as
	// kernels.Config.Options and GetServerInfo reports them.
	CUDA cuda.Options
	// Threads bounds CPU backend goroutines per call, 0 for GOMAXPROCS
	// (-threads, EXPERTD_THREADS).
	Threads int
	// WeightsDir is the only directory safetensors loads read from; empty
	// disables them (-weights-dir, EXPERTD_WEIGHTS_DIR).
	WeightsDir string
	// MaxTokens bounds M per FusedMoE call (-max-tokens, EXPERTD_MAX_TOKENS).
	MaxTokens int
	// MaxMessageBytes is the gRPC message limit both ways; 0 sizes it from
	// the largest legal request at MaxTokens (-max-message-bytes,
	// EXPERTD_MAX_MESSAGE_BYTES).
	MaxMessageBytes int64
	// MaxLoadedBytes bounds resident expert sets, 0 for unlimited
	// (-max-loaded-bytes, EXPERTD_MAX_LOADED_BYTES).
	MaxLoadedBytes int64
	// MaxConcurrent bounds FusedMoE calls running at once
	// (-max-concurrent, EXPERTD_MAX_CONCURRENT).
	MaxConcurrent int
	// MaxQueued bounds FusedMoE calls waiting for a slot; more are refused
	// with ResourceExhausted. 0 means 4 × MaxConcurrent (-max-queued,
	// EXPERTD_MAX_QUEUED).
	MaxQueued int
	// BatchWindow is how long a batch of FusedMoE calls gathered while
	// another of their kind ran waits, after it, for more compatible
	// calls before its backend call; a call on an idle set runs at once.
	// 0 disables dynamic batching (-batch-window, EXPERTD_BATCH_WINDOW).
	BatchWindow time.Duration
	// BatchMaxTokens bounds the tokens of one merged backend call; 0
	// means service.DefaultBatchMaxTokens (-batch-max-tokens,
	// EXPERTD_BATCH_MAX_TOKENS).
	BatchMaxTokens int
	// AdminAddr serves /metrics (Prometheus) and /healthz; empty disables
	// (-admin-addr, EXPERTD_ADMIN_ADDR).
	AdminAddr string
	// LogLevel is debug, info, warn or error (-log-level, EXPERTD_LOG_LEVEL).
	LogLevel string
	// LogFormat is text or json (-log-format, EXPERTD_LOG_FORMAT).
	LogFormat string
	// OTLPEndpoint receives RPC traces over OTLP/gRPC, as a URL such as
	// http://localhost:4317 (http: plaintext, https: TLS); empty exports no
	// traces (-otlp-endpoint, EXPERTD_OTLP_ENDPOINT).
	OTLPEndpoint string
	// TLSCert and TLSKey are the server's PEM certificate (chain) and key;
	// both set serve TLS, neither plaintext (-tls-cert, -tls-key,
	// EXPERTD_TLS_CERT, EXPERTD_TLS_KEY).
	TLSCert, TLSKey string
	// TLSClientCA is a PEM bundle of CAs client certificates must chain
	// to; set, it turns on mutual TLS and authorization (-tls-client-ca,
	// EXPERTD_TLS_CLIENT_CA).
	TLSClientCA string
	// AuthTokensFile holds `token role` lines (role user or admin); set,
	// every call but health checks needs a bearer token or, with mTLS, a
	// client certificate (-auth-tokens-file, EXPERTD_AUTH_TOKENS_FILE).
	AuthTokensFile string
	// AdminIdentities are client-certificate names (subject CN or any
	// SAN) granted the admin role; other verified certificates are users
	// (-admin-identities, comma-separated, EXPERTD_ADMIN_IDENTITIES).
	AdminIdentities []string
	// SharedMemory serves RegisterSharedMemory and tensors in POSIX shared
	// memory to callers on this host (-shared-memory,
	// EXPERTD_SHARED_MEMORY=true).
	SharedMemory bool
	// Ring serves call rings (AttachRing) to shared-memory callers (-ring,
	// EXPERTD_RING=true); it needs SharedMemory. RingSpin is how long a
	// ring's poller polls after its last call before sleeping
	// (-ring-spin); the Ring* limits are -ring-max-per-conn, -ring-max and
	// -ring-max-slot-bytes.
	Ring             bool
	RingSpin         time.Duration
	RingMaxPerConn   int
	RingMax          int
	RingMaxSlotBytes int64
	// MaxShmRegions bounds the shared-memory regions mapped at once over
	// all connections (-max-shm-regions, EXPERTD_MAX_SHM_REGIONS).
	MaxShmRegions int
	// MaxShmBytes bounds their bytes (-max-shm-bytes,
	// EXPERTD_MAX_SHM_BYTES).
	MaxShmBytes int64
	// IdleFreeMemory is how long the daemon must admit no call before it
	// returns the memory a burst left behind to the OS; 0 leaves that to
	// the Go runtime (-idle-free-memory, EXPERTD_IDLE_FREE_MEMORY).
	IdleFreeMemory time.Duration
	// StreamWorkers, when > 0, runs RPC handlers on a pool of this many
	// goroutines instead of a new goroutine per stream
	// (grpc.NumStreamWorkers; -stream-workers, EXPERTD_STREAM_WORKERS).
	StreamWorkers int
	// Pprof serves net/http/pprof under /debug/pprof/ on AdminAddr
	// (-pprof, EXPERTD_PPROF=true).
	Pprof bool
	// ShutdownTimeout bounds the drain on SIGINT/SIGTERM before calls are
	// cut (-shutdown-timeout, EXPERTD_SHUTDOWN_TIMEOUT).
	ShutdownTimeout time.Duration
	// KeepaliveMinTime is the shortest interval at which a client may
	// ping; one pinging more often is sent GOAWAY too_many_pings
	// (-keepalive-min-time, EXPERTD_KEEPALIVE_MIN_TIME).
	KeepaliveMinTime time.Duration
	// KeepaliveTime and KeepaliveTimeout: the server pings a connection
	// idle for KeepaliveTime and closes it when no answer comes within
	// KeepaliveTimeout (-keepalive-time, -keepalive-timeout,
	// EXPERTD_KEEPALIVE_TIME, EXPERTD_KEEPALIVE_TIMEOUT).
	KeepaliveTime, KeepaliveTimeout time.Duration
	// MaxConnectionAge is how long a connection lives (±10% jitter) before
	// the server sends GOAWAY, so clients behind a load balancer spread
	// over new replicas; MaxConnectionAgeGrace is how long calls in
	// flight then have to finish. 0 means never (-max-connection-age,
	// -max-connection-age-grace, EXPERTD_MAX_CONNECTION_AGE,
	// EXPERTD_MAX_CONNECTION_AGE_GRACE).
	MaxConnectionAge, MaxConnectionAgeGrace time.Duration
	// Manifest is a YAML or JSON file naming expert sets to load from
	// WeightsDir at start, before the daemon reports ready (-manifest,
	// EXPERTD_MANIFEST); see manifest.go for the format.
	Manifest string
	// ShardIndex is the shard of a sharded manifest this daemon loads;
	// -1 takes it from the host name's ordinal (-shard-index,
	// EXPERTD_SHARD_INDEX).
	ShardIndex int
	// ShowVersion prints the version and exits (-version).
	ShowVersion bool
	// Probe, when set, is a URL to GET instead of serving: exit status 0
	// on 200 (-probe), for container health checks in images without curl.
	Probe string
}

// Defaults. Both addresses are loopback: exposing the daemon is a choice.
const (
	defaultListen    = "127.0.0.1:50051"
	defaultAdminAddr = "127.0.0.1:9090"
	defaultMaxTokens = 8192
	// 32 GiB holds a dozen full Nemotron layers (1.28 GB each) or every
	// Qwen3-30B layer; beyond that a host should say what it can spare.
	defaultMaxLoadedBytes = 32 << 30
	defaultMaxConcurrent  = 4
	defaultShutdown       = 30 * time.Second
	// defaultIdleFreeMemory is long enough that a caller pausing between
	// bursts keeps its warm buffers (codec.Pool saves a page fault per
	// 4 KiB of output), short enough that an idle replica gives memory back.
	defaultIdleFreeMemory = 30 * time.Second
	// maxRingSpin bounds -ring-spin: each ring's poller holds a core for
	// that long after every call.
	maxRingSpin = 100 * time.Millisecond
	// defaultUnixMode lets the daemon's user and group connect to its
	// socket and nobody else: membership of the group is the grant.
	defaultUnixMode = "0660"
	// maxBatchWindow bounds -batch-window: a window is a few
	// milliseconds; a second is a typo that would stall every call.
	maxBatchWindow = time.Second
	// maxStreamWorkers bounds -stream-workers: each is a goroutine
	// parked for the daemon's life.
	maxStreamWorkers = 1024
)

// Largest layer dimensions the default message limit is sized for: every
// reference model of MOE_SPEC.md fits (DeepSeek-V3 has K = 7168, E = 256).
const (
	sizingMaxK = 8192
	sizingMaxE = 512
	// sizingMaxTopK bounds precomputed routing and returned routing.
	sizingMaxTopK = 16
)

// messageBytesFor is the largest legal FusedMoE request or response with a
// named expert set at maxTokens: FP32 hidden states (or output), FP32
// logits, and precomputed top-k ids and weights, plus 1 MiB for protobuf
// framing, scales and routing fields. Larger inline weights must be
// loaded with the chunked LoadExperts instead.
func messageBytesFor(maxTokens int) int64 {
	m := int64(maxTokens)
	return m*(sizingMaxK*4+sizingMaxE*4+2*sizingMaxTopK*4) + 1<<20
}

// parseConfig reads args (without the program name) and the environment
// through getenv. Flags win over the environment.
func parseConfig(args []string, getenv func(string) string, usage io.Writer) (Config, error) {
	var c Config
	fs := flag.NewFlagSet("expertd", flag.ContinueOnError)
	fs.SetOutput(clip.LineWriter(usage))
	var envErrs []error
	str := func(p *string, name, def, help string) {
		env := envName(name)
		if v := getenv(env); v != "" {
			def = v
		}
		fs.StringVar(p, name, def, help+" ($"+env+")")
	}
	// Numbers parse with one function so flags and variables accept the
	// same spellings (byte suffixes included).
	num := func(name string, def int64, help string, set func(int64)) {
		env := envName(name)
		if v := getenv(env); v != "" {
			n, err := parseBytes(v)
			if err != nil {
				envErrs = append(envErrs, fmt.Errorf("$%s: %w", env, err))
			}
			def = n
		}
		set(def)
		fs.Func(name, fmt.Sprintf("%s ($%s) (default %d)", help, env, def), func(s string) error {
			n, err := parseBytes(s)
			set(n)
			return err
		})
	}
	i64 := func(p *int64, name string, def int64, help string) {
		num(name, def, help, func(n int64) { *p = n })
	}
	integer := func(p *int, name string, def int, help string) {
		num(name, int64(def), help, func(n int64) { *p = int(min(n, 1<<31-1)) })
	}
	str(&c.Listen, "listen", defaultListen, "gRPC listen address: host:port, or unix:///absolute/path (or unix:path) for a Unix socket")
	var unixMode string
	str(&unixMode, "unix-mode", defaultUnixMode, "permissions (octal) of the -listen unix: socket file; connecting needs write permission")
	str(&c.Backend, "backend", "auto", "compute backend: auto (cuda if it loads, else cpu), cpu or cuda")
	str(&c.LibraryPath, "library-path", "", "path of the CUDA kernel library (libexpertd_cuda.so); empty searches the default locations")
	integer(&c.Device, "device", 0, "GPU ordinal for the cuda backend")
	integer(&c.Threads, "threads", 0, "goroutines per call for the cpu backend; 0 means GOMAXPROCS")
	str(&c.WeightsDir, "weights-dir", "", "directory safetensors loads may read from; empty disables safetensors loading")
	integer(&c.MaxTokens, "max-tokens", defaultMaxTokens, "largest number of tokens M in one FusedMoE call")
	i64(&c.MaxMessageBytes, "max-message-bytes", 0, "largest gRPC message in bytes (suffixes KiB, MiB, GiB); 0 sizes it for FP32 requests of max-tokens tokens with K <= 8192, E <= 512")
	i64(&c.MaxLoadedBytes, "max-loaded-bytes", defaultMaxLoadedBytes, "bytes of expert weights that may be resident at once (suffixes KiB, MiB, GiB); 0 means unlimited")
	integer(&c.MaxConcurrent, "max-concurrent", defaultMaxConcurrent, "FusedMoE calls that run at once; more wait in order")
	integer(&c.MaxQueued, "max-queued", 0, "FusedMoE calls that may wait for a slot; more are refused with RESOURCE_EXHAUSTED; 0 means 4 x max-concurrent")
	str(&c.AdminAddr, "admin-addr", defaultAdminAddr, "address serving /metrics and /healthz; empty disables it")
	str(&c.LogLevel, "log-level", "info", "log level: debug, info, warn or error")
	str(&c.LogFormat, "log-format", "text", "log format: text or json")
	str(&c.OTLPEndpoint, "otlp-endpoint", "", "OTLP/gRPC collector URL for RPC traces, e.g. http://localhost:4317; empty disables tracing")
	str(&c.TLSCert, "tls-cert", "", "PEM certificate (chain) to serve TLS with; needs -tls-key")
	str(&c.TLSKey, "tls-key", "", "PEM private key of -tls-cert")
	str(&c.TLSClientCA, "tls-client-ca", "", "PEM CA bundle; set, clients must present a certificate it signed (mutual TLS), which grants the user role")
	str(&c.AuthTokensFile, "auth-tokens-file", "", "file of \"token role\" lines (role user or admin); set, calls other than health checks need a bearer token")
	var admins string
	str(&admins, "admin-identities", "", "comma-separated client-certificate names (subject CN or SAN) granted the admin role; needs -tls-client-ca")
	str(&c.Manifest, "manifest", "", "YAML or JSON file of expert sets to load from -weights-dir before reporting ready; empty loads none")
	c.ShardIndex = -1
	if v := getenv("EXPERTD_SHARD_INDEX"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			envErrs = append(envErrs, fmt.Errorf("$EXPERTD_SHARD_INDEX: %q is not a whole number", v))
		}
		c.ShardIndex = n
	}
	fs.IntVar(&c.ShardIndex, "shard-index", c.ShardIndex, "shard of a sharded -manifest to load; -1 takes the ordinal at the end of the host name (a StatefulSet pod's expertd-2 is 2) ($EXPERTD_SHARD_INDEX)")
	fs.BoolVar(&c.ShowVersion, "version", false, "print the version and exit")
	fs.StringVar(&c.Probe, "probe", "", "GET this URL (e.g. http://127.0.0.1:9090/livez), exit 0 on 200 and 1 otherwise, instead of serving")
	booleanDef := func(p *bool, name string, def bool, help string) {
		env := envName(name)
		if v := getenv(env); v != "" {
			b, err := strconv.ParseBool(v)
			if err != nil {
				envErrs = append(envErrs, fmt.Errorf("$%s: %q is not true or false", env, v))
			}
			def = b
		}
		fs.BoolVar(p, name, def, help+" ($"+env+")")
	}
	boolean := func(p *bool, name, help string) { booleanDef(p, name, false, help) }
	boolean(&c.SharedMemory, "shared-memory", "serve RegisterSharedMemory: callers on this host may pass tensors and receive outputs in POSIX shared memory (/dev/shm) or, with the cuda backend, in GPU memory shared through CUDA IPC")
	boolean(&c.Ring, "ring", "serve AttachRing: shared-memory callers may post FusedMoE calls through a call ring in a POSIX region (docs/ring.md), each ring polled by one thread; needs -shared-memory")
	integer(&c.RingMaxPerConn, "ring-max-per-conn", service.DefaultRingMaxPerConn, "call rings one connection may attach")
	integer(&c.RingMax, "ring-max", service.DefaultRingMax, "call rings served at once")
	i64(&c.RingMaxSlotBytes, "ring-max-slot-bytes", service.DefaultRingMaxSlotBytes, "largest call-ring slot in bytes (suffixes KiB, MiB, GiB)")
	integer(&c.MaxShmRegions, "max-shm-regions", service.DefaultMaxShmRegions, "shared-memory regions mapped at once over all connections (each connection has at most 64); more are refused with RESOURCE_EXHAUSTED")
	i64(&c.MaxShmBytes, "max-shm-bytes", service.DefaultMaxShmBytes, "bytes of the shared-memory regions mapped at once over all connections (suffixes KiB, MiB, GiB); more are refused with RESOURCE_EXHAUSTED")
	boolean(&c.Pprof, "pprof", "serve Go's profiles (net/http/pprof) under /debug/pprof/ on -admin-addr, which has no authorization: keep it on loopback")
	duration := func(p *time.Duration, name string, def time.Duration, help string) {
		env := envName(name)
		if v := getenv(env); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil {
				envErrs = append(envErrs, fmt.Errorf("$%s: %w", env, err))
			}
			def = d
		}
		fs.DurationVar(p, name, def, help+" ($"+env+")")
	}
	duration(&c.IdleFreeMemory, "idle-free-memory", defaultIdleFreeMemory, "after this long without a call, return the memory a burst left behind to the OS; 0 leaves it to the Go runtime (GOMEMLIMIT also applies)")
	duration(&c.ShutdownTimeout, "shutdown-timeout", defaultShutdown, "how long a drain waits for calls in flight on SIGINT/SIGTERM")
	duration(&c.BatchWindow, "batch-window", service.SuggestedBatchWindow, "dynamic batching: FusedMoE calls that arrive while a compatible call runs are merged into one backend call, which waits this long after the running one for more; 0 disables batching")
	duration(&c.RingSpin, "ring-spin", service.DefaultRingSpin, "how long a call ring's poller polls (one core busy) after its last call before it sleeps on the doorbell; 0 sleeps at once")
	integer(&c.StreamWorkers, "stream-workers", 0, "run RPC handlers on a pool of this many goroutines instead of one new goroutine per call (grpc-go's NumStreamWorkers); 0 keeps one per call")
	integer(&c.BatchMaxTokens, "batch-max-tokens", 0, fmt.Sprintf("most tokens in one merged backend call; 0 means %d", service.DefaultBatchMaxTokens))
	duration(&c.KeepaliveMinTime, "keepalive-min-time", defaultKeepaliveMinTime, "shortest client ping interval allowed; a client pinging more often gets GOAWAY too_many_pings")
	duration(&c.KeepaliveTime, "keepalive-time", defaultKeepaliveTime, "ping a connection idle this long")
	duration(&c.KeepaliveTimeout, "keepalive-timeout", defaultKeepaliveTimeout, "close a connection whose ping is not answered within this")
	duration(&c.MaxConnectionAge, "max-connection-age", defaultMaxConnectionAge, "send GOAWAY to a connection this old (±10% jitter) so clients rebalance over replicas; 0 never ages connections; with -shared-memory the default is 0")
	duration(&c.MaxConnectionAgeGrace, "max-connection-age-grace", defaultMaxConnectionGrace, "how long calls in flight on an aged connection have to finish; 0 waits for them without limit")
	cudaDef := cuda.DefaultOptions()
	str(&c.CUDA.GEMM, "cuda-gemm", cudaDef.GEMM, "cuda backend: GEMM path of every call: auto (the Hopper wgmma kernels where the card and shape allow, else portable), portable, portable-f16 or sm90")
	integer(&c.CUDA.Streams, "cuda-streams", cudaDef.Streams, "cuda backend: calls on one expert set that run at once, each with its own stream and workspace (1-16)")
	booleanDef(&c.CUDA.PDL, "cuda-pdl", cudaDef.PDL, "cuda backend: launch a call's kernels with programmatic dependent launch (sm_90+)")
	booleanDef(&c.CUDA.SM90Block, "cuda-sm90-block", cudaDef.SM90Block, "cuda backend: run block-scaled sets on the Hopper kernels under -cuda-gemm auto")
	str(&c.CUDA.SM90Grid, "cuda-sm90-grid", cudaDef.SM90Grid, "cuda backend: Hopper GEMM grid: persistent (as many CTAs as fit) or full (one per tile)")
	booleanDef(&c.CUDA.SM90TokA, "cuda-sm90-toka", cudaDef.SM90TokA, "cuda backend: put tokens on wgmma's M side for block-scaled 128-token tiles")
	booleanDef(&c.CUDA.SM90Pair, "cuda-sm90-pair", cudaDef.SM90Pair, "cuda backend: run two 128-row blocks of one expert as one 256-token Hopper tile (per-expert and per-channel scales)")
	duration(&c.CUDA.SyncSpin, "cuda-sync-spin", cudaDef.SyncSpin, "cuda backend: how long a call polls for its completion (one core busy) before it blocks; 0 blocks at once (at most 10ms)")
	booleanDef(&c.CUDA.HostTrace, "cuda-host-trace", cudaDef.HostTrace, "cuda backend: print each call's host-side stage times to stderr (never tensor contents)")

	if err := errors.Join(envErrs...); err != nil {
		return c, err
	}
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, id := range strings.Split(admins, ",") {
		if id = strings.TrimSpace(id); id != "" {
			c.AdminIdentities = append(c.AdminIdentities, id)
		}
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = messageBytesFor(c.MaxTokens)
	}
	if c.SharedMemory && !flagSet(fs, "max-connection-age") && getenv(envName("max-connection-age")) == "" {
		c.MaxConnectionAge = 0 // see defaultMaxConnectionAge
	}
	mode, err := strconv.ParseUint(unixMode, 8, 32)
	if err != nil || mode > 0o777 {
		return c, fmt.Errorf("-unix-mode %q: want octal permission bits such as 0660", unixMode)
	}
	c.UnixMode = os.FileMode(mode)
	return c, c.validate()
}

// flagSet reports whether the command line set flag name.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// envName is the environment variable of a flag: -max-tokens is
// EXPERTD_MAX_TOKENS.
func envName(flagName string) string {
	return "EXPERTD_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// parseBytes reads an integer with an optional binary suffix (KiB, MiB,
// GiB, TiB).
func parseBytes(s string) (int64, error) {
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a whole number (with optional KiB, MiB, GiB, TiB)", s)
	}
	if n < 0 || (mult > 1 && n > (1<<62)/mult) {
		return 0, fmt.Errorf("%q is out of range", s)
	}
	return n * mult, nil
}

// validate checks ranges and enumerations.
func (c Config) validate() error {
	var errs []error
	if _, err := cuda.ParseOptions(c.CUDA.Map()); err != nil {
		errs = append(errs, fmt.Errorf("%w (option x is -cuda-x, $EXPERTD_CUDA_X)", err))
	}
	switch c.Backend {
	case "auto", "cpu", "cuda":
	default:
		errs = append(errs, fmt.Errorf("-backend %q: want auto, cpu or cuda", c.Backend))
	}
	if c.Listen == "" {
		errs = append(errs, errors.New("-listen: must not be empty"))
	} else if _, _, err := listenAddress(c.Listen); err != nil {
		errs = append(errs, err)
	}
	if c.MaxTokens < 1 {
		errs = append(errs, fmt.Errorf("-max-tokens %d: want >= 1", c.MaxTokens))
	}
	if c.MaxConcurrent < 1 {
		errs = append(errs, fmt.Errorf("-max-concurrent %d: want >= 1", c.MaxConcurrent))
	}
	// gRPC takes the limit as an int32-ranged int.
	if c.MaxMessageBytes < 1<<20 || c.MaxMessageBytes > 1<<31-1 {
		errs = append(errs, fmt.Errorf("-max-message-bytes %d: want between 1 MiB and 2 GiB - 1", c.MaxMessageBytes))
	}
	if c.Device < 0 || c.Threads < 0 {
		errs = append(errs, fmt.Errorf("-device %d, -threads %d: want >= 0", c.Device, c.Threads))
	}
	if _, err := c.level(); err != nil {
		errs = append(errs, err)
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		errs = append(errs, fmt.Errorf("-log-format %q: want text or json", c.LogFormat))
	}
	if c.OTLPEndpoint != "" {
		if u, err := url.Parse(c.OTLPEndpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("-otlp-endpoint %q: want an http:// or https:// URL with a host", c.OTLPEndpoint))
		}
	}
	errs = append(errs, c.validateSecurity()...)
	if c.BatchWindow < 0 || c.BatchWindow > maxBatchWindow {
		errs = append(errs, fmt.Errorf("-batch-window %v: want 0 (off) to %v", c.BatchWindow, maxBatchWindow))
	}
	if c.Ring && !c.SharedMemory {
		errs = append(errs, errors.New("-ring: needs -shared-memory (rings live in shared-memory regions)"))
	}
	if c.RingSpin < 0 || c.RingSpin > maxRingSpin {
		errs = append(errs, fmt.Errorf("-ring-spin %v: want 0 (sleep at once) to %v", c.RingSpin, maxRingSpin))
	}
	if c.RingMaxPerConn < 1 || c.RingMax < 1 || c.RingMaxSlotBytes < 128 || c.RingMaxSlotBytes > 1<<30 {
		errs = append(errs, fmt.Errorf("-ring-max-per-conn %d, -ring-max %d, -ring-max-slot-bytes %d: want >= 1, >= 1 and 128 B to 1 GiB", c.RingMaxPerConn, c.RingMax, c.RingMaxSlotBytes))
	}
	if c.MaxShmRegions < 1 || c.MaxShmBytes < 1 {
		errs = append(errs, fmt.Errorf("-max-shm-regions %d, -max-shm-bytes %d: want >= 1", c.MaxShmRegions, c.MaxShmBytes))
	}
	if c.IdleFreeMemory < 0 {
		errs = append(errs, fmt.Errorf("-idle-free-memory %v: want >= 0", c.IdleFreeMemory))
	}
	if c.StreamWorkers < 0 || c.StreamWorkers > maxStreamWorkers {
		errs = append(errs, fmt.Errorf("-stream-workers %d: want 0 (off) to %d", c.StreamWorkers, maxStreamWorkers))
	}
	if c.ShardIndex < -1 {
		errs = append(errs, fmt.Errorf("-shard-index %d: want >= 0, or -1 for the host name's ordinal", c.ShardIndex))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("-shutdown-timeout %v: want > 0", c.ShutdownTimeout))
	}
	errs = append(errs, c.validateKeepalive()...)
	return errors.Join(errs...)
}

func (c Config) level() (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(c.LogLevel)); err != nil {
		return l, fmt.Errorf("-log-level %q: want debug, info, warn or error", c.LogLevel)
	}
	return l, nil
}

// logger builds the daemon's slog logger.
func (c Config) logger(w io.Writer) *slog.Logger {
	l, _ := c.level()
	opts := &slog.HandlerOptions{Level: l}
	if c.LogFormat == "json" {
		return slog.New(clipHandler{slog.NewJSONHandler(w, opts)})
	}
	return slog.New(clipHandler{slog.NewTextHandler(w, opts)})
}

// listenAddress splits a -listen value into net.Listen's network and
// address. The unix forms are gRPC's target syntax, so a caller dials
// the very string the daemon was given: unix:///abs/path (an empty
// authority, then the absolute path) and unix:path (relative or
// absolute).
func listenAddress(listen string) (network, address string, err error) {
	rest, ok := strings.CutPrefix(listen, "unix:")
	if !ok {
		return "tcp", listen, nil
	}
	if p, ok := strings.CutPrefix(rest, "//"); ok {
		if !strings.HasPrefix(p, "/") {
			return "", "", fmt.Errorf("-listen %q: unix:// needs an absolute path (unix:///run/expertd.sock), or use unix:relative/path", listen)
		}
		rest = p
	}
	if rest == "" {
		return "", "", fmt.Errorf("-listen %q: the socket path is empty", listen)
	}
	return "unix", rest, nil
}
