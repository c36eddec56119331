package moe

import (
	"errors"
	"strings"
	"testing"
)

// decl is a valid SiluGated set of E = 2, K = 4, N = 3 with per-expert
// scales, the declaration the cases below break one rule at a time.
func decl() *SetDecl {
	d := &SetDecl{Activation: SiluGated}
	d.Tensors[SetW13] = &Tensor{DType: Float8E4M3FN, Shape: []int{2, 6, 4}}
	d.Tensors[SetW2] = &Tensor{DType: Float8E4M3FN, Shape: []int{2, 4, 3}}
	d.Tensors[SetW13Scale] = &Tensor{DType: Float32, Shape: []int{2}}
	d.Tensors[SetW2Scale] = &Tensor{DType: Float32, Shape: []int{2}}
	return d
}

// TestCheckLayout: each rule of the layout names its field.
func TestCheckLayout(t *testing.T) {
	tests := []struct {
		name  string
		edit  func(d *SetDecl)
		field string
		msg   string
	}{
		{"activation", func(d *SetDecl) { d.Activation = 9 }, "p.activation", "9: want one of [ACTIVATION_SILU_GATED"},
		{"swiglu limit without SWIGLU_OAI", func(d *SetDecl) { d.SwigluLimit = 1 }, "p.swiglu_limit", "only valid with ACTIVATION_SWIGLU_OAI"},
		{"missing w2_scale", func(d *SetDecl) { d.Tensors[SetW2Scale] = nil }, "p.w2_scale", "is required"},
		{"w13 dtype", func(d *SetDecl) { d.Tensors[SetW13].DType = BFloat16 }, "p.w13", "dtype DATA_TYPE_BFLOAT16"},
		{"odd gated rows", func(d *SetDecl) { d.Tensors[SetW13].Shape = []int{2, 5, 4} }, "p.w13", "even middle dimension"},
		{"w2 shape", func(d *SetDecl) { d.Tensors[SetW2].Shape = []int{2, 3, 4} }, "p.w2", "want [2 4 3]"},
		{"block shape", func(d *SetDecl) { d.BlockShape = []int{128} }, "p.weight_block_shape", "[128]: want [] or [Bn, Bk]"},
		{"a13 shape", func(d *SetDecl) { d.Tensors[SetA13Scale] = &Tensor{DType: Float32, Shape: []int{3}} }, "p.a13_scale", "want [] or [1] (per-tensor) or [2] (per-expert)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := decl()
			tt.edit(d)
			_, err := CheckLayout("p", d)
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field != tt.field || !strings.Contains(fe.Msg, tt.msg) {
				t.Errorf("CheckLayout = %v, want a FieldError for %s containing %q", err, tt.field, tt.msg)
			}
		})
	}
	if _, err := CheckLayout("p", nil); err == nil || err.Error() != "p: is required" {
		t.Errorf("CheckLayout(nil) = %v, want p: is required", err)
	}
}

// TestLayoutBuild: a checked layout and its bytes make the set, with its
// geometry, scales and sizes.
func TestLayoutBuild(t *testing.T) {
	l, err := CheckLayout("p", decl())
	if err != nil {
		t.Fatal(err)
	}
	if l.E != 2 || l.K != 4 || l.N != 3 || l.TotalBytes() != 2*6*4+2*4*3+8+8 {
		t.Fatalf("layout E %d K %d N %d bytes %d, want 2, 4, 3 and %d", l.E, l.K, l.N, l.TotalBytes(), 2*6*4+2*4*3+8+8)
	}
	if err := l.CheckScaleShapes("p"); err != nil {
		t.Fatalf("CheckScaleShapes: %v", err)
	}
	var data [SetTensors][]byte
	data[SetW13], data[SetW2] = make([]byte, 48), make([]byte, 24)
	data[SetW13Scale], data[SetW2Scale] = Float32Bytes([]float32{1, 2}), Float32Bytes([]float32{3, 0})
	if _, err := l.Build("p", data); err == nil || !strings.HasPrefix(err.Error(), "p.w2_scale: element 1 is 0") {
		t.Errorf("Build with a zero scale = %v, want p.w2_scale's element 1 refused", err)
	}
	data[SetW2Scale] = Float32Bytes([]float32{3, 4})
	set, err := l.Build("p", data)
	if err != nil {
		t.Fatal(err)
	}
	if set.E != 2 || set.Rows1() != 6 || set.A13Scale != nil || &set.W13[0] != &data[SetW13][0] {
		t.Errorf("set %+v: want E 2, 6 GEMM1 rows, dynamic a13, W13 aliasing its bytes", set)
	}
	if Fingerprint(data) == Fingerprint([SetTensors][]byte{}) {
		t.Error("Fingerprint ignores the bytes")
	}
}
