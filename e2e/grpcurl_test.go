package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

var update = flag.Bool("update", false, "rewrite the request files in testdata/grpcurl")

// The grpcurl request files, relative to the repo root, and the name
// load.json loads under.
const (
	fusedMoEJSON      = "testdata/grpcurl/fusedmoe.json"
	loadJSON          = "testdata/grpcurl/load.json"
	fusedMoENamedJSON = "testdata/grpcurl/fusedmoe_named.json"
	grpcurlSet        = "grpcurl-layer"
)

// The grpcurl request's problem: small enough to read in a terminal.
const (
	jsonE, jsonK, jsonN, jsonM, jsonTopK = 4, 32, 16, 4, 2
)

func grpcurlPath(t *testing.T) string {
	return tool(t, "EXPERTD_GRPCURL", ".tools/e2e/bin/grpcurl", "grpcurl", "grpcurl", func(p string) error {
		_, err := run(t, nil, p, "-version")
		return err
	})
}

// TestWriteGrpcurlRequest regenerates the committed request files with
// -update, and otherwise checks that the FusedMoE request still parses
// with the documented shape. The files: fusedmoe.json (inline weights),
// load.json (a LoadExperts stream of the same weights: header, then one
// chunk per tensor) and fusedmoe_named.json (the same tokens on the
// loaded set).
func TestWriteGrpcurlRequest(t *testing.T) {
	root := repoRoot(t)
	path := filepath.Join(root, fusedMoEJSON)
	if *update {
		// A fixed seed: the files are committed, so regenerating them
		// without a change of shape should not churn them.
		rng := rand.New(rand.NewPCG(2026, 12))
		s := kerneltest.Qwen3.Scaled(jsonK, jsonN)
		s.E, s.TopK = jsonE, jsonTopK
		set, req := kerneltest.NewCase(rng, s, jsonM, kerneltest.WithGranularity(scaling.PerExpert),
			kerneltest.WithHidden(moe.Float32), kerneltest.WithOutput(moe.Float32))
		r := clienttest.Request("", set, req)
		r.Weights = clienttest.Weights(set)
		r.ReturnRouting = true
		p := requestProto(r)
		writeJSON(t, path, p)

		w := p.GetWeights()
		meta := proto.Clone(w).(*pb.ExpertWeights)
		hdr := &pb.LoadExpertsRequest_Header{Name: grpcurlSet, Weights: meta}
		stream := []proto.Message{&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Header_{Header: hdr}}}
		h := sha256.New()
		for _, f := range []struct {
			name string
			t, m *pb.Tensor
		}{{"w13", w.W13, meta.W13}, {"w2", w.W2, meta.W2}, {"w13_scale", w.W13Scale, meta.W13Scale}, {"w2_scale", w.W2Scale, meta.W2Scale}} {
			f.m.Source = nil
			hdr.TotalBytes += int64(len(f.t.GetData()))
			h.Write(f.t.GetData())
			stream = append(stream, &pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Chunk_{Chunk: &pb.LoadExpertsRequest_Chunk{
				Tensor: f.name, Data: f.t.GetData()}}})
		}
		hdr.Sha256 = hex.EncodeToString(h.Sum(nil))
		writeJSON(t, filepath.Join(root, loadJSON), stream...)

		p.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: grpcurlSet}
		writeJSON(t, filepath.Join(root, fusedMoENamedJSON), p)
	}
	set, req := readRequestJSON(t, path)
	if set.E != jsonE || set.K != jsonK || set.N != jsonN || req.M() != jsonM || req.Routing.TopK != jsonTopK {
		t.Errorf("%s: E,K,N,M,top_k = %d,%d,%d,%d,%d; want %d,%d,%d,%d,%d", fusedMoEJSON,
			set.E, set.K, set.N, req.M(), req.Routing.TopK, jsonE, jsonK, jsonN, jsonM, jsonTopK)
	}
}

