package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/internal/clitest"
	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

func TestParseLayers(t *testing.T) {
	tests := []struct {
		spec string
		n    int
		want []int
		err  bool
	}{
		{"3", 0, []int{3}, false},
		{"0,2,4-6", 0, []int{0, 2, 4, 5, 6}, false},
		{"1-2,2,1", 0, []int{1, 2}, false},
		{"all", 3, []int{0, 1, 2}, false},
		{"all", 0, nil, true},
		{"5-3", 0, nil, true},
		{"x", 0, nil, true},
		{"-1", 0, nil, true},
		{"0-1023", 0, nil, false},
		{"1024", 0, nil, true},
		{"0-1000000000", 0, nil, true},
		{"all", 1024, nil, false},
		{"all", 1025, nil, true},
	}
	for _, tt := range tests {
		got, err := parseLayers(tt.spec, tt.n)
		if tt.want == nil && !tt.err {
			tt.want = got // only the error is checked
		}
		if (err != nil) != tt.err || !slices.Equal(got, tt.want) {
			t.Errorf("parseLayers(%q, %d) = %v, %v; want %v (error %v)", tt.spec, tt.n, got, err, tt.want, tt.err)
		}
	}
}

// writeQwen writes a Qwen3-MoE FP8 checkpoint with layers 1 and 2 MoE and
// layer 0 dense (no experts), as two shards and an index.
func writeQwen(t *testing.T, dir string, e, k, n int) {
	t.Helper()
	type tensor struct {
		dtype string
		shape []int
		data  []byte
	}
	shards := []map[string]tensor{{}, {}}
	one := make([]byte, 4)
	binary.LittleEndian.PutUint32(one, math.Float32bits(0.01))
	code := func(rows, cols int) []byte {
		b := make([]byte, rows*cols)
		for i := range b {
			b[i] = byte(0x30 + i%16)
		}
		return b
	}
	shards[0]["model.layers.0.mlp.down_proj.weight"] = tensor{"F8_E4M3", []int{k, n}, code(k, n)}
	for _, layer := range []int{1, 2} {
		for x := range e {
			for i, p := range []string{"gate_proj", "up_proj", "down_proj"} {
				rows, cols := n, k
				if p == "down_proj" {
					rows, cols = k, n
				}
				name := fmt.Sprintf("model.layers.%d.mlp.experts.%d.%s", layer, x, p)
				s := shards[(x+i)%2]
				s[name+".weight"] = tensor{"F8_E4M3", []int{rows, cols}, code(rows, cols)}
				s[name+".weight_scale"] = tensor{"F32", []int{}, one}
			}
		}
	}
	wm := map[string]string{}
	for i, s := range shards {
		file := fmt.Sprintf("model-%05d-of-00002.safetensors", i+1)
		hdr := map[string]any{}
		var data []byte
		names := make([]string, 0, len(s))
		for name := range s {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			hdr[name] = map[string]any{"dtype": s[name].dtype, "shape": s[name].shape, "data_offsets": []int{len(data), len(data) + len(s[name].data)}}
			data = append(data, s[name].data...)
			wm[name] = file
		}
		js, _ := json.Marshal(hdr)
		out := binary.LittleEndian.AppendUint64(nil, uint64(len(js)))
		if err := os.WriteFile(filepath.Join(dir, file), append(append(out, js...), data...), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	js, _ := json.Marshal(map[string]any{"weight_map": wm})
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), js, 0o644)
	js, _ = json.Marshal(map[string]any{"model_type": "qwen3_moe", "num_experts": e, "num_experts_per_tok": 2, "num_hidden_layers": 3})
	os.WriteFile(filepath.Join(dir, "config.json"), js, 0o644)
}

