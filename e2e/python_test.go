package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

func pythonPath(t *testing.T) string {
	return tool(t, "EXPERTD_PYTHON", ".tools/e2e/venv/bin/python", "python3", "python with the expertd package (pip install ./clients/python) and pytest", func(p string) error {
		_, err := run(t, nil, p, "-c", "import expertd, expertd.v1.expert_pb2_grpc, pytest")
		return err
	})
}

// torchRequired says whether the Python tests that import torch must run
// rather than skip: under EXPERTD_E2E_REQUIRE=1 (CI) unless
// EXPERTD_E2E_TORCH=0 told scripts/e2e-setup.sh to leave torch out.
func torchRequired() bool {
	return os.Getenv(requireEnv) == "1" && os.Getenv("EXPERTD_E2E_TORCH") != "0"
}

// pyArray is one input array of the Python case: a raw little-endian
// file with its numpy dtype and shape.
type pyArray struct {
	File  string `json:"file"`
	DType string `json:"dtype"`
	Shape []int  `json:"shape"`
}

// pyCase is case.json, what clients/python/tests/e2e_case.py reads.
type pyCase struct {
	Activation  string             `json:"activation"`
	TopK        int                `json:"top_k"`
	Renormalize bool               `json:"renormalize"`
	ChunkBytes  int                `json:"chunk_bytes"`
	Arrays      map[string]pyArray `json:"arrays"`
}

// pySummary is what e2e_case.py prints.
type pySummary struct {
	Version     string   `json:"version"`
	Module      string   `json:"module"`
	Fingerprint string   `json:"fingerprint"`
	Bytes       int64    `json:"bytes"`
	Chunks      int      `json:"chunks"`
	Sets        []string `json:"sets"`
	OutputShape []int    `json:"output_shape"`
	Backend     string   `json:"backend"`
	TopKIDs     []int32  `json:"topk_ids"`
	UnknownSet  string   `json:"unknown_set"`
	Freed       int64    `json:"freed"`
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func readF32(t *testing.T, path string) []float32 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

// TestPython drives the daemon with the installed Python package: the Go
// test writes a fresh random case, clients/python/tests/e2e_case.py loads
// it in chunks and runs it on the named set and inline, and the Go test
// checks its outputs against the float64 reference of the same inputs.
func TestPython(t *testing.T) {
	python := pythonPath(t)
	d := startDaemon(t)
	root := repoRoot(t)
	rng := newRand(t)

	// FP32 hidden states and logits (numpy has no bfloat16), per-expert
	// FP32 scales, Qwen3 routing on fewer experts.
	s := kerneltest.Qwen3.Scaled(64, 32)
	s.E = 16
	const m = 9
	set, req := kerneltest.NewCase(rng, s, m, kerneltest.WithGranularity(scaling.PerExpert),
		kerneltest.WithHidden(moe.Float32), kerneltest.WithOutput(moe.Float32))

	dir := t.TempDir()
	c := pyCase{Activation: "silu_gated", TopK: s.TopK, Renormalize: s.Renormalize, ChunkBytes: 4096, Arrays: map[string]pyArray{}}
	write := func(name, dtype string, data []byte, shape ...int) {
		if err := os.WriteFile(filepath.Join(dir, name+".bin"), data, 0o644); err != nil {
			t.Fatal(err)
		}
		c.Arrays[name] = pyArray{File: name + ".bin", DType: dtype, Shape: shape}
	}
	write("w13", "uint8", set.W13, s.E, 2*s.N, s.K)
	write("w2", "uint8", set.W2, s.E, s.K, s.N)
	write("w13_scale", "float32", f32Bytes(set.W13Scale.Values), s.E)
	write("w2_scale", "float32", f32Bytes(set.W2Scale.Values), s.E)
	write("hidden", "float32", req.Hidden.Data, m, s.K)
	write("router_logits", "float32", req.Logits.Data, m, s.E)
	meta, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "case.json"), meta, 0o644); err != nil {
		t.Fatal(err)
	}

	script := filepath.Join(root, "clients/python/tests/e2e_case.py")
	args := []string{script, "--addr", d.Addr, "--case", dir}
	t.Logf("$ python clients/python/tests/e2e_case.py --addr localhost:PORT --case CASE")
	out, err := run(t, nil, python, args...)
	if err != nil {
		t.Fatal(err)
	}
	var sum pySummary
	if err := json.Unmarshal([]byte(out), &sum); err != nil {
		t.Fatalf("parsing the script's summary %q: %v", out, err)
	}
	t.Logf("python summary: %+v", sum)
	if strings.HasPrefix(sum.Module, filepath.Join(root, "clients")) {
		t.Errorf("expertd imported from the source tree (%s), want the installed package", sum.Module)
	}

	if sum.Bytes != set.Bytes() || sum.Chunks < int(set.Bytes()/4096) {
		t.Errorf("python loaded %d bytes in %d chunks, want %d bytes in >= %d chunks of 4096", sum.Bytes, sum.Chunks, set.Bytes(), set.Bytes()/4096)
	}
	h := sha256.New()
	for _, b := range [][]byte{set.W13, set.W2, f32Bytes(set.W13Scale.Values), f32Bytes(set.W2Scale.Values)} {
		h.Write(b)
	}
	if want := hex.EncodeToString(h.Sum(nil)); sum.Fingerprint != want || len(sum.Sets) != 1 || sum.Sets[0] != "py-layer" {
		t.Errorf("fingerprint %q, sets %v: want %s and the one set py-layer", sum.Fingerprint, sum.Sets, want)
	}
	if sum.UnknownSet != "NOT_FOUND" || sum.Freed != set.Bytes() || sum.Backend != "cpu" {
		t.Errorf("unknown set gave %s, unload freed %d, backend %q; want NOT_FOUND, %d, cpu", sum.UnknownSet, sum.Freed, sum.Backend, set.Bytes())
	}
	if len(sum.OutputShape) != 2 || sum.OutputShape[0] != m || sum.OutputShape[1] != s.K {
		t.Errorf("output shape %v, want [%d %d]", sum.OutputShape, m, s.K)
	}
	_, wantIDs, _ := kerneltest.Reference(set, req)
	if !sameRouting(sum.TopKIDs, wantIDs, s.TopK) {
		t.Errorf("python got topk_ids %v, want the reference's %v", sum.TopKIDs, wantIDs)
	}
	checkAgainstReference(t, "python, named set", readF32(t, filepath.Join(dir, "out_named.f32")), set, req)
	checkAgainstReference(t, "python, inline weights", readF32(t, filepath.Join(dir, "out_inline.f32")), set, req)
}

