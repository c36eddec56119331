// Package kernels defines what the service needs from a compute engine: the
// Backend interface over the request model of package moe (whose names
// backends use directly), and a registry through which backends make
// themselves available.
//
// Everything here is already checked at the service edge; backends trust
// shapes and byte lengths and never see a protobuf message.
package kernels

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// DeviceRegion is device memory another process shared through CUDA IPC,
// opened by a backend.
type DeviceRegion interface {
	// Ptr is the device address of the region's first byte.
	Ptr() uintptr
	// Size is the region's length in bytes.
	Size() int64
	// Close unmaps the region; no call may use its addresses afterwards.
	Close() error
}

// Capabilities say what a backend can run.
type Capabilities struct {
	// Activations and Granularities the backend supports.
	Activations   []moe.Activation
	Granularities []scaling.Granularity
	// Devices describes the hardware, e.g. "NVIDIA H200 (sm_90, 132 SMs)".
	Devices []string
	// MaxTokens is the largest M per call the backend accepts, 0 for no limit.
	MaxTokens int
	// Details are the backend's settings in force, by name, for
	// GetServerInfo (the cuda backend reports its Options).
	Details map[string]string
}

// Loaded is an expert set resident in a backend (host or device memory).
type Loaded interface {
	// Set is the expert set's metadata (weights may have been released from
	// host memory by device backends, so W13/W2 can be nil).
	Set() *moe.ExpertSet
	// Close frees the set's memory; calls in flight finish first.
	Close() error
}

// Backend runs fused MoE layers.
type Backend interface {
	// Name is the backend's registry name ("cpu", "cuda").
	Name() string
	// Capabilities reports what the backend supports.
	Capabilities() Capabilities
	// Load makes an expert set resident. The backend may keep set's slices.
	Load(ctx context.Context, set *moe.ExpertSet) (Loaded, error)
	// FusedMoE runs req through a loaded set. It is safe for concurrent use.
	FusedMoE(ctx context.Context, set Loaded, req *moe.Request) (*moe.Result, error)
	// Close releases the backend.
	Close() error
}

// ErrUnsupported marks a valid request this backend cannot run (an
// activation or granularity it lacks); the service maps it to
// FailedPrecondition or falls back.
var ErrUnsupported = errors.New("unsupported by backend")

// ErrOutOfMemory marks an allocation the backend could not make; the
// service maps it to ResourceExhausted.
var ErrOutOfMemory = errors.New("backend out of memory")

// Run loads set into b, runs req, checks the result's sizes and closes
// the set: one call from start to end, for a self-test or a test table.
func Run(ctx context.Context, b Backend, set *moe.ExpertSet, req *moe.Request) (*moe.Result, error) {
	l, err := b.Load(ctx, set)
	if err != nil {
		return nil, err
	}
	defer l.Close()
	res, err := b.FusedMoE(ctx, l, req)
	if err != nil {
		return nil, err
	}
	if n := req.M() * set.K * req.OutDType.Size(); len(res.Output) != n {
		return nil, fmt.Errorf("output has %d bytes, want %d", len(res.Output), n)
	}
	if !RoutingSized(req, res) {
		return nil, fmt.Errorf("topk ids/weights have %d/%d values, want %d", len(res.TopKIDs), len(res.TopKWeights), req.M()*req.Routing.TopK)
	}
	return res, nil
}

// RoutingSized says whether res carries req's routing as the contract
// asks: [M, TopK] ids and weights, or neither when req.NoRouting.
func RoutingSized(req *moe.Request, res *moe.Result) bool {
	if req.NoRouting && res.TopKIDs == nil && res.TopKWeights == nil {
		return true
	}
	n := req.M() * req.Routing.TopK
	return len(res.TopKIDs) == n && len(res.TopKWeights) == n
}

// Factory opens a backend from the daemon's configuration.
type Factory func(cfg Config) (Backend, error)

// Config is what the daemon passes to backend factories.
type Config struct {
	// LibraryPath locates a native kernel library, when the backend has one.
	LibraryPath string
	// Device is the GPU ordinal for device backends.
	Device int
	// Threads bounds CPU parallelism; 0 means GOMAXPROCS.
	Threads int
	// Options are the typed switches of the backend being opened (the
	// cuda backend takes a cuda.Options and refuses any other type); nil
	// means the backend's defaults.
	Options any
}

var (
	regMu     sync.Mutex
	factories = map[string]Factory{}
)

// Register makes a backend available by name; backends call it from init.
func Register(name string, f Factory) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := factories[name]; dup {
		panic("kernels: backend registered twice: " + name)
	}
	factories[name] = f
}

// Open opens the named backend.
func Open(name string, cfg Config) (Backend, error) {
	regMu.Lock()
	f, ok := factories[name]
	regMu.Unlock()
	if !ok {
		return nil, fmt.Errorf("kernels: no backend %q (have %v)", name, Names())
	}
	return f(cfg)
}

// Names lists the registered backends.
func Names() []string {
	regMu.Lock()
	defer regMu.Unlock()
	names := make([]string, 0, len(factories))
	for n := range factories {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
