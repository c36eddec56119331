package main

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/expertd/expertd/kernels/cuda"
	"github.com/expertd/expertd/service"
)

func defaults() Config {
	return Config{
		Config: service.Config{
			MaxTokens: 8192, MaxMessageBytes: messageBytesFor(8192), MaxLoadedBytes: 32 << 30, MaxConcurrent: 4,
			BatchWindow:      service.SuggestedBatchWindow,
			KeepaliveMinTime: 10 * time.Second, KeepaliveTime: time.Minute, KeepaliveTimeout: 20 * time.Second,
			MaxConnectionAge: 30 * time.Minute, MaxConnectionAgeGrace: 5 * time.Minute,
			RingSpin: service.DefaultRingSpin, RingMaxPerConn: service.DefaultRingMaxPerConn, RingMax: service.DefaultRingMax,
			RingMaxSlotBytes: service.DefaultRingMaxSlotBytes,
			MaxShmRegions:    service.DefaultMaxShmRegions, MaxShmBytes: service.DefaultMaxShmBytes,
			MaxLanes: service.DefaultLaneMax,
		},
		Listen: "127.0.0.1:50051", UnixMode: 0o660, Backend: "auto",
		AdminAddr: "127.0.0.1:9090", LogLevel: "info", LogFormat: "text", ShutdownTimeout: 30 * time.Second,
		ShardIndex:     -1,
		IdleFreeMemory: 30 * time.Second,
		CUDA:           cuda.DefaultOptions(),
	}
}

