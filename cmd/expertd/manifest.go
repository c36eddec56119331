package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/metric"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/expertd/expertd/internal/capfile"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/shard"
	"github.com/expertd/expertd/weights"
)

// A startup manifest names the expert sets a daemon loads before it
// reports ready, so a pod serves without a separate loader. YAML or JSON:
//
//	sets:
//	  - safetensors:            # a LoadExpertsRequest, protobuf JSON
//	      name: layer3
//	      path: qwen3/layer3.safetensors
//	      layer: 3
//	      preset: NAMING_PRESET_QWEN3_MOE
//	shard:                      # optional: load only this shard's experts
//	  count: 4
//	  placement: contiguous     # or round-robin
//	waitForFiles: 10m           # optional: wait for missing files
//
// Each set is a LoadExpertsRequest in protobuf JSON, so every field of the
// source message (and any added later) is spelled as in a LoadExperts call.
type manifest struct {
	// Sets load in order.
	Sets []*pb.LoadExpertsRequest
	// Shard, when set, loads only shard Index of Count of every set.
	Shard *manifestShard
	// WaitForFiles bounds how long a set waits for its file to appear
	// (written by a sidecar or an init step); 0 fails at once.
	WaitForFiles time.Duration
}

// manifestShard places each set's experts with a shard.Map of Count shards;
// the daemon loads shard Index's experts, as local ids 0.. in map order.
type manifestShard struct {
	Count     int    `json:"count"`
	Placement string `json:"placement"`
	// Index, when absent, comes from -shard-index or the host name.
	Index *int `json:"index"`
}

// readManifest parses path, refusing unknown keys anywhere so a typo is an
// error at start instead of a set that silently loads wrong.
func readManifest(path string) (*manifest, error) {
	raw, err := capfile.ReadAll(path, maxManifestBytes)
	if err != nil {
		return nil, fmt.Errorf("-manifest: %w", err)
	}
	m, err := parseManifest(raw)
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w", path, err)
	}
	return m, nil
}

func parseManifest(raw []byte) (*manifest, error) {
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, err
	}
	var doc struct {
		Sets         []json.RawMessage `json:"sets"`
		Shard        *manifestShard    `json:"shard"`
		WaitForFiles string            `json:"waitForFiles"`
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		return nil, err
	}
	m := &manifest{Shard: doc.Shard}
	if doc.WaitForFiles != "" {
		if m.WaitForFiles, err = time.ParseDuration(doc.WaitForFiles); err != nil || m.WaitForFiles < 0 {
			return nil, fmt.Errorf("waitForFiles %q: want a duration such as 10m", doc.WaitForFiles)
		}
	}
	if len(doc.Sets) == 0 {
		return nil, errors.New("sets: at least one set is required")
	}
	names := map[string]int{}
	for i, s := range doc.Sets {
		req := &pb.LoadExpertsRequest{}
		if err := protojson.Unmarshal(s, req); err != nil {
			return nil, fmt.Errorf("sets[%d]: %w", i, err)
		}
		src := req.GetSafetensors()
		if src == nil {
			return nil, fmt.Errorf("sets[%d]: want a safetensors source (uploads cannot be named in a manifest)", i)
		}
		if j, dup := names[src.GetName()]; dup {
			return nil, fmt.Errorf("sets[%d]: name %s is also sets[%d]'s", i, service.Quote(src.GetName()), j)
		}
		names[src.GetName()] = i
		m.Sets = append(m.Sets, req)
	}
	if sh := m.Shard; sh != nil {
		if sh.Count < 1 {
			return nil, fmt.Errorf("shard.count %d: want >= 1", sh.Count)
		}
		switch sh.Placement {
		case "", "contiguous", "round-robin":
		default:
			return nil, fmt.Errorf("shard.placement %q: want contiguous or round-robin", sh.Placement)
		}
		if sh.Index != nil && (*sh.Index < 0 || *sh.Index >= sh.Count) {
			return nil, fmt.Errorf("shard.index %d: want in [0, %d)", *sh.Index, sh.Count)
		}
	}
	return m, nil
}

// resolveIndex fixes the shard this daemon serves: the manifest's index,
// else flagIndex (-shard-index, >= 0), else the ordinal a StatefulSet puts
// at the end of the pod's host name (expertd-2 is shard 2).
func (sh *manifestShard) resolveIndex(flagIndex int, hostname func() (string, error)) (int, error) {
	idx := flagIndex
	switch {
	case sh.Index != nil:
		idx = *sh.Index
	case idx < 0:
		h, err := hostname()
		if err != nil {
			return 0, fmt.Errorf("shard index: %w", err)
		}
		i := strings.LastIndexByte(h, '-')
		n, err := strconv.Atoi(h[i+1:])
		if i < 0 || err != nil || n < 0 {
			return 0, fmt.Errorf("shard index: set shard.index or -shard-index, or run on a host named <name>-<ordinal> (a StatefulSet pod); host name %q has no ordinal", truncate(h, 64))
		}
		idx = n
	}
	if idx >= sh.Count {
		return 0, fmt.Errorf("shard index %d: the manifest has %d shards", idx, sh.Count)
	}
	return idx, nil
}

