// Package shard is expert parallelism's placement: which experts of an
// E-expert layer live on which of S shards, and, for one call's routing,
// which (token, slot) pairs each shard computes, and how their results
// combine into the call's output.
//
// A shard is whatever holds a subset of the experts: a GPU of one host
// (in-process expert parallelism) or an expertd daemon (the Go client's
// fan-out across hosts). Both levels use the same Map, so a placement can
// be nested or reused without translation. docs/sharding.md has the design.
package shard

import (
	"errors"
	"fmt"
	"strings"
)

// ErrPlacement is wrapped by every error about a map or a placement.
var ErrPlacement = errors.New("bad expert placement")

// Map is a placement of E experts on S shards: every expert on exactly one
// shard, every shard owning at least one expert. An expert's local id is its
// position in its shard's list, so shard s serves global expert
// Experts(s)[i] as its expert i. A Map is immutable and safe for concurrent
// use.
type Map struct {
	// experts[s] are shard s's global expert ids, in local-id order.
	experts [][]int
	// owner[e] and local[e] are where global expert e lives.
	owner, local []int
}

// Contiguous places e experts on s shards in contiguous ranges, balanced:
// the first e mod s shards get one expert more. With grouped routing
// (DeepSeek-V3) contiguous ranges keep groups together, so a token's
// experts land on fewer shards; see RoundRobin for the opposite trade.
func Contiguous(e, s int) (*Map, error) {
	if err := checkCounts(e, s); err != nil {
		return nil, err
	}
	p := make([][]int, s)
	base, extra := e/s, e%s
	next := 0
	for i := range s {
		n := base
		if i < extra {
			n++
		}
		for range n {
			p[i] = append(p[i], next)
			next++
		}
	}
	return New(e, p)
}

// RoundRobin places expert i on shard i mod s: balanced in count, and it
// spreads each expert group over the shards, which evens the load when a
// few adjacent experts are hot at the cost of sending a token to more
// shards.
func RoundRobin(e, s int) (*Map, error) {
	if err := checkCounts(e, s); err != nil {
		return nil, err
	}
	p := make([][]int, s)
	for i := range e {
		p[i%s] = append(p[i%s], i)
	}
	return New(e, p)
}

func checkCounts(e, s int) error {
	if e < 1 {
		return fmt.Errorf("%w: %d experts: want >= 1", ErrPlacement, e)
	}
	if s < 1 || s > e {
		return fmt.Errorf("%w: %d shards for %d experts: want 1 to %d (every shard owns an expert)", ErrPlacement, s, e, e)
	}
	return nil
}

// New validates an explicit placement of e experts: placement[s] lists the
// global ids on shard s, in local-id order. Every id must be in [0, e),
// appear exactly once over all shards, and every shard must own at least
// one; the error names the first violation. placement is copied.
func New(e int, placement [][]int) (*Map, error) {
	if e < 1 {
		return nil, fmt.Errorf("%w: %d experts: want >= 1", ErrPlacement, e)
	}
	if len(placement) < 1 {
		return nil, fmt.Errorf("%w: no shards", ErrPlacement)
	}
	m := &Map{experts: make([][]int, len(placement)), owner: make([]int, e), local: make([]int, e)}
	for i := range m.owner {
		m.owner[i] = -1
	}
	for s, ids := range placement {
		if len(ids) == 0 {
			return nil, fmt.Errorf("%w: shard %d owns no expert", ErrPlacement, s)
		}
		m.experts[s] = append([]int(nil), ids...)
		for i, id := range ids {
			if id < 0 || id >= e {
				return nil, fmt.Errorf("%w: shard %d lists expert %d: want ids in [0, %d)", ErrPlacement, s, id, e)
			}
			if o := m.owner[id]; o >= 0 {
				return nil, fmt.Errorf("%w: expert %d is on shard %d and again on shard %d", ErrPlacement, id, o, s)
			}
			m.owner[id], m.local[id] = s, i
		}
	}
	var missing []string
	for id, o := range m.owner {
		if o < 0 {
			missing = append(missing, fmt.Sprint(id))
		}
	}
	if len(missing) > 0 {
		if len(missing) > 8 {
			missing = append(missing[:8], fmt.Sprintf("... (%d in all)", len(missing)))
		}
		return nil, fmt.Errorf("%w: experts %s are on no shard", ErrPlacement, strings.Join(missing, ", "))
	}
	return m, nil
}

// NumExperts is E.
func (m *Map) NumExperts() int { return len(m.owner) }

// NumShards is S.
func (m *Map) NumShards() int { return len(m.experts) }

// Experts returns shard s's global expert ids in local-id order. The slice
// is the caller's.
func (m *Map) Experts(s int) []int { return append([]int(nil), m.experts[s]...) }

// Owner returns the shard that holds global expert e and e's local id there.
// It panics when e is out of range, like an index.
func (m *Map) Owner(e int) (shard, local int) { return m.owner[e], m.local[e] }

// Placement returns the map as an explicit placement, New's input.
func (m *Map) Placement() [][]int {
	p := make([][]int, len(m.experts))
	for s := range p {
		p[s] = m.Experts(s)
	}
	return p
}

// String is a compact description, e.g. "8 experts on 2 shards: [0-3] [4-7]".
func (m *Map) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d experts on %d shards:", m.NumExperts(), m.NumShards())
	for _, ids := range m.experts {
		b.WriteString(" [")
		b.WriteString(ranges(ids))
		b.WriteString("]")
	}
	return b.String()
}

// ranges writes ids with runs of consecutive ids as "a-b".
func ranges(ids []int) string {
	var parts []string
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if j > i {
			parts = append(parts, fmt.Sprintf("%d-%d", ids[i], ids[j]))
		} else {
			parts = append(parts, fmt.Sprint(ids[i]))
		}
		i = j + 1
	}
	return strings.Join(parts, " ")
}
