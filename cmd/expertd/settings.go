package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/expertd/expertd/kernels/cuda"
	"github.com/expertd/expertd/service"
)

// setting is one row of the daemon's configuration table: a flag, the
// EXPERTD_ variable that sets it when the flag is absent, its entry in
// GetServerInfo's settings and its line in the README's flag list.
type setting struct {
	// name is the flag's; the variable is envName(name).
	name string
	// env is the variable of an environment-only row (no flag, not
	// reported): a deprecated alias or a diagnostic of test binaries.
	env  string
	help string
	// def is the default as the README shows it.
	def string
	// cmdOnly marks a command-line mode (-version, -probe): no variable,
	// not reported.
	cmdOnly bool
	// redact reports only whether the setting is set: where the keys are,
	// who the admins are and a collector URL (which may carry credentials)
	// are no business of every caller.
	redact bool
	// bind registers the flag on fs with the variable's value, when set,
	// as its default; an error is the variable's.
	bind func(fs *flag.FlagSet, getenv func(string) string) error
	// value is the setting in force, as the flag would spell it.
	value func() string
}

// variable is the row's environment variable, "" for a command-line mode.
func (s setting) variable() string {
	switch {
	case s.env != "":
		return s.env
	case s.cmdOnly:
		return ""
	}
	return envName(s.name)
}

// deprecatedLibraryVar is the old name of $EXPERTD_LIBRARY_PATH, read
// only when that is unset, with a warning.
const deprecatedLibraryVar = "EXPERTD_CUDA_LIB"

