package service

import (
	"bytes"
	"math"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

func TestCoverage(t *testing.T) {
	tests := []struct {
		name     string
		spans    [][2]int64
		size     int64
		wantErr  bool // on the last add
		complete bool
		gaps     string
	}{
		{"in order", [][2]int64{{0, 4}, {4, 8}, {8, 10}}, 10, false, true, ""},
		{"reverse", [][2]int64{{8, 10}, {4, 8}, {0, 4}}, 10, false, true, ""},
		{"middle last", [][2]int64{{0, 3}, {7, 10}, {3, 7}}, 10, false, true, ""},
		{"gaps", [][2]int64{{2, 3}, {5, 6}}, 10, false, false, "[0, 2) [3, 5) [6, 10)"},
		{"many gaps", [][2]int64{{1, 2}, {3, 4}, {5, 6}, {7, 8}}, 10, false, false, "[0, 1) [2, 3) [4, 5) ..."},
		{"overlap left", [][2]int64{{0, 4}, {3, 6}}, 10, true, false, ""},
		{"overlap right", [][2]int64{{4, 8}, {2, 5}}, 10, true, false, ""},
		{"contained", [][2]int64{{0, 10}, {3, 4}}, 10, true, false, ""},
		{"same", [][2]int64{{3, 4}, {3, 4}}, 10, true, false, ""},
		{"empty tensor", nil, 0, false, true, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c coverage
			var err error
			for _, s := range tt.spans {
				if err = c.add(s[0], s[1]); err != nil {
					break
				}
			}
			if (err != nil) != tt.wantErr {
				t.Fatalf("add error = %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if got := c.complete(tt.size); got != tt.complete {
				t.Errorf("complete = %v, want %v (spans %v)", got, tt.complete, c.spans)
			}
			if !tt.complete {
				if got := c.gaps(tt.size); got != tt.gaps {
					t.Errorf("gaps = %q, want %q", got, tt.gaps)
				}
			}
		})
	}
}

// FuzzCheckRequest feeds arbitrary FusedMoERequest bytes to the validator:
// it must never panic, and whatever it accepts must satisfy the invariants
// backends rely on without re-checking.
func FuzzCheckRequest(f *testing.F) {
	set := &moe.ExpertSet{Activation: moe.SiluGated, E: 4, K: 8, N: 4, Block: [2]int{4, 4}}
	seed := &pb.FusedMoERequest{
		HiddenStates: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{2, 8}, Source: &pb.Tensor_Data{Data: make([]byte, 16)}},
		HiddenStatesScale: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{2, 2},
			Source: &pb.Tensor_Data{Data: bytes.Repeat([]byte{0, 0, 0x80, 0x3f}, 4)}},
		RouterLogits: &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{2, 4}, Source: &pb.Tensor_Data{Data: make([]byte, 16)}},
		Routing:      &pb.Routing{TopK: 2, Scoring: pb.Scoring_SCORING_SIGMOID, NumExpertGroups: 2, TopkGroups: 1},
	}
	b, _ := proto.Marshal(seed)
	f.Add(b)
	// A row of -Inf (BF16 0xff80): legal with sigmoid, refused with softmax.
	ninf := bytes.Repeat([]byte{0x80, 0xff}, 8)
	seed.RouterLogits.Source = &pb.Tensor_Data{Data: ninf}
	b, _ = proto.Marshal(seed)
	f.Add(b)
	seed.Routing = &pb.Routing{TopK: 2}
	b, _ = proto.Marshal(seed)
	f.Add(b)
	seed.RouterLogits, seed.Routing = nil, nil
	seed.TopkIds = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{2, 1}, Source: &pb.Tensor_Data{Data: make([]byte, 8)}}
	seed.TopkWeights = &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{2, 1}, Source: &pb.Tensor_Data{Data: make([]byte, 8)}}
	b, _ = proto.Marshal(seed)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		var req pb.FusedMoERequest
		if proto.Unmarshal(b, &req) != nil {
			return
		}
		r, err := checkRequest(&req, set, moe.Limits{MaxTokens: 64}, nil)
		if err != nil {
			return
		}
		m := r.M()
		if m < 1 || m > 64 || len(r.Hidden.Shape) != 2 || r.Hidden.Shape[1] != set.K || len(r.Hidden.Data) != m*set.K*r.Hidden.DType.Size() {
			t.Fatalf("accepted hidden %v %v with %d bytes", r.Hidden.DType, r.Hidden.Shape, len(r.Hidden.Data))
		}
		if r.Routing.TopK < 1 || r.Routing.TopK > set.E || !(r.Routing.ScalingFactor > 0) {
			t.Fatalf("accepted routing %+v", r.Routing)
		}
		if r.TopKIDs != nil {
			if len(r.TopKIDs) != m*r.Routing.TopK || len(r.TopKWeights) != len(r.TopKIDs) {
				t.Fatalf("accepted %d ids, %d weights for M=%d k=%d", len(r.TopKIDs), len(r.TopKWeights), m, r.Routing.TopK)
			}
			for _, id := range r.TopKIDs {
				if id < 0 || int(id) >= set.E {
					t.Fatalf("accepted expert id %d", id)
				}
			}
		} else if len(r.Logits.Data) != m*set.E*r.Logits.DType.Size() {
			t.Fatalf("accepted logits %v with %d bytes", r.Logits.Shape, len(r.Logits.Data))
		} else {
			// Whatever logits validation accepts, routing gives finite
			// weights: the rule of issue 14 end to end.
			logits := make([]float32, m*set.E)
			for i := range logits {
				logits[i] = moe.Element(r.Logits.DType, r.Logits.Data, i)
			}
			ids, w := make([]int32, m*r.Routing.TopK), make([]float32, m*r.Routing.TopK)
			moe.Route(ids, w, logits, m, set.E, r.Routing)
			for i, x := range w {
				if x != x || math.IsInf(float64(x), 0) {
					t.Fatalf("accepted logits %v route to weight %d = %v", logits, i, x)
				}
			}
		}
		if r.Routing.NumGroups > 1 && (set.E%r.Routing.NumGroups != 0 || r.Routing.TopKGroups < 1 || r.Routing.TopKGroups > r.Routing.NumGroups) {
			t.Fatalf("accepted groups %d/%d", r.Routing.NumGroups, r.Routing.TopKGroups)
		}
		if r.Hidden.DType == moe.Float8E4M3FN {
			if n := len(r.HiddenScale); n != 1 && n != m && n != m*2 {
				t.Fatalf("accepted %d hidden scales for M=%d", n, m)
			}
		}
		for _, s := range r.HiddenScale {
			if !(s > 0) || math.IsInf(float64(s), 0) {
				t.Fatalf("accepted hidden scale %v", s)
			}
		}
		if r.OutDType != moe.BFloat16 && r.OutDType != moe.Float32 {
			t.Fatalf("accepted output %v", r.OutDType)
		}
	})
}

