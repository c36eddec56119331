package service

import (
	"bytes"
	"fmt"
	"testing"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/google/go-cmp/cmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// ones are the values fill gives scalar fields.
var ones = map[protoreflect.Kind]protoreflect.Value{
	protoreflect.BoolKind: protoreflect.ValueOfBool(true), protoreflect.EnumKind: protoreflect.ValueOfEnum(1),
	protoreflect.FloatKind: protoreflect.ValueOfFloat32(1), protoreflect.Int32Kind: protoreflect.ValueOfInt32(1),
	protoreflect.Int64Kind: protoreflect.ValueOfInt64(1), protoreflect.Uint32Kind: protoreflect.ValueOfUint32(1),
	protoreflect.Uint64Kind: protoreflect.ValueOfUint64(1),
}

// fill sets every field reachable from m to a value naming its path:
// strings to the path, numbers to 1, bytes to the path's bytes, and
// messages filled likewise. Of a oneof, the member declared last wins,
// except in Tensor, whose shared-memory reference is what holds a string.
func fill(m protoreflect.Message, path string) {
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		p := path + "." + string(fd.Name())
		if fd.IsList() || fd.IsMap() {
			continue // none holds a string today; TestOwnStringsCovers checks
		}
		switch fd.Kind() {
		case protoreflect.StringKind:
			m.Set(fd, protoreflect.ValueOfString(p))
		case protoreflect.BytesKind:
			m.Set(fd, protoreflect.ValueOfBytes([]byte(p)))
		case protoreflect.MessageKind:
			fill(m.Mutable(fd).Message(), p)
		default:
			v, ok := ones[fd.Kind()]
			if !ok {
				panic(fmt.Sprintf("fill: field %s of kind %v", p, fd.Kind()))
			}
			m.Set(fd, v)
		}
	}
	if t, ok := m.Interface().(*pb.Tensor); ok {
		t.Source = &pb.Tensor_Shm{Shm: &pb.SharedMemoryRef{RegionName: path + ".shm.region_name", Offset: 1, ByteSize: 1}}
	}
}

// TestDecodeSlotOwnsStrings: a request decoded from a slot's copy keeps
// its strings when that copy is overwritten (it goes back to a pool after
// the call and holds the next call's request), with every tensor in
// shared memory, inline weights or a named set.
func TestDecodeSlotOwnsStrings(t *testing.T) {
	weights := &pb.FusedMoERequest{}
	fill(weights.ProtoReflect(), "req")
	named := proto.Clone(weights).(*pb.FusedMoERequest)
	named.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "req.expert_set"}
	for name, want := range map[string]*pb.FusedMoERequest{"weights": weights, "expert_set": named} {
		t.Run(name, func(t *testing.T) {
			b, err := proto.Marshal(want)
			if err != nil {
				t.Fatal(err)
			}
			var got pb.FusedMoERequest
			if err := decodeSlot(0, b, &got); err != nil {
				t.Fatal(err)
			}
			clear(b) // the tensors' bytes alias it; the strings must not
			if diff := cmp.Diff(stringsOf(want.ProtoReflect(), "req"), stringsOf(got.ProtoReflect(), "req")); diff != "" {
				t.Errorf("strings changed with the buffer (-want +got):\n%s", diff)
			}
		})
	}
}

// stringsOf is the strings set in m, by path.
func stringsOf(m protoreflect.Message, path string) map[string]string {
	out := map[string]string{}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		p := path + "." + string(fd.Name())
		switch {
		case fd.IsList() || fd.IsMap():
		case fd.Kind() == protoreflect.StringKind:
			out[p] = v.String()
		case fd.Kind() == protoreflect.MessageKind:
			for k, s := range stringsOf(v.Message(), p) {
				out[k] = s
			}
		}
		return true
	})
	return out
}

// TestOwnStringsCovers: the strings a FusedMoERequest can hold are those
// ownStrings checks and copies, and its tensors are those
// requestTensors lists; a field added to the contract fails here until
// ownStrings (or requestTensors) learns of it.
func TestOwnStringsCovers(t *testing.T) {
	var got []string
	seen := map[protoreflect.FullName]bool{}
	var walk func(md protoreflect.MessageDescriptor)
	walk = func(md protoreflect.MessageDescriptor) {
		if seen[md.FullName()] {
			return
		}
		seen[md.FullName()] = true
		fields := md.Fields()
		for i := range fields.Len() {
			fd := fields.Get(i)
			switch {
			case fd.IsMap():
				got = append(got, string(fd.FullName())+" (map)")
			case fd.Kind() == protoreflect.StringKind:
				got = append(got, string(fd.FullName()))
			case fd.Kind() == protoreflect.MessageKind:
				walk(fd.Message())
			}
		}
	}
	walk((&pb.FusedMoERequest{}).ProtoReflect().Descriptor())
	want := []string{"expertd.v1.FusedMoERequest.expert_set", "expertd.v1.SharedMemoryRef.region_name"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("string fields reachable from FusedMoERequest (-want +got):\n%s", diff)
	}
	// Every Tensor reachable is one requestTensors lists (or output_shm).
	req := &pb.FusedMoERequest{}
	fill(req.ProtoReflect(), "req")
	listed := map[*pb.Tensor]bool{}
	for _, x := range requestTensors(req) {
		listed[x.t] = true
	}
	var check func(m protoreflect.Message)
	check = func(m protoreflect.Message) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			if fd.Kind() != protoreflect.MessageKind || fd.IsList() || fd.IsMap() {
				return true
			}
			if x, ok := v.Message().Interface().(*pb.Tensor); ok && !listed[x] {
				t.Errorf("tensor %s is not in requestTensors", fd.FullName())
			}
			check(v.Message())
			return true
		})
	}
	check(req.ProtoReflect())
}

