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
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cuda"
	"github.com/expertd/expertd/service"
)

// Config is every knob of the daemon, parsed once at start. Each field is
// set by a flag or, when the flag is absent, by its EXPERTD_* environment
// variable, else by its default: settings() is the table of them.
type Config struct {
	// Config is the service's: limits, batching, shared memory, rings and
	// the transport settings GetServerInfo reports. The daemon passes it
	// to service.New as it is.
	service.Config
	// Kernels is the backend's: LibraryPath, Device and Threads.
	Kernels kernels.Config
	// CUDA are the cuda backend's switches, its Kernels.Options when it
	// opens.
	CUDA cuda.Options
	// Listen is the gRPC address: host:port for TCP, or
	// unix:///absolute/path or unix:path for a Unix socket.
	Listen string
	// UnixMode is the permission bits of a Unix-socket listener's file:
	// who may connect.
	UnixMode os.FileMode
	// Backend is auto, cpu or cuda. auto tries cuda and falls back to cpu
	// with a warning.
	Backend string
	// AdminAddr serves /metrics (Prometheus) and /healthz; empty disables.
	AdminAddr string
	// LogLevel is debug, info, warn or error.
	LogLevel string
	// LogFormat is text or json.
	LogFormat string
	// OTLPEndpoint receives RPC traces over OTLP/gRPC, as a URL such as
	// http://localhost:4317 (http: plaintext, https: TLS); empty exports no
	// traces.
	OTLPEndpoint string
	// TLSCert and TLSKey are the server's PEM certificate (chain) and key;
	// both set serve TLS, neither plaintext.
	TLSCert, TLSKey string
	// TLSClientCA is a PEM bundle of CAs client certificates must chain
	// to; set, it turns on mutual TLS and authorization.
	TLSClientCA string
	// AuthTokensFile holds `token role` lines (role user or admin); set,
	// every call but health checks needs a bearer token or, with mTLS, a
	// client certificate.
	AuthTokensFile string
	// AdminIdentities are client-certificate names (subject CN or any
	// SAN) granted the admin role; other verified certificates are users.
	AdminIdentities []string
	// IdleFreeMemory is how long the daemon must admit no call before it
	// returns the memory a burst left behind to the OS; 0 leaves that to
	// the Go runtime.
	IdleFreeMemory time.Duration
	// Pprof serves net/http/pprof under /debug/pprof/ on AdminAddr.
	Pprof bool
	// ShutdownTimeout bounds the drain on SIGINT/SIGTERM before calls are
	// cut.
	ShutdownTimeout time.Duration
	// Manifest is a YAML or JSON file naming expert sets to load from
	// WeightsDir at start, before the daemon reports ready; see
	// manifest.go for the format.
	Manifest string
	// ShardIndex is the shard of a sharded manifest this daemon loads;
	// -1 takes it from the host name's ordinal.
	ShardIndex int
	// ShowVersion prints the version and exits.
	ShowVersion bool
	// Probe, when set, is a URL to GET instead of serving: exit status 0
	// on 200, for container health checks in images without curl.
	Probe string
	// Warnings are what parsing found worth a warning (a deprecated
	// variable read), logged once the logger is up.
	Warnings []string
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
	for _, st := range c.settings() {
		if st.bind == nil {
			continue // an environment-only row: read where it is used
		}
		if err := st.bind(fs, getenv); err != nil {
			envErrs = append(envErrs, err)
		}
	}
	if err := errors.Join(envErrs...); err != nil {
		return c, err
	}
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if c.Kernels.LibraryPath == "" && getenv(envName("library-path")) == "" {
		if p := getenv(deprecatedLibraryVar); p != "" {
			c.Kernels.LibraryPath = p
			c.Warnings = append(c.Warnings, deprecatedLibraryVar+" is deprecated: set EXPERTD_LIBRARY_PATH (or -library-path) instead")
		}
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = messageBytesFor(c.MaxTokens)
	}
	if c.SharedMemory && !flagSet(fs, "max-connection-age") && getenv(envName("max-connection-age")) == "" {
		c.MaxConnectionAge = 0 // see defaultMaxConnectionAge
	}
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
	if err := c.CUDA.Validate(); err != nil {
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
	if c.Kernels.Device < 0 || c.Kernels.Threads < 0 {
		errs = append(errs, fmt.Errorf("-device %d, -threads %d: want >= 0", c.Kernels.Device, c.Kernels.Threads))
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
	if c.Lanes && !c.SharedMemory {
		errs = append(errs, errors.New("-lanes: needs -shared-memory (a lane's tensors are CUDA IPC regions)"))
	}
	if c.MaxLanes < 1 {
		errs = append(errs, fmt.Errorf("-lane-max %d: want >= 1", c.MaxLanes))
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
