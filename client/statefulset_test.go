package client_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/shard"
)

func TestStatefulSetAddrs(t *testing.T) {
	got := client.StatefulSetAddrs("expertd", "expertd-headless.models.svc.cluster.local", 50051, 3)
	want := []string{
		"expertd-0.expertd-headless.models.svc.cluster.local:50051",
		"expertd-1.expertd-headless.models.svc.cluster.local:50051",
		"expertd-2.expertd-headless.models.svc.cluster.local:50051",
	}
	if !slices.Equal(got, want) {
		t.Errorf("StatefulSetAddrs = %q, want %q", got, want)
	}
}

// TestDialStatefulSet resolves the shard names by DNS: names under
// .invalid never resolve (RFC 6761), so dialing fails naming shard 0's
// address, proving the names went to the resolver.
func TestDialStatefulSet(t *testing.T) {
	m, err := shard.Contiguous(8, 2)
	if err != nil {
		t.Fatal(err)
	}
	// Resolution never succeeds, so the dial ends at the deadline.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = client.DialStatefulSet(ctx, m, "expertd", "expertd-headless.invalid", 50051, client.WithMaxAttempts(1))
	if err == nil || !strings.Contains(err.Error(), "expertd-headless.invalid:50051") {
		t.Fatalf("DialStatefulSet = %v, want an error naming a shard's DNS name", err)
	}
	if _, err := client.DialStatefulSet(ctx, nil, "expertd", "h", 1); err == nil {
		t.Error("DialStatefulSet with no map succeeded")
	}
}
