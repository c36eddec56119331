package cpu

import (
	"sync"
	"sync/atomic"
)

// parallelFor runs fn(i) for i in [0, n) on up to workers goroutines that
// pull indices from a shared counter, so uneven items (experts with many
// tokens next to experts with none) balance themselves. fn receives the
// worker number w in [0, workers) so callers can index per-worker scratch.
func parallelFor(workers, n int, fn func(w, i int)) {
	if workers > n {
		workers = n
	}
	if workers <= 1 {
		for i := range n {
			fn(0, i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				fn(w, i)
			}
		}()
	}
	wg.Wait()
}
