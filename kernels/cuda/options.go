package cuda

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Options are the CUDA backend's switches: the GEMM path every call asks
// for and the library's expertd_options. The daemon sets them from its
// configuration (cmd/expertd: a -cuda-* flag and an EXPERTD_CUDA_*
// variable each) and passes them as kernels.Config.Options;
// GetServerInfo reports them, keyed by the names of OptionKeys.
type Options struct {
	// GEMM is auto, portable, portable-f16 or sm90.
	GEMM string
	// Streams is how many calls on one expert set run at once
	// (1..16): two let one call's host copies overlap another's kernels.
	Streams int
	// PDL launches each kernel of a call while its predecessor drains
	// (sm_90+); off times the chain without it.
	PDL bool
	// SM90Block runs block-scaled sets on the Hopper GEMM under auto.
	SM90Block bool
	// SM90Grid is persistent (as many CTAs as fit) or full (one per tile).
	SM90Grid string
	// SM90TokA puts tokens on wgmma's M side for 128-token block tiles.
	SM90TokA bool
	// SM90Pair runs two 128-row alignment blocks of one expert as one
	// 256-token tile (per-expert and per-channel scales).
	SM90Pair bool
	// SyncSpin is how long a call polls for its completion before it
	// blocks: up to that much of one core per call, for a faster wake-up.
	SyncSpin time.Duration
	// HostTrace prints each call's host-path stage times to stderr.
	HostTrace bool
	// Poison NaN-fills outputs and intermediates before each call, so a
	// kernel that skips a write fails the tests (test diagnostic).
	Poison bool
}

// DefaultOptions are the library's defaults.
func DefaultOptions() Options {
	return Options{GEMM: "auto", Streams: DefaultStreams, PDL: true, SM90Block: true, SM90Grid: "persistent", SM90TokA: true}
}

// DefaultStreams is the default Options.Streams.
const DefaultStreams = 2

// maxSyncSpin bounds Options.SyncSpin (the library's EXPERTD_MAX_SPIN_US).
const maxSyncSpin = maxSpinUS * time.Microsecond

// OptionKeys are the option names of ParseOptions and Map.
var OptionKeys = []string{"gemm", "streams", "pdl", "sm90-block", "sm90-grid", "sm90-toka", "sm90-pair", "sync-spin", "host-trace", "poison"}

// gemmPaths maps Options.GEMM to the ABI's path choice.
var gemmPaths = map[string]int64{
	"auto": gemmAuto, "portable": gemmPortable, "portable-f16": gemmPortableF16, "sm90": gemmSM90,
}

// ParseOptions reads options by name (OptionKeys) over the defaults, for
// a process configured by strings (a test binary's EXPERTD_CUDA_*
// variables). Unknown keys and bad values are errors naming the key.
func ParseOptions(kv map[string]string) (Options, error) {
	o := DefaultOptions()
	keys := make([]string, 0, len(kv))
	for k := range kv {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := kv[k]
		var err error
		boolean := func(p *bool) {
			*p, err = strconv.ParseBool(v)
		}
		switch k {
		case "gemm":
			o.GEMM = v
		case "streams":
			o.Streams, err = strconv.Atoi(v)
		case "pdl":
			boolean(&o.PDL)
		case "sm90-block":
			boolean(&o.SM90Block)
		case "sm90-grid":
			o.SM90Grid = v
		case "sm90-toka":
			boolean(&o.SM90TokA)
		case "sm90-pair":
			boolean(&o.SM90Pair)
		case "sync-spin":
			o.SyncSpin, err = time.ParseDuration(v)
		case "host-trace":
			boolean(&o.HostTrace)
		case "poison":
			boolean(&o.Poison)
		default:
			return o, fmt.Errorf("cuda: unknown option %q (want one of %s)", quote(k), strings.Join(OptionKeys, ", "))
		}
		if err != nil {
			return o, fmt.Errorf("cuda: option %s=%s: %w", k, quote(v), err)
		}
	}
	return o, o.Validate()
}

// Validate checks the options' ranges and enumerations; an error names
// the option (by its OptionKeys name) and its value.
func (o Options) Validate() error {
	bad := func(k, v, want string) error {
		return fmt.Errorf("cuda: option %s=%s: want %s", k, quote(v), want)
	}
	if _, ok := gemmPaths[o.GEMM]; !ok {
		return bad("gemm", o.GEMM, "auto, portable, portable-f16 or sm90")
	}
	if o.SM90Grid != "persistent" && o.SM90Grid != "full" {
		return bad("sm90-grid", o.SM90Grid, "persistent or full")
	}
	if o.Streams < 1 || o.Streams > maxStreams {
		return bad("streams", strconv.Itoa(o.Streams), fmt.Sprintf("1..%d", maxStreams))
	}
	if o.SyncSpin < 0 || o.SyncSpin > maxSyncSpin {
		return bad("sync-spin", o.SyncSpin.String(), fmt.Sprintf("0..%v", maxSyncSpin))
	}
	return nil
}

// quote bounds a caller's string before it reaches a message.
func quote(s string) string {
	if len(s) > 64 {
		s = s[:64] + "..."
	}
	return strconv.Quote(s)
}

// Map is o by name (every key of OptionKeys), as GetServerInfo reports
// the values in force.
func (o Options) Map() map[string]string {
	return map[string]string{
		"gemm": o.GEMM, "streams": strconv.Itoa(o.Streams), "pdl": strconv.FormatBool(o.PDL),
		"sm90-block": strconv.FormatBool(o.SM90Block), "sm90-grid": o.SM90Grid,
		"sm90-toka": strconv.FormatBool(o.SM90TokA), "sm90-pair": strconv.FormatBool(o.SM90Pair), "sync-spin": o.SyncSpin.String(),
		"host-trace": strconv.FormatBool(o.HostTrace), "poison": strconv.FormatBool(o.Poison),
	}
}

// c is o as the library's expertd_options.
func (o Options) c() *cOptions {
	b := func(v bool) int32 {
		if v {
			return 1
		}
		return 0
	}
	return &cOptions{size: optionsBytes, version: abiVersion, streams: int32(o.Streams), pdl: b(o.PDL),
		sm90Block: b(o.SM90Block), sm90Persistent: b(o.SM90Grid != "full"), sm90TokA: b(o.SM90TokA),
		poison: b(o.Poison), hostTrace: b(o.HostTrace), syncSpinUS: int32(o.SyncSpin / time.Microsecond), sm90Pair: b(o.SM90Pair)}
}
