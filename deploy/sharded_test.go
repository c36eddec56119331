package deploy

import (
	"bufio"
	"context"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/client/clienttest"
	"github.com/expertd/expertd/kernels/kerneltest"
	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/scaling"
	"github.com/expertd/expertd/service/servicetest"
	"github.com/expertd/expertd/shard"
)

const testTimeout = 60 * time.Second

// shardProcess is one running daemon, as a pod of the StatefulSet.
type shardProcess struct {
	cmd         *exec.Cmd
	grpc, admin string
	done        chan error
}

// startPod runs the daemon with a rendered container's args and env on
// loopback: the listen and admin addresses become 127.0.0.1:0 and the
// mounted paths (weights, manifest) the test's files; every other flag and
// variable is the chart's. fieldRefs are what Kubernetes resolves them to.
func startPod(t *testing.T, bin string, c corev1.Container, weights, manifest string, fieldRefs map[string]string) *shardProcess {
	t.Helper()
	var args []string
	for _, a := range c.Args {
		switch {
		case strings.HasPrefix(a, "-listen="):
			a = "-listen=127.0.0.1:0"
		case strings.HasPrefix(a, "-admin-addr="):
			a = "-admin-addr=127.0.0.1:0"
		case strings.HasPrefix(a, "-weights-dir="):
			a = "-weights-dir=" + weights
		case strings.HasPrefix(a, "-manifest="):
			a = "-manifest=" + manifest
		}
		args = append(args, a)
	}
	env := []string{"EXPERTD_LOG_FORMAT=json", "PATH=" + os.Getenv("PATH")} // the image's ENV
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom != nil {
			var ok bool
			if v, ok = fieldRefs[e.ValueFrom.FieldRef.FieldPath]; !ok {
				t.Fatalf("env %s: no value for fieldRef %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		}
		env = append(env, e.Name+"="+v)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Logf("$ %s expertd %s", strings.Join(env[2:], " "), strings.Join(args, " "))
	p := &shardProcess{cmd: cmd, done: make(chan error, 1)}
	addrs := make(chan [2]string, 1)
	var logs strings.Builder
	logDone := make(chan struct{})
	go func() {
		defer close(logDone)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			logs.WriteString(sc.Text() + "\n")
			var rec struct{ Msg, GRPC, Admin string }
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == "expertd serving" {
				addrs <- [2]string{rec.GRPC, rec.Admin}
			}
		}
	}()
	go func() { <-logDone; p.done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-p.done:
			if err != nil {
				t.Errorf("shard exited with %v after SIGTERM", err)
			}
		case <-time.After(15 * time.Second):
			cmd.Process.Kill()
			t.Errorf("shard did not stop within 15s of SIGTERM")
		}
		if t.Failed() {
			t.Logf("shard log:\n%s", logs.String())
		}
	})
	select {
	case a := <-addrs:
		p.grpc, p.admin = a[0], a[1]
	case err := <-p.done:
		t.Fatalf("shard exited before serving: %v", err)
	case <-time.After(testTimeout):
		t.Fatal("shard did not report its addresses")
	}
	return p
}

