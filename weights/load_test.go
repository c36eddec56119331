package weights_test

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/weights"
)

// TestDependencies: the loader links neither protobuf nor gRPC nor the
// daemon and the engine, so it is usable wherever moe is.
func TestDependencies(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		rel, ok := strings.CutPrefix(p, "github.com/expertd/expertd/")
		if strings.HasPrefix(p, "google.golang.org/") || ok && (strings.HasPrefix(rel, "proto") || strings.HasPrefix(rel, "kernels") || strings.HasPrefix(rel, "service")) {
			t.Errorf("package weights depends on %s", p)
		}
	}
}

// budget is a Budget of max bytes that counts what is held.
type budget struct{ max, held int64 }

var errFull = errors.New("full")

func (b *budget) Reserve(_ string, n int64) error {
	if b.held+n > b.max {
		return errFull
	}
	b.held += n
	return nil
}

func (b *budget) Release(n int64) { b.held -= n }

// writeNemotron writes one Nemotron-H expert of FP8 [2, 2] weights with
// unit scales, 16 bytes of set, as dir/name.
func writeNemotron(t *testing.T, dir, name string) {
	t.Helper()
	js := `{"backbone.layers.0.mixer.experts.0.up_proj.weight":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},` +
		`"backbone.layers.0.mixer.experts.0.down_proj.weight":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[4,8]},` +
		`"backbone.layers.0.mixer.experts.0.up_proj.weight_scale":{"dtype":"F32","shape":[],"data_offsets":[8,12]},` +
		`"backbone.layers.0.mixer.experts.0.down_proj.weight_scale":{"dtype":"F32","shape":[],"data_offsets":[12,16]}}`
	b := append(binary.LittleEndian.AppendUint64(nil, uint64(len(js))), js...)
	b = append(b, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0, 0, 0x80, 0x3f, 0, 0, 0x80, 0x3f)
	if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// oneExpert is a Loader of a directory holding writeNemotron's file, its
// budget, and the file's source.
func oneExpert(t *testing.T) (*weights.Loader, *budget, *weights.Source) {
	dir := t.TempDir()
	writeNemotron(t, dir, "one.safetensors")
	b := &budget{max: 1 << 20}
	return &weights.Loader{Dir: weights.Dir(dir), Budget: b}, b, &weights.Source{Path: "one.safetensors", Preset: weights.NemotronH}
}

// TestLoad: a set read from a file holds its bytes in the budget until
// Release, and Keep hands them over.
func TestLoad(t *testing.T) {
	l, b, src := oneExpert(t)
	set, err := l.Load(context.Background(), src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if set.Set.E != 1 || set.Set.K != 2 || set.Set.N != 2 || set.Set.Activation != moe.Relu2 || set.Bytes != 16 || b.held != 16 {
		t.Errorf("set E %d K %d N %d %v of %d bytes, %d held: want 1, 2, 2, relu2, 16 and 16", set.Set.E, set.Set.K, set.Set.N, set.Set.Activation, set.Bytes, b.held)
	}
	if set.Fingerprint == "" || set.Routing != nil {
		t.Errorf("fingerprint %q, routing %v: want one and none", set.Fingerprint, set.Routing)
	}
	set.Keep()
	set.Release()
	if b.held != 16 {
		t.Errorf("%d bytes held after Keep and Release, want 16", b.held)
	}
	set, err = l.Load(context.Background(), src, nil)
	if err != nil {
		t.Fatal(err)
	}
	set.Release()
	if b.held != 16 {
		t.Errorf("%d bytes held after a second set's Release, want the first set's 16", b.held)
	}
	b.max = 20
	if _, err := l.Load(context.Background(), src, nil); !errors.Is(err, errFull) || b.held != 16 {
		t.Errorf("load over the budget: %v with %d bytes held, want the budget's error with 16", err, b.held)
	}
}

// TestLoadCancelled: a load whose context has ended (deadline,
// cancellation, or the daemon's drain, which cancels it) stops before
// reading experts and gives its reservation back.
func TestLoadCancelled(t *testing.T) {
	l, b, src := oneExpert(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := l.Load(ctx, src, nil); !errors.Is(err, context.Canceled) || b.held != 0 {
		t.Errorf("cancelled load: %v with %d bytes held, want context.Canceled with none", err, b.held)
	}
}

// TestLoadCheckpointWithoutLog: a Loader without a Log reads a checkpoint
// directory, whose reads it would log.
func TestLoadCheckpointWithoutLog(t *testing.T) {
	dir := t.TempDir()
	writeNemotron(t, dir, "model.safetensors")
	l := &weights.Loader{Dir: weights.Dir(dir), Budget: &budget{max: 1 << 20}}
	set, err := l.Load(context.Background(), &weights.Source{Path: ".", Preset: weights.NemotronH}, nil)
	if err != nil {
		t.Fatal(err)
	}
	set.Release()
}

// TestLoadErrors: each error names its field and says what the caller
// must change.
func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	writeNemotron(t, dir, "one.safetensors")
	if err := os.Mkdir(filepath.Join(dir, "ck"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeNemotron(t, filepath.Join(dir, "ck"), "model.safetensors")
	tests := []struct {
		name  string
		dir   string
		src   weights.Source
		kind  weights.Kind
		field string
		msg   string
	}{
		{"no weights directory", "", weights.Source{Path: "one.safetensors", Preset: weights.NemotronH},
			weights.NoDir, "safetensors.path", "no weights directory"},
		{"missing file", dir, weights.Source{Path: "two.safetensors", Preset: weights.NemotronH},
			weights.NotFound, "safetensors.path", `"two.safetensors": no such file`},
		{"escape", dir, weights.Source{Path: "../one.safetensors", Preset: weights.NemotronH},
			weights.Invalid, "safetensors.path", `may not contain ".."`},
		{"preset", dir, weights.Source{Path: "one.safetensors", Preset: 42},
			weights.Invalid, "safetensors.preset", "42: want NEMOTRON_H"},
		{"quantization", dir, weights.Source{Path: "one.safetensors", Preset: weights.NemotronH, WeightQuantization: 9},
			weights.Invalid, "safetensors.weight_quantization", "9: want PER_TENSOR"},
		{"subset", dir, weights.Source{Path: "one.safetensors", Preset: weights.NemotronH},
			weights.Invalid, "experts", "expert 1 out of range [0, 1)"},
		{"checkpoint layer without experts", dir, weights.Source{Path: "ck", Layer: 1, Preset: weights.NemotronH},
			weights.NotFound, "safetensors.layer", "no tensor of layer 1"},
		{"checkpoint without model.safetensors", dir, weights.Source{Path: ".", Preset: weights.NemotronH},
			weights.NotFound, "safetensors.path", `"model.safetensors": no such file`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := &budget{max: 1 << 20}
			l := &weights.Loader{Dir: weights.Dir(tt.dir), Budget: b}
			var subset weights.ExpertSubset
			if tt.name == "subset" {
				subset = func(int) ([]int, error) { return []int{1}, nil }
			}
			_, err := l.Load(context.Background(), &tt.src, subset)
			var we *weights.Error
			if !errors.As(err, &we) || we.Kind != tt.kind || we.Field != tt.field || !strings.Contains(we.Msg, tt.msg) {
				t.Errorf("Load = %v, want a kind %d error for %s containing %q", err, tt.kind, tt.field, tt.msg)
			}
			if b.held != 0 {
				t.Errorf("%d bytes held after a failed load", b.held)
			}
		})
	}
}
