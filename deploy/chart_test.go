package deploy

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

const chartDir = "helm/expertd"

// kubeVersion is the cluster the chart is rendered for (its kubeVersion
// constraint is >= 1.27).
var kubeVersion = chartutil.KubeVersion{Version: "v1.30.0", Major: "1", Minor: "30"}

// setValues are a manifest of one set, as a user would write it.
const setValues = `
manifest:
  sets:
    - safetensors:
        name: layer0
        path: model/layer0.safetensors
        preset: NAMING_PRESET_CUSTOM
        activation: ACTIVATION_SILU_GATED
        w13Template: "layers.{L}.experts.{e}.w13.weight"
        w2Template: "layers.{L}.experts.{e}.w2.weight"
        w13ScaleTemplate: "layers.{L}.experts.{e}.w13.weight_scale"
        w2ScaleTemplate: "layers.{L}.experts.{e}.w2.weight_scale"
  waitForFiles: 5m
weights:
  volume:
    persistentVolumeClaim:
      claimName: model-weights
`

func values(t *testing.T, docs ...string) map[string]any {
	t.Helper()
	out := map[string]any{}
	for _, d := range docs {
		v, err := chartutil.ReadValues([]byte(d))
		if err != nil {
			t.Fatalf("values %q: %v", d, err)
		}
		out = chartutil.CoalesceTables(v.AsMap(), out)
	}
	return out
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// render is `helm template expertd deploy/helm/expertd -n models` with
// vals: every rendered object, by "Kind/name".
func render(t *testing.T, ch *chart.Chart, vals map[string]any) map[string][]byte {
	t.Helper()
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "expertd", Namespace: "models", IsInstall: true}, caps)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Render(ch, rv)
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	objs := map[string][]byte{}
	for name, content := range files {
		if !strings.HasSuffix(name, ".yaml") {
			continue
		}
		for _, doc := range strings.Split(content, "\n---") {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var meta struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				t.Fatalf("%s: not YAML: %v\n%s", name, err, doc)
			}
			objs[meta.Kind+"/"+meta.Metadata.Name] = []byte(doc)
		}
	}
	return objs
}

func stripComments(doc string) string {
	var keep []string
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

// decode unmarshals a rendered object into its Kubernetes API type,
// refusing any field the type does not have.
func decode[T any](t *testing.T, objs map[string][]byte, key string) *T {
	t.Helper()
	doc, ok := objs[key]
	if !ok {
		t.Fatalf("no %s rendered; have %v", key, keys(objs))
	}
	var v T
	if err := yaml.UnmarshalStrict(doc, &v); err != nil {
		t.Fatalf("%s does not decode strictly: %v\n%s", key, err, doc)
	}
	return &v
}

func keys(m map[string][]byte) []string {
	var k []string
	for s := range m {
		k = append(k, s)
	}
	slices.Sort(k)
	return k
}

func TestLint(t *testing.T) {
	for _, mode := range []string{"mode: single", "mode: sharded"} {
		t.Run(mode, func(t *testing.T) {
			l := lint.AllWithKubeVersion(chartDir, values(t, setValues, mode), "models", &kubeVersion)
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %v", m)
				} else {
					t.Logf("helm lint: %v", m)
				}
			}
		})
	}
}

func container(t *testing.T, spec corev1.PodSpec) corev1.Container {
	t.Helper()
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(spec.Containers))
	}
	return spec.Containers[0]
}

// checkPod checks what both modes share: probes, GPUs, the manifest and
// weights mounts, a non-root user.
func checkPod(t *testing.T, spec corev1.PodSpec, gpus int64) {
	t.Helper()
	c := container(t, spec)
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"startup", c.StartupProbe, "/readyz"}, {"liveness", c.LivenessProbe, "/livez"}, {"readiness", c.ReadinessProbe, "/readyz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.String() != "metrics" {
			t.Errorf("%s probe %+v, want GET %s on the metrics port", p.name, p.probe, p.path)
		}
	}
	if c.StartupProbe != nil && c.StartupProbe.FailureThreshold*c.StartupProbe.PeriodSeconds < 600 {
		t.Errorf("startup probe allows %ds for the load, want >= 10 minutes", c.StartupProbe.FailureThreshold*c.StartupProbe.PeriodSeconds)
	}
	if got := c.Resources.Limits["nvidia.com/gpu"]; got.Value() != gpus {
		t.Errorf("nvidia.com/gpu limit %v, want %d", got.String(), gpus)
	}
	if c.Resources.Limits.Memory().IsZero() {
		t.Error("the values' memory limit was lost in the merge with the GPU limit")
	}
	for _, want := range []string{"-manifest=/etc/expertd/manifest.json", "-weights-dir=/weights", "-listen=0.0.0.0:50051", "-admin-addr=0.0.0.0:9090"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("args %q lack %q", c.Args, want)
		}
	}
	if sc := spec.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Errorf("pod security context %+v, want runAsNonRoot", sc)
	}
	names := map[string]bool{}
	for _, v := range spec.Volumes {
		names[v.Name] = true
	}
	for _, m := range c.VolumeMounts {
		if !names[m.Name] {
			t.Errorf("mount %s has no volume", m.Name)
		}
	}
	if !names["weights"] || !names["manifest"] {
		t.Errorf("volumes %v, want weights and manifest", names)
	}
}

