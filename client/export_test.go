package client

import (
	"github.com/expertd/expertd/codec"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// RequestProto is a request's wire form, for tests that post it by hand.
func RequestProto(r *FusedMoERequest) (*pb.FusedMoERequest, error) { return r.proto() }

// ReceiveBuffer is the receive buffer a result holds until Release (one
// that holds nothing when there is none).
func ReceiveBuffer(r *FusedMoEResult) codec.Held { return r.recv }