// subset is the service's pick of shard index's experts of a layer.
func (sh *manifestShard) subset(index int) weights.ExpertSubset {
	return func(numExperts int) ([]int, error) {
		place := shard.Contiguous
		if sh.Placement == "round-robin" {
			place = shard.RoundRobin
		}
		m, err := place(numExperts, sh.Count)
		if err != nil {
			return nil, err
		}
		return m.Experts(index), nil
	}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// manifestMetrics are the startup manifest's instruments. They are made
// before the admin port serves, so the first scrape already has
// sets_pending, whose value is what readiness waits on.
type manifestMetrics struct {
	setsLoaded, bytesLoaded metric.Int64Counter
}

func newManifestMetrics(meter metric.Meter, rd *readiness, log *slog.Logger) manifestMetrics {
	setsLoaded, _ := meter.Int64Counter("expertd.manifest.sets_loaded",
		metric.WithDescription("Expert sets of the startup manifest loaded."), metric.WithUnit("{set}"))
	bytesLoaded, _ := meter.Int64Counter("expertd.manifest.loaded",
		metric.WithDescription("Bytes of expert sets of the startup manifest loaded."), metric.WithUnit("By"))
	_, err := meter.Int64ObservableGauge("expertd.manifest.sets_pending",
		metric.WithDescription("Expert sets of the startup manifest not loaded yet; the daemon is not ready while any is."),
		metric.WithUnit("{set}"),
		metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
			o.Observe(rd.pending.Load())
			return nil
		}))
	if err != nil {
		log.Warn("metric not recorded", slog.String("metric", "expertd.manifest.sets_pending"), slog.Any("err", err))
	}
	return manifestMetrics{setsLoaded: setsLoaded, bytesLoaded: bytesLoaded}
}

// loadManifest loads every set of m in order, logging and counting
// progress. The first failure stops it: a replica missing a set it is
// meant to serve must not join the rotation, and failing the start makes
// that visible (a crash loop with the cause in the log) instead of a pod
// that stays unready without saying why.
func loadManifest(ctx context.Context, m *manifest, svc *service.Server, weightsDir string, shardIndex int, rd *readiness, mm manifestMetrics, log *slog.Logger) error {
	var subset weights.ExpertSubset
	attrs := []any{slog.Int("sets", len(m.Sets))}
	if m.Shard != nil {
		subset = m.Shard.subset(shardIndex)
		attrs = append(attrs, slog.Int("shard", shardIndex), slog.Int("shards", m.Shard.Count), slog.String("placement", m.Shard.Placement))
	}
	log.Info("loading startup manifest", attrs...)
	start := time.Now()
	var total int64
	for i, req := range m.Sets {
		src := req.GetSafetensors()
		if err := waitForFile(ctx, weightsDir, src.GetPath(), m.WaitForFiles, log); err != nil {
			return fmt.Errorf("manifest sets[%d] (%s): %w", i, service.Quote(src.GetName()), err)
		}
		t0 := time.Now()
		info, err := svc.LoadSafetensors(ctx, src, subset)
		if err != nil {
			return fmt.Errorf("manifest sets[%d]: %w", i, err)
		}
		rd.pending.Add(-1)
		mm.setsLoaded.Add(ctx, 1)
		mm.bytesLoaded.Add(ctx, info.GetBytes())
		total += info.GetBytes()
		log.Info("expert set loaded", slog.Int("set", i+1), slog.Int("of", len(m.Sets)), slog.String("name", info.GetName()),
			slog.Int("experts", int(info.GetNumExperts())), slog.Int64("bytes", info.GetBytes()), slog.Duration("took", time.Since(t0)))
	}
	log.Info("startup manifest loaded", slog.Int("sets", len(m.Sets)), slog.Int64("bytes", total), slog.Duration("took", time.Since(start)))
	return nil
}

// waitForFile waits up to wait for rel to exist under dir, so a sidecar
// that downloads weights can start beside the daemon. Only existence is
// checked: the writer must move a complete file into place.
func waitForFile(ctx context.Context, dir, rel string, wait time.Duration, log *slog.Logger) error {
	if wait <= 0 || dir == "" {
		return nil
	}
	p := filepath.Join(dir, filepath.Clean("/"+rel))
	deadline := time.Now().Add(wait)
	logged := false
	for {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if !logged {
			log.Info("waiting for a weights file", slog.String("path", rel), slog.Duration("up_to", wait))
			logged = true
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not appear in the weights directory within %v", rel, wait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}