// renderedManifest is the manifest the chart's ConfigMap holds.
func renderedManifest(t *testing.T, objs map[string][]byte) map[string]any {
	t.Helper()
	cm := decode[corev1.ConfigMap](t, objs, "ConfigMap/expertd-manifest")
	var m map[string]any
	if err := json.Unmarshal([]byte(cm.Data["manifest.json"]), &m); err != nil {
		t.Fatalf("manifest.json: %v\n%s", err, cm.Data["manifest.json"])
	}
	return m
}

func TestTemplateSingle(t *testing.T) {
	ch := loadChart(t)
	objs := render(t, ch, values(t, setValues, "replicas: 2\nmetrics: {serviceMonitor: {enabled: true}}"))
	d := decode[appsv1.Deployment](t, objs, "Deployment/expertd")
	if *d.Spec.Replicas != 2 {
		t.Errorf("replicas %d, want 2", *d.Spec.Replicas)
	}
	checkPod(t, d.Spec.Template.Spec, 1)
	svc := decode[corev1.Service](t, objs, "Service/expertd")
	if svc.Spec.ClusterIP == corev1.ClusterIPNone || svc.Spec.Ports[0].Name != "grpc" {
		t.Errorf("service %+v, want a ClusterIP service with the grpc port", svc.Spec)
	}
	metrics := decode[corev1.Service](t, objs, "Service/expertd-metrics")
	if metrics.Spec.Ports[0].Port != 9090 {
		t.Errorf("metrics service ports %+v", metrics.Spec.Ports)
	}
	m := renderedManifest(t, objs)
	if _, ok := m["shard"]; ok || m["waitForFiles"] != "5m" || len(m["sets"].([]any)) != 1 {
		t.Errorf("single-mode manifest %v, want one set, no shard section", m)
	}
	var sm struct {
		APIVersion string `json:"apiVersion"`
		Spec       struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			Endpoints []struct {
				Port, Path string
			} `json:"endpoints"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(objs["ServiceMonitor/expertd"], &sm); err != nil || sm.APIVersion != "monitoring.coreos.com/v1" ||
		len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "metrics" || sm.Spec.Selector.MatchLabels["app.kubernetes.io/component"] != "metrics" {
		t.Errorf("ServiceMonitor %+v (%v), want one endpoint on the metrics service's port", sm, err)
	}
	for k, v := range metrics.Labels {
		if sel, ok := sm.Spec.Selector.MatchLabels[k]; ok && sel != v {
			t.Errorf("ServiceMonitor selects %s=%s, the metrics service has %s", k, sel, v)
		}
	}
	if _, ok := objs["StatefulSet/expertd"]; ok {
		t.Error("single mode rendered a StatefulSet")
	}
}

func TestTemplateSharded(t *testing.T) {
	ch := loadChart(t)
	objs := render(t, ch, values(t, setValues, "mode: sharded\nsharded: {shards: 4, placement: round-robin}\ngpus: 2"))
	ss := decode[appsv1.StatefulSet](t, objs, "StatefulSet/expertd")
	if *ss.Spec.Replicas != 4 || ss.Spec.ServiceName != "expertd-headless" || ss.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("statefulset replicas %d, serviceName %q, policy %q; want 4, expertd-headless, Parallel", *ss.Spec.Replicas, ss.Spec.ServiceName, ss.Spec.PodManagementPolicy)
	}
	checkPod(t, ss.Spec.Template.Spec, 2)
	c := container(t, ss.Spec.Template.Spec)
	idx := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "EXPERTD_SHARD_INDEX" })
	if idx < 0 || c.Env[idx].ValueFrom == nil || c.Env[idx].ValueFrom.FieldRef.FieldPath != "metadata.labels['apps.kubernetes.io/pod-index']" {
		t.Errorf("env %+v, want EXPERTD_SHARD_INDEX from the pod-index label", c.Env)
	}
	h := decode[corev1.Service](t, objs, "Service/expertd-headless")
	if h.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("headless service clusterIP %q, want None", h.Spec.ClusterIP)
	}
	for k, v := range h.Spec.Selector {
		if ss.Spec.Template.Labels[k] != v {
			t.Errorf("headless service selects %s=%s; pods have %q", k, v, ss.Spec.Template.Labels[k])
		}
	}
	m := renderedManifest(t, objs)
	if fmt.Sprint(m["shard"]) != "map[count:4 placement:round-robin]" {
		t.Errorf("sharded manifest shard = %v, want count 4, round-robin", m["shard"])
	}
	if _, ok := objs["Service/expertd"]; ok {
		t.Error("sharded mode rendered a load-balanced gRPC service; a call needs every shard")
	}
}

func TestTemplateSecretsAndDashboard(t *testing.T) {
	ch := loadChart(t)
	ch.Files = append(ch.Files, &chart.File{Name: "dashboards/test.json", Data: []byte(`{"title": "expertd"}`)})
	objs := render(t, ch, values(t, setValues, `
tls: {secretName: expertd-tls, clientCASecretName: expertd-ca, adminIdentities: [ops, "spiffe://x/admin"]}
auth: {tokensSecretName: expertd-tokens}
grafana: {dashboard: {enabled: true, file: dashboards/test.json}}
extraArgs: ["-max-tokens", "16384"]
env: [{name: EXPERTD_LOG_LEVEL, value: debug}]
`))
	d := decode[appsv1.Deployment](t, objs, "Deployment/expertd")
	c := container(t, d.Spec.Template.Spec)
	for _, want := range []string{"-tls-cert=/etc/expertd/tls/tls.crt", "-tls-key=/etc/expertd/tls/tls.key", "-tls-client-ca=/etc/expertd/client-ca/ca.crt",
		"-admin-identities=ops,spiffe://x/admin", "-auth-tokens-file=/etc/expertd/auth/tokens", "-max-tokens", "16384"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("args %q lack %q", c.Args, want)
		}
	}
	checkPod(t, d.Spec.Template.Spec, 1)
	dash := decode[corev1.ConfigMap](t, objs, "ConfigMap/expertd-dashboard")
	if strings.TrimSpace(dash.Data["expertd.json"]) != `{"title": "expertd"}` || dash.Labels["grafana_dashboard"] != "1" {
		t.Errorf("dashboard ConfigMap %+v", dash)
	}
}

func TestTemplateRefuses(t *testing.T) {
	ch := loadChart(t)
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = kubeVersion
	for _, tt := range []struct{ vals, want string }{
		{"mode: both", `mode "both"`},
		{"mode: sharded\nsharded: {shards: 0}", "sharded.shards"},
		{"sharded: {placement: random}", `sharded.placement "random"`},
		{"manifest: {sets: [{safetensors: {name: a, path: a}}]}", "needs weights.volume"},
		{"grafana: {dashboard: {enabled: true, file: nope.json}}", `"nope.json" is not in the chart`},
	} {
		rv, err := chartutil.ToRenderValues(ch, values(t, tt.vals), chartutil.ReleaseOptions{Name: "expertd", Namespace: "models"}, caps)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := engine.Render(ch, rv); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("values %q: render error %v, want one containing %q", tt.vals, err, tt.want)
		}
	}
}

// TestDashboardFromRepo checks the chart ships the repository's Grafana
// dashboard (deploy/grafana/expertd.json) through its link
// dashboards/expertd.json, once that file exists.
func TestDashboardFromRepo(t *testing.T) {
	want, err := os.ReadFile("grafana/expertd.json")
	if errors.Is(err, fs.ErrNotExist) {
		t.Skip("deploy/grafana/expertd.json is not in the tree yet; once it is: ln -s ../../../grafana/expertd.json deploy/helm/expertd/dashboards/expertd.json")
	}
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(want) {
		t.Fatal("deploy/grafana/expertd.json is not JSON")
	}
	objs := render(t, loadChart(t), values(t, "grafana: {dashboard: {enabled: true}}"))
	dash := decode[corev1.ConfigMap](t, objs, "ConfigMap/expertd-dashboard")
	if strings.TrimSpace(dash.Data["expertd.json"]) != strings.TrimSpace(string(want)) {
		t.Error("the chart's dashboard ConfigMap differs from deploy/grafana/expertd.json")
	}
}
