// Package codec is the gRPC codec of expertd's server and Go SDK: protobuf
// on the wire, but tensor bytes are not copied on the way in or out.
//
// grpc-go's default codec copies a received message twice before a
// handler sees it (its frames into one buffer, then each bytes field out
// of that buffer into a fresh slice), and copies each bytes field of a
// sent message into the marshal buffer. For expertd's messages those
// fields are the tensors, hundreds of kilobytes to gigabytes. This codec
// parses with the bytes fields aliasing the received message: where the
// message's HTTP/2 frames lie back to back (BufferPool places them so), in
// those frames; else in one buffer they are gathered into, since a message
// must be contiguous to parse. It sends large bytes fields as buffers of
// their own instead of copying them.
//
// Lifetimes: a received message's buffer is ordinary Go memory that lives
// exactly as long as something refers to it (the request, a view of it in
// a batch, the response), unless Codec.Recycle picks the message: then the
// message is parsed in its frames or gathered into a buffer from a Pool,
// and either goes back when its handler calls Release, which it must do
// only when nothing refers to the message any more. The server recycles
// FusedMoE requests only (service.ServerOptions), because fresh
// multi-megabyte buffers cost a page fault per 4 KiB on first write. A
// Receiver does the same for one call's large responses and hands the
// buffer to the caller (the SDK's FusedMoEResult.Release returns it).
// A sent message must not change until gRPC is done with it, which
// grpc-go already requires of every message passed to SendMsg; a buffer
// lent to Marshal (Pool.Lend) goes back to its pool when gRPC frees the
// encoded message.
package codec

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/expertd/expertd/internal/clip"
)

// Name is the codec's name: it replaces the standard protobuf codec, and
// its wire format is exactly protobuf's.
const Name = "proto"

// AliasBytes is the smallest bytes field Marshal sends as a buffer of its
// own rather than copying: one HTTP/2 frame, below which a copy is cheaper
// than another buffer to track.
const AliasBytes = 16 << 10

// aliasBytes is AliasBytes, lowered by tests so that small fuzz inputs
// take the referencing path too.
var aliasBytes = AliasBytes

// recursionLimit bounds message nesting, as protobuf's decoder does (with
// its default).
const recursionLimit = 10000

var errRecursion = errors.New("codec: message nested too deeply")

// Codec is the aliasing protobuf codec; its zero value is ready to use.
// Pass it with grpc.ForceServerCodecV2 or grpc.ForceCodecV2.
type Codec struct {
	// Recycle, when set, picks received messages whose buffer comes from
	// a pool instead of a fresh allocation (whose first write faults in
	// every page; see Pool). Whoever handles such a message must call
	// Release once nothing refers to it or to its bytes fields.
	Recycle func(proto.Message) bool
	// Refuse, when set, makes a request that does not parse the caller's
	// InvalidArgument instead of grpc-go's Internal: grpc-go answers any
	// error of a codec's Unmarshal with Internal ("grpc: failed to
	// unmarshal the received message"), whatever its type, before any
	// interceptor runs. So Unmarshal of such a message succeeds, leaving
	// the message empty, and keeps an InvalidArgument status that
	// UnaryServerInterceptor and StreamServerInterceptor return in the
	// handler's place. A server that sets it must install both.
	Refuse bool
}

var _ encoding.CodecV2 = Codec{}

// Name implements encoding.CodecV2.
func (Codec) Name() string { return Name }

// Marshal implements encoding.CodecV2. Messages without a bytes field of
// at least AliasBytes are marshalled by grpc-go's protobuf codec.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("codec: cannot marshal %T: not a proto.Message", v)
	}
	// A message smaller than AliasBytes cannot hold a large field; its
	// size (generated code) is far cheaper than hasLarge's reflection walk.
	r := m.ProtoReflect()
	if proto.Size(m) < aliasBytes || !hasLarge(r, 0) {
		return encoding.GetCodecV2(Name).Marshal(v)
	}
	var w writer
	if err := w.message(r, 0); err != nil {
		return nil, err
	}
	w.flush()
	return w.out, nil
}

// Unmarshal implements encoding.CodecV2: data is copied once into a
// buffer of its own, and v's bytes fields alias that buffer.
func (c Codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("codec: cannot unmarshal into %T: not a proto.Message", v)
	}
	err := c.unmarshal(data, m)
	if err == nil || !c.Refuse {
		return err
	}
	msg := "malformed request: " + clip.To(err.Error(), clip.Line)
	if field := badUTF8Field(data.Materialize(), m.ProtoReflect().Descriptor(), 0); field != "" {
		msg = "malformed request: field " + field + " is not valid UTF-8"
	}
	proto.Reset(m)
	refused.Store(m, status.Error(codes.InvalidArgument, msg))
	nRefused.Add(1)
	return nil
}

