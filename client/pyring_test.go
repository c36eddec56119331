package client_test

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// pyRingScript drives clients/python/expertd/ring.py as a Python caller
// would, with the standard library only: it lays a ring out in the
// object, waits for the Go side to attach it, posts the request bytes
// twice (sleeping on the futex, then spinning), writes each
// completion's kind and payload, and closes its mapping.
const pyRingScript = `
import mmap, os, sys
sys.path.insert(0, sys.argv[1])
import ring
key, req_path, out_dir = sys.argv[2], sys.argv[3], sys.argv[4]
fd = os.open("/dev/shm/" + key, os.O_RDWR)
buf = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
r = ring.Ring(buf, 0, slots=2, slot_size=4096)
print("ready", flush=True)
sys.stdin.readline()
req = open(req_path, "rb").read()
for n, spin in enumerate((0.0, 0.05)):
    kind, payload = r.call(req, timeout_s=10, spin_s=spin)
    open(os.path.join(out_dir, "resp%d" % n), "wb").write(bytes([kind]) + payload)
r.drop_memory()
buf.close()  # BufferError while the ring still holds views of it
print("done", flush=True)
`

// TestPythonRing checks the Python ring client against the daemon: the
// layout it writes is the one AttachRing accepts, its posts wake the
// poller, its futex waits are woken by completions, and it reads the
// same answer the RPC gives.
func TestPythonRing(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	ctx := testContext(t)
	f := newRingFixture(t, ringConfig, 3)
	want, err := f.c.FusedMoE(ctx, f.request())
	if err != nil {
		t.Fatal(err)
	}
	reqBytes, err := proto.Marshal(requestProto(t, f.request()))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	reqPath := filepath.Join(dir, "req")
	if err := os.WriteFile(reqPath, reqBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	mod, err := filepath.Abs("../clients/python/expertd")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, py, "-c", pyRingScript, mod, f.shm.Key(), reqPath, dir)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "ready" {
		cmd.Wait()
		t.Fatalf("python: %q, stderr:\n%s", lines.Text(), stderr.String())
	}
	stream, err := f.c.RPC().AttachRing(ctx, &pb.AttachRingRequest{RegionName: f.region.Name, SlotCount: 2, SlotSize: 4096})
	if err == nil {
		_, err = stream.Recv()
	}
	if err != nil {
		t.Fatalf("AttachRing of the Python layout: %v", err)
	}
	io.WriteString(stdin, "go\n")
	if !lines.Scan() || lines.Text() != "done" {
		cmd.Wait()
		t.Fatalf("python: %q, stderr:\n%s", lines.Text(), stderr.String())
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("python: %v, stderr:\n%s", err, stderr.String())
	}
	for _, name := range []string{"resp0", "resp1"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if len(b) == 0 || b[0] != 1 {
			t.Fatalf("%s: completion kind %v, want 1 (a FusedMoEResponse): %q", name, b[:min(len(b), 1)], strings.ToValidUTF8(string(b), "?"))
		}
		var resp pb.FusedMoEResponse
		if err := proto.Unmarshal(b[1:], &resp); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(resp.GetOutput().GetData(), want.Output.Data) {
			t.Errorf("%s: the Python ring call's output differs from the RPC's", name)
		}
	}
}
