//go:build !(goexperiment.simd && amd64)

package cpu

// decodeMinRows is the fewest token rows for which decoding a weight tile
// to float32 first beats reading the codes through the table in the dot
// product itself. Measured on the 2-core EPYC of docs/perf-notes.md:
// decoding costs about two scalar multiply-adds per weight, the table
// lookup in the inner loop about a third of one more per use.
const decodeMinRows = 5

// simdKernel names the dot4 in use, for Capabilities.
const simdKernel = "scalar"

// dot4 is four dot products sharing one activation row: five loads per four
// multiply-adds, four independent accumulator chains.
func dot4(a, w0, w1, w2, w3 []float32) (s0, s1, s2, s3 float32) {
	n := len(a)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	for k, x := range a {
		s0 += x * w0[k]
		s1 += x * w1[k]
		s2 += x * w2[k]
		s3 += x * w3[k]
	}
	return
}