func TestParseConfig(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want func(c *Config)
	}{
		{"defaults", nil, nil, func(c *Config) {}},
		{"flags", []string{"-listen", ":7000", "-backend", "cpu", "-max-tokens", "16", "-max-loaded-bytes", "2GiB",
			"-weights-dir", "/w", "-threads", "3", "-admin-addr", "", "-log-format", "json", "-shutdown-timeout", "5s"}, nil,
			func(c *Config) {
				c.Listen, c.Backend, c.MaxTokens, c.MaxLoadedBytes = ":7000", "cpu", 16, 2<<30
				c.MaxMessageBytes = messageBytesFor(16)
				c.WeightsDir, c.Kernels.Threads, c.AdminAddr, c.LogFormat, c.ShutdownTimeout = "/w", 3, "", "json", 5*time.Second
			}},
		{"env", nil, map[string]string{"EXPERTD_LISTEN": ":8000", "EXPERTD_MAX_CONCURRENT": "9", "EXPERTD_MAX_MESSAGE_BYTES": "64MiB",
			"EXPERTD_LIBRARY_PATH": "/lib/x.so", "EXPERTD_DEVICE": "1", "EXPERTD_LOG_LEVEL": "debug", "EXPERTD_SHUTDOWN_TIMEOUT": "1m",
			"EXPERTD_OTLP_ENDPOINT": "http://collector:4317"},
			func(c *Config) {
				c.Listen, c.MaxConcurrent, c.MaxMessageBytes, c.OTLPEndpoint = ":8000", 9, 64<<20, "http://collector:4317"
				c.Kernels.LibraryPath, c.Kernels.Device, c.LogLevel, c.ShutdownTimeout = "/lib/x.so", 1, "debug", time.Minute
			}},
		{"flag beats env", []string{"-max-tokens", "32"}, map[string]string{"EXPERTD_MAX_TOKENS": "64"},
			func(c *Config) { c.MaxTokens, c.MaxMessageBytes = 32, messageBytesFor(32) }},
		{"queue flag", []string{"-max-queued", "12"}, nil, func(c *Config) { c.MaxQueued = 12 }},
		{"cuda flags", []string{"-cuda-gemm", "portable", "-cuda-streams", "4", "-cuda-pdl=false", "-cuda-sm90-block=false",
			"-cuda-sm90-grid", "full", "-cuda-sm90-toka=false", "-cuda-sync-spin", "50us", "-cuda-host-trace"}, nil,
			func(c *Config) {
				c.CUDA = cuda.Options{GEMM: "portable", Streams: 4, SM90Grid: "full", SyncSpin: 50 * time.Microsecond, HostTrace: true}
			}},
		{"cuda env", nil, map[string]string{"EXPERTD_CUDA_GEMM": "sm90", "EXPERTD_CUDA_STREAMS": "1", "EXPERTD_CUDA_PDL": "0",
			"EXPERTD_CUDA_SYNC_SPIN": "20us", "EXPERTD_CUDA_HOST_TRACE": "1"},
			func(c *Config) {
				c.CUDA.GEMM, c.CUDA.Streams, c.CUDA.PDL, c.CUDA.SyncSpin, c.CUDA.HostTrace = "sm90", 1, false, 20*time.Microsecond, true
			}},
		{"queue env", nil, map[string]string{"EXPERTD_MAX_QUEUED": "3"}, func(c *Config) { c.MaxQueued = 3 }},
		{"shared memory flag", []string{"-shared-memory"}, nil, func(c *Config) { c.SharedMemory, c.MaxConnectionAge = true, 0 }},
		{"shared memory env", nil, map[string]string{"EXPERTD_SHARED_MEMORY": "true"}, func(c *Config) { c.SharedMemory, c.MaxConnectionAge = true, 0 }},
		{"shared memory with age flag", []string{"-shared-memory", "-max-connection-age", "1h"}, nil,
			func(c *Config) { c.SharedMemory, c.MaxConnectionAge = true, time.Hour }},
		{"shared memory with age env", []string{"-shared-memory"}, map[string]string{"EXPERTD_MAX_CONNECTION_AGE": "2h"},
			func(c *Config) { c.SharedMemory, c.MaxConnectionAge = true, 2*time.Hour }},
		{"shared memory flag beats env", []string{"-shared-memory=false"}, map[string]string{"EXPERTD_SHARED_MEMORY": "1"}, func(c *Config) {}},
		{"batching flags", []string{"-batch-window", "500us", "-batch-max-tokens", "1024"}, nil,
			func(c *Config) { c.BatchWindow, c.BatchMaxTokens = 500*time.Microsecond, 1024 }},
		{"ring flags", []string{"-shared-memory", "-ring", "-ring-spin", "0", "-ring-max", "3", "-ring-max-slot-bytes", "1MiB"}, nil,
			func(c *Config) {
				c.SharedMemory, c.Ring, c.RingSpin, c.RingMax, c.RingMaxSlotBytes = true, true, 0, 3, 1<<20
				c.MaxConnectionAge = 0 // regions and rings live with their connection
			}},
		{"ring env", nil, map[string]string{"EXPERTD_SHARED_MEMORY": "1", "EXPERTD_RING": "true", "EXPERTD_RING_SPIN": "50us", "EXPERTD_RING_MAX_PER_CONN": "2"},
			func(c *Config) {
				c.SharedMemory, c.Ring, c.RingSpin, c.RingMaxPerConn = true, true, 50*time.Microsecond, 2
				c.MaxConnectionAge = 0
			}},
		{"manifest flags", []string{"-manifest", "/m.yaml", "-shard-index", "3"}, nil,
			func(c *Config) { c.Manifest, c.ShardIndex = "/m.yaml", 3 }},
		{"manifest env", nil, map[string]string{"EXPERTD_MANIFEST": "/m.json", "EXPERTD_SHARD_INDEX": "0"},
			func(c *Config) { c.Manifest, c.ShardIndex = "/m.json", 0 }},
		{"batching env", nil, map[string]string{"EXPERTD_BATCH_WINDOW": "0", "EXPERTD_BATCH_MAX_TOKENS": "64"},
			func(c *Config) { c.BatchWindow, c.BatchMaxTokens = 0, 64 }},
		{"keepalive flags", []string{"-keepalive-min-time", "1s", "-keepalive-time", "2m", "-keepalive-timeout", "3s",
			"-max-connection-age", "0", "-max-connection-age-grace", "1m"}, nil,
			func(c *Config) {
				c.KeepaliveMinTime, c.KeepaliveTime, c.KeepaliveTimeout = time.Second, 2*time.Minute, 3*time.Second
				c.MaxConnectionAge, c.MaxConnectionAgeGrace = 0, time.Minute
			}},
		{"keepalive env", nil, map[string]string{"EXPERTD_MAX_CONNECTION_AGE": "1h", "EXPERTD_MAX_CONNECTION_AGE_GRACE": "30s", "EXPERTD_KEEPALIVE_MIN_TIME": "5s"},
			func(c *Config) {
				c.MaxConnectionAge, c.MaxConnectionAgeGrace, c.KeepaliveMinTime = time.Hour, 30*time.Second, 5*time.Second
			}},
		{"lane cap", []string{"-lane-max", "2"}, nil, func(c *Config) { c.MaxLanes = 2 }},
		{"lanes", []string{"-shared-memory", "-lanes"}, nil, func(c *Config) { c.SharedMemory, c.Lanes, c.MaxConnectionAge = true, true, 0 }},
		{"shared memory caps", []string{"-max-shm-regions", "100", "-max-shm-bytes", "1GiB", "-idle-free-memory", "0"}, nil,
			func(c *Config) { c.MaxShmRegions, c.MaxShmBytes, c.IdleFreeMemory = 100, 1<<30, 0 }},
		{"shared memory caps env", nil, map[string]string{"EXPERTD_MAX_SHM_REGIONS": "7", "EXPERTD_MAX_SHM_BYTES": "1MiB", "EXPERTD_IDLE_FREE_MEMORY": "2m"},
			func(c *Config) { c.MaxShmRegions, c.MaxShmBytes, c.IdleFreeMemory = 7, 1<<20, 2*time.Minute }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseConfig(tt.args, func(k string) string { return tt.env[k] }, io.Discard)
			if err != nil {
				t.Fatalf("parseConfig: %v", err)
			}
			want := defaults()
			tt.want(&want)
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("config (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
	}{
		{"bad backend", []string{"-backend", "tpu"}, nil, `-backend "tpu": want auto, cpu or cuda`},
		{"bad cuda gemm", []string{"-cuda-gemm", "fastest"}, nil, `option gemm="fastest": want auto, portable, portable-f16 or sm90`},
		{"bad cuda streams", nil, map[string]string{"EXPERTD_CUDA_STREAMS": "17"}, "option streams=\"17\": want 1..16"},
		{"cuda spin too long", []string{"-cuda-sync-spin", "1s"}, nil, "option sync-spin"},
		{"bad cuda grid", []string{"-cuda-sm90-grid", "half"}, nil, "option sm90-grid"},
		{"bad cuda env bool", nil, map[string]string{"EXPERTD_CUDA_PDL": "off"}, `$EXPERTD_CUDA_PDL: "off" is not true or false`},
		{"bad number", []string{"-max-tokens", "many"}, nil, `"many" is not a whole number`},
		{"bad env number", nil, map[string]string{"EXPERTD_MAX_LOADED_BYTES": "1XB"}, "$EXPERTD_MAX_LOADED_BYTES"},
		{"bad env bool", nil, map[string]string{"EXPERTD_SHARED_MEMORY": "yes"}, `$EXPERTD_SHARED_MEMORY: "yes" is not true or false`},
		{"bad env duration", nil, map[string]string{"EXPERTD_SHUTDOWN_TIMEOUT": "soon"}, "$EXPERTD_SHUTDOWN_TIMEOUT"},
		{"zero tokens", []string{"-max-tokens", "0"}, nil, "-max-tokens 0: want >= 1"},
		{"negative", []string{"-max-concurrent", "-1"}, nil, "out of range"},
		{"message too small", []string{"-max-message-bytes", "1KiB"}, nil, "-max-message-bytes 1024"},
		{"message too large", []string{"-max-message-bytes", "4GiB"}, nil, "-max-message-bytes"},
		{"bad level", []string{"-log-level", "loud"}, nil, `-log-level "loud"`},
		{"bad format", []string{"-log-format", "xml"}, nil, `-log-format "xml"`},
		{"stray argument", []string{"serve"}, nil, "unexpected arguments"},
		{"unknown flag", []string{"-gpu"}, nil, "flag provided but not defined"},
		{"bad env window", nil, map[string]string{"EXPERTD_BATCH_WINDOW": "2"}, "$EXPERTD_BATCH_WINDOW"},
		{"negative window", []string{"-batch-window", "-1ms"}, nil, "-batch-window -1ms: want 0 (off) to 1s"},
		{"window too long", []string{"-batch-window", "2s"}, nil, "-batch-window 2s"},
		{"negative age", []string{"-max-connection-age", "-1s"}, nil, "-max-connection-age -1s, -max-connection-age-grace 5m0s: want >= 0"},
		{"zero ping minimum", []string{"-keepalive-min-time", "0"}, nil, "-keepalive-min-time 0s: want > 0"},
		{"ping interval too short", []string{"-keepalive-time", "100ms"}, nil, "-keepalive-time 100ms: want >= 1s"},
		{"zero ping timeout", []string{"-keepalive-timeout", "0"}, nil, "-keepalive-timeout 0s: want > 0"},
		{"ring without shared memory", []string{"-ring"}, nil, "-ring: needs -shared-memory"},
		{"lanes without shared memory", []string{"-lanes"}, nil, "-lanes: needs -shared-memory"},
		{"bad env ring", nil, map[string]string{"EXPERTD_RING": "on"}, `$EXPERTD_RING: "on" is not true or false`},
		{"ring spin too long", []string{"-ring-spin", "1s"}, nil, "-ring-spin 1s"},
		{"no rings", []string{"-ring-max", "0"}, nil, "-ring-max 0"},
		{"no lanes", []string{"-lane-max", "0"}, nil, "-lane-max 0: want >= 1"},
		{"no shm regions", []string{"-max-shm-regions", "0"}, nil, "-max-shm-regions 0, -max-shm-bytes 68719476736: want >= 1"},
		{"negative idle", []string{"-idle-free-memory", "-1s"}, nil, "-idle-free-memory -1s: want >= 0"},
		{"otlp without scheme", []string{"-otlp-endpoint", "localhost:4317"}, nil, `-otlp-endpoint "localhost:4317": want an http:// or https:// URL`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig(tt.args, func(k string) string { return tt.env[k] }, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("parseConfig error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

// TestDefaultMessageLimit checks the default admits the largest legal
// request for the biggest reference shape (DeepSeek-V3, FP32 hidden) and
// stays under gRPC's 2 GiB ceiling.
func TestDefaultMessageLimit(t *testing.T) {
	c, err := parseConfig(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	const m, k, e, topk = 8192, 7168, 256, 8
	need := int64(m*k*4 + m*e*4 + 2*m*topk*4)
	if c.MaxMessageBytes < need || c.MaxMessageBytes >= 1<<31 {
		t.Errorf("default max message bytes %d: want >= %d (DeepSeek-V3 at M=8192) and < 2 GiB", c.MaxMessageBytes, need)
	}
}
