package service

import (
	"testing"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// TestModelWireNames: the request model spells dtypes and scorings in its
// messages as the wire enums do, for every value a request can carry, and
// activations too, whose values the service converts by number.
func TestModelWireNames(t *testing.T) {
	for v := int32(-2); v <= 9; v++ {
		if got, want := moe.DType(v).WireName(), pb.DataType(v).String(); got != want {
			t.Errorf("moe.DType(%d).WireName() = %q, want %q", v, got, want)
		}
		if got, want := moe.Scoring(v).WireName(), pb.Scoring(v).String(); got != want {
			t.Errorf("moe.Scoring(%d).WireName() = %q, want %q", v, got, want)
		}
		if got, want := moe.Activation(v).WireName(), pb.Activation(v).String(); got != want {
			t.Errorf("moe.Activation(%d).WireName() = %q, want %q", v, got, want)
		}
	}
}
