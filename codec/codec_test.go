package codec

import (
	"bytes"
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

func newRand(t testing.TB) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d", seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

func randBytes(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

func tensor(rng *rand.Rand, n int, shape ...int64) *pb.Tensor {
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: shape, Source: &pb.Tensor_Data{Data: randBytes(rng, n)}}
}

// messages are requests and responses with tensors above and below
// AliasBytes, empty ones, nested ones and unknown fields.
func messages(rng *rand.Rand) map[string]proto.Message {
	withUnknown := &pb.FusedMoERequest{HiddenStates: tensor(rng, 3*AliasBytes, 3, AliasBytes/2)}
	withUnknown.ProtoReflect().SetUnknown([]byte{0xf8, 0x01, 0x07}) // field 31, varint 7
	return map[string]proto.Message{
		"empty request": &pb.FusedMoERequest{},
		"small request": &pb.FusedMoERequest{
			Experts:      &pb.FusedMoERequest_ExpertSet{ExpertSet: "layer0"},
			HiddenStates: tensor(rng, 64, 4, 8), RouterLogits: tensor(rng, 32, 4, 4),
			Routing: &pb.Routing{TopK: 2, Renormalize: true, CorrectionBias: tensor(rng, 8, 4)},
		},
		"large request": &pb.FusedMoERequest{
			Experts:      &pb.FusedMoERequest_ExpertSet{ExpertSet: "nemotron"},
			HiddenStates: tensor(rng, 2*AliasBytes+3, 1, AliasBytes+1), RouterLogits: tensor(rng, 512, 1, 256),
			Routing:     &pb.Routing{TopK: 6, Scoring: pb.Scoring_SCORING_SIGMOID, RoutedScalingFactor: 2.5},
			OutputDtype: pb.DataType_DATA_TYPE_FLOAT32, ReturnRouting: true,
		},
		"inline weights": &pb.FusedMoERequest{
			Experts: &pb.FusedMoERequest_Weights{Weights: &pb.ExpertWeights{
				Activation: pb.Activation_ACTIVATION_RELU2,
				W13:        tensor(rng, 5*AliasBytes, 5, AliasBytes), W2: tensor(rng, AliasBytes, 1, AliasBytes),
				W13Scale: tensor(rng, 4), WeightBlockShape: []int32{128, 128},
			}},
			HiddenStates: tensor(rng, AliasBytes, 1, AliasBytes/2),
		},
		"empty tensor data": &pb.FusedMoERequest{HiddenStates: &pb.Tensor{Shape: []int64{0, 4}, Source: &pb.Tensor_Data{Data: []byte{}}}},
		"unknown fields":    withUnknown,
		"large response": &pb.FusedMoEResponse{
			Output:  tensor(rng, 4*AliasBytes, 2, AliasBytes),
			TopkIds: tensor(rng, 48, 2, 6), Timings: &pb.Timings{KernelNanos: 5, TotalNanos: 9}, Backend: "cpu",
		},
		"small response": &pb.FusedMoEResponse{Output: tensor(rng, 16, 1, 8), Backend: "cpu"},
		"load chunk": &pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: &pb.LoadExpertsRequest_Chunk{
			Tensor: "w13", Offset: 1 << 20, Data: randBytes(rng, 2*AliasBytes)}}},
	}
}

// TestRoundTrip: Marshal gives proto.Marshal's bytes, and Unmarshal gives
// proto.Unmarshal's message, for every kind of message.
func TestRoundTrip(t *testing.T) {
	rng := newRand(t)
	for name, msg := range messages(rng) {
		t.Run(name, func(t *testing.T) {
			want, err := proto.Marshal(msg)
			if err != nil {
				t.Fatal(err)
			}
			out, err := Codec{}.Marshal(msg)
			if err != nil {
				t.Fatalf("Marshal: %v", err)
			}
			if got := out.Materialize(); !bytes.Equal(got, want) {
				t.Errorf("Marshal gave %d bytes that differ from proto.Marshal's %d", len(got), len(want))
			}
			out.Free()

			got := msg.ProtoReflect().New().Interface()
			if err := (Codec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(want[:len(want)/2]), mem.SliceBuffer(want[len(want)/2:])}, got); err != nil {
				t.Fatalf("Unmarshal: %v", err)
			}
			if diff := cmp.Diff(msg, got, protocmp.Transform()); diff != "" {
				t.Errorf("Unmarshal(Marshal(m)) differs from m (-want +got):\n%s", diff)
			}
		})
	}
}

