package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// serverStats are the daemon's own process figures, read from its admin
// /metrics endpoint (the Go and process collectors of client_golang).
type serverStats struct {
	Goroutines int   `json:"goroutines"`
	RSS        int64 `json:"rss_bytes"`
	HeapInuse  int64 `json:"heap_inuse_bytes"`
}

// statMetrics are the series serverStats needs; a scrape lacking one is an
// error rather than a silent zero.
var statMetrics = []string{"go_goroutines", "process_resident_memory_bytes", "go_memstats_heap_inuse_bytes"}

// scrapeTimeout bounds one /metrics request.
const scrapeTimeout = 5 * time.Second

// scrape reads serverStats from http://addr/metrics.
func scrape(ctx context.Context, addr string) (serverStats, error) {
	ctx, cancel := context.WithTimeout(ctx, scrapeTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return serverStats{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return serverStats{}, fmt.Errorf("scraping the daemon's metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return serverStats{}, fmt.Errorf("scraping http://%s/metrics: %s", addr, resp.Status)
	}
	return parseStats(resp.Body)
}

// parseStats reads the unlabelled samples of statMetrics from the
// Prometheus text format.
func parseStats(r io.Reader) (serverStats, error) {
	found := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 || strings.HasPrefix(f[0], "#") {
			continue
		}
		for _, name := range statMetrics {
			if f[0] == name {
				v, err := strconv.ParseFloat(f[1], 64)
				if err != nil {
					return serverStats{}, fmt.Errorf("metric %s: %q is not a number", name, f[1])
				}
				found[name] = v
			}
		}
	}
	if err := sc.Err(); err != nil {
		return serverStats{}, fmt.Errorf("reading metrics: %w", err)
	}
	for _, name := range statMetrics {
		if _, ok := found[name]; !ok {
			return serverStats{}, fmt.Errorf("the daemon's metrics lack %s", name)
		}
	}
	return serverStats{
		Goroutines: int(found["go_goroutines"]),
		RSS:        int64(found["process_resident_memory_bytes"]),
		HeapInuse:  int64(found["go_memstats_heap_inuse_bytes"]),
	}, nil
}
