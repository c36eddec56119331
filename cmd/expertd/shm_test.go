package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// shmObject creates /dev/shm/<key> of size bytes, removed at cleanup.
func shmObject(t *testing.T, size int64) string {
	t.Helper()
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	key := fmt.Sprintf("expertd-daemon-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	f, err := os.OpenFile("/dev/shm/"+key, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	t.Cleanup(func() { os.Remove("/dev/shm/" + key) })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	return key
}

// mappedHere reports whether this process (the daemon runs in it) maps
// /dev/shm/<key>.
func mappedHere(t *testing.T, key string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	return bytes.Contains(b, []byte("/dev/shm/"+key+"\n"))
}

// TestSharedMemoryFlag: off by default (FailedPrecondition naming the
// flag); with -shared-memory a user-role caller registers a region, and the
// daemon unmaps it when the caller's connection closes.
func TestSharedMemoryFlag(t *testing.T) {
	key := shmObject(t, 1<<16)
	reg := &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, ByteSize: 1 << 16}
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()

	t.Run("off", func(t *testing.T) {
		addr, _ := startDaemon(t)
		_, err := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials())).RegisterSharedMemory(ctx, reg)
		if status.Code(err) != codes.FailedPrecondition || !bytes.Contains([]byte(status.Convert(err).Message()), []byte("-shared-memory")) {
			t.Errorf("RegisterSharedMemory = %v, want FailedPrecondition naming -shared-memory", err)
		}
	})
	t.Run("on", func(t *testing.T) {
		path, user, _ := writeTokens(t)
		addr, logs := startDaemon(t, "-shared-memory", "-auth-tokens-file", path)
		conn := dial(t, addr, insecure.NewCredentials())
		c := pb.NewExpertServiceClient(conn)
		uctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+user)
		if _, err := c.RegisterSharedMemory(uctx, reg); err != nil {
			t.Fatalf("RegisterSharedMemory as a user: %v", err)
		}
		list, err := c.ListSharedMemory(uctx, &pb.ListSharedMemoryRequest{})
		if err != nil || len(list.GetRegions()) != 1 {
			t.Fatalf("ListSharedMemory = %v, %v; want the region", list, err)
		}
		if !mappedHere(t, key) {
			t.Fatalf("/dev/shm/%s is not mapped after registering", key)
		}
		conn.Close()
		for deadline := time.Now().Add(defaultTestTimeout); mappedHere(t, key); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("/dev/shm/%s still mapped after its connection closed\n%s", key, logs.String())
			}
		}
	})
}

// openFDs is how many file descriptors this process (the daemon runs in
// it) has open.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(ents)
}

// TestSharedMemoryDaemonCaps is the issue 14 probe at small scale: many
// connections register page-sized regions of one object until the
// daemon-wide cap refuses the next with ResourceExhausted naming the flag;
// the regions hold no file descriptors, and a new client's health check
// is still answered. Past -max-shm-bytes a region is refused the same way.
func TestSharedMemoryDaemonCaps(t *testing.T) {
	const conns, perConn = 8, 5
	key := shmObject(t, 1<<20)
	addr, _ := startDaemon(t, "-shared-memory", "-max-shm-regions", fmt.Sprint(conns*perConn), "-max-shm-bytes", "512KiB")
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	var clients []pb.ExpertServiceClient
	for range conns + 1 {
		c := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials()))
		if _, err := c.ListSharedMemory(ctx, &pb.ListSharedMemoryRequest{}); err != nil { // connects
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	before := openFDs(t)
	for i := range conns {
		for j := range perConn {
			off := int64(i*perConn+j) * 4096
			if _, err := clients[i].RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: fmt.Sprint("r", j), Key: key, Offset: off, ByteSize: 4096}); err != nil {
				t.Fatalf("connection %d region %d: %v", i, j, err)
			}
		}
	}
	if n := openFDs(t); n > before+4 {
		t.Errorf("%d regions took the process from %d to %d file descriptors", conns*perConn, before, n)
	}
	_, err := clients[conns].RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "r", Key: key, Offset: 1 << 19, ByteSize: 4096})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(status.Convert(err).Message(), "-max-shm-regions") {
		t.Errorf("region %d: %v, want ResourceExhausted naming -max-shm-regions", conns*perConn+1, err)
	}
	health := healthpb.NewHealthClient(dial(t, addr, insecure.NewCredentials()))
	if _, err := health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health check with the regions cap reached: %v", err)
	}
	// Free one connection's regions: the bytes cap answers next.
	if _, err := clients[0].UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{}); err != nil {
		t.Fatal(err)
	}
	_, err = clients[conns].RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: "big", Key: key, ByteSize: 512 << 10})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(status.Convert(err).Message(), "-max-shm-bytes") {
		t.Errorf("a 512 KiB region beside %d KiB: %v, want ResourceExhausted naming -max-shm-bytes", (conns-1)*perConn*4, err)
	}
}