// TestPythonPackage runs the package's pytest suite (clients/python/tests:
// sync, asyncio, FusedMoEStream, POSIX shared memory, typed errors,
// RemoteMoE's choice of path on two more daemons, one with -ring and one
// without -shared-memory; CUDA IPC skips without a GPU; sharded checkpoints in its weights directory,
// among them the real layouts written from transformers' MoE blocks and
// compared with their forward) against a real daemon serving shared
// memory. It runs outside the source tree, so the installed package is
// what is tested. Under EXPERTD_E2E_REQUIRE=1 the transformers
// comparisons must run (EXPERTD_REQUIRE_TORCH=1) unless
// EXPERTD_E2E_TORCH=0 said scripts/e2e-setup.sh should not install torch.
func TestPythonPackage(t *testing.T) {
	python := pythonPath(t)
	weights := t.TempDir()
	d := startDaemon(t, "-shared-memory", "-weights-dir", weights)
	// RemoteMoE's path choice wants a daemon with call rings and one
	// without shared memory besides d, which serves shared memory only.
	ring := startDaemon(t, "-shared-memory", "-ring")
	plain := startDaemon(t)
	tests := filepath.Join(repoRoot(t), "clients/python/tests")
	// The transformers comparisons import torch and build a dozen blocks:
	// tens of seconds on two busy cores.
	t.Logf("$ EXPERTD_ADDR=localhost:PORT EXPERTD_SHM=1 EXPERTD_RING_ADDR=localhost:PORT2 EXPERTD_PLAIN_ADDR=localhost:PORT3 python -m pytest -q clients/python/tests")
	if !pytest(t, python, 12*defaultTimeout, tests, "EXPERTD_ADDR="+d.Addr, "EXPERTD_SHM=1", "EXPERTD_WEIGHTS_DIR="+weights,
		"EXPERTD_CUDA=", "EXPERTD_RING_ADDR="+ring.Addr, "EXPERTD_PLAIN_ADDR="+plain.Addr) {
		t.Fatalf("pytest ran no tests")
	}
}

// pytest runs python -m pytest on path (a file or a folder) from a
// temporary directory, so that the installed expertd package is what the
// tests import, with env added to this process's and EXPERTD_REQUIRE_TORCH=1
// where torchRequired. A failing run fails the test; it says whether any
// test passed (a run that only skipped did not).
func pytest(t *testing.T, python string, timeout time.Duration, path string, env ...string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", path)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), env...)
	if torchRequired() {
		cmd.Env = append(cmd.Env, "EXPERTD_REQUIRE_TORCH=1")
	}
	out, err := cmd.CombinedOutput()
	t.Logf("pytest:\n%s", out)
	if err != nil {
		t.Fatalf("pytest: %v", err)
	}
	return strings.Contains(string(out), " passed")
}
