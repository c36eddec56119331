package service_test

import (
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
	"github.com/expertd/expertd/weights"
)

// sliceExperts is w restricted to the experts ids, in that order, as a
// shard holding them would load it: per-expert tensors sliced, static
// input scales the max over the whole layer.
func sliceExperts(t *testing.T, w *pb.ExpertWeights, ids []int) *pb.ExpertWeights {
	t.Helper()
	slice := func(tt *pb.Tensor) *pb.Tensor {
		if tt == nil {
			return nil
		}
		e := int(tt.Shape[0])
		per := len(tt.GetData()) / e
		var b []byte
		for _, id := range ids {
			b = append(b, tt.GetData()[id*per:(id+1)*per]...)
		}
		shape := append([]int64{int64(len(ids))}, tt.Shape[1:]...)
		return &pb.Tensor{Dtype: tt.Dtype, Shape: shape, Source: &pb.Tensor_Data{Data: b}}
	}
	maxed := func(tt *pb.Tensor) *pb.Tensor {
		if tt == nil {
			return nil
		}
		v := make([]float32, len(ids))
		for i := range v {
			v[i] = slices.Max(kerneltest.DecodeOutput(moe.Float32, tt.GetData()))
		}
		return f32Tensor(v, int64(len(ids)))
	}
	return &pb.ExpertWeights{
		Activation: w.Activation, WeightBlockShape: w.WeightBlockShape,
		W13: slice(w.W13), W2: slice(w.W2), W13Scale: slice(w.W13Scale), W2Scale: slice(w.W2Scale),
		A13Scale: maxed(w.A13Scale), A2Scale: maxed(w.A2Scale),
	}
}

// TestLoadSafetensorsSubset loads chosen experts of a file, as one shard
// of an expert-parallel deployment does, and checks the set is the
// upload of exactly those experts' bytes in the chosen order (equal
// fingerprints), with the layer-wide static input scale; bad picks are
// InvalidArgument naming experts, and load nothing.
func TestLoadSafetensorsSubset(t *testing.T) {
	rng := newRand(t)
	dir := t.TempDir()
	const e, k, n = 5, 32, 16
	nem := nemotronFile(t, rng, filepath.Join(dir, "nemotron.safetensors"), e, k, n)
	qwen := qwenFile(t, rng, filepath.Join(dir, "qwen.safetensors"), e, k, n, []int{8, 16})
	_, srv, _ := servicetest.StartServerConfig(t, service.Config{WeightsDir: dir}, &fakeBackend{})
	pick := func(ids ...int) weights.ExpertSubset {
		return func(numExperts int) ([]int, error) {
			if numExperts != e {
				return nil, errors.New("wrong expert count")
			}
			return ids, nil
		}
	}
	tests := []struct {
		name string
		src  *pb.LoadExpertsRequest_SafetensorsSource
		ids  []int
		w    *pb.ExpertWeights
	}{
		{"nemotron-range", &pb.LoadExpertsRequest_SafetensorsSource{Path: "nemotron.safetensors", Layer: 1, Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H}, []int{3, 4}, nem},
		{"nemotron-permuted", &pb.LoadExpertsRequest_SafetensorsSource{Path: "nemotron.safetensors", Layer: 1, Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H}, []int{4, 0, 2}, nem},
		{"qwen-block", &pb.LoadExpertsRequest_SafetensorsSource{Path: "qwen.safetensors", Preset: pb.NamingPreset_NAMING_PRESET_QWEN3_MOE, WeightBlockShape: []int32{8, 16}}, []int{1}, qwen},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.src.Name = tt.name
			got, err := srv.LoadSafetensors(testContext(t), tt.src, pick(tt.ids...))
			if err != nil {
				t.Fatalf("LoadSafetensors: %v", err)
			}
			want := sliceExperts(t, tt.w, tt.ids)
			if got.GetFingerprint() != fingerprintOf(want) {
				t.Errorf("fingerprint %s, want %s (the upload of experts %v)", got.GetFingerprint(), fingerprintOf(want), tt.ids)
			}
			if got.GetNumExperts() != int32(len(tt.ids)) {
				t.Errorf("num_experts %d, want %d", got.GetNumExperts(), len(tt.ids))
			}
		})
	}
	loaded := srv.LoadedBytes()
	for _, tt := range []struct {
		name string
		ids  []int
		want string
	}{
		{"none", nil, "experts: no experts"},
		{"out of range", []int{0, 5}, "experts: expert 5 out of range [0, 5)"},
		{"twice", []int{2, 2}, "experts: expert 2 selected twice"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			src := &pb.LoadExpertsRequest_SafetensorsSource{Name: "bad", Path: "nemotron.safetensors", Layer: 1, Preset: pb.NamingPreset_NAMING_PRESET_NEMOTRON_H}
			_, err := srv.LoadSafetensors(testContext(t), src, pick(tt.ids...))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("LoadSafetensors(experts %v) = %v, want an error containing %q", tt.ids, err, tt.want)
			}
			if srv.LoadedBytes() != loaded {
				t.Errorf("a refused load left bytes reserved")
			}
		})
	}
}