// TestLoadLayers loads every layer of a checkpoint into a real service:
// the dense layer is skipped, the MoE layers load under their names, and
// the progress lines count them.
func TestLoadLayers(t *testing.T) {
	root := t.TempDir()
	ck := filepath.Join(root, "qwen")
	os.Mkdir(ck, 0o755)
	const e, k, n = 4, 32, 16
	writeQwen(t, ck, e, k, n)
	dial, _ := servicetest.StartServerDial(t, service.Config{WeightsDir: root}, cpu.New(kernels.Config{}))
	rpc := pb.NewExpertServiceClient(dial())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	n3, err := numHiddenLayers(filepath.Join(ck, "config.json"))
	if err != nil || n3 != 3 {
		t.Fatalf("numHiddenLayers = %d, %v; want 3", n3, err)
	}
	layers, _ := parseLayers("all", n3)
	var log bytes.Buffer
	c := config{path: "qwen", name: "qwen/layer{L}", preset: "auto"}
	c.dial.Timeout = 10 * time.Second
	res, err := loadLayers(ctx, rpc, c, layers, newProgress(&log, "lines", len(layers)))
	if err != nil {
		t.Fatalf("loadLayers: %v\n%s", err, log.String())
	}
	if len(res) != 3 || !res[0].skipped || res[1].skipped || res[2].skipped {
		t.Fatalf("results %+v: want layer 0 skipped, 1 and 2 loaded", res)
	}
	for _, r := range res[1:] {
		if want := fmt.Sprintf("qwen/layer%d", r.layer); r.info.GetName() != want || r.info.GetNumExperts() != e || r.info.GetRouting().GetTopK() != 2 {
			t.Errorf("layer %d: set %q E=%d top_k=%d; want %q E=%d top_k=2", r.layer, r.info.GetName(), r.info.GetNumExperts(), r.info.GetRouting().GetTopK(), want, e)
		}
	}
	for _, want := range []string{"[1/3] layer 0: no experts, skipped", "[2/3] layer 1: qwen/layer1", "[3/3] layer 2: qwen/layer2"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("progress %q lacks %q", log.String(), want)
		}
	}
	list, _ := rpc.ListExperts(ctx, &pb.ListExpertsRequest{})
	if len(list.GetExpertSets()) != 2 {
		t.Errorf("%d sets resident, want 2", len(list.GetExpertSets()))
	}

	// Loading again without -overwrite stops at the first layer in use.
	_, err = loadLayers(ctx, rpc, c, []int{1, 2}, newProgress(&log, "none", 2))
	if err == nil || !strings.Contains(err.Error(), "layer 1") || !strings.Contains(err.Error(), "already loaded") {
		t.Errorf("second load: %v, want layer 1 already loaded", err)
	}
	// A single dense layer asked for by name is an error, not a skip.
	if _, err := loadLayers(ctx, rpc, c, []int{0}, newProgress(&log, "none", 1)); err == nil {
		t.Error("loading dense layer 0 alone succeeded")
	}
	// The bar draws in place.
	var bar bytes.Buffer
	p := newProgress(&bar, "bar", 2)
	p.start(0, 1)
	p.done(1, 1, 3<<20, "x")
	p.finish()
	if !strings.Contains(bar.String(), "\r\x1b[K[===============               ] 1/2 layers  3.0 MiB") {
		t.Errorf("bar %q", bar.String())
	}
}

// runBounded runs the command, failing the test if it does not return
// within a minute: every case here must end long before.
func runBounded(t *testing.T, args ...string) (err error, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- run(context.Background(), args, &out, &errOut) }()
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		t.Fatalf("expertd-load %q still running after a minute", args)
	}
	return err, out.String(), errOut.String()
}

// TestRunTimeout: with no daemon at -addr, or a peer that accepts TCP and
// never answers, the command ends with an error after -timeout instead of
// waiting for ever in the dial.
func TestRunTimeout(t *testing.T) {
	for _, addr := range []string{"127.0.0.1:1", clitest.SilentPeer(t)} {
		err, _, _ := runBounded(t, "-addr", addr, "-timeout", "300ms", "-path", "x", "-layers", "0")
		if err == nil || !strings.Contains(err.Error(), "within -timeout 300ms") {
			t.Errorf("-addr %s: %v; want an error naming -timeout", addr, err)
		}
	}
}

// TestRunBoundedInputs: files are read only when regular and small, and
// layer counts are capped, before anything is dialled.
func TestRunBoundedInputs(t *testing.T) {
	dir := t.TempDir()
	huge := filepath.Join(dir, "huge")
	os.WriteFile(huge, nil, 0o600)
	if err := os.Truncate(huge, 4<<30); err != nil {
		t.Fatal(err)
	}
	base := []string{"-addr", "127.0.0.1:1", "-timeout", "5s", "-path", "x"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-layers", "all", "-config", huge}, "-config: \"huge\" is 4294967296 bytes, over the size cap of 4 MiB"},
		{[]string{"-layers", "all", "-config", dir}, "not a regular file (a directory)"},
		{[]string{"-layers", "0", "-token-file", huge}, "-token-file: \"huge\" is 4294967296 bytes, over the size cap of 64 KiB"},
		{[]string{"-layers", "all", "-num-layers", "1000000000"}, "-num-layers 1000000000: want 1 to 1024"},
		{[]string{"-layers", "all", "-num-layers", "-3"}, "-num-layers -3: want 1 to 1024"},
		{[]string{"-layers", "0-99999999"}, "layer indices go up to 1023"},
		{[]string{"-layers", "0", "-timeout", "0s"}, "-timeout 0s: want > 0"},
	} {
		err, _, _ := runBounded(t, append(base, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v; want an error with %q", tc.args, err, tc.want)
		}
	}
}

