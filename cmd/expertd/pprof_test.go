package main

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/expertd/expertd/service/servicetest"
)

// TestPprof: /debug/pprof/ is on the admin listener only with -pprof (or
// EXPERTD_PPROF=true).
func TestPprof(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		env  string
		want int
	}{
		{"off by default", nil, "", http.StatusNotFound},
		{"-pprof", []string{"-pprof"}, "", http.StatusOK},
		{"EXPERTD_PPROF", nil, "true", http.StatusOK},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			logs := &servicetest.LogBuffer{}
			ready := make(chan listening, 1)
			done := make(chan error, 1)
			args := append([]string{"-listen", "127.0.0.1:0", "-admin-addr", "127.0.0.1:0", "-backend", "cpu", "-threads", "1"}, tt.args...)
			getenv := func(k string) string {
				if k == "EXPERTD_PPROF" {
					return tt.env
				}
				return ""
			}
			go func() { done <- run(ctx, args, getenv, logs, ready) }()
			defer func() {
				cancel()
				<-done
			}()
			var a listening
			select {
			case a = <-ready:
			case err := <-done:
				t.Fatalf("run: %v\n%s", err, logs.String())
			case <-time.After(defaultTestTimeout):
				t.Fatal("daemon not ready")
			}
			resp, err := http.Get("http://" + a.admin + "/debug/pprof/")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tt.want {
				t.Errorf("GET /debug/pprof/ = %d, want %d", resp.StatusCode, tt.want)
			}
		})
	}
}
