package service_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
	"github.com/expertd/expertd/service/servicetest"
)

func TestGetServerInfo(t *testing.T) {
	cfg := service.Config{Version: "v1.2.3", MaxTokens: 8192, MaxLoadedBytes: 1 << 30, MaxConcurrent: 3, MaxMessageBytes: 1 << 26,
		BatchWindow: 300 * time.Microsecond, BatchMaxTokens: 64, StreamWorkers: 5,
		KeepaliveMinTime: time.Second, KeepaliveTime: 2 * time.Second, KeepaliveTimeout: 3 * time.Second,
		MaxConnectionAge: 4 * time.Second, MaxConnectionAgeGrace: 5 * time.Second,
		Settings: map[string]string{"max-tokens": "8192", "tls-key": "(set)"}}
	c, _, _ := servicetest.StartServerConfig(t, cfg, &fakeBackend{})
	got, err := c.GetServerInfo(testContext(t), &pb.GetServerInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	want := &pb.ServerInfo{
		Version: "v1.2.3",
		Backends: []*pb.ServerInfo_BackendInfo{{
			Name:          "fake",
			Activations:   []pb.Activation{pb.Activation_ACTIVATION_SILU_GATED, pb.Activation_ACTIVATION_RELU2},
			Granularities: []string{"per-tensor", "per-expert"},
			Devices:       []string{"fake device"},
			Details:       map[string]string{"streams": "2"},
		}},
		Devices: []string{"fake device"},
		Limits: &pb.ServerInfo_Limits{MaxMessageBytes: 1 << 26, MaxTokens: 8192, MaxLoadedBytes: 1 << 30, MaxConcurrent: 3,
			MaxQueued: 12, BatchWindowNanos: 300e3, BatchMaxTokens: 64},
		Ring: &pb.ServerInfo_RingInfo{Version: 1, MaxPerConn: service.DefaultRingMaxPerConn, MaxRings: service.DefaultRingMax,
			MaxSlotBytes: service.DefaultRingMaxSlotBytes},
		Lane: &pb.ServerInfo_LaneInfo{MaxLanes: service.DefaultLaneMax},
		Transport: &pb.ServerInfo_Transport{StreamWorkers: 5, KeepaliveMinTimeNanos: 1e9, KeepaliveTimeNanos: 2e9,
			KeepaliveTimeoutNanos: 3e9, MaxConnectionAgeNanos: 4e9, MaxConnectionAgeGraceNanos: 5e9},
		Settings: map[string]string{"max-tokens": "8192", "tls-key": "(set)"},
	}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("GetServerInfo (-want +got):\n%s", diff)
	}
}

// TestGetServerInfoBatchMaxTokens checks that the reported batch bound is
// the one in force: the default when unset, capped by max_tokens.
func TestGetServerInfoBatchMaxTokens(t *testing.T) {
	for _, tc := range []struct {
		name                string
		batchMax, maxTokens int
		want                int32
	}{
		{"default", 0, 0, service.DefaultBatchMaxTokens},
		{"set", 64, 0, 64},
		{"capped by max_tokens", 0, 100, 100},
		{"set, capped", 512, 300, 300},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := service.Config{BatchWindow: time.Millisecond, BatchMaxTokens: tc.batchMax, MaxTokens: tc.maxTokens}
			c, _, _ := servicetest.StartServerConfig(t, cfg, &fakeBackend{})
			got, err := c.GetServerInfo(testContext(t), &pb.GetServerInfoRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if g := got.GetLimits().GetBatchMaxTokens(); g != tc.want {
				t.Errorf("batch_max_tokens %d, want %d", g, tc.want)
			}
		})
	}
}

// TestShutdownDrains checks that Shutdown waits for a running call, refuses
// new ones with Unavailable, and frees the loaded sets.
func TestShutdownDrains(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 1)}
	c, srv, _ := func() (pb.ExpertServiceClient, *service.Server, func()) {
		c, srv, cleanup := servicetest.StartServerConfig(t, service.Config{}, b)
		w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
		if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
			t.Fatal(err)
		}
		return c, srv, cleanup
	}()
	running := make(chan error, 1)
	req := request(rng, 2)
	go func() {
		_, err := c.FusedMoE(testContext(t), req)
		running <- err
	}()
	<-b.started

	drained := make(chan error, 1)
	go func() { drained <- srv.Shutdown(testContext(t)) }()
	for !srv.Draining() {
		time.Sleep(time.Millisecond)
	}
	if _, err := c.FusedMoE(testContext(t), request(rng, 1)); status.Code(err) != codes.Unavailable {
		t.Errorf("FusedMoE while draining: got %v, want Unavailable", err)
	}
	if _, err := c.UnloadExperts(testContext(t), &pb.UnloadExpertsRequest{Name: "layer"}); status.Code(err) != codes.Unavailable {
		t.Errorf("UnloadExperts while draining: got %v, want Unavailable", err)
	}
	select {
	case err := <-drained:
		t.Fatalf("Shutdown returned %v with a call in flight", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(b.release)
	if err := <-running; err != nil {
		t.Errorf("call in flight during Shutdown: %v, want success", err)
	}
	if err := <-drained; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if loads, closes := b.counts(); closes != loads {
		t.Errorf("after Shutdown %d of %d loaded sets are closed", closes, loads)
	}
}

func TestShutdownTimeout(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 1)}
	defer close(b.release)
	c, srv, _ := servicetest.StartServerConfig(t, service.Config{}, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatal(err)
	}
	req := request(rng, 2)
	go c.FusedMoE(testContext(t), req) //nolint:errcheck // ends with the test
	<-b.started
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if err := srv.Shutdown(ctx); err != context.DeadlineExceeded {
		t.Errorf("Shutdown with a stuck call: got %v, want DeadlineExceeded", err)
	}
}

