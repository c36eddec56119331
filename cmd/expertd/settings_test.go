package main

import (
	"flag"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// checkReportedSettings checks a daemon started with TestDaemon's flags
// reports every setting: the typed fields and the settings map, which
// has a value for each reported row of the table.
func checkReportedSettings(t *testing.T, info *pb.ServerInfo) {
	t.Helper()
	l, tr := info.GetLimits(), info.GetTransport()
	if l.GetMaxQueued() != 4*defaultMaxConcurrent || time.Duration(l.GetBatchWindowNanos()) != 200*time.Microsecond || l.GetBatchMaxTokens() != service.DefaultBatchMaxTokens {
		t.Errorf("limits %v: want max_queued %d, the default batch window and batch_max_tokens", l, 4*defaultMaxConcurrent)
	}
	if tr.GetStreamWorkers() != 0 || time.Duration(tr.GetKeepaliveMinTimeNanos()) != defaultKeepaliveMinTime ||
		time.Duration(tr.GetKeepaliveTimeNanos()) != defaultKeepaliveTime || time.Duration(tr.GetKeepaliveTimeoutNanos()) != defaultKeepaliveTimeout ||
		time.Duration(tr.GetMaxConnectionAgeNanos()) != defaultMaxConnectionAge || time.Duration(tr.GetMaxConnectionAgeGraceNanos()) != defaultMaxConnectionGrace {
		t.Errorf("transport %v: want the keepalive defaults and no stream workers", tr)
	}
	got := info.GetSettings()
	var c Config
	for _, s := range c.settings() {
		if s.value == nil {
			continue
		}
		if _, ok := got[s.name]; !ok {
			t.Errorf("settings lack %q", s.name)
		}
	}
	for k, want := range map[string]string{"threads": "2", "log-level": "debug", "max-tokens": "8192", "batch-window": "200µs", "cuda-gemm": "auto", "unix-mode": "0660", "tls-key": ""} {
		if got[k] != want {
			t.Errorf("settings[%q] = %q, want %q", k, got[k], want)
		}
	}
}

// TestSettingsInForce checks the reported values follow flags and
// variables, and that security settings read only as set.
func TestSettingsInForce(t *testing.T) {
	env := map[string]string{"EXPERTD_STREAM_WORKERS": "3", "EXPERTD_TLS_CLIENT_CA": "/secret/ca.pem"}
	c, err := parseConfig([]string{"-batch-max-tokens", "64", "-tls-cert", "/secret/c.pem", "-tls-key", "/secret/k.pem",
		"-admin-identities", "ops, spiffe://x/y", "-unix-mode", "0600", "-cuda-streams", "3", "-ring-max-slot-bytes", "1MiB",
		"-otlp-endpoint", "https://user:secret@collector:4317"},
		func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	got := c.inForce()
	for k, want := range map[string]string{"batch-max-tokens": "64", "stream-workers": "3", "unix-mode": "0600", "cuda-streams": "3",
		"ring-max-slot-bytes": "1048576", "tls-cert": "(set)", "tls-key": "(set)", "tls-client-ca": "(set)", "admin-identities": "(set)", "otlp-endpoint": "(set)",
		"auth-tokens-file": "", "keepalive-time": "1m0s", "shard-index": "-1"} {
		if got[k] != want {
			t.Errorf("settings[%q] = %q, want %q", k, got[k], want)
		}
	}
	for k, v := range got {
		if strings.Contains(v, "secret") || strings.Contains(v, "spiffe") {
			t.Errorf("settings[%q] = %q leaks a security setting", k, v)
		}
	}
	if _, ok := got["version"]; ok {
		t.Error("settings report -version, a command-line mode")
	}
	// Building the table again (as inForce does) leaves the config alone.
	if c.StreamWorkers != 3 || c.Kernels.Threads != 0 || c.CUDA.Streams != 3 {
		t.Errorf("config after inForce: stream workers %d, cuda streams %d", c.StreamWorkers, c.CUDA.Streams)
	}
}

// TestSettingsTable checks every flag comes from the table with its
// variable named in its help, and each row names a flag or a variable.
func TestSettingsTable(t *testing.T) {
	var c Config
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	rows := map[string]setting{}
	for _, s := range c.settings() {
		if s.name == "" && s.env == "" || s.help == "" {
			t.Errorf("row %+v: want a flag or a variable, and help", s)
		}
		if s.bind != nil {
			if err := s.bind(fs, func(string) string { return "" }); err != nil {
				t.Fatal(err)
			}
			rows[s.name] = s
		}
	}
	fs.VisitAll(func(f *flag.Flag) {
		s, ok := rows[f.Name]
		if !ok {
			t.Errorf("flag -%s has no row", f.Name)
			return
		}
		if v := s.variable(); v != "" && !strings.Contains(f.Usage, "$"+v) {
			t.Errorf("-%s: usage %q does not name $%s", f.Name, f.Usage, v)
		}
	})
}

// TestDeprecatedLibraryVariable checks $EXPERTD_CUDA_LIB still sets the
// library path, with a warning, and only when $EXPERTD_LIBRARY_PATH and
// -library-path are unset.
func TestDeprecatedLibraryVariable(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		env  map[string]string
		want string
		warn bool
	}{
		{"alias", nil, map[string]string{"EXPERTD_CUDA_LIB": "/old.so"}, "/old.so", true},
		{"variable wins", nil, map[string]string{"EXPERTD_CUDA_LIB": "/old.so", "EXPERTD_LIBRARY_PATH": "/new.so"}, "/new.so", false},
		{"flag wins", []string{"-library-path", "/flag.so"}, map[string]string{"EXPERTD_CUDA_LIB": "/old.so"}, "/flag.so", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseConfig(tt.args, func(k string) string { return tt.env[k] }, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if c.Kernels.LibraryPath != tt.want || (len(c.Warnings) > 0) != tt.warn {
				t.Errorf("library path %q, warnings %q; want %q, a warning: %v", c.Kernels.LibraryPath, c.Warnings, tt.want, tt.warn)
			}
		})
	}
}

var updateREADME = flag.Bool("update-readme", false, "rewrite README.md's flag list from the settings table")

// The README's flag list lies between these lines.
const (
	readmeFlagsBegin = "<!-- settings table: generated from cmd/expertd/settings.go; go test ./cmd/expertd -run TestREADMEFlags -update-readme -->\n"
	readmeFlagsEnd   = "<!-- end of settings table -->\n"
)

// TestREADMEFlags checks the README's flag list is the settings table.
func TestREADMEFlags(t *testing.T) {
	const path = "../../README.md"
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	readme := string(raw)
	before, rest, ok1 := strings.Cut(readme, readmeFlagsBegin)
	got, after, ok2 := strings.Cut(rest, readmeFlagsEnd)
	if !ok1 || !ok2 {
		t.Fatalf("README.md has no settings table between %q and %q", readmeFlagsBegin, readmeFlagsEnd)
	}
	var c Config
	want := c.markdown()
	if got == want {
		return
	}
	if *updateREADME {
		if err := os.WriteFile(path, []byte(before+readmeFlagsBegin+want+readmeFlagsEnd+after), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("README.md's flag list differs from the settings table (run go test ./cmd/expertd -run TestREADMEFlags -update-readme):\n%s",
		cmp.Diff(got, want))
}