// FuzzInlineSet feeds arbitrary ExpertWeights bytes to the weight
// validator: no panic, and an accepted set's buffers match its sizes.
func FuzzInlineSet(f *testing.F) {
	fp8 := func(shape ...int64) *pb.Tensor {
		n := int64(1)
		for _, d := range shape {
			n *= d
		}
		return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: shape, Source: &pb.Tensor_Data{Data: make([]byte, n)}}
	}
	one := []byte{0, 0, 0x80, 0x3f}
	f32 := func(n int, shape ...int64) *pb.Tensor {
		return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: shape, Source: &pb.Tensor_Data{Data: bytes.Repeat(one, n)}}
	}
	seeds := []*pb.ExpertWeights{
		{Activation: pb.Activation_ACTIVATION_SILU_GATED, W13: fp8(2, 8, 4), W2: fp8(2, 4, 4), W13Scale: f32(1), W2Scale: f32(2, 2), A13Scale: f32(2, 2)},
		{Activation: pb.Activation_ACTIVATION_RELU2, W13: fp8(2, 4, 8), W2: fp8(2, 8, 4), W13Scale: f32(4, 2, 2, 1), W2Scale: f32(16, 2, 8), WeightBlockShape: []int32{4, 8}},
	}
	for _, s := range seeds {
		b, _ := proto.Marshal(s)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var w pb.ExpertWeights
		if proto.Unmarshal(b, &w) != nil {
			return
		}
		set, n, err := inlineSet(&w, nil)
		if err != nil {
			return
		}
		if len(set.W13) != set.E*set.Rows1()*set.K || len(set.W2) != set.E*set.K*set.N || n < int64(len(set.W13)+len(set.W2)) {
			t.Fatalf("accepted E=%d K=%d N=%d with %d/%d weight bytes, %d total", set.E, set.K, set.N, len(set.W13), len(set.W2), n)
		}
		for _, ws := range []scaling.WeightScale{set.W13Scale, set.W2Scale} {
			for _, v := range ws.Values {
				if !(v > 0) || math.IsInf(float64(v), 0) {
					t.Fatalf("accepted scale %v", v)
				}
			}
		}
	})
}