// within reports whether b lies inside buf's memory.
func within(b, buf []byte) bool {
	if len(b) == 0 {
		return true
	}
	lo, hi := uintptr(unsafe.Pointer(unsafe.SliceData(buf))), uintptr(unsafe.Pointer(unsafe.SliceData(buf)))+uintptr(len(buf))
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return p >= lo && p+uintptr(len(b)) <= hi
}

// TestUnmarshalAliases: tensor bytes point into the parsed buffer.
func TestUnmarshalAliases(t *testing.T) {
	rng := newRand(t)
	msg := messages(rng)["inline weights"].(*pb.FusedMoERequest)
	b, err := proto.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	var got pb.FusedMoERequest
	if err := Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{
		"hidden_states": got.GetHiddenStates().GetData(), "w13": got.GetWeights().GetW13().GetData(),
		"w2": got.GetWeights().GetW2().GetData(), "w13_scale": got.GetWeights().GetW13Scale().GetData(),
	} {
		if len(data) == 0 || !within(data, b) {
			t.Errorf("%s (%d bytes) does not alias the buffer", name, len(data))
		}
	}
}

// TestMarshalReferences: large tensor bytes are sent as they are, not
// copied.
func TestMarshalReferences(t *testing.T) {
	rng := newRand(t)
	msg := messages(rng)["large response"].(*pb.FusedMoEResponse)
	out, err := Codec{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Free()
	data := msg.GetOutput().GetData()
	found := false
	for _, buf := range out {
		found = found || (len(buf.ReadOnlyData()) == len(data) && unsafe.SliceData(buf.ReadOnlyData()) == unsafe.SliceData(data))
	}
	if !found {
		t.Errorf("the output's %d bytes were copied, want them referenced by one buffer of %d", len(data), len(out))
	}
}

// TestUnmarshalErrors: malformed input fails as it does for proto.Unmarshal.
func TestUnmarshalErrors(t *testing.T) {
	tests := []struct {
		name string
		in   []byte
	}{
		{"truncated tag", []byte{0x80}},
		{"field 0", []byte{0x00, 0x01}},
		{"bytes longer than the message", []byte{0x1a, 0x05, 0x08}},             // hidden_states, 5 bytes, 1 present
		{"nested bytes too long", []byte{0x1a, 0x03, 0x1a, 0x09, 0x00}},         // hidden_states.data of 9 bytes in 3
		{"bad UTF-8 in a string", []byte{0x0a, 0x02, 0xff, 0xfe}},               // expert_set
		{"end group without start", []byte{0x0c}},                               // field 1, end group
		{"nested invalid varint", []byte{0x1a, 0x02, 0x08, 0x80}},               // hidden_states.dtype truncated
		{"nested message too long", []byte{0x32, 0x04, 0x22, 0x05, 0x00, 0x01}}, // routing.correction_bias
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := proto.Unmarshal(tc.in, &pb.FusedMoERequest{}); err == nil {
				t.Fatalf("proto.Unmarshal accepts %x; the case is wrong", tc.in)
			}
			if err := Unmarshal(tc.in, &pb.FusedMoERequest{}); err == nil {
				t.Errorf("Unmarshal(%x) = nil, want an error", tc.in)
			}
		})
	}
}

// FuzzUnmarshal: on any input, Unmarshal fails exactly when
// proto.Unmarshal does, and otherwise gives the same message; with
// Refuse, the codec never fails and the interceptor answers
// InvalidArgument exactly then.
func FuzzUnmarshal(f *testing.F) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, m := range messages(rng) {
		if _, ok := m.(*pb.FusedMoERequest); !ok {
			continue
		}
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		if len(b) < 4096 {
			f.Add(b)
		}
	}
	f.Add([]byte{0x1a, 0x03, 0x1a, 0x01, 0x00, 0x1a, 0x02, 0x08, 0x02})
	f.Add([]byte{0x0a, 0x02, 'a', 0xff})
	f.Fuzz(func(t *testing.T, in []byte) {
		var want, got pb.FusedMoERequest
		werr := proto.Unmarshal(in, &want)
		gerr := Unmarshal(in, &got)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("proto.Unmarshal error %v, Unmarshal error %v", werr, gerr)
		}
		if werr == nil && !proto.Equal(&want, &got) {
			t.Fatalf("messages differ:\n%v\n%v", &want, &got)
		}
		var refused pb.FusedMoERequest
		if err := (Codec{Refuse: true}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(in)}, &refused); err != nil {
			t.Fatalf("Unmarshal with Refuse: %v", err)
		}
		_, ierr := UnaryServerInterceptor(context.Background(), &refused, nil, func(context.Context, any) (any, error) { return nil, nil })
		if (werr == nil) != (ierr == nil) || (ierr != nil && status.Code(ierr) != codes.InvalidArgument) {
			t.Fatalf("proto.Unmarshal error %v, interceptor error %v", werr, ierr)
		}
	})
}

