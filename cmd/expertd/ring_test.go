//go:build linux

package main

import (
	"context"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/ring"
)

// TestRingFlag: without -ring, AttachRing is FailedPrecondition naming
// the flag; with it a user attaches a ring, GetServerInfo reports it,
// and a call posted into the ring is served (here: answered NotFound for
// a set that is not loaded).
func TestRingFlag(t *testing.T) {
	const slots, slotSize = 1, 1024
	size := ring.Size(slots, slotSize)
	key := shmObject(t, size)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	reg := &pb.RegisterSharedMemoryRequest{Name: "ring", Key: key, ByteSize: size}
	attach := &pb.AttachRingRequest{RegionName: "ring", SlotCount: slots, SlotSize: slotSize}

	t.Run("off", func(t *testing.T) {
		addr, _ := startDaemon(t, "-shared-memory")
		c := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials()))
		s, err := c.AttachRing(ctx, attach)
		if err == nil {
			_, err = s.Recv()
		}
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "-ring") {
			t.Errorf("AttachRing = %v, want FailedPrecondition naming -ring", err)
		}
	})
	t.Run("on", func(t *testing.T) {
		path, user, _ := writeTokens(t)
		addr, _ := startDaemon(t, "-shared-memory", "-ring", "-ring-spin", "50us", "-auth-tokens-file", path)
		c := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials()))
		uctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+user)
		info, err := c.GetServerInfo(uctx, &pb.GetServerInfoRequest{})
		if err != nil || !info.GetRing().GetEnabled() || info.GetRing().GetSpinNanos() != (50*time.Microsecond).Nanoseconds() {
			t.Fatalf("GetServerInfo = %v, %v; want rings enabled with a 50us spin", info.GetRing(), err)
		}
		f, err := os.OpenFile("/dev/shm/"+key, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		mem, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		defer syscall.Munmap(mem)
		r, err := ring.Init(mem, slots, slotSize)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.RegisterSharedMemory(uctx, reg); err != nil {
			t.Fatalf("RegisterSharedMemory: %v", err)
		}
		sctx, stop := context.WithCancel(uctx)
		defer stop()
		s, err := c.AttachRing(sctx, attach)
		if err == nil {
			_, err = s.Recv()
		}
		if err != nil {
			t.Fatalf("AttachRing as a user: %v", err)
		}
		req, _ := proto.Marshal(&pb.FusedMoERequest{Experts: &pb.FusedMoERequest_ExpertSet{ExpertSet: "absent"}})
		if err := r.Post(0, 1, req, time.Second); err != nil {
			t.Fatal(err)
		}
		if !r.WaitDone(0, 0, 10*time.Millisecond, func() bool { return ctx.Err() != nil }) {
			t.Fatal("no completion")
		}
		kind, _, payload, err := r.Response(0)
		var st spb.Status
		if err != nil || kind != ring.KindStatus || proto.Unmarshal(payload, &st) != nil || codes.Code(st.GetCode()) != codes.NotFound {
			t.Fatalf("completion kind %d, status %v, %v; want NotFound", kind, &st, err)
		}
	})
}