// FuzzDecodeSlot: what proto.Unmarshal parses, decodeSlot parses to the
// same message, also where the generated decoder alone would not (seeds:
// strings that are not UTF-8, a known field of the wrong wire type).
// Unknown fields, which nothing reads, may keep their bytes as sent.
// Input protobuf refuses may be parsed (see decodeSlot), but never with a
// string that is not UTF-8.
func FuzzDecodeSlot(f *testing.F) {
	for _, in := range decodeSlotSeeds(f) {
		f.Add(in)
	}
	f.Fuzz(checkDecodeSlot)
}

func checkDecodeSlot(t *testing.T, in []byte) {
	var want, got pb.FusedMoERequest
	werr := proto.Unmarshal(in, &want)
	gerr := decodeSlot(0, in, &got)
	if werr != nil {
		if gerr == nil && !utf8Strings(got.ProtoReflect()) {
			t.Fatalf("% x: decodeSlot took a string that is not UTF-8: %v", in, &got)
		}
		return
	}
	if gerr != nil {
		t.Fatalf("% x: proto.Unmarshal parses it, decodeSlot: %v", in, gerr)
	}
	dropUnknown(want.ProtoReflect())
	dropUnknown(got.ProtoReflect())
	if !proto.Equal(&want, &got) {
		t.Fatalf("% x: messages differ:\n%v\n%v", in, &want, &got)
	}
}

// utf8Strings reports whether every string in m is valid UTF-8.
func utf8Strings(m protoreflect.Message) bool {
	for _, s := range stringsOf(m, "") {
		if !utf8.ValidString(s) {
			return false
		}
	}
	return true
}

// dropUnknown clears the unknown fields of m and the messages in it.
func dropUnknown(m protoreflect.Message) {
	m.SetUnknown(nil)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Kind() == protoreflect.MessageKind:
			for i := range v.List().Len() {
				dropUnknown(v.List().Get(i).Message())
			}
		case !fd.IsList() && !fd.IsMap() && fd.Kind() == protoreflect.MessageKind:
			dropUnknown(v.Message())
		}
		return true
	})
}

func decodeSlotSeeds(t testing.TB) [][]byte {
	full := &pb.FusedMoERequest{}
	fill(full.ProtoReflect(), "req")
	named := proto.Clone(full).(*pb.FusedMoERequest)
	named.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: "layer"}
	var seeds [][]byte
	for _, m := range []proto.Message{full, named} {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		seeds = append(seeds, b)
	}
	tag := func(num protowire.Number, typ protowire.Type) []byte { return protowire.AppendTag(nil, num, typ) }
	return append(seeds,
		// expert_set not UTF-8: protobuf refuses it.
		append(tag(1, protowire.BytesType), 2, 'a', 0xff),
		// A region name not UTF-8, in hidden_states.shm.
		append(tag(3, protowire.BytesType), append(tag(4, protowire.BytesType), append(tag(1, protowire.BytesType), 1, 0xfe)...)...),
		// expert_set as a varint: protobuf keeps it as an unknown field.
		append(tag(1, protowire.VarintType), 7),
		// output_dtype as bytes, and truncated input.
		append(tag(9, protowire.BytesType), 1, 0),
		append(tag(3, protowire.BytesType), 9, 0),
		nil,
	)
}

// FuzzCompletionBytes: a response complete encodes with the generated
// encoder is, byte for byte, what proto.Marshal writes (seeds: every
// field set, an output inline and one in shared memory, the empty
// response).
func FuzzCompletionBytes(f *testing.F) {
	full := &pb.FusedMoEResponse{}
	fill(full.ProtoReflect(), "resp")
	inline := proto.Clone(full).(*pb.FusedMoEResponse)
	inline.Output.Source = &pb.Tensor_Data{Data: []byte{}}
	for _, m := range []*pb.FusedMoEResponse{full, inline, {}} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var resp pb.FusedMoEResponse
		if proto.Unmarshal(in, &resp) != nil {
			return
		}
		want, err := proto.Marshal(&resp)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, resp.SizeVT())
		if _, err := resp.MarshalToSizedBufferVT(got); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("MarshalToSizedBufferVT = % x, %v; proto.Marshal % x", got, err, want)
		}
	})
}