// settings is the table of c's settings, bound to c's fields: parseConfig
// registers its flags and variables, GetServerInfo reports its values and
// the README lists it (TestREADMEFlags).
func (c *Config) settings() []setting {
	cudaDef := cuda.DefaultOptions()
	return []setting{
		str(&c.Listen, "listen", defaultListen, "gRPC listen address: host:port, or unix:///absolute/path (or unix:path) for a Unix socket"),
		fileMode(&c.UnixMode, "unix-mode", defaultUnixMode, "permissions (octal) of the -listen unix: socket file; connecting needs write permission"),
		str(&c.Backend, "backend", "auto", "compute backend: auto (cuda if it loads, else cpu), cpu or cuda"),
		str(&c.Kernels.LibraryPath, "library-path", "", "path of the CUDA kernel library (libexpertd_cuda.so); empty searches the default locations"),
		{env: deprecatedLibraryVar, help: "deprecated alias of $EXPERTD_LIBRARY_PATH, read only when that is unset (with a warning)"},
		integer(&c.Kernels.Device, "device", 0, "GPU ordinal for the cuda backend"),
		integer(&c.Kernels.Threads, "threads", 0, "goroutines per call for the cpu backend; 0 means GOMAXPROCS"),
		str(&c.WeightsDir, "weights-dir", "", "directory safetensors loads may read from; empty disables safetensors loading"),
		integer(&c.MaxTokens, "max-tokens", defaultMaxTokens, "largest number of tokens M in one FusedMoE call"),
		i64(&c.MaxMessageBytes, "max-message-bytes", 0, "largest gRPC message in bytes (suffixes KiB, MiB, GiB); 0 sizes it for FP32 requests of max-tokens tokens with K <= 8192, E <= 512"),
		i64(&c.MaxLoadedBytes, "max-loaded-bytes", defaultMaxLoadedBytes, "bytes of expert weights that may be resident at once (suffixes KiB, MiB, GiB); 0 means unlimited"),
		integer(&c.MaxConcurrent, "max-concurrent", defaultMaxConcurrent, "FusedMoE calls that run at once; more wait in order"),
		integer(&c.MaxQueued, "max-queued", 0, "FusedMoE calls that may wait for a slot; more are refused with RESOURCE_EXHAUSTED; 0 means 4 x max-concurrent"),
		str(&c.AdminAddr, "admin-addr", defaultAdminAddr, "address serving /metrics and /healthz; empty disables it"),
		str(&c.LogLevel, "log-level", "info", "log level: debug, info, warn or error"),
		str(&c.LogFormat, "log-format", "text", "log format: text or json"),
		redacted(str(&c.OTLPEndpoint, "otlp-endpoint", "", "OTLP/gRPC collector URL for RPC traces, e.g. http://localhost:4317; empty disables tracing")),
		redacted(str(&c.TLSCert, "tls-cert", "", "PEM certificate (chain) to serve TLS with; needs -tls-key")),
		redacted(str(&c.TLSKey, "tls-key", "", "PEM private key of -tls-cert")),
		redacted(str(&c.TLSClientCA, "tls-client-ca", "", "PEM CA bundle; set, clients must present a certificate it signed (mutual TLS), which grants the user role")),
		redacted(str(&c.AuthTokensFile, "auth-tokens-file", "", "file of \"token role\" lines (role user or admin); set, calls other than health checks need a bearer token")),
		list(&c.AdminIdentities, "admin-identities", "comma-separated client-certificate names (subject CN or SAN) granted the admin role; needs -tls-client-ca"),
		str(&c.Manifest, "manifest", "", "YAML or JSON file of expert sets to load from -weights-dir before reporting ready; empty loads none"),
		shardIndex(&c.ShardIndex, "shard-index", "shard of a sharded -manifest to load; -1 takes the ordinal at the end of the host name (a StatefulSet pod's expertd-2 is 2)"),
		{name: "version", cmdOnly: true, help: "print the version and exit", def: "false",
			bind: func(fs *flag.FlagSet, _ func(string) string) error {
				fs.BoolVar(&c.ShowVersion, "version", false, "print the version and exit")
				return nil
			}},
		{name: "probe", cmdOnly: true, help: "GET this URL (e.g. http://127.0.0.1:9090/livez), exit 0 on 200 and 1 otherwise, instead of serving",
			bind: func(fs *flag.FlagSet, _ func(string) string) error {
				fs.StringVar(&c.Probe, "probe", "", "GET this URL (e.g. http://127.0.0.1:9090/livez), exit 0 on 200 and 1 otherwise, instead of serving")
				return nil
			}},
		boolean(&c.SharedMemory, "shared-memory", false, "serve RegisterSharedMemory: callers on this host may pass tensors and receive outputs in POSIX shared memory (/dev/shm) or, with the cuda backend, in GPU memory shared through CUDA IPC"),
		boolean(&c.Ring, "ring", false, "serve AttachRing: shared-memory callers may post FusedMoE calls through a call ring in a POSIX region (docs/ring.md), each ring polled by one thread; needs -shared-memory"),
		integer(&c.RingMaxPerConn, "ring-max-per-conn", service.DefaultRingMaxPerConn, "call rings one connection may attach"),
		integer(&c.RingMax, "ring-max", service.DefaultRingMax, "call rings served at once"),
		i64(&c.RingMaxSlotBytes, "ring-max-slot-bytes", service.DefaultRingMaxSlotBytes, "largest call-ring slot in bytes (suffixes KiB, MiB, GiB)"),
		boolean(&c.Lanes, "lanes", false, "serve OpenLane, GPU-ordered lanes for callers on the daemon's GPU (needs MPS to pay off, and -lane-max plus the daemon's other streams within the GPU's 32 hardware queues; docs/gpu-ordered.md); needs -shared-memory and the cuda backend"),
		integer(&c.MaxLanes, "lane-max", service.DefaultLaneMax, "GPU-ordered lanes (OpenLane) open at once; served with -shared-memory by the cuda backend; each holds one of the GPU's 32 hardware queues (docs/gpu-ordered.md)"),
		integer(&c.MaxShmRegions, "max-shm-regions", service.DefaultMaxShmRegions, "shared-memory regions mapped at once over all connections (each connection has at most 64); more are refused with RESOURCE_EXHAUSTED"),
		i64(&c.MaxShmBytes, "max-shm-bytes", service.DefaultMaxShmBytes, "bytes of the shared-memory regions mapped at once over all connections (suffixes KiB, MiB, GiB); more are refused with RESOURCE_EXHAUSTED"),
		boolean(&c.Pprof, "pprof", false, "serve Go's profiles (net/http/pprof) under /debug/pprof/ on -admin-addr, which has no authorization: keep it on loopback"),
		duration(&c.IdleFreeMemory, "idle-free-memory", defaultIdleFreeMemory, "after this long without a call, return the memory a burst left behind to the OS; 0 leaves it to the Go runtime (GOMEMLIMIT also applies)"),
		duration(&c.ShutdownTimeout, "shutdown-timeout", defaultShutdown, "how long a drain waits for calls in flight on SIGINT/SIGTERM"),
		duration(&c.BatchWindow, "batch-window", service.SuggestedBatchWindow, "dynamic batching: FusedMoE calls that arrive while a compatible call runs are merged into one backend call, which waits this long after the running one for more; 0 disables batching"),
		duration(&c.RingSpin, "ring-spin", service.DefaultRingSpin, "how long a call ring's poller polls (one core busy) after its last call before it sleeps on the doorbell; 0 sleeps at once"),
		integer(&c.StreamWorkers, "stream-workers", 0, "run RPC handlers on a pool of this many goroutines instead of one new goroutine per call (grpc-go's NumStreamWorkers); 0 keeps one per call"),
		integer(&c.BatchMaxTokens, "batch-max-tokens", 0, fmt.Sprintf("most tokens in one merged backend call; 0 means %d", service.DefaultBatchMaxTokens)),
		duration(&c.KeepaliveMinTime, "keepalive-min-time", defaultKeepaliveMinTime, "shortest client ping interval allowed; a client pinging more often gets GOAWAY too_many_pings"),
		duration(&c.KeepaliveTime, "keepalive-time", defaultKeepaliveTime, "ping a connection idle this long"),
		duration(&c.KeepaliveTimeout, "keepalive-timeout", defaultKeepaliveTimeout, "close a connection whose ping is not answered within this"),
		duration(&c.MaxConnectionAge, "max-connection-age", defaultMaxConnectionAge, "send GOAWAY to a connection this old (±10% jitter) so clients rebalance over replicas; 0 never ages connections; with -shared-memory the default is 0"),
		duration(&c.MaxConnectionAgeGrace, "max-connection-age-grace", defaultMaxConnectionGrace, "how long calls in flight on an aged connection have to finish; 0 waits for them without limit"),
		str(&c.CUDA.GEMM, "cuda-gemm", cudaDef.GEMM, "cuda backend: GEMM path of every call: auto (the Hopper wgmma kernels where the card and shape allow, else portable), portable, portable-f16 or sm90"),
		integer(&c.CUDA.Streams, "cuda-streams", cudaDef.Streams, "cuda backend: calls on one expert set that run at once, each with its own stream and workspace (1-16)"),
		boolean(&c.CUDA.PDL, "cuda-pdl", cudaDef.PDL, "cuda backend: launch a call's kernels with programmatic dependent launch (sm_90+)"),
		boolean(&c.CUDA.SM90Block, "cuda-sm90-block", cudaDef.SM90Block, "cuda backend: run block-scaled sets on the Hopper kernels under -cuda-gemm auto"),
		str(&c.CUDA.SM90Grid, "cuda-sm90-grid", cudaDef.SM90Grid, "cuda backend: Hopper GEMM grid: persistent (as many CTAs as fit) or full (one per tile)"),
		boolean(&c.CUDA.SM90TokA, "cuda-sm90-toka", cudaDef.SM90TokA, "cuda backend: put tokens on wgmma's M side for block-scaled 128-token tiles"),
		boolean(&c.CUDA.SM90Pair, "cuda-sm90-pair", cudaDef.SM90Pair, "cuda backend: run two 128-row blocks of one expert as one 256-token Hopper tile (per-expert and per-channel scales)"),
		duration(&c.CUDA.SyncSpin, "cuda-sync-spin", cudaDef.SyncSpin, "cuda backend: how long a call polls for its completion (one core busy) before it blocks; 0 blocks at once (at most 10ms)"),
		boolean(&c.CUDA.HostTrace, "cuda-host-trace", cudaDef.HostTrace, "cuda backend: print each call's host-side stage times to stderr (never tensor contents)"),
		{env: "EXPERTD_CUDA_POISON", help: "test binaries of kernels/cuda: 1 NaN-fills outputs and intermediates before each call, so a kernel that skips a write fails its test"},
		{env: "EXPERTD_CUDA_REQUIRE", help: "test binaries of kernels/cuda: 1 turns a missing GPU or library into a failure instead of a skip"},
		{env: "EXPERTD_CUDA_TIMING", help: "test binaries of kernels/cuda: 1 runs the Nemotron timings"},
	}
}