func (c Codec) unmarshal(data mem.BufferSlice, m proto.Message) error {
	if data.Len() >= AliasBytes && c.Recycle != nil && c.Recycle(m) {
		h, err := unmarshalHeld(data, m)
		if err != nil {
			return err
		}
		held.Store(m, h)
		return nil
	}
	// bytes.Join allocates without zeroing, which for a large message
	// costs more than the copy itself (mem.BufferSlice.Materialize zeroes
	// first: BenchmarkServicePath's profile shows it).
	pieces := make([][]byte, len(data))
	for i, b := range data {
		pieces[i] = b.ReadOnlyData()
	}
	return Unmarshal(bytes.Join(pieces, nil), m)
}

// Held is the receive buffer of a message that its owner releases once
// nothing refers to the message or its bytes fields: the transport's
// frames the message was parsed from in place, or a pooled copy of them.
// The zero Held holds nothing.
type Held struct {
	frames mem.BufferSlice
	tail   *[]byte // the frame region a small last frame was copied into
	buf    []byte
}

// Holds reports whether h holds a buffer.
func (h Held) Holds() bool { return h.frames != nil || h.buf != nil }

// Contains reports whether b lies within the buffer h holds: whether a
// bytes field aliases it rather than holding a copy.
func (h Held) Contains(b []byte) bool {
	lo, n := unsafe.Pointer(unsafe.SliceData(h.buf)), len(h.buf)
	if h.frames != nil {
		// The frames and the tail copied after them are back to back.
		lo, n = unsafe.Pointer(unsafe.SliceData(h.frames[0].ReadOnlyData())), h.frames.Len()
		if h.tail != nil {
			n += len(*h.tail)
		}
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return len(b) > 0 && lo != nil && p >= uintptr(lo) && p+uintptr(len(b)) <= uintptr(lo)+uintptr(n)
}

// Release hands the buffer back for reuse; call it once, and use nothing
// taken from the message afterwards. Never releasing it is safe: the
// garbage collector frees it.
func (h Held) Release() {
	if h.frames != nil {
		h.frames.Free()
		if h.tail != nil {
			frames.Put(h.tail)
		}
	} else if h.buf != nil {
		received.Put(h.buf)
	}
}

// unmarshalHeld parses data into m from a buffer that stays valid until
// the returned Held is released: in place when data's frames lie back to
// back in the transport's memory (BufferPool), else from a copy in a
// buffer of the received pool. It holds nothing when it fails.
func unmarshalHeld(data mem.BufferSlice, m proto.Message) (Held, error) {
	// gRPC frees data when Unmarshal returns; the message keeps its own
	// references to the frames it aliases.
	if b, refs, tail := frames.inPlace(data); b != nil {
		h := Held{frames: refs, tail: tail}
		if err := Unmarshal(b, m); err != nil {
			h.Release()
			return Held{}, err
		}
		return h, nil
	}
	buf := received.Get(data.Len())
	data.CopyTo(buf)
	if err := Unmarshal(buf, m); err != nil {
		received.Put(buf)
		return Held{}, err
	}
	return Held{buf: buf}, nil
}

// received recycles the buffers of messages Codec.Recycle or a Receiver
// picked whose frames were not back to back.
var received Pool

// Receiver is the codec of one call (grpc.ForceCodecV2 as a call
// option) whose large received message is parsed from a buffer that the
// caller takes afterwards, rather than one the garbage collector frees: a
// client's response buffer belongs to whatever the caller keeps of the
// response, so only the caller can say when it is free. Take the buffer
// after each received message (a stream's RecvMsg returns in one
// goroutine at a time); a message received while one is still held is
// parsed as Codec does.
type Receiver struct {
	Codec
	held Held
}

var _ encoding.CodecV2 = (*Receiver)(nil)

// Unmarshal implements encoding.CodecV2.
func (r *Receiver) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok || data.Len() < AliasBytes || r.held.Holds() {
		return r.Codec.Unmarshal(data, v)
	}
	h, err := unmarshalHeld(data, m)
	if err != nil {
		return err
	}
	r.held = h
	return nil
}

// Take returns the buffer the last message was parsed from (one that
// holds nothing when there is none) and forgets it. The caller owns it:
// it releases it once nothing refers to the message or its bytes fields.
func (r *Receiver) Take() Held {
	h := r.held
	r.held = Held{}
	return h
}

// held maps each such message to its buffer until Release.
var held sync.Map

// Release returns the receive buffer of m, a message unmarshalled by a
// Codec whose Recycle picked it, for reuse; m and every bytes field
// taken from it must not be used afterwards. Other messages are ignored.
func Release(m proto.Message) {
	if h, ok := held.LoadAndDelete(m); ok {
		h.(Held).Release()
	}
}

// Unmarshal parses b into m, as proto.Unmarshal does, except that when b
// is at least AliasBytes long every singular bytes field of m (and of the
// singular messages within it) aliases b instead of holding a copy: b must
// not change while m is in use. Other fields are decoded by
// proto.Unmarshal, one at a time; a message's encoding is the
// concatenation of its fields', so that is the same parse. A shorter b is
// parsed by proto.Unmarshal outright (its bytes fields copied): the
// field-by-field walk costs microseconds, which a small message, a
// shared-memory call's above all, would pay for copies of a few bytes.
func Unmarshal(b []byte, m proto.Message) error {
	if len(b) < aliasBytes {
		return proto.Unmarshal(b, m)
	}
	proto.Reset(m)
	return unmarshal(b, m.ProtoReflect(), 0)
}

