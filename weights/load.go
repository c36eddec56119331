package weights

import (
	"log/slog"

	"github.com/expertd/expertd/moe"
)

// Loader reads expert sets from the files of one weights directory.
type Loader struct {
	// Dir is where files are read from; "" refuses every load.
	Dir Dir
	// Budget holds the daemon-wide cap on resident expert-set bytes, which
	// a load reserves against before it reads weights.
	Budget Budget
	// Quantizer quantizes BF16 and F16 weights; nil quantizes on the host.
	Quantizer HalfQuantizer
	// Log tells when a checkpoint layer's long read starts and ends; nil
	// discards.
	Log *slog.Logger
}

// log is l.Log, or a logger that discards without one.
func (l *Loader) log() *slog.Logger {
	if l.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l.Log
}

// Budget is a daemon-wide byte cap. Reserve takes n bytes or fails with
// the error the caller reports (field names the request field that asked);
// Release gives n back.
type Budget interface {
	Reserve(field string, n int64) error
	Release(n int64)
}

// Set is an expert set read from files. It holds its reservation of Bytes
// until Release, which is a no-op once Keep hands the bytes to the set's
// new owner.
type Set struct {
	Set *moe.ExpertSet
	// Bytes is what the set holds and reserved.
	Bytes int64
	// Fingerprint is moe.Fingerprint of the set's tensors.
	Fingerprint string
	// TopKHint is the checkpoint's experts per token, 0 when it says none.
	TopKHint int
	// Routing is the routing the checkpoint's config.json gives, checked
	// against the set; nil for none.
	Routing *moe.RoutingInput

	bufs   [moe.SetTensors][]byte
	budget Budget
	kept   bool
}

// Release gives the set's reservation back unless Keep was called.
func (s *Set) Release() {
	if !s.kept {
		s.budget.Release(s.Bytes)
	}
}

// Keep hands the reservation over to whoever now holds the set.
func (s *Set) Keep() { s.kept = true }
