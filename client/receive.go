package client

import "github.com/expertd/expertd/codec"

// Release hands the result's receive buffer back to the SDK for a later
// call's response; afterwards the result's tensors (Output, TopKIDs,
// TopKWeights, and every copy or slice of their Data) must not be used.
// Calling it is optional: a result never released is garbage collected.
//
// Why: inline tensors alias the response's receive buffer rather than
// being copied out of it, and that buffer is a large allocation per call
// (1.4 MB at M = 256 on Nemotron) whose pages fault on first write when
// it is fresh; an engine calling a layer in a loop reuses warm buffers
// instead. Results of shared-memory outputs hold no receive buffer.
func (r *FusedMoEResult) Release() {
	if r == nil || !r.recv.Holds() {
		return
	}
	h := r.recv
	r.recv = codec.Held{}
	for _, t := range []*Tensor{&r.Output, &r.TopKIDs, &r.TopKWeights} {
		if t.Shm == nil {
			t.Data = nil
		}
	}
	h.Release()
}
