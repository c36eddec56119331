package service

import (
	"sort"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/kernels"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// registry holds the loaded expert sets and accounts for their memory.
//
// A set is reference-counted: a FusedMoE call holds it while running, so
// UnloadExperts (or an overwriting load) removes the name at once but frees
// the memory only when the last call lets go. That keeps "calls in flight
// finish first" true whatever the backend's Close does.
type registry struct {
	mu   sync.Mutex
	sets map[string]*entry
	// used counts resident sets plus reservations for loads and inline
	// sets in flight; limit bounds it (0: unlimited).
	used, limit int64
	// closeFn frees an entry once unreferenced; set by the Server.
	closeFn func(*entry)
}

// entry is one resident expert set.
type entry struct {
	info   *pb.ExpertSetInfo
	loaded kernels.Loaded
	// bytes is the reservation the entry holds until it is freed.
	bytes   int64
	refs    int
	removed bool
}

func newRegistry(limit int64) *registry {
	return &registry{sets: map[string]*entry{}, limit: limit, closeFn: func(*entry) {}}
}

// reserve claims n bytes against the limit; field names the request field
// for the error.
func (r *registry) reserve(field string, n int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.limit > 0 && r.used+n > r.limit {
		return limitf(field, "max-loaded-bytes", r.limit, 0, "%d bytes would exceed the server's max loaded bytes (%d of %d in use); unload a set first", n, r.used, r.limit)
	}
	r.used += n
	return nil
}

// release returns a reservation that never became an entry.
func (r *registry) release(n int64) {
	r.mu.Lock()
	r.used -= n
	r.mu.Unlock()
}

// usedBytes is the memory in use or reserved.
func (r *registry) usedBytes() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.used
}

// checkFree fails with AlreadyExists, naming field, when name is loaded
// and overwrite is unset: a load checks it before reading any weights, so
// a name clash costs nothing. put checks again when the set is ready.
func (r *registry) checkFree(field, name string, overwrite bool) error {
	r.mu.Lock()
	_, ok := r.sets[name]
	r.mu.Unlock()
	if ok && !overwrite {
		return errAlreadyLoaded(field, name)
	}
	return nil
}

func errAlreadyLoaded(field, name string) error {
	return codedf(codes.AlreadyExists, field, "expert set %s is already loaded; set overwrite to replace it", Quote(name))
}

// put makes e visible under its name. The entry takes over a reservation of
// e.bytes. With overwrite an existing set of that name is removed (freed
// when its calls finish); without, put fails with AlreadyExists.
func (r *registry) put(e *entry, overwrite bool) error {
	r.mu.Lock()
	old, ok := r.sets[e.info.GetName()]
	if ok && !overwrite {
		r.mu.Unlock()
		return errAlreadyLoaded("name", e.info.GetName())
	}
	r.sets[e.info.GetName()] = e
	free := ok && r.removeLocked(old)
	r.mu.Unlock()
	if free {
		r.closeFn(old)
	}
	return nil
}

// acquire returns the named set with a reference the caller must drop with
// done.
func (r *registry) acquire(name string) (*entry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.sets[name]
	if !ok {
		return nil, codedf(codes.NotFound, "expert_set", "no expert set %s is loaded", Quote(name))
	}
	e.refs++
	return e, nil
}

// hold takes another reference on e, which the caller already holds
// through acquire; drop it with done.
func (r *registry) hold(e *entry) {
	r.mu.Lock()
	e.refs++
	r.mu.Unlock()
}

// done drops a reference taken by acquire or hold.
func (r *registry) done(e *entry) {
	r.mu.Lock()
	e.refs--
	free := e.removed && e.refs == 0
	if free {
		r.used -= e.bytes
	}
	r.mu.Unlock()
	if free {
		r.closeFn(e)
	}
}

// remove unloads the named set; its memory is freed when unreferenced.
func (r *registry) remove(name string) (*entry, error) {
	r.mu.Lock()
	e, ok := r.sets[name]
	if !ok {
		r.mu.Unlock()
		return nil, codedf(codes.NotFound, "name", "no expert set %s is loaded", Quote(name))
	}
	delete(r.sets, name)
	free := r.removeLocked(e)
	r.mu.Unlock()
	if free {
		r.closeFn(e)
	}
	return e, nil
}

// removeLocked marks e removed and reports whether it can be freed now
// (its reservation is returned then).
func (r *registry) removeLocked(e *entry) bool {
	e.removed = true
	if e.refs > 0 {
		return false
	}
	r.used -= e.bytes
	return true
}

// list returns copies of every set's info, sorted by name.
func (r *registry) list() []*pb.ExpertSetInfo {
	r.mu.Lock()
	out := make([]*pb.ExpertSetInfo, 0, len(r.sets))
	for _, e := range r.sets {
		out = append(out, proto.Clone(e.info).(*pb.ExpertSetInfo))
	}
	r.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].GetName() < out[j].GetName() })
	return out
}

// removeAll unloads every set (Shutdown).
func (r *registry) removeAll() {
	r.mu.Lock()
	names := make([]string, 0, len(r.sets))
	for n := range r.sets {
		names = append(names, n)
	}
	r.mu.Unlock()
	for _, n := range names {
		r.remove(n) //nolint:errcheck // a concurrent remove already did it
	}
}
