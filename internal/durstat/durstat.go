// Package durstat takes quantiles of duration samples, the way
// expertbench's summaries and the repository's latency benchmarks report
// them, so both read the same rank of the same samples.
package durstat

import (
	"math"
	"slices"
	"time"
)

// Percentile is the nearest-rank p-quantile (0 < p <= 1) of sorted; 0 for
// no samples.
func Percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// Of sorts v in place and returns its nearest-rank p-quantile in
// nanoseconds, as testing.B.ReportMetric takes it.
func Of(v []time.Duration, p float64) float64 {
	slices.Sort(v)
	return float64(Percentile(v, p))
}