// FuzzDecodeTensor feeds arbitrary Tensor bytes, checked against a chosen
// set of dtypes, to the tensor decoders: no panic, and what they accept
// has exactly the bytes its shape needs and the values they promise.
func FuzzDecodeTensor(f *testing.F) {
	seeds := []*pb.Tensor{
		{Dtype: pb.DataType_DATA_TYPE_FLOAT32, Shape: []int64{2}, Source: &pb.Tensor_Data{Data: bytes.Repeat([]byte{0, 0, 0x80, 0x3f}, 2)}},
		{Dtype: pb.DataType_DATA_TYPE_BFLOAT16, Shape: []int64{1, 2}, Source: &pb.Tensor_Data{Data: []byte{0x80, 0xff, 0x80, 0x3f}}},
		{Dtype: pb.DataType_DATA_TYPE_FLOAT8_E4M3FN, Shape: []int64{1 << 40, 1 << 40}, Source: &pb.Tensor_Data{Data: []byte{1}}},
	}
	for i, s := range seeds {
		b, _ := proto.Marshal(s)
		f.Add(b, uint8(i))
	}
	all := []moe.DType{moe.Float32, moe.BFloat16, moe.Float16, moe.Float8E4M3FN, moe.Int32}
	f.Fuzz(func(t *testing.T, b []byte, mask uint8) {
		var pt pb.Tensor
		if proto.Unmarshal(b, &pt) != nil {
			return
		}
		var allowed []moe.DType
		for i, d := range all {
			if mask&(1<<i) != 0 {
				allowed = append(allowed, d)
			}
		}
		m, err := checkMeta("t", &pt, allowed...)
		if err != nil {
			return
		}
		data, err := tensorBytes("t", &pt, m, nil)
		if err != nil {
			return
		}
		n := 1
		for _, d := range m.shape {
			if d < 0 {
				t.Fatalf("accepted shape %v", m.shape)
			}
			n *= d
		}
		if len(data) != n*m.dtype.Size() || int64(len(data)) != m.bytes {
			t.Fatalf("accepted %v %v with %d bytes", m.dtype, m.shape, len(data))
		}
		legal := false
		for _, a := range allowed {
			legal = legal || a == m.dtype
		}
		if !legal {
			t.Fatalf("accepted dtype %v, allowed %v", m.dtype, allowed)
		}
		switch m.dtype {
		case moe.Float32:
			if v, err := moe.DecodeScales("t", data); err == nil {
				for _, x := range v {
					if !(x > 0) || math.IsInf(float64(x), 0) {
						t.Fatalf("accepted scale %v", x)
					}
				}
			}
			fallthrough
		case moe.BFloat16:
			e := max(n, 1)
			if len(m.shape) > 0 && m.shape[len(m.shape)-1] > 0 {
				e = m.shape[len(m.shape)-1]
			}
			if moe.CheckLogits(m.dtype, data, e, moe.Softmax) == nil {
				for row := 0; row*e < n; row++ {
					finite := false
					for i := row * e; i < (row+1)*e; i++ {
						x := moe.Element(m.dtype, data, i)
						if x != x || math.IsInf(float64(x), 1) {
							t.Fatalf("accepted logit %v", x)
						}
						finite = finite || !math.IsInf(float64(x), -1)
					}
					if !finite {
						t.Fatalf("accepted softmax row %d of -Inf", row)
					}
				}
			}
		}
	})
}

