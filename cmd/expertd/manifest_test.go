package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/service/servicetest"
)

func TestParseManifest(t *testing.T) {
	two := 2
	tests := []struct {
		name    string
		in      string
		wantErr string
		check   func(t *testing.T, m *manifest)
	}{
		{"yaml", `
sets:
  - safetensors: {name: a, path: x/a.safetensors, layer: 3, preset: NAMING_PRESET_QWEN3_MOE, numExperts: 8}
  - safetensors:
      name: b
      path: b.safetensors
      weight_block_shape: [128, 128]
shard: {count: 4, placement: round-robin, index: 2}
waitForFiles: 90s
`, "", func(t *testing.T, m *manifest) {
			if len(m.Sets) != 2 || m.Sets[0].GetSafetensors().GetLayer() != 3 || m.Sets[0].GetSafetensors().GetNumExperts() != 8 ||
				!slices.Equal(m.Sets[1].GetSafetensors().GetWeightBlockShape(), []int32{128, 128}) {
				t.Errorf("sets = %v", m.Sets)
			}
			if m.Shard.Count != 4 || m.Shard.Placement != "round-robin" || *m.Shard.Index != two || m.WaitForFiles != 90*time.Second {
				t.Errorf("shard %+v, waitForFiles %v", m.Shard, m.WaitForFiles)
			}
		}},
		{"json", `{"sets": [{"safetensors": {"name": "a", "path": "a.safetensors", "preset": "NAMING_PRESET_NEMOTRON_H"}}]}`, "", nil},
		{"unknown key", "sets: [{safetensors: {name: a, path: a}}]\nshards: {count: 2}\n", `unknown field "shards"`, nil},
		{"unknown source field", "sets: [{safetensors: {name: a, pth: a}}]\n", `sets[0]: `, nil},
		{"upload header", "sets: [{header: {name: a}}]\n", "sets[0]: want a safetensors source", nil},
		{"duplicate name", "sets: [{safetensors: {name: a, path: a}}, {safetensors: {name: a, path: b}}]\n", `sets[1]: name "a" is also sets[0]'s`, nil},
		{"no sets", "shard: {count: 2}\n", "sets: at least one set is required", nil},
		{"bad placement", "sets: [{safetensors: {name: a, path: a}}]\nshard: {count: 2, placement: random}\n", `shard.placement "random"`, nil},
		{"bad count", "sets: [{safetensors: {name: a, path: a}}]\nshard: {count: 0}\n", "shard.count 0", nil},
		{"index out of range", "sets: [{safetensors: {name: a, path: a}}]\nshard: {count: 2, index: 2}\n", "shard.index 2: want in [0, 2)", nil},
		{"bad wait", "sets: [{safetensors: {name: a, path: a}}]\nwaitForFiles: soon\n", `waitForFiles "soon"`, nil},
		{"not yaml", "sets: [\n", "yaml", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := parseManifest([]byte(tt.in))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseManifest = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.check != nil {
				tt.check(t, m)
			}
		})
	}
}

func TestShardIndex(t *testing.T) {
	one := 1
	host := func(h string) func() (string, error) { return func() (string, error) { return h, nil } }
	tests := []struct {
		name     string
		sh       manifestShard
		flag     int
		hostname func() (string, error)
		want     int
		wantErr  string
	}{
		{"manifest wins", manifestShard{Count: 3, Index: &one}, 2, host("expertd-0"), 1, ""},
		{"flag", manifestShard{Count: 3}, 2, host("expertd-0"), 2, ""},
		{"host ordinal", manifestShard{Count: 3}, -1, host("expertd-shard-2"), 2, ""},
		{"host without ordinal", manifestShard{Count: 3}, -1, host("gpu-node"), 0, `host name "gpu-node" has no ordinal`},
		{"ordinal beyond count", manifestShard{Count: 3}, -1, host("expertd-3"), 0, "shard index 3: the manifest has 3 shards"},
		{"hostname error", manifestShard{Count: 3}, -1, func() (string, error) { return "", errors.New("no uts") }, 0, "no uts"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.sh.resolveIndex(tt.flag, tt.hostname)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("resolveIndex = %d, %v; want an error containing %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("resolveIndex = %d, %v; want %d", got, err, tt.want)
			}
		})
	}
}

func TestFormatVersion(t *testing.T) {
	bi := func(v string, settings ...string) *debug.BuildInfo {
		b := &debug.BuildInfo{Main: debug.Module{Version: v}}
		for i := 0; i < len(settings); i += 2 {
			b.Settings = append(b.Settings, debug.BuildSetting{Key: settings[i], Value: settings[i+1]})
		}
		return b
	}
	tests := []struct {
		name         string
		bi           *debug.BuildInfo
		ok           bool
		stampVersion string
		stampCommit  string
		want         string
	}{
		{"no build info", nil, false, "", "", "dev"},
		{"devel, no vcs", bi("(devel)"), true, "", "", "dev"},
		{"module version", bi("v1.4.0"), true, "", "", "v1.4.0"},
		{"vcs clean", bi("(devel)", "vcs.revision", "0123456789abcdef0123", "vcs.modified", "false"), true, "", "", "dev (commit 0123456789ab)"},
		{"vcs dirty", bi("(devel)", "vcs.revision", "0123456789abcdef0123", "vcs.modified", "true"), true, "", "", "dev (commit 0123456789ab, dirty)"},
		{"release stamp", bi("(devel)", "vcs.revision", "ffff", "vcs.modified", "true"), true, "v2.0.0", "abcdef", "v2.0.0 (commit abcdef)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			buildVersion, buildCommit = tt.stampVersion, tt.stampCommit
			defer func() { buildVersion, buildCommit = "", "" }()
			if got := formatVersion(tt.bi, tt.ok); got != tt.want {
				t.Errorf("formatVersion = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestVersionFlag(t *testing.T) {
	var out strings.Builder
	stdout = &out
	defer func() { stdout = os.Stdout }()
	if err := run(context.Background(), []string{"-version"}, func(string) string { return "" }, io.Discard, nil); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); !strings.HasPrefix(got, "expertd ") || !strings.Contains(got, version()) {
		t.Errorf("-version printed %q, want expertd %s", got, version())
	}
}

// TestManifestFailure: a set that cannot load stops the start with an
// error naming it.
func TestManifestFailure(t *testing.T) {
	dir := t.TempDir()
	man := filepath.Join(dir, "m.json")
	os.WriteFile(man, []byte(`{"sets": [{"safetensors": {"name": "gone", "path": "missing.safetensors", "preset": "NAMING_PRESET_NEMOTRON_H"}}]}`), 0o644)
	var logs servicetest.LogBuffer
	err := run(context.Background(), []string{"-listen", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0", "-backend", "cpu", "-weights-dir", dir, "-manifest", man},
		func(string) string { return "" }, &logs, nil)
	if err == nil || !strings.Contains(err.Error(), `manifest sets[0]: expert set "gone"`) || !strings.Contains(err.Error(), "missing.safetensors") {
		t.Fatalf("run = %v, want a start failure naming the set and file", err)
	}
	err = run(context.Background(), []string{"-backend", "cpu", "-manifest", man}, func(string) string { return "" }, &logs, nil)
	if err == nil || !strings.Contains(err.Error(), "-weights-dir") {
		t.Fatalf("run without -weights-dir = %v, want an error naming it", err)
	}
}
