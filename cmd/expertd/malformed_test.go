package main

import (
	"context"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// rawCodec sends []byte as the message as it is and ignores what comes
// back: for requests no well-behaved client can send.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(v.([]byte))}, nil
}
func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }
func (rawCodec) Name() string                         { return "proto" }

// badUTF8 is m's encoding with its first string field holding bytes that
// are not UTF-8, which proto3 refuses to parse.
func badUTF8(t *testing.T, m proto.Message) []byte {
	t.Helper()
	fields := m.ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		if fd := fields.Get(i); fd.Kind() == protoreflect.StringKind {
			b := protowire.AppendTag(nil, fd.Number(), protowire.BytesType)
			return protowire.AppendBytes(b, []byte{'a', 0xff, 0xfe})
		}
	}
	t.Fatalf("%T has no string field", m)
	return nil
}

// TestMalformedBodies: a request body that is not protobuf, or whose
// string field is not UTF-8, is the caller's InvalidArgument, on unary
// calls and streams alike, never Internal.
func TestMalformedBodies(t *testing.T) {
	addr, _ := startDaemon(t, "-shared-memory")
	conn := dial(t, addr, insecure.NewCredentials(), grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{})))
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	notProto := []byte{0xff, 0xff, 0xff, 0xff}
	unary := []struct {
		method string
		body   []byte
	}{
		{pb.ExpertService_FusedMoE_FullMethodName, badUTF8(t, &pb.FusedMoERequest{})},
		{pb.ExpertService_FusedMoE_FullMethodName, notProto},
		{pb.ExpertService_UnloadExperts_FullMethodName, badUTF8(t, &pb.UnloadExpertsRequest{})},
		{pb.ExpertService_RegisterSharedMemory_FullMethodName, badUTF8(t, &pb.RegisterSharedMemoryRequest{})},
		{pb.ExpertService_ListSharedMemory_FullMethodName, badUTF8(t, &pb.ListSharedMemoryRequest{})},
		{pb.ExpertService_GetServerInfo_FullMethodName, notProto},
		{healthpb.Health_Check_FullMethodName, badUTF8(t, &healthpb.HealthCheckRequest{})},
		{pb.ExpertService_FusedMoE_FullMethodName, append(badUTF8(t, &pb.FusedMoERequest{}), notProto...)},
	}
	for _, tc := range unary {
		err := conn.Invoke(ctx, tc.method, tc.body, new([]byte))
		if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), "malformed request: ") {
			t.Errorf("%s with %x: %v; want InvalidArgument: malformed request", tc.method, tc.body, err)
		}
	}
	streams := []struct {
		name string
		body []byte
	}{
		{"FusedMoEStream", badUTF8(t, &pb.FusedMoERequest{})},
		{"FusedMoEStream", notProto},
		{"LoadExperts", notProto},
	}
	for _, tc := range streams {
		desc := pb.ExpertService_ServiceDesc.Streams[slices.IndexFunc(pb.ExpertService_ServiceDesc.Streams,
			func(d grpc.StreamDesc) bool { return d.StreamName == tc.name })]
		s, err := conn.NewStream(ctx, &desc, "/"+pb.ExpertService_ServiceDesc.ServiceName+"/"+tc.name)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.SendMsg(tc.body); err != nil {
			t.Fatal(err)
		}
		s.CloseSend()
		err = s.RecvMsg(new([]byte))
		if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.HasPrefix(st.Message(), "malformed request: ") {
			t.Errorf("%s with %x: %v; want InvalidArgument: malformed request", tc.name, tc.body, err)
		}
	}
}