// TestCheckRequestDevice: tensors in device memory (as shmTable.resolve finds
// them) are checked for dtype, shape and size and become device tensors
// with no host bytes, as does the output; a reference nothing resolved is
// refused, and a size that disagrees with the declaration is the
// reference's byte_size.
func TestCheckRequestDevice(t *testing.T) {
	set := &moe.ExpertSet{Activation: moe.SiluGated, E: 4, K: 8, N: 4}
	ref := func(dt pb.DataType, n int64, shape ...int64) *pb.Tensor {
		return &pb.Tensor{Dtype: dt, Shape: shape, Source: &pb.Tensor_Shm{Shm: &pb.SharedMemoryRef{RegionName: "dev", ByteSize: n}}}
	}
	req := &pb.FusedMoERequest{
		HiddenStates: ref(pb.DataType_DATA_TYPE_BFLOAT16, 32, 2, 8),
		RouterLogits: ref(pb.DataType_DATA_TYPE_FLOAT32, 32, 2, 4),
		Routing:      &pb.Routing{TopK: 2},
	}
	hidden := moe.Tensor{Memory: moe.Device, Dev: 0x1000, DevBytes: 32}
	logits := moe.Tensor{Memory: moe.Device, Dev: 0x2000, DevBytes: 32}
	short := hidden
	short.DevBytes = 31
	onDevice := &placement{tensors: map[string]moe.Tensor{"hidden_states": hidden, "router_logits": logits}, outDev: 0x3000}
	tests := []struct {
		name       string
		sh         *placement
		dtype      pb.DataType
		wantHidden moe.Tensor
		wantLogits moe.Tensor
		wantOutDev uintptr
		wantErr    string
	}{
		{"on the device", onDevice, pb.DataType_DATA_TYPE_BFLOAT16,
			moe.Tensor{DType: moe.BFloat16, Shape: []int{2, 8}, Memory: moe.Device, Dev: 0x1000, DevBytes: 32},
			moe.Tensor{DType: moe.Float32, Shape: []int{2, 4}, Memory: moe.Device, Dev: 0x2000, DevBytes: 32}, 0x3000, ""},
		{"short", &placement{tensors: map[string]moe.Tensor{"hidden_states": short, "router_logits": logits}}, pb.DataType_DATA_TYPE_BFLOAT16,
			moe.Tensor{}, moe.Tensor{}, 0, "hidden_states.shm.byte_size: 31: shape [2 8] of DATA_TYPE_BFLOAT16 needs 32 bytes"},
		{"dtype", onDevice, pb.DataType_DATA_TYPE_INT32, moe.Tensor{}, moe.Tensor{}, 0, "hidden_states: dtype DATA_TYPE_INT32"},
		{"logits not resolved", &placement{tensors: map[string]moe.Tensor{"hidden_states": hidden}}, pb.DataType_DATA_TYPE_BFLOAT16,
			moe.Tensor{}, moe.Tensor{}, 0, "router_logits.shm: shared memory is not supported"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := proto.Clone(req).(*pb.FusedMoERequest)
			r.HiddenStates.Dtype = tt.dtype
			got, err := checkRequest(r, set, moe.Limits{}, tt.sh)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("checkRequest = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("checkRequest: %v", err)
			}
			if diff := cmp.Diff(tt.wantHidden, got.Hidden); diff != "" {
				t.Errorf("hidden (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantLogits, got.Logits); diff != "" {
				t.Errorf("logits (-want +got):\n%s", diff)
			}
			if got.OutDev != tt.wantOutDev || got.Out != nil {
				t.Errorf("output at %#x with %d host bytes, want %#x and none", got.OutDev, len(got.Out), tt.wantOutDev)
			}
			if !proto.Equal(r, req) && tt.dtype == req.GetHiddenStates().GetDtype() {
				t.Errorf("checkRequest modified the request")
			}
		})
	}
}

// FuzzQuote: whatever a client sends, Quote's result is short, valid
// UTF-8, and starts with a Go-quoted prefix of the input.
func FuzzQuote(f *testing.F) {
	f.Add("layer0")
	f.Add(strings.Repeat("\u00e9", 200))
	f.Add("a\nlevel=ERROR msg=forged")
	f.Fuzz(func(t *testing.T, s string) {
		q := Quote(s)
		if len(q) > 4*clip.Quoted+40 || !utf8.ValidString(q) || strings.ContainsAny(q, "\n\r") {
			t.Fatalf("Quote(%d bytes) = %d bytes %.200q", len(s), len(q), q)
		}
		head, err := strconv.QuotedPrefix(q)
		if err != nil {
			t.Fatalf("Quote(%.100q) = %.200q: %v", s, q, err)
		}
		if u, _ := strconv.Unquote(head); !strings.HasPrefix(s, u) || (len(s) <= clip.Quoted && u != s) {
			t.Fatalf("Quote(%.100q) quotes %.100q", s, u)
		}
	})
}