// inForce is every reported setting's value by flag name, for
// GetServerInfo.
func (c *Config) inForce() map[string]string {
	m := map[string]string{}
	for _, s := range c.settings() {
		if s.value == nil {
			continue
		}
		v := s.value()
		if s.redact && v != "" {
			v = "(set)"
		}
		m[s.name] = v
	}
	return m
}

// row is a setting that bind sets to its default, then to its variable
// with parse (an error names the variable), and registers as a flag.
// Building the table changes no field, so inForce can build it again.
func row(name, def, help string, parse func(string) error, register func(fs *flag.FlagSet, help string), value func() string) setting {
	return setting{name: name, def: def, help: help, value: value,
		bind: func(fs *flag.FlagSet, getenv func(string) string) error {
			if err := parse(def); err != nil {
				panic(fmt.Sprintf("setting %s: default %q: %v", name, def, err))
			}
			env := envName(name)
			var err error
			if v := getenv(env); v != "" {
				if err = parse(v); err != nil {
					err = fmt.Errorf("$%s: %w", env, err)
				}
			}
			register(fs, help+" ($"+env+")")
			return err
		}}
}

func str(p *string, name, def, help string) setting {
	return row(name, def, help, func(v string) error { *p = v; return nil },
		func(fs *flag.FlagSet, help string) { fs.StringVar(p, name, *p, help) },
		func() string { return *p })
}

