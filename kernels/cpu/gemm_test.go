package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/expertd/expertd/scaling"
)

// TestGemmTile checks the blocked kernel against a float64 triple loop on
// the same FP8 operands: with every product exact, float32 accumulation is
// the only error, so the FP32 bar of 1e-5 applies. Sizes cover the 4-row
// register block's remainder, odd k, and segments that do not divide k.
func TestGemmTile(t *testing.T) {
	tests := []struct{ n, rt, k, seg int }{
		{1, 4, 64, 64},
		{3, 7, 77, 77},
		{5, 13, 200, 128},
		{2, 16, 300, 24},
		{4, 3, 5, 2},
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for _, tt := range tests {
		nseg := (tt.k + tt.seg - 1) / tt.seg
		m := tt.n + 2 // some activation rows are not used
		a := make([]float32, m*tt.k)
		for i := range a {
			a[i] = scaling.E4M3Table[scaling.Float32ToE4M3(float32(rng.NormFloat64()*100))]
		}
		aS := randScales(rng, m*nseg)
		wq := make([]uint8, tt.rt*tt.k)
		for i := range wq {
			wq[i] = scaling.Float32ToE4M3(float32(rng.NormFloat64() * 100))
		}
		w := make([]float32, len(wq))
		decodeFP8(w, wq)
		wS := randScales(rng, tt.rt*nseg)
		rows := make([]int32, tt.n)
		out := make([]int32, tt.n)
		for i := range rows {
			rows[i] = int32((i * 2) % m)
			out[i] = int32(tt.n - 1 - i)
		}
		ldc, col0 := tt.rt+3, 2
		for _, decoded := range []bool{true, false} {
			c := make([]float32, tt.n*ldc)
			g := gemmArgs{a: a, rows: rows, aS: aS, wq: wq, wS: wS, rt: tt.rt,
				k: tt.k, seg: tt.seg, nseg: nseg, c: c, out: out, ldc: ldc, col0: col0}
			if decoded {
				g.w = w
			}
			gemmTile(&g)
			if e := tileError(&g); !(e <= 1e-5) {
				t.Errorf("n=%d rt=%d k=%d seg=%d decoded=%v: rel-L2 %.3g, want <= 1e-5", tt.n, tt.rt, tt.k, tt.seg, decoded, e)
			}
		}
	}
}

// tileError is the rel-L2 error of g's output against a float64 triple
// loop over the same FP8 operands and scales.
func tileError(g *gemmArgs) float64 {
	var num, den float64
	for i, row := range g.rows {
		for r := range g.rt {
			var want float64
			for kk := range g.k {
				s := kk / g.seg
				want += float64(g.a[int(row)*g.k+kk]) * float64(scaling.E4M3Table[g.wq[r*g.k+kk]]) *
					float64(g.aS[int(row)*g.nseg+s]) * float64(g.wS[r*g.nseg+s])
			}
			got := float64(g.c[int(g.out[i])*g.ldc+g.col0+r])
			num += (got - want) * (got - want)
			den += want * want
		}
	}
	return math.Sqrt(num / den)
}

func randScales(rng *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(math.Exp(rng.NormFloat64()))
	}
	return s
}

func TestTileRows(t *testing.T) {
	for _, k := range []int{1, 40, 2688, 1 << 20} {
		r := tileRows(k)
		if r < 4 || r%4 != 0 {
			t.Errorf("tileRows(%d) = %d, want a multiple of 4, at least 4", k, r)
		}
		if r > 4 && r*k*4 > tileBytes {
			t.Errorf("tileRows(%d) = %d: tile of %d bytes exceeds %d", k, r, r*k*4, tileBytes)
		}
	}
}
