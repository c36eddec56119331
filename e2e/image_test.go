//go:build linux

package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
)

// TestImage runs the container image scripts/image-test.sh built
// ($EXPERTD_IMAGE): the image's user, the CUDA library found without
// flags (the CPU fallback names its cause, not a missing library), the
// version stamp, the probes and the HEALTHCHECK command, and a FusedMoE
// call checked against the float64 reference. $EXPERTD_IMAGE_RUNTIME is
// buildah (buildah run --isolation chroot: the image's root file system
// on the host's network) or podman.
func TestImage(t *testing.T) {
	image := os.Getenv("EXPERTD_IMAGE")
	if image == "" {
		t.Skip("EXPERTD_IMAGE is not set; scripts/image-test.sh builds the image and sets it")
	}
	runtime := os.Getenv("EXPERTD_IMAGE_RUNTIME")
	var inImage func(args ...string) (string, []string)
	switch runtime {
	case "buildah", "":
		out, err := exec.Command("buildah", "--storage-driver", "vfs", "from", "--pull-never", image).Output()
		if err != nil {
			t.Fatalf("buildah from %s: %v", image, err)
		}
		ctr := strings.TrimSpace(string(out))
		t.Cleanup(func() { exec.Command("buildah", "--storage-driver", "vfs", "rm", ctr).Run() })
		inImage = func(args ...string) (string, []string) {
			return "buildah", append([]string{"--storage-driver", "vfs", "run", "--isolation", "chroot", ctr, "--"}, args...)
		}
	case "podman":
		inImage = func(args ...string) (string, []string) {
			return "podman", append([]string{"--storage-driver", "vfs", "run", "--rm", "--network", "host", "--entrypoint", args[0], image}, args[1:]...)
		}
	default:
		t.Fatalf("EXPERTD_IMAGE_RUNTIME %q: want buildah or podman", runtime)
	}
	runIn := func(args ...string) (string, error) {
		name, argv := inImage(args...)
		return run(t, nil, name, argv...)
	}

	if out, err := runIn("id", "-u"); err != nil || strings.TrimSpace(out) != "10001" {
		t.Errorf("the image runs as uid %q (%v), want 10001 (non-root)", strings.TrimSpace(out), err)
	}
	out, err := runIn("/usr/local/bin/expertd", "-version")
	if err != nil {
		t.Fatal(err)
	}
	want := os.Getenv("EXPERTD_IMAGE_VERSION")
	if !strings.HasPrefix(out, "expertd ") || (want != "" && !strings.Contains(out, want)) {
		t.Errorf("expertd -version = %q, want the stamped version %q", out, want)
	}

	name, argv := inImage("/usr/local/bin/expertd", "-listen", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0",
		"-max-tokens", "512", "-threads", "2")
	d := startProcess(t, name, argv)
	if name == "buildah" {
		// buildah run kills its command on SIGTERM instead of passing it
		// on, so the drain is asked of the daemon itself, as a container
		// runtime's stop does.
		d.sigterm = func() error {
			pid, err := descendant(d.cmd.Process.Pid, "expertd")
			if err != nil {
				return err
			}
			return syscall.Kill(pid, syscall.SIGTERM)
		}
	}
	d.waitServing(t, time.After(startTimeout))
	logs := d.logs.String()
	if strings.Contains(logs, "library not found") || !strings.Contains(logs, `"backend":"cpu"`) {
		t.Errorf("the daemon did not find /usr/local/lib/libexpertd_cuda.so by itself, or did not fall back to the CPU:\n%s", logs)
	}
	for _, path := range []string{"/livez", "/readyz", "/healthz"} {
		resp, err := http.Get("http://" + d.Admin + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("%s = %d %q, want 200", path, resp.StatusCode, body)
		}
	}
	if _, err := runIn("/usr/local/bin/expertd", "-probe", "http://"+d.Admin+"/livez"); err != nil {
		t.Errorf("HEALTHCHECK command: %v", err)
	}

	ctx := testContext(t)
	c, err := client.Dial(ctx, d.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	info, err := c.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want != "" && !strings.Contains(info.Version, want) {
		t.Errorf("GetServerInfo version %q, want the stamped %q", info.Version, want)
	}
	set, req := kerneltest.NewCase(newRand(t), kerneltest.Shape{Name: "image", Activation: moe.SiluGated, E: 8, TopK: 2, K: 64, N: 32,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}, 4, kerneltest.WithGranularity(scaling.PerExpert))
	if _, err := c.LoadExperts(ctx, "image", clienttest.Weights(set)); err != nil {
		t.Fatal(err)
	}
	res, err := c.FusedMoE(ctx, clienttest.Request("image", set, req))
	if err != nil {
		t.Fatal(err)
	}
	got, err := res.Output.Float32s()
	if err != nil {
		t.Fatal(err)
	}
	checkAgainstReference(t, "FusedMoE in the image ("+res.Backend+")", got, set, req)
}

// descendant is the pid of the process named comm below pid.
func descendant(pid int, comm string) (int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	parent := map[int]int{}
	name := map[int]string{}
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so split after ")".
		i := bytes.LastIndexByte(stat, ')')
		f := strings.Fields(string(stat[i+1:]))
		if i < 0 || len(f) < 2 {
			continue
		}
		parent[p], _ = strconv.Atoi(f[1])
		name[p] = string(stat[bytes.IndexByte(stat, '(')+1 : i])
	}
	for p, n := range name {
		if n != comm {
			continue
		}
		for a := parent[p]; a > 1; a = parent[a] {
			if a == pid {
				return p, nil
			}
		}
	}
	return 0, fmt.Errorf("no process %q below pid %d", comm, pid)
}
