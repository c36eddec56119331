package codec

import (
	"testing"
	"unsafe"

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
