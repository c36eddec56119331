package client

import pb "github.com/expertd/expertd/proto/expertd/v1"

// RequestProto is a request's wire form, for tests that post it by hand.
func RequestProto(r *FusedMoERequest) (*pb.FusedMoERequest, error) { return r.proto() }

// ReceiveBuffer is the pooled receive buffer a result holds until
// Release, nil when it holds none.
func ReceiveBuffer(r *FusedMoEResult) []byte { return r.recv }