// num reads numbers with one function, so flags and variables accept the
// same spellings (byte suffixes included).
func num(name string, def int64, help string, set func(int64), get func() int64) setting {
	parse := func(v string) error {
		n, err := parseBytes(v)
		set(n)
		return err
	}
	return row(name, strconv.FormatInt(def, 10), help, parse,
		func(fs *flag.FlagSet, help string) {
			fs.Func(name, fmt.Sprintf("%s (default %d)", help, get()), parse)
		},
		func() string { return strconv.FormatInt(get(), 10) })
}

func i64(p *int64, name string, def int64, help string) setting {
	return num(name, def, help, func(n int64) { *p = n }, func() int64 { return *p })
}

func integer(p *int, name string, def int, help string) setting {
	return num(name, int64(def), help, func(n int64) { *p = int(min(n, 1<<31-1)) }, func() int64 { return int64(*p) })
}

func boolean(p *bool, name string, def bool, help string) setting {
	return row(name, strconv.FormatBool(def), help,
		func(v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("%q is not true or false", v)
			}
			*p = b
			return nil
		},
		func(fs *flag.FlagSet, help string) { fs.BoolVar(p, name, *p, help) },
		func() string { return strconv.FormatBool(*p) })
}

func duration(p *time.Duration, name string, def time.Duration, help string) setting {
	return row(name, def.String(), help,
		func(v string) error {
			d, err := time.ParseDuration(v)
			*p = d
			return err
		},
		func(fs *flag.FlagSet, help string) { fs.DurationVar(p, name, *p, help) },
		func() string { return p.String() })
}

// shardIndex takes a whole number, negative ones included (-1 is the host
// name's ordinal).
func shardIndex(p *int, name, help string) setting {
	return row(name, "-1", help,
		func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil {
				return fmt.Errorf("%q is not a whole number", v)
			}
			*p = n
			return nil
		},
		func(fs *flag.FlagSet, help string) { fs.IntVar(p, name, *p, help) },
		func() string { return strconv.Itoa(*p) })
}

// fileMode takes octal permission bits.
func fileMode(p *os.FileMode, name, def, help string) setting {
	parse := func(v string) error {
		mode, err := strconv.ParseUint(v, 8, 32)
		if err != nil || mode > 0o777 {
			return fmt.Errorf("-%s %q: want octal permission bits such as 0660", name, v)
		}
		*p = os.FileMode(mode)
		return nil
	}
	value := func() string { return fmt.Sprintf("%04o", uint32(*p)) }
	return row(name, def, help, parse,
		func(fs *flag.FlagSet, help string) {
			fs.Func(name, fmt.Sprintf("%s (default %s)", help, value()), parse)
		}, value)
}

// list takes comma-separated names, blanks dropped; it is redacted like
// the security settings it belongs to.
func list(p *[]string, name, help string) setting {
	parse := func(v string) error {
		*p = nil
		for _, id := range strings.Split(v, ",") {
			if id = strings.TrimSpace(id); id != "" {
				*p = append(*p, id)
			}
		}
		return nil
	}
	return redacted(row(name, "", help, parse,
		func(fs *flag.FlagSet, help string) { fs.Func(name, help, parse) },
		func() string { return strings.Join(*p, ",") }))
}

// redacted marks s as reported only as set or unset.
func redacted(s setting) setting {
	s.redact = true
	return s
}

// markdown is the README's flag list: one table row per setting.
func (c *Config) markdown() string {
	var b strings.Builder
	b.WriteString("| flag | variable | default | what it does |\n|---|---|---|---|\n")
	code := func(s string) string {
		if s == "" {
			return ""
		}
		return "`" + s + "`"
	}
	for _, s := range c.settings() {
		flagName := ""
		if s.bind != nil {
			flagName = "-" + s.name
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", code(flagName), code(s.variable()), code(s.def),
			strings.ReplaceAll(s.help, "|", `\|`))
	}
	return b.String()
}
