package moe

import (
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"
)

func f32Tensor(v []float32, shape ...int) *Tensor {
	return &Tensor{DType: Float32, Shape: shape, Data: Float32Bytes(v)}
}

// TestHiddenScaleAt: the one indexing rule of FP8 hidden scales.
func TestHiddenScaleAt(t *testing.T) {
	a13 := float32(0.5)
	set := &ExpertSet{E: 2, K: 10, Block: [2]int{4, 4}} // 3 groups of 4 columns
	hidden := Tensor{DType: Float8E4M3FN, Shape: []int{2, 10}}
	tests := []struct {
		name  string
		scale []float32
		a13   *float32
		t, g  int
		want  float32
	}{
		{"none", nil, nil, 1, 2, 1},
		{"static", nil, &a13, 1, 2, 0.5},
		{"per-tensor", []float32{3}, &a13, 1, 2, 3},
		{"per-token", []float32{3, 4}, nil, 1, 2, 4},
		{"per-group", []float32{1, 2, 3, 4, 5, 6}, nil, 1, 2, 6},
		{"per-group first", []float32{1, 2, 3, 4, 5, 6}, nil, 0, 1, 2},
	}
	for _, tt := range tests {
		s := *set
		s.A13Scale = tt.a13
		r := &Request{Hidden: hidden, HiddenScale: tt.scale}
		if got := r.HiddenScaleAt(&s, tt.t, tt.g); got != tt.want {
			t.Errorf("%s: HiddenScaleAt(%d, %d) = %v, want %v", tt.name, tt.t, tt.g, got, tt.want)
		}
	}
}

// TestValidate covers what the model decides by itself: defaults, the
// limit error, and device tensors that are checked but never read.
func TestValidate(t *testing.T) {
	set := &ExpertSet{E: 4, K: 2}
	hidden := func() *Tensor { return f32Tensor([]float32{1, 2, 3, 4}, 2, 2) }
	logits := func() *Tensor { return f32Tensor([]float32{0, 1, 2, 3, 3, 2, 1, 0}, 2, 4) }

	r, err := Validate(&Input{Hidden: hidden(), Logits: logits(), Routing: &RoutingInput{TopK: 2}}, set, Limits{})
	if err != nil {
		t.Fatalf("Validate: %v", err)
	}
	if r.OutDType != BFloat16 || r.Routing.Scoring != Softmax || r.Routing.ScalingFactor != 1 {
		t.Errorf("defaults: out %v, scoring %v, scaling %v; want bfloat16, softmax, 1", r.OutDType, r.Routing.Scoring, r.Routing.ScalingFactor)
	}

	_, err = Validate(&Input{Hidden: hidden(), Logits: logits(), Routing: &RoutingInput{TopK: 2}}, set, Limits{MaxTokens: 1})
	var le *LimitError
	if !errors.As(err, &le) || le.Field != "hidden_states" || le.Quota != "max-tokens" || le.Limit != 1 {
		t.Errorf("over max tokens: %v, want a LimitError for hidden_states, max-tokens 1", err)
	}

	// A NaN in device memory cannot be seen, so it is not looked for.
	dev := &Tensor{DType: Float32, Shape: []int{2, 4}, Memory: Device, Dev: 0x1000, DevBytes: 32}
	if r, err := Validate(&Input{Hidden: hidden(), Logits: dev, Routing: &RoutingInput{TopK: 2}}, set, Limits{}); err != nil || r.Logits.Dev != 0x1000 {
		t.Errorf("device logits: %v, %+v", err, r)
	}
	// Device bytes are sized as host bytes are, and the error says by how
	// much, for a server to word it for where the bytes are.
	short := *dev
	short.DevBytes = 31
	_, err = Validate(&Input{Hidden: hidden(), Logits: &short, Routing: &RoutingInput{TopK: 2}}, set, Limits{})
	var se *SizeError
	if !errors.As(err, &se) || se.Field != "router_logits" || se.Need != 32 || se.Got != 31 || se.DType != Float32 ||
		err.Error() != "router_logits: shape [2 4] needs 32 bytes, got 31" || !errors.As(err, new(*FieldError)) {
		t.Errorf("device logits one byte short: %v, want a SizeError for router_logits (32 bytes needed, 31 got) that is a FieldError", err)
	}
	nan := logits()
	binary.LittleEndian.PutUint32(nan.Data[4:], math.Float32bits(float32(math.NaN())))
	_, err = Validate(&Input{Hidden: hidden(), Logits: nan, Routing: &RoutingInput{TopK: 2}}, set, Limits{})
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Field != "router_logits" || !strings.Contains(fe.Msg, "element 1 is NaN") {
		t.Errorf("host NaN logit: %v, want a FieldError for router_logits element 1", err)
	}

	missing := &Tensor{DType: Float32, Shape: []int{2, 2}}
	if _, err := Validate(&Input{Hidden: missing}, set, Limits{}); err == nil || err.Error() != "hidden_states.data: is required" {
		t.Errorf("no bytes: %v, want hidden_states.data: is required", err)
	}
}

// FuzzLogitsClean checks the bit-level scan against the float-level one
// that names the refused element: they must agree on every input, NaN
// payloads, both infinities and rows of -Inf included.
func FuzzLogitsClean(f *testing.F) {
	f32 := func(v ...float32) []byte {
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		return b
	}
	inf := float32(math.Inf(1))
	f.Add(f32(1, -2, 3, 0), false, uint8(2), false)
	f.Add(f32(-inf, -inf, 1, -inf), false, uint8(2), false)
	f.Add(f32(-inf, -inf, 1, -inf), false, uint8(2), true)
	f.Add(f32(1, inf, 0, 0), false, uint8(4), false)
	f.Add(f32(float32(math.NaN()), 0), false, uint8(1), true)
	f.Add(f32(0, -0), false, uint8(2), false)
	f.Add([]byte{0x80, 0xff, 0x80, 0x7f, 0xc1, 0xff, 0x00, 0x80}, true, uint8(2), false)
	f.Add([]byte{0x80, 0xff, 0x80, 0xff, 0x3f, 0x80, 0x80, 0xff}, true, uint8(2), false)
	f.Fuzz(func(t *testing.T, b []byte, bf16 bool, e uint8, sigmoid bool) {
		if e == 0 {
			return
		}
		d, scoring := Float32, Softmax
		if bf16 {
			d = BFloat16
		}
		if sigmoid {
			scoring = Sigmoid
		}
		// Whole rows only, as validation passes them.
		row := int(e) * d.Size()
		b = b[:len(b)/row*row]
		clean, err := logitsClean(d, b, int(e), scoring), logitsError(d, b, int(e), scoring)
		if clean != (err == nil) {
			t.Fatalf("logitsClean = %v, logitsError = %v (dtype %v, e %d, %x)", clean, err, d, e, b)
		}
	})
}