// invalidIndex answers every load as the daemon does a checkpoint whose
// index is corrupt, with a message far longer than a line.
type invalidIndex struct {
	pb.UnimplementedExpertServiceServer
}

func (invalidIndex) LoadExperts(pb.ExpertService_LoadExpertsServer) error {
	return status.Error(codes.InvalidArgument, "model.safetensors.index.json: weight_map is empty "+strings.Repeat("x", 1<<20))
}

// TestRunInvalidIndex: a load the daemon refuses with InvalidArgument (a
// corrupt index) stops the run with that error, which main turns into a
// non-zero exit, and is not counted as a layer without experts.
func TestRunInvalidIndex(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	pb.RegisterExpertServiceServer(gs, invalidIndex{})
	go gs.Serve(lis)
	defer gs.Stop()
	err, stdout, stderr := runBounded(t, "-addr", lis.Addr().String(), "-timeout", "10s", "-path", "x", "-layers", "all", "-num-layers", "3", "-progress", "lines")
	if status.Code(errors.Unwrap(err)) != codes.InvalidArgument || !strings.Contains(err.Error(), "layer 0") {
		t.Fatalf("run = %.200v; want InvalidArgument for layer 0", err)
	}
	if stdout != "" || strings.Contains(stderr, "skipped\n[") || !strings.Contains(stderr, "0 sets loaded") {
		t.Errorf("stdout %q, stderr %.300q", stdout, stderr)
	}
	var line bytes.Buffer
	clip.Fprintf(&line, "expertd-load: %v\n", err)
	clitest.CheckLines(t, line.String())
}

// TestUsageLinesBounded: a megabyte flag value reaches stderr in lines of
// at most clip.Line bytes.
func TestUsageLinesBounded(t *testing.T) {
	var stderr bytes.Buffer
	if _, err := parseFlags([]string{"-num-layers", strings.Repeat("9", 1<<20) + "x"}, &stderr); err == nil {
		t.Fatal("parseFlags accepted a megabyte -num-layers")
	}
	clitest.CheckLines(t, stderr.String())
}

// TestQuantizationOf: -weight-quantization names the proto's values in
// lower case; empty leaves the daemon's default; anything else is refused
// before a call is made.
func TestQuantizationOf(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want pb.WeightQuantization
	}{
		{"", pb.WeightQuantization_WEIGHT_QUANTIZATION_UNSPECIFIED},
		{"per_channel", pb.WeightQuantization_WEIGHT_QUANTIZATION_PER_CHANNEL},
		{"per_tensor", pb.WeightQuantization_WEIGHT_QUANTIZATION_PER_TENSOR},
		{"BLOCK", pb.WeightQuantization_WEIGHT_QUANTIZATION_BLOCK},
	} {
		if got, err := quantizationOf(tc.in); err != nil || got != tc.want {
			t.Errorf("quantizationOf(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"unspecified", "fp8", "per-channel"} {
		if _, err := quantizationOf(bad); err == nil || !strings.Contains(err.Error(), "-weight-quantization") {
			t.Errorf("quantizationOf(%q): %v, want an error naming the flag", bad, err)
		}
	}
}

// TestPresetOf: -preset takes every naming preset of the contract but
// CUSTOM (which needs templates the tool does not take), in lower case,
// and the refusal of any other name lists each one.
func TestPresetOf(t *testing.T) {
	_, err := presetOf("custom")
	if err == nil {
		t.Fatal(`presetOf("custom") succeeded`)
	}
	for v, full := range pb.NamingPreset_name {
		if v == 0 || v == int32(pb.NamingPreset_NAMING_PRESET_CUSTOM) {
			continue
		}
		name := strings.ToLower(strings.TrimPrefix(full, "NAMING_PRESET_"))
		if got, err := presetOf(name); err != nil || got != pb.NamingPreset(v) {
			t.Errorf("presetOf(%q) = %v, %v; want %v", name, got, err, pb.NamingPreset(v))
		}
		if !strings.Contains(err.Error(), name) {
			t.Errorf("the refusal %q does not list %s", err, name)
		}
	}
}
