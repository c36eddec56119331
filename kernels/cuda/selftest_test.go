package cuda

import (
	"context"
	"testing"

	"github.com/expertd/expertd/kernels"
	"github.com/expertd/expertd/kernels/cpu"
	"github.com/expertd/expertd/moe"
)

// garbage is the CPU backend with its output overwritten: what a library
// that loads but computes nonsense looks like to the self-test.
type garbage struct{ kernels.Backend }

func (g garbage) FusedMoE(ctx context.Context, l kernels.Loaded, req *moe.Request) (*moe.Result, error) {
	res, err := g.Backend.FusedMoE(ctx, l, req)
	if err == nil {
		for i := range res.Output {
			res.Output[i] ^= 0x55
		}
	}
	return res, err
}

// TestSelfCheck: the self-test's case passes on a backend that computes
// what the CPU backend does and refuses one that does not.
func TestSelfCheck(t *testing.T) {
	if err := selfCheck(context.Background(), cpu.New(kernels.Config{})); err != nil {
		t.Errorf("selfCheck(cpu) = %v, want nil", err)
	}
	if err := selfCheck(context.Background(), garbage{cpu.New(kernels.Config{})}); err == nil {
		t.Error("selfCheck(garbage) = nil, want an error")
	}
}