// waitReady polls /readyz, as the startup probe does.
func (p *shardProcess) waitReady(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for {
		resp, err := http.Get("http://" + p.admin + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("shard on %s not ready within %v (last: %v %v)", p.grpc, testTimeout, resp, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestShardedFromChart renders the chart's sharded mode, starts one real
// daemon per StatefulSet replica with the rendered flags, environment and
// manifest (each loads only its experts of one safetensors layer), and
// calls the layer through client.Sharded with the shard map the manifest
// describes, against the float64 reference.
func TestShardedFromChart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts daemons")
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	seed := rng.Uint64()
	t.Logf("seed %d", seed)
	rng = rand.New(rand.NewPCG(seed, 3))
	shape := kerneltest.Shape{Name: "sharded", Activation: moe.SiluGated, E: 10, TopK: 3, K: 64, N: 32,
		Scoring: moe.Softmax, Renormalize: true, ScalingFactor: 1}
	set, req := kerneltest.NewCase(rng, shape, 9, kerneltest.WithGranularity(scaling.PerChannel))

	for _, placement := range []string{"contiguous", "round-robin"} {
		t.Run(placement, func(t *testing.T) {
			weights := t.TempDir()
			os.Mkdir(filepath.Join(weights, "model"), 0o755)
			src, err := servicetest.WriteSafetensorsLayer(filepath.Join(weights, "model", "layer0.safetensors"), set, 0)
			if err != nil {
				t.Fatal(err)
			}
			src.Name, src.Path = "layer0", "model/layer0.safetensors"
			srcJSON, err := protojson.Marshal(src)
			if err != nil {
				t.Fatal(err)
			}
			vals := values(t, "mode: sharded\ngpus: 0\nbackend: cpu\nsharded: {shards: 3, placement: "+placement+"}\n"+
				"weights: {volume: {persistentVolumeClaim: {claimName: w}}}\n")
			vals["manifest"] = map[string]any{"sets": []any{map[string]any{"safetensors": jsonMap(t, srcJSON)}}}
			objs := render(t, loadChart(t), vals)
			ss := decode[appsv1.StatefulSet](t, objs, "StatefulSet/expertd")
			manifest := filepath.Join(t.TempDir(), "manifest.json")
			cm := decode[corev1.ConfigMap](t, objs, "ConfigMap/expertd-manifest")
			if err := os.WriteFile(manifest, []byte(cm.Data["manifest.json"]), 0o644); err != nil {
				t.Fatal(err)
			}
			var man struct {
				Shard struct {
					Count     int
					Placement string
				}
			}
			json.Unmarshal([]byte(cm.Data["manifest.json"]), &man)
			place := map[string]func(int, int) (*shard.Map, error){"contiguous": shard.Contiguous, "round-robin": shard.RoundRobin}[man.Shard.Placement]
			if place == nil || man.Shard.Count != int(*ss.Spec.Replicas) {
				t.Fatalf("manifest shard section %+v does not match %d replicas", man.Shard, *ss.Spec.Replicas)
			}
			m, err := place(set.E, man.Shard.Count)
			if err != nil {
				t.Fatal(err)
			}

			bin := daemonBinary(t)
			c := container(t, ss.Spec.Template.Spec)
			addrs := make([]string, *ss.Spec.Replicas)
			procs := make([]*shardProcess, len(addrs))
			for i := range procs {
				procs[i] = startPod(t, bin, c, weights, manifest, map[string]string{
					"metadata.labels['apps.kubernetes.io/pod-index']": strconv.Itoa(i),
				})
				addrs[i] = procs[i].grpc
			}
			for _, p := range procs {
				p.waitReady(t)
			}
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			sc, err := client.DialSharded(ctx, m, addrs)
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			for i := range addrs {
				sets, err := sc.Shard(i).ListExperts(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if len(sets) != 1 || sets[0].NumExperts != len(m.Experts(i)) {
					t.Errorf("shard %d holds %+v, want layer0 with its %d experts %v", i, sets, len(m.Experts(i)), m.Experts(i))
				}
			}
			res, err := sc.FusedMoE(ctx, clienttest.Request("layer0", set, req))
			if err != nil {
				t.Fatal(err)
			}
			got, err := res.Output.Float32s()
			if err != nil {
				t.Fatal(err)
			}
			want, _, _ := kerneltest.Reference(set, req)
			e := kerneltest.RelL2(got, want)
			if e > kerneltest.FP8Tol {
				t.Errorf("sharded FusedMoE: rel L2 %.3g against the reference, want <= %g", e, kerneltest.FP8Tol)
			}
			t.Logf("%d shards (%s, experts %v): rel L2 %.3g against the float64 reference", len(addrs), placement, m.Placement(), e)
		})
	}
}

func jsonMap(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

var daemonBin string

func TestMain(m *testing.M) {
	code := m.Run()
	if daemonBin != "" {
		os.RemoveAll(filepath.Dir(daemonBin))
	}
	os.Exit(code)
}

// daemonBinary builds ./cmd/expertd of the enclosing repository once.
func daemonBinary(t *testing.T) string {
	t.Helper()
	if daemonBin != "" {
		return daemonBin
	}
	dir, err := os.MkdirTemp("", "expertd-deploy-")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "expertd")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/expertd")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/expertd: %v\n%s", err, out)
	}
	daemonBin = bin
	return bin
}