// TestUnloadWhileRunning checks a set unloaded mid-call is freed only when
// the call ends, and that its name is gone at once.
func TestUnloadWhileRunning(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 1)}
	c, _ := loadedServer(t, rng, service.Config{MaxLoadedBytes: 1 << 20}, b)
	done := make(chan error, 1)
	req := request(rng, 2)
	go func() {
		_, err := c.FusedMoE(testContext(t), req)
		done <- err
	}()
	<-b.started
	if _, err := c.UnloadExperts(testContext(t), &pb.UnloadExpertsRequest{Name: "layer"}); err != nil {
		t.Fatalf("UnloadExperts: %v", err)
	}
	if _, closes := b.counts(); closes != 0 {
		t.Errorf("set closed while a call was running on it")
	}
	if _, err := c.FusedMoE(testContext(t), request(rng, 1)); status.Code(err) != codes.NotFound {
		t.Errorf("FusedMoE on the unloaded name: got %v, want NotFound", err)
	}
	close(b.release)
	if err := <-done; err != nil {
		t.Errorf("running call: %v", err)
	}
	if _, closes := b.counts(); closes != 1 {
		t.Errorf("set closed %d times after its call ended, want 1", closes)
	}
}

// TestConcurrencyLimit checks calls beyond MaxConcurrent wait for a slot
// and report that wait as queue time.
func TestConcurrencyLimit(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 4)}
	c, srv, _ := servicetest.StartServerConfig(t, service.Config{MaxConcurrent: 1}, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatal(err)
	}
	type result struct {
		resp *pb.FusedMoEResponse
		err  error
	}
	results := make(chan result, 2)
	for range 2 {
		req := request(rng, 1)
		go func() {
			resp, err := c.FusedMoE(testContext(t), req)
			results <- result{resp, err}
		}()
	}
	<-b.started
	// The other call is in the queue from here until the release: its
	// queue time is at least the time in between.
	waitFor(t, "the second call to queue", func() bool { return srv.Queued() == 1 })
	queuedBy := time.Now()
	select {
	case <-b.started:
		t.Fatal("a second call started with MaxConcurrent 1")
	case <-time.After(20 * time.Millisecond):
	}
	minQueue := time.Since(queuedBy)
	close(b.release)
	var maxQueue int64
	for range 2 {
		r := <-results
		if r.err != nil {
			t.Fatal(r.err)
		}
		maxQueue = max(maxQueue, r.resp.GetTimings().GetQueueNanos())
	}
	if maxQueue < int64(minQueue) {
		t.Errorf("max queue time %v, want >= %v, the time the test saw a call queued", time.Duration(maxQueue), minQueue)
	}
}

// TestQueueBound checks the queue in front of the execution slots: calls
// beyond MaxConcurrent + MaxQueued are refused at once with
// ResourceExhausted, and the queued calls run once the slot frees.
func TestQueueBound(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 8)}
	c, srv, _ := servicetest.StartServerConfig(t, service.Config{MaxConcurrent: 1, MaxQueued: 2}, b)
	w := randomWeights(rng, pb.Activation_ACTIVATION_SILU_GATED, testE, testK, testN)
	if _, err := servicetest.Upload(testContext(t), c, servicetest.Header("layer", w, false), servicetest.Chunks(w, 1000)); err != nil {
		t.Fatal(err)
	}
	results := make(chan error, 3)
	call := func() {
		req := request(rng, 1)
		go func() {
			_, err := c.FusedMoE(testContext(t), req)
			results <- err
		}()
	}
	call()
	<-b.started // the one slot is taken
	call()
	call()
	for srv.Queued() < 2 {
		time.Sleep(time.Millisecond)
	}
	_, err := c.FusedMoE(testContext(t), request(rng, 1))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(status.Convert(err).Message(), "server busy: 1 calls running, 2 queued") {
		t.Errorf("call beyond the queue: got %v, want ResourceExhausted \"server busy: 1 calls running, 2 queued\"", err)
	}
	close(b.release)
	for range 3 {
		if err := <-results; err != nil {
			t.Errorf("admitted call: %v", err)
		}
	}
	if _, err := c.FusedMoE(testContext(t), request(rng, 2)); err != nil {
		t.Errorf("call after the burst: %v", err)
	}
	if n := b.numCalls(); n != 4 {
		t.Errorf("backend ran %d calls, want 4 (3 admitted and the last)", n)
	}
}

// TestQueueCancel checks a call waiting in the queue ends with its own
// deadline or cancellation and never reaches the backend.
func TestQueueCancel(t *testing.T) {
	rng := newRand(t)
	b := &fakeBackend{release: make(chan struct{}), started: make(chan struct{}, 8)}
	defer close(b.release)
	c, _ := loadedServer(t, rng, service.Config{MaxConcurrent: 1}, b)
	go c.FusedMoE(testContext(t), request(rng, 1)) //nolint:errcheck // released at the end
	<-b.started
	ctx, cancel := context.WithTimeout(testContext(t), 30*time.Millisecond)
	defer cancel()
	if _, err := c.FusedMoE(ctx, request(rng, 1)); status.Code(err) != codes.DeadlineExceeded {
		t.Errorf("queued call past its deadline: got %v, want DeadlineExceeded", err)
	}
	ctx2, cancel2 := context.WithCancel(testContext(t))
	time.AfterFunc(30*time.Millisecond, cancel2)
	if _, err := c.FusedMoE(ctx2, request(rng, 1)); status.Code(err) != codes.Canceled {
		t.Errorf("queued call cancelled: got %v, want Canceled", err)
	}
	if n := b.numCalls(); n != 1 {
		t.Errorf("backend ran %d calls, want only the running one", n)
	}
}