// FuzzMarshal: for any message proto.Unmarshal accepts, Marshal gives
// proto.Marshal's bytes. The threshold is lowered to one byte so that
// every bytes field takes the referencing path.
func FuzzMarshal(f *testing.F) {
	defer func(n int) { aliasBytes = n }(aliasBytes)
	aliasBytes = 1
	rng := rand.New(rand.NewPCG(3, 4))
	for _, m := range messages(rng) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		if _, ok := m.(*pb.FusedMoERequest); ok && len(b) < 4096 {
			f.Add(b)
		}
	}
	f.Add([]byte{0x1a, 0x03, 0x1a, 0x01, 0x00, 0x32, 0x04, 0x22, 0x02, 0x1a, 0x00})
	f.Fuzz(func(t *testing.T, in []byte) {
		var m pb.FusedMoERequest
		if proto.Unmarshal(in, &m) != nil {
			return
		}
		want, err := proto.Marshal(&m)
		if err != nil {
			t.Fatal(err)
		}
		out, err := Codec{}.Marshal(&m)
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		if got := out.Materialize(); !bytes.Equal(got, want) {
			t.Fatalf("Marshal gave\n%x\nproto.Marshal gave\n%x", got, want)
		}
	})
}

// TestRefuse: with Refuse, a request that does not parse reaches no
// handler: the interceptors answer InvalidArgument naming the field that
// is not UTF-8, once, and forget it.
func TestRefuse(t *testing.T) {
	hidden := (&pb.FusedMoERequest{}).ProtoReflect().Descriptor().Fields().ByName("hidden_states").Number()
	shmRef := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), []byte{0xc3, 0x28}) // region_name
	tensor := protowire.AppendBytes(protowire.AppendTag(nil, 4, protowire.BytesType), shmRef)             // shm
	nested := protowire.AppendBytes(protowire.AppendTag(nil, hidden, protowire.BytesType), tensor)
	top := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), []byte{'a', 0xff}) // expert_set
	for _, tc := range []struct {
		name string
		in   []byte
		want string
	}{
		{"top", top, "malformed request: field expert_set is not valid UTF-8"},
		{"nested", nested, "malformed request: field hidden_states.shm.region_name is not valid UTF-8"},
		{"wire", []byte{0xff, 0xff, 0xff}, "malformed request: proto: cannot parse invalid wire-format data"},
		// Above AliasBytes, parsed field by field.
		{"large", append(protowire.AppendBytes(protowire.AppendTag(nil, hidden, protowire.BytesType),
			protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), make([]byte, 2*AliasBytes))), top...),
			"malformed request: field expert_set is not valid UTF-8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := mem.BufferSlice{mem.SliceBuffer(tc.in)}
			if err := (Codec{}).Unmarshal(data, &pb.FusedMoERequest{}); err == nil {
				t.Fatal("Unmarshal without Refuse accepted the message")
			}
			m := &pb.FusedMoERequest{}
			if err := (Codec{Refuse: true, Recycle: func(proto.Message) bool { return true }}).Unmarshal(data, m); err != nil {
				t.Fatalf("Unmarshal with Refuse = %v, want nil", err)
			}
			if proto.Size(m) != 0 {
				t.Errorf("the refused message holds %d bytes of fields", proto.Size(m))
			}
			called := false
			handler := func(context.Context, any) (any, error) { called = true; return nil, nil }
			_, err := UnaryServerInterceptor(context.Background(), m, nil, handler)
			// protobuf's messages put a no-break space after "proto:" at
			// random, against matching them exactly.
			if st := status.Convert(err); called || st.Code() != codes.InvalidArgument || strings.ReplaceAll(st.Message(), "\u00a0", " ") != tc.want {
				t.Errorf("interceptor = %v (handler called %v); want InvalidArgument %q", err, called, tc.want)
			}
			if _, err := UnaryServerInterceptor(context.Background(), m, nil, handler); err != nil || !called {
				t.Errorf("second pass = %v (handler called %v); want the handler", err, called)
			}
			if n := nRefused.Load(); n != 0 {
				t.Errorf("%d refusals still held", n)
			}
		})
	}
}
