package codec

import (
	"bytes"
	"testing"
	"unsafe"

	"google.golang.org/protobuf/proto"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

func TestPoolSizes(t *testing.T) {
	var p Pool
	for _, tt := range []struct {
		n       int
		wantCap int
	}{
		{100, 100},                     // below the smallest class: plain allocation
		{1 << minClass, 1 << minClass}, // exactly a class
		{1376256, 1 << 21},             // Nemotron M=256 BF16 output
		{1<<20 + 1, 1 << 21},
	} {
		b := p.Get(tt.n)
		if got := len(b); got != tt.n {
			t.Errorf("Get(%d): len %d", tt.n, got)
		}
		if got := cap(b); got != tt.wantCap {
			t.Errorf("Get(%d): cap %d, want %d", tt.n, got, tt.wantCap)
		}
	}
}

// TestLendReturnsAfterFree: a lent output is sent by reference and comes
// back to the pool only when gRPC frees the marshalled message, once.
func TestLendReturnsAfterFree(t *testing.T) {
	var p Pool
	var returned [][]byte
	putHook = func(b []byte) { returned = append(returned, b) }
	defer func() { putHook = nil }()

	out := p.Get(3 * AliasBytes)
	msg := &pb.FusedMoEResponse{Output: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{3, AliasBytes / 2},
		Source: &pb.Tensor_Data{Data: out}}}
	p.Lend(out)
	enc, err := Codec{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if p.Unlend(out) {
		t.Error("Marshal left the buffer lent")
	}
	if len(returned) != 0 {
		t.Fatalf("buffer returned before the message was freed")
	}
	referenced := false
	for _, b := range enc {
		referenced = referenced || unsafe.SliceData(b.ReadOnlyData()) == unsafe.SliceData(out)
	}
	if !referenced {
		t.Error("the lent buffer was copied, want it referenced")
	}
	enc.Free()
	if got, want := len(returned), 1; got != want {
		t.Fatalf("after Free: %d buffers returned, want %d", got, want)
	}
	if unsafe.SliceData(returned[0]) != unsafe.SliceData(out) || cap(returned[0]) != cap(out) {
		t.Error("a different buffer came back")
	}

	// Not lent: referenced, never returned.
	returned = nil
	other := p.Get(3 * AliasBytes)
	msg.Output.Source = &pb.Tensor_Data{Data: other}
	enc, err = Codec{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	enc.Free()
	if len(returned) != 0 {
		t.Error("a buffer that was not lent went back to the pool")
	}
}

// TestUnlend: a lent buffer whose send failed before Marshal is taken back.
func TestUnlend(t *testing.T) {
	var p Pool
	b := p.Get(2 * AliasBytes)
	p.Lend(b)
	if !p.Unlend(b) {
		t.Error("Unlend of a lent buffer: false")
	}
	if p.Unlend(b) {
		t.Error("second Unlend: true")
	}
	small := p.Get(10)
	p.Lend(small) // below AliasBytes: Marshal copies it, nothing to lend
	if p.Unlend(small) {
		t.Error("a small buffer was lent")
	}
}

// TestRecycleRelease: a picked message's receive buffer goes back to the
// pool on Release, once; other messages' buffers never do.
func TestRecycleRelease(t *testing.T) {
	var returned [][]byte
	putHook = func(b []byte) { returned = append(returned, b) }
	defer func() { putHook = nil }()
	c := Codec{Recycle: func(m proto.Message) bool { _, ok := m.(*pb.FusedMoERequest); return ok }}

	req := &pb.FusedMoERequest{HiddenStates: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{2, AliasBytes},
		Source: &pb.Tensor_Data{Data: make([]byte, 4*AliasBytes)}}}
	enc, err := Codec{}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	var got pb.FusedMoERequest
	if err := c.Unmarshal(enc, &got); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&got, req) {
		t.Fatal("recycled unmarshal differs from the message sent")
	}
	data := got.GetHiddenStates().GetData()
	Release(&got)
	if len(returned) != 1 || cap(returned[0]) < len(data) {
		t.Fatalf("after Release: %d buffers returned, want the receive buffer", len(returned))
	}
	Release(&got)
	if len(returned) != 1 {
		t.Error("a second Release returned the buffer again")
	}

	// Not picked: never pooled.
	resp := &pb.FusedMoEResponse{Output: &pb.Tensor{Source: &pb.Tensor_Data{Data: make([]byte, 2*AliasBytes)}}}
	if enc, err = (Codec{}).Marshal(resp); err != nil {
		t.Fatal(err)
	}
	var gotResp pb.FusedMoEResponse
	if err := c.Unmarshal(enc, &gotResp); err != nil {
		t.Fatal(err)
	}
	Release(&gotResp)
	if len(returned) != 1 {
		t.Error("a message Recycle did not pick was pooled")
	}
}

// TestReceiver: a large message is parsed from a pooled buffer that Take
// hands over (its bytes fields alias it) and Release returns; a
// message received while one is held, and a small one, are parsed as
// Codec does.
func TestReceiver(t *testing.T) {
	var returned [][]byte
	putHook = func(b []byte) { returned = append(returned, b) }
	defer func() { putHook = nil }()

	resp := &pb.FusedMoEResponse{Backend: "cpu", Output: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{2, AliasBytes},
		Source: &pb.Tensor_Data{Data: bytes.Repeat([]byte{7}, 4*AliasBytes)}}}
	enc, err := Codec{}.Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	r := &Receiver{}
	var got pb.FusedMoEResponse
	if err := r.Unmarshal(enc, &got); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&got, resp) {
		t.Fatal("Receiver's unmarshal differs from the message sent")
	}
	var again pb.FusedMoEResponse
	if err := r.Unmarshal(enc, &again); err != nil || !proto.Equal(&again, resp) {
		t.Fatalf("second unmarshal while one is held: %v", err)
	}
	h := r.Take()
	if !h.Holds() {
		t.Fatal("Take after a large message: holds nothing")
	}
	data := got.GetOutput().GetData()
	if !h.Contains(data) {
		t.Error("the output does not alias the taken buffer")
	}
	if again := again.GetOutput().GetData(); unsafe.SliceData(again) == unsafe.SliceData(data) {
		t.Error("the second message shares the held buffer")
	}
	if r.Take().Holds() {
		t.Error("a second Take returned the buffer again")
	}
	h.Release()
	if len(returned) != 1 || !h.Contains(returned[0][:len(data)]) {
		t.Fatalf("after Release: %d buffers returned, want the taken one", len(returned))
	}

	small, err := Codec{}.Marshal(&pb.FusedMoEResponse{Backend: "cpu"})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Unmarshal(small, &got); err != nil || got.GetBackend() != "cpu" {
		t.Fatalf("small message: %v", err)
	}
	if r.Take().Holds() {
		t.Error("a small message was pooled")
	}
}

// TestBufferPoolAllocs: the transport's pool recycles its buffers without
// an allocation per buffer (grpc-go takes one per HTTP/2 frame) and hands
// them out without zeroing them.
func TestBufferPoolAllocs(t *testing.T) {
	p := BufferPool()
	b := p.Get(1 << 14)
	(*b)[0] = 1
	p.Put(b)
	if n := testing.AllocsPerRun(100, func() { p.Put(p.Get(1 << 14)) }); n != 0 {
		t.Errorf("Get+Put: %v allocations, want 0", n)
	}
	if got := p.Get(100); len(*got) != 100 {
		t.Errorf("Get(100): len %d", len(*got))
	}
}