func unmarshal(b []byte, m protoreflect.Message, depth int) error {
	if depth > recursionLimit {
		return errRecursion
	}
	fields := m.Descriptor().Fields()
	merge := proto.UnmarshalOptions{Merge: true}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("codec: %w", protowire.ParseError(n))
		}
		fd := fields.ByNumber(num)
		if typ == protowire.BytesType && fd != nil && fd.Cardinality() != protoreflect.Repeated &&
			(fd.Kind() == protoreflect.BytesKind || fd.Kind() == protoreflect.MessageKind) {
			v, vn := protowire.ConsumeBytes(b[n:])
			if vn < 0 {
				return fmt.Errorf("codec: %w", protowire.ParseError(vn))
			}
			if fd.Kind() == protoreflect.BytesKind {
				// A later occurrence replaces an earlier one, as in
				// protobuf; a oneof member replaces its siblings.
				m.Set(fd, protoreflect.ValueOfBytes(v))
			} else if err := unmarshal(v, m.Mutable(fd).Message(), depth+1); err != nil {
				// Mutable returns the message already there, so a
				// repeated occurrence merges, as in protobuf.
				return err
			}
			b = b[n+vn:]
			continue
		}
		vn := protowire.ConsumeFieldValue(num, typ, b[n:])
		if vn < 0 {
			return fmt.Errorf("codec: %w", protowire.ParseError(vn))
		}
		if err := merge.Unmarshal(b[:n+vn], m.Interface()); err != nil {
			return err
		}
		b = b[n+vn:]
	}
	return nil
}

// hasLarge reports whether m holds a singular bytes field of at least
// AliasBytes, directly or in a singular message field.
func hasLarge(m protoreflect.Message, depth int) bool {
	if depth > recursionLimit {
		return false
	}
	found := false
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Cardinality() == protoreflect.Repeated {
			return true
		}
		switch fd.Kind() {
		case protoreflect.BytesKind:
			found = len(v.Bytes()) >= aliasBytes
		case protoreflect.MessageKind:
			found = hasLarge(v.Message(), depth+1)
		}
		return !found
	})
	return found
}

// writer builds a message's encoding as small copied runs between large
// bytes fields that are referenced, not copied.
type writer struct {
	out   mem.BufferSlice
	small []byte
}

func (w *writer) flush() {
	if len(w.small) > 0 {
		w.out = append(w.out, mem.SliceBuffer(w.small))
		w.small = nil
	}
}

// message appends m's fields in field-number order, members of oneofs
// after the others, then its unknown fields: the order proto.Marshal
// uses, so the bytes are the same.
func (w *writer) message(m protoreflect.Message, depth int) error {
	if depth > recursionLimit {
		return errRecursion
	}
	fds := make([]protoreflect.FieldDescriptor, 0, m.Descriptor().Fields().Len())
	m.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		fds = append(fds, fd)
		return true
	})
	slices.SortFunc(fds, func(a, b protoreflect.FieldDescriptor) int {
		if oa, ob := inOneof(a), inOneof(b); oa != ob {
			if oa {
				return 1
			}
			return -1
		}
		return int(a.Number()) - int(b.Number())
	})
	// run gathers consecutive small fields, marshalled by protobuf in one
	// go: a message's encoding is its fields' in this order, so a run of
	// them encodes as the fields one by one would, for one allocation.
	var run protoreflect.Message
	flushRun := func() error {
		if run == nil {
			return nil
		}
		var err error
		w.small, err = (proto.MarshalOptions{}).MarshalAppend(w.small, run.Interface())
		run = nil
		return err
	}
	for _, fd := range fds {
		v := m.Get(fd)
		singular := fd.Cardinality() != protoreflect.Repeated
		switch {
		case singular && fd.Kind() == protoreflect.BytesKind && len(v.Bytes()) >= aliasBytes:
			if err := flushRun(); err != nil {
				return err
			}
			w.small = protowire.AppendTag(w.small, fd.Number(), protowire.BytesType)
			w.small = protowire.AppendVarint(w.small, uint64(len(v.Bytes())))
			w.flush()
			w.out = append(w.out, sendBuffer(v.Bytes()))
		case singular && fd.Kind() == protoreflect.MessageKind && hasLarge(v.Message(), depth+1):
			if err := flushRun(); err != nil {
				return err
			}
			w.small = protowire.AppendTag(w.small, fd.Number(), protowire.BytesType)
			w.small = protowire.AppendVarint(w.small, uint64(proto.Size(v.Message().Interface())))
			if err := w.message(v.Message(), depth+1); err != nil {
				return err
			}
		default:
			if run == nil {
				run = m.New()
			}
			run.Set(fd, v)
		}
	}
	if err := flushRun(); err != nil {
		return err
	}
	w.small = append(w.small, m.GetUnknown()...)
	return nil
}

// inOneof reports whether fd is a member of a real (not synthetic) oneof.
func inOneof(fd protoreflect.FieldDescriptor) bool {
	o := fd.ContainingOneof()
	return o != nil && !o.IsSynthetic()
}
