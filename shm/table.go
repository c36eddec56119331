// Package shm is the shared memory callers on a daemon's host lend it:
// the table of registered regions (Table), which belong to an owner (a
// connection), are reference-counted by the calls using them and bounded
// by daemon-wide caps, and resolve a reference (region, offset, size) to
// memory: host bytes of a POSIX object's mapping, or a device address of
// an allocation shared through CUDA IPC. It knows nothing of the requests
// that point into regions; which fields may hold which memory, and how
// big they must be, is the server's to check.
//
// It also holds the one mmap implementation (Mapping) that both sides
// use: the daemon maps a caller's object (Open), the SDK creates one
// (Create).
package shm

import (
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/expertd/expertd/internal/clip"
)

// Kind is the memory a region is in. The values mirror
// expertd.v1.SharedMemoryKind.
type Kind int

const (
	// POSIX is host memory: a mapping of a shm_open object.
	POSIX Kind = 1
	// CUDAIPC is device memory another process shared through CUDA IPC.
	CUDAIPC Kind = 2
)

// String is the kind as the SDK prints it (client.RegionKind).
func (k Kind) String() string {
	switch k {
	case POSIX:
		return "posix"
	case CUDAIPC:
		return "cuda_ipc"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// DeviceMemory is device memory a backend opened from another process's
// CUDA IPC handle.
type DeviceMemory interface {
	// Ptr is the device address of the first byte.
	Ptr() uintptr
	// Size is the length in bytes.
	Size() int64
	// Close unmaps it; no call may use its addresses afterwards.
	Close() error
}

// Backing is the memory behind a region: a POSIX region's Mapping (with
// Unpin when a backend page-locked it), or a CUDA IPC region's Device.
type Backing struct {
	Mapping *Mapping
	Unpin   func() error
	Device  DeviceMemory
}

// Spec is what a registration names: a slice [Offset, Offset+Size) of the
// object Key (POSIX) or of an IPC allocation (CUDAIPC).
type Spec struct {
	Name, Key    string
	Kind         Kind
	Offset, Size int64
}

// Region is one registered region.
type Region struct {
	Spec
	registered time.Time
	b          Backing
	owner      uint64
	// refs counts calls holding the region; gone is set once it is
	// unregistered. Both are guarded by Table.mu; the memory is released
	// when gone && refs == 0.
	refs int
	gone bool
}

// Mapping is a POSIX region's mapping (Mapping.Bytes is the region), nil
// for CUDA IPC.
func (r *Region) Mapping() *Mapping { return r.b.Mapping }

// Info is a region as listed.
type Info struct {
	Spec
	Registered time.Time
	// CallsInFlight counts the calls holding the region.
	CallsInFlight int
	// Pinned says a backend page-locked a POSIX region's pages.
	Pinned bool
}

func (r *Region) infoLocked() Info {
	return Info{Spec: r.Spec, Registered: r.registered, CallsInFlight: r.refs, Pinned: r.b.Unpin != nil}
}

// Config bounds a Table.
type Config struct {
	// MaxRegions and MaxBytes are the daemon-wide caps on the regions
	// mapped (registered, or unregistered but still held) and their
	// bytes; MaxPerOwner bounds one owner's registered regions.
	MaxRegions  int64
	MaxBytes    int64
	MaxPerOwner int
	// Log reports memory that could not be released.
	Log *slog.Logger
}

// Table holds every owner's regions. Owners are connections: a name means
// nothing to another owner, and an owner's regions go when it
// disconnects.
type Table struct {
	cfg Config

	mu     sync.Mutex
	nextID uint64
	// owners has an entry for every connected owner (from Connect to
	// Disconnect), so a registration racing its owner's end cannot leave
	// a region nobody will clean up.
	owners map[uint64]map[string]*Region
	closed bool
	// mapped counts the regions mapped and their bytes, against the caps.
	mapped, mappedBytes int64
}

// New returns an empty table.
func New(cfg Config) *Table {
	return &Table{cfg: cfg, owners: map[uint64]map[string]*Region{}}
}

// Usage is the regions mapped (registered, or unregistered but still held
// by a call) and their bytes.
func (t *Table) Usage() (regions, bytes int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mapped, t.mappedBytes
}

// Connect adds an owner and returns its id. After Close the id owns
// nothing, and its calls fail with ErrClosed.
func (t *Table) Connect() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nextID++
	id := t.nextID
	if !t.closed {
		t.owners[id] = map[string]*Region{}
	}
	return id
}

// Disconnect unregisters the owner's regions and forgets it; it returns
// the regions' names, sorted.
func (t *Table) Disconnect(owner uint64) []string {
	t.mu.Lock()
	regs := t.owners[owner]
	delete(t.owners, owner)
	names, free := t.dropLocked(regs)
	t.mu.Unlock()
	t.free(free)
	return names
}

// Close unregisters every region and refuses new ones.
func (t *Table) Close() {
	t.mu.Lock()
	t.closed = true
	var free []*Region
	for id, regs := range t.owners {
		_, f := t.dropLocked(regs)
		free = append(free, f...)
		delete(t.owners, id)
	}
	t.mu.Unlock()
	t.free(free)
}

// dropLocked marks regs gone and returns their names, sorted, and those
// no call holds, for free once t.mu is released.
func (t *Table) dropLocked(regs map[string]*Region) (names []string, free []*Region) {
	names = make([]string, 0, len(regs))
	for name, r := range regs {
		r.gone = true
		if r.refs == 0 {
			free = append(free, t.forgetLocked(r))
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names, free
}

// forgetLocked takes r out of the counts; free releases its memory.
func (t *Table) forgetLocked(r *Region) *Region {
	t.mapped--
	t.mappedBytes -= r.Size
	return r
}

// free unmaps POSIX regions (unpinning them first: their pages must still
// be mapped) and closes CUDA IPC ones. It runs without t.mu, since
// munmap, cudaHostUnregister and cudaIpcCloseMemHandle can take a while
// and every call that uses shared memory takes t.mu.
func (t *Table) free(rs []*Region) {
	for _, r := range rs {
		if err := r.b.release(); err != nil && t.cfg.Log != nil {
			t.cfg.Log.Error("releasing shared memory", slog.String("region", r.Name), slog.String("kind", r.Kind.String()),
				slog.String("key", r.Key), slog.Uint64("conn", r.owner), slog.Any("err", err))
		}
	}
}

func (b Backing) release() error {
	if b.Device != nil {
		return b.Device.Close()
	}
	var err error
	if b.Unpin != nil {
		err = b.Unpin()
	}
	if b.Mapping != nil {
		err = errors.Join(err, b.Mapping.Close())
	}
	return err
}

// regionsLocked returns the owner's regions; t.mu must be held.
func (t *Table) regionsLocked(owner uint64) (map[string]*Region, error) {
	if t.closed {
		return nil, ErrClosed
	}
	regs, ok := t.owners[owner]
	if !ok {
		return nil, errorf(codes.Canceled, "", "the connection has closed")
	}
	return regs, nil
}

// admitLocked refuses a region of s's name and size that the owner (regs)
// or the table has no room for; t.mu must be held.
func (t *Table) admitLocked(regs map[string]*Region, s Spec) error {
	if _, dup := regs[s.Name]; dup {
		return errorf(codes.AlreadyExists, "name", "%s: this connection already has a region of that name; unregister it first", clip.Quote(s.Name))
	}
	if len(regs) >= t.cfg.MaxPerOwner {
		return &Error{Code: codes.ResourceExhausted, Field: "name", Quota: "regions-per-connection", Limit: int64(t.cfg.MaxPerOwner),
			Msg: fmt.Sprintf("this connection has %d regions, the most it may have; unregister one first", len(regs))}
	}
	if t.mapped >= t.cfg.MaxRegions {
		return exhaustedf("name", "the server has %d shared-memory regions mapped, the most it may (expertd -max-shm-regions); unregister regions or retry later", t.mapped)
	}
	if s.Size > t.cfg.MaxBytes-t.mappedBytes {
		return exhaustedf("byte_size", "%d bytes would take the server's shared-memory regions past %d bytes (%d mapped; expertd -max-shm-bytes); unregister regions or register less",
			s.Size, t.cfg.MaxBytes, t.mappedBytes)
	}
	return nil
}

// Register adds the region s to the owner's. The name and the caps are
// checked before open is called, so a refused registration costs no open
// or mapping, and again once open has made the memory, which is released
// if registrations raced past them meanwhile. open's errors are returned
// as they are.
func (t *Table) Register(owner uint64, s Spec, open func() (Backing, error)) (Info, error) {
	t.mu.Lock()
	regs, err := t.regionsLocked(owner)
	if err == nil {
		err = t.admitLocked(regs, s)
	}
	t.mu.Unlock()
	if err != nil {
		return Info{}, err
	}
	b, err := open()
	if err != nil {
		return Info{}, err
	}
	r := &Region{Spec: s, registered: time.Now(), b: b, owner: owner}
	t.mu.Lock()
	regs, err = t.regionsLocked(owner)
	if err == nil {
		err = t.admitLocked(regs, s)
	}
	if err != nil {
		t.mu.Unlock()
		t.free([]*Region{r}) // never shared
		return Info{}, err
	}
	regs[s.Name] = r
	t.mapped++
	t.mappedBytes += s.Size
	info := r.infoLocked()
	t.mu.Unlock()
	return info, nil
}

// Unregister forgets one of the owner's regions, or all of them when name
// is empty, and returns the names forgotten, sorted. The memory goes when
// the last call holding it lets go.
func (t *Table) Unregister(owner uint64, name string) ([]string, error) {
	t.mu.Lock()
	regs, err := t.regionsLocked(owner)
	if err != nil {
		t.mu.Unlock()
		return nil, err
	}
	drop := regs
	if name != "" {
		r, ok := regs[name]
		if !ok {
			t.mu.Unlock()
			return nil, errNoRegion(name, "")
		}
		drop = map[string]*Region{name: r}
	}
	// drop may be regs itself: mark before deleting.
	names, free := t.dropLocked(drop)
	for _, name := range names {
		delete(regs, name)
	}
	t.mu.Unlock()
	t.free(free)
	return names, nil
}

// List reports the owner's regions sorted by name, or the one named.
func (t *Table) List(owner uint64, name string) ([]Info, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	regs, err := t.regionsLocked(owner)
	if err != nil {
		return nil, err
	}
	if name != "" {
		r, ok := regs[name]
		if !ok {
			return nil, errNoRegion(name, "")
		}
		return []Info{r.infoLocked()}, nil
	}
	infos := make([]Info, 0, len(regs))
	for _, r := range regs {
		infos = append(infos, r.infoLocked())
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].Name < infos[j].Name })
	return infos, nil
}

func errNoRegion(name, hint string) error {
	return errorf(codes.NotFound, "region_name", "no shared-memory region %s on this connection%s", clip.Quote(name), hint)
}

// Lease is what one call holds: the regions it resolved references in,
// each held once until Release, so none is unmapped under the call. It is
// a value, so a call's lease costs no allocation of its own; a nil *Lease
// holds nothing.
type Lease struct {
	t     *Table
	owner uint64
	used  []*Region
}

// Lease starts a call of the owner's.
func (t *Table) Lease(owner uint64) Lease { return Lease{t: t, owner: owner} }

// Hold finds the owner's region name and holds it for the call.
func (l *Lease) Hold(name string) (*Region, error) {
	t := l.t
	t.mu.Lock()
	defer t.mu.Unlock()
	regs, err := t.regionsLocked(l.owner)
	if err != nil {
		return nil, err
	}
	r, ok := regs[name]
	if !ok {
		return nil, errNoRegion(name, "; register it first")
	}
	for _, x := range l.used {
		if x == r {
			return r, nil
		}
	}
	r.refs++
	l.used = append(l.used, r)
	return r, nil
}

// Memory is where a resolved reference's bytes are: Host for a POSIX
// region (page-locked when Pinned), Dev for a CUDA IPC one.
type Memory struct {
	// Host views exactly the referenced bytes; its capacity stops an
	// append from writing past them.
	Host   []byte
	Pinned bool
	Dev    uintptr
}

// Resolve holds the owner's region name and returns [off, off+size) of
// it, which must lie within the region.
func (l *Lease) Resolve(name string, off, size int64) (Memory, *Region, error) {
	r, err := l.Hold(name)
	if err != nil {
		return Memory{}, nil, err
	}
	if off < 0 || off > r.Size {
		return Memory{}, nil, invalidf("offset", "%d: want in [0, %d] (region %s has %d bytes)", off, r.Size, clip.Quote(r.Name), r.Size)
	}
	if size < 0 || size > r.Size-off {
		return Memory{}, nil, invalidf("byte_size", "%d at offset %d runs past the end of region %s (%d bytes)", size, off, clip.Quote(r.Name), r.Size)
	}
	if r.b.Device != nil {
		return Memory{Dev: r.b.Device.Ptr() + uintptr(off)}, r, nil
	}
	hi := off + size
	return Memory{Host: r.b.Mapping.Bytes()[off:hi:hi], Pinned: r.b.Unpin != nil}, r, nil
}

// Check checks that no POSIX region the call holds was shrunk under its
// mapping, which would make reads past the new end fault (SIGBUS); once
// per call, outside the table's lock. The check cannot close the race
// with a truncation while the call runs, which is why writes into a
// mapping go through Guard.
func (l *Lease) Check() error {
	for _, r := range l.used {
		if r.b.Mapping == nil {
			continue // device memory: freeing it is the caller's to avoid
		}
		if err := r.b.Mapping.Check(); err != nil {
			return errorf(codes.FailedPrecondition, "", "shared-memory region %s: %v; unregister and register it again", clip.Quote(r.Name), err)
		}
	}
	return nil
}

// Release lets go of the call's regions, releasing any unregistered
// meanwhile.
func (l *Lease) Release() {
	if l == nil || l.t == nil {
		return
	}
	t := l.t
	var free []*Region
	t.mu.Lock()
	for _, r := range l.used {
		r.refs--
		if r.gone && r.refs == 0 {
			free = append(free, t.forgetLocked(r))
		}
	}
	l.used = nil
	t.mu.Unlock()
	t.free(free)
}