// writeJSON writes messages as indented JSON objects one after another,
// as grpcurl -d @ reads a stream, with proto field names. protojson
// writes int64 dims as strings and randomizes its spacing: shapes become
// numbers (grpcurl takes both) and the indentation is json.Indent's, for
// stable diffs.
func writeJSON(t *testing.T, path string, msgs ...proto.Message) {
	t.Helper()
	var buf bytes.Buffer
	for _, m := range msgs {
		b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		b = shapeRE.ReplaceAllFunc(compact(t, b), func(m []byte) []byte { return bytes.ReplaceAll(m, []byte(`"`), nil) })
		b = bytes.ReplaceAll(b, []byte("shape:"), []byte(`"shape":`))
		var ind bytes.Buffer
		if err := json.Indent(&ind, b, "", "  "); err != nil {
			t.Fatal(err)
		}
		// One line per shape: [4, 32, 32] reads better than a column.
		buf.Write(indentedShapeRE.ReplaceAllFunc(ind.Bytes(), func(m []byte) []byte {
			f := strings.Fields(string(m[len(`"shape": [`) : len(m)-1]))
			return []byte(`"shape": [` + strings.Join(f, " ") + "]")
		}))
		buf.WriteByte('\n')
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s (%d bytes)", path, buf.Len())
}

// shapeRE matches a tensor's shape array in compact JSON, and
// indentedShapeRE in indented JSON.
var (
	shapeRE         = regexp.MustCompile(`"shape":\[[^\]]*\]`)
	indentedShapeRE = regexp.MustCompile(`"shape": \[[^\]]*\]`)
)

func compact(t *testing.T, b []byte) []byte {
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// requestProto is the wire form of an SDK request, through the SDK's own
// conversion (a FusedMoE call on a recording stub would do the same).
func requestProto(r *client.FusedMoERequest) *pb.FusedMoERequest {
	p := &pb.FusedMoERequest{
		HiddenStates: r.Hidden.Proto(), RouterLogits: r.RouterLogits.Proto(),
		OutputDtype: pb.DataType(r.OutputDType), ReturnRouting: r.ReturnRouting,
		Routing: &pb.Routing{TopK: int32(r.Routing.TopK), Renormalize: r.Routing.Renormalize, Scoring: pb.Scoring(r.Routing.Scoring)},
	}
	w := r.Weights
	p.Experts = &pb.FusedMoERequest_Weights{Weights: &pb.ExpertWeights{
		Activation: pb.Activation(w.Activation), W13: w.W13.Proto(), W2: w.W2.Proto(),
		W13Scale: w.W13Scale.Proto(), W2Scale: w.W2Scale.Proto(),
	}}
	return p
}

// readRequestJSON parses the grpcurl request file into the kernels types
// the reference takes. It understands what the file uses: inline gated
// weights with per-tensor or per-expert scales, FP32 hidden states and
// logits, softmax routing.
func readRequestJSON(t *testing.T, path string) (*moe.ExpertSet, *moe.Request) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var p pb.FusedMoERequest
	if err := protojson.Unmarshal(b, &p); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	tensor := func(name string, pt *pb.Tensor) client.Tensor {
		ct, err := client.TensorFromProto(pt)
		if err != nil {
			t.Fatalf("%s: %s: %v", path, name, err)
		}
		return ct
	}
	floats := func(name string, pt *pb.Tensor) []float32 {
		v, err := tensor(name, pt).Float32s()
		if err != nil {
			t.Fatalf("%s: %s: %v", path, name, err)
		}
		return v
	}
	w := p.GetWeights()
	w13, w2 := tensor("w13", w.GetW13()), tensor("w2", w.GetW2())
	if w.GetActivation() != pb.Activation_ACTIVATION_SILU_GATED || len(w13.Shape) != 3 || len(w2.Shape) != 3 {
		t.Fatalf("%s: want inline SILU_GATED weights with 3-D w13 and w2", path)
	}
	set := &moe.ExpertSet{Activation: moe.SiluGated, E: w13.Shape[0], K: w13.Shape[2], N: w2.Shape[2], W13: w13.Data, W2: w2.Data}
	scale := func(name string, pt *pb.Tensor, rows, cols int) scaling.WeightScale {
		ws, err := scaling.NewWeightScale(tensor(name, pt).Shape, floats(name, pt), set.E, rows, cols, [2]int{})
		if err != nil {
			t.Fatalf("%s: %s: %v", path, name, err)
		}
		return ws
	}
	set.W13Scale = scale("w13_scale", w.GetW13Scale(), 2*set.N, set.K)
	set.W2Scale = scale("w2_scale", w.GetW2Scale(), set.K, set.N)
	hidden := tensor("hidden_states", p.GetHiddenStates())
	logits := tensor("router_logits", p.GetRouterLogits())
	req := &moe.Request{
		Hidden:   moe.Tensor{DType: moe.DType(hidden.DType), Shape: hidden.Shape, Data: hidden.Data},
		Logits:   moe.Tensor{DType: moe.DType(logits.DType), Shape: logits.Shape, Data: logits.Data},
		Routing:  moe.Routing{TopK: int(p.GetRouting().GetTopK()), Renormalize: p.GetRouting().GetRenormalize(), Scoring: moe.Softmax, ScalingFactor: 1},
		OutDType: moe.DType(p.GetOutputDtype()),
	}
	return set, req
}

// TestGrpcurl drives the daemon with grpcurl and no .proto files, as the
// README shows: list and describe through reflection, the health check,
// server info, a FusedMoE call from the JSON file (checked against the
// float64 reference of the same inputs) and an error.
func TestGrpcurl(t *testing.T) {
	grpcurl := grpcurlPath(t)
	d := startDaemon(t)
	root := repoRoot(t)
	// call runs grpcurl as the README writes it, with the file on stdin.
	call := func(t *testing.T, stdinFile string, args ...string) (string, error) {
		t.Helper()
		var stdin *os.File
		shown := "grpcurl " + shellJoin(args)
		if stdinFile != "" {
			f, err := os.Open(filepath.Join(root, stdinFile))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			stdin = f
			shown += " < " + stdinFile
		}
		t.Logf("$ %s", strings.ReplaceAll(shown, d.Addr, "localhost:PORT"))
		if stdin == nil {
			return run(t, nil, grpcurl, args...)
		}
		return run(t, stdin, grpcurl, args...)
	}

	t.Run("list", func(t *testing.T) {
		out, err := call(t, "", "-plaintext", d.Addr, "list")
		if err != nil {
			t.Fatal(err)
		}
		got := strings.Fields(out)
		for _, want := range []string{"expertd.v1.ExpertService", "grpc.health.v1.Health"} {
			if !slices.Contains(got, want) {
				t.Errorf("list = %q, want it to include %s", got, want)
			}
		}
	})
	t.Run("describe", func(t *testing.T) {
		out, err := call(t, "", "-plaintext", d.Addr, "describe", "expertd.v1.ExpertService")
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"rpc FusedMoE ( .expertd.v1.FusedMoERequest ) returns ( .expertd.v1.FusedMoEResponse );",
			"rpc LoadExperts ( stream .expertd.v1.LoadExpertsRequest ) returns ( .expertd.v1.ExpertSetInfo );"} {
			if !strings.Contains(out, want) {
				t.Errorf("describe output lacks %q:\n%s", want, out)
			}
		}
	})
	t.Run("health", func(t *testing.T) {
		out, err := call(t, "", "-plaintext", d.Addr, "grpc.health.v1.Health/Check")
		if err != nil {
			t.Fatal(err)
		}
		var resp struct{ Status string }
		if err := json.Unmarshal([]byte(out), &resp); err != nil || resp.Status != "SERVING" {
			t.Errorf("health check printed %q (%v), want status SERVING", out, err)
		}
	})
	t.Run("server info", func(t *testing.T) {
		out, err := call(t, "", "-plaintext", d.Addr, "expertd.v1.ExpertService/GetServerInfo")
		if err != nil {
			t.Fatal(err)
		}
		var info pb.ServerInfo
		if err := protojson.Unmarshal([]byte(out), &info); err != nil {
			t.Fatalf("parsing %q: %v", out, err)
		}
		if info.GetLimits().GetMaxTokens() != 512 || info.GetBackends()[0].GetName() != "cpu" {
			t.Errorf("server info = %v, want max tokens 512 and the cpu backend", &info)
		}
	})
	// checkOutput parses a FusedMoE response printed by grpcurl and checks
	// it against the reference of fusedmoe.json's inputs.
	set, req := readRequestJSON(t, filepath.Join(root, fusedMoEJSON))
	checkOutput := func(t *testing.T, out string) {
		t.Helper()
		var resp pb.FusedMoEResponse
		if err := protojson.Unmarshal([]byte(out), &resp); err != nil {
			t.Fatalf("parsing grpcurl output: %v\n%s", err, out)
		}
		res, err := client.TensorFromProto(resp.GetOutput())
		if err != nil {
			t.Fatal(err)
		}
		got, err := res.Float32s()
		if err != nil {
			t.Fatal(err)
		}
		if want := []int{jsonM, jsonK}; fmt.Sprint(res.Shape) != fmt.Sprint(want) || res.DType != moe.Float32 {
			t.Errorf("output %v %v, want float32 %v", res.DType, res.Shape, want)
		}
		checkAgainstReference(t, "grpcurl FusedMoE", got, set, req)
		ids, err := client.TensorFromProto(resp.GetTopkIds())
		if err != nil {
			t.Fatal(err)
		}
		gotIDs, err := ids.Int32s()
		if err != nil {
			t.Fatal(err)
		}
		_, wantIDs, _ := kerneltest.Reference(set, req)
		if !sameRouting(gotIDs, wantIDs, jsonTopK) {
			t.Errorf("returned topk_ids %v, want the reference's %v (in any order per token)", gotIDs, wantIDs)
		}
	}
	t.Run("fusedmoe inline", func(t *testing.T) {
		out, err := call(t, fusedMoEJSON, "-plaintext", "-d", "@", d.Addr, "expertd.v1.ExpertService/FusedMoE")
		if err != nil {
			t.Fatal(err)
		}
		checkOutput(t, out)
	})
	t.Run("load, list, run by name, unload", func(t *testing.T) {
		out, err := call(t, loadJSON, "-plaintext", "-d", "@", d.Addr, "expertd.v1.ExpertService/LoadExperts")
		if err != nil {
			t.Fatal(err)
		}
		var info pb.ExpertSetInfo
		if err := protojson.Unmarshal([]byte(out), &info); err != nil {
			t.Fatalf("parsing %q: %v", out, err)
		}
		h := sha256.New()
		for _, b := range [][]byte{set.W13, set.W2, f32Bytes(set.W13Scale.Values), f32Bytes(set.W2Scale.Values)} {
			h.Write(b)
		}
		if want := hex.EncodeToString(h.Sum(nil)); info.GetName() != grpcurlSet || info.GetFingerprint() != want {
			t.Errorf("loaded %q with fingerprint %s, want %q with %s (the weights of %s)", info.GetName(), info.GetFingerprint(), grpcurlSet, want, fusedMoEJSON)
		}

		out, err = call(t, "", "-plaintext", d.Addr, "expertd.v1.ExpertService/ListExperts")
		if err != nil {
			t.Fatal(err)
		}
		var list pb.ListExpertsResponse
		if err := protojson.Unmarshal([]byte(out), &list); err != nil || len(list.GetExpertSets()) != 1 || list.GetExpertSets()[0].GetName() != grpcurlSet {
			t.Errorf("ListExperts printed %s (%v), want the one set %s", out, err, grpcurlSet)
		}

		out, err = call(t, fusedMoENamedJSON, "-plaintext", "-d", "@", d.Addr, "expertd.v1.ExpertService/FusedMoE")
		if err != nil {
			t.Fatal(err)
		}
		checkOutput(t, out)

		out, err = call(t, "", "-plaintext", "-d", `{"name": "`+grpcurlSet+`"}`, d.Addr, "expertd.v1.ExpertService/UnloadExperts")
		if err != nil {
			t.Fatal(err)
		}
		var freed pb.UnloadExpertsResponse
		if err := protojson.Unmarshal([]byte(out), &freed); err != nil || freed.GetFreedBytes() != set.Bytes() {
			t.Errorf("UnloadExperts printed %s (%v), want %d bytes freed", out, err, set.Bytes())
		}
	})
	t.Run("not found", func(t *testing.T) {
		_, err := call(t, "", "-plaintext", "-d", `{"expert_set": "missing"}`, d.Addr, "expertd.v1.ExpertService/FusedMoE")
		if err == nil || !strings.Contains(err.Error(), "NotFound") {
			t.Errorf("FusedMoE on a missing set: %v, want grpcurl to fail with NotFound", err)
		}
	})
}

// sameRouting reports whether got and want pick the same experts for each
// token of k, in any order.
func sameRouting(got, want []int32, k int) bool {
	if len(got) != len(want) {
		return false
	}
	for t := 0; t < len(got); t += k {
		g, w := slices.Clone(got[t:t+k]), slices.Clone(want[t:t+k])
		slices.Sort(g)
		slices.Sort(w)
		if !slices.Equal(g, w) {
			return false
		}
	}
	return true
}
