package main

import (
	"context"
	"log/slog"
	"runtime"
	"runtime/debug"
	"time"
)

// reclaimIdle gives memory back to the OS once the daemon has run no call
// for idle (activity reports the calls admitted so far and those running),
// once per quiet spell, until ctx ends. A burst leaves its request and output buffers in
// pools (codec.Pool, grpc-go's buffer pools: sync.Pools, emptied only by
// two garbage collections) and the freed pages with the runtime, whose
// background scavenger returns them slowly; an idle process runs no
// collection for minutes. Two collections empty the pools and
// debug.FreeOSMemory returns the pages, within 1.25 x idle of the last call's end.
// idle <= 0 disables it.
func reclaimIdle(ctx context.Context, idle time.Duration, activity func() (admitted, running int64), log *slog.Logger) {
	if idle <= 0 {
		return
	}
	tick := time.NewTicker(idle / 4)
	defer tick.Stop()
	last, _ := activity()
	quietSince, reclaimed := time.Now(), true
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if n, running := activity(); n != last || running > 0 {
			last, quietSince, reclaimed = n, time.Now(), false
			continue
		}
		if reclaimed || time.Since(quietSince) < idle {
			continue
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		runtime.GC() // the pools' primary caches become victims
		debug.FreeOSMemory()
		runtime.ReadMemStats(&after)
		reclaimed = true
		// calls_admitted tells which quiet spell this was: the calls
		// admitted before it.
		log.Debug("idle: memory returned to the OS", slog.Duration("idle", idle), slog.Int64("calls_admitted", last),
			slog.Uint64("heap_in_use_before", before.HeapInuse), slog.Uint64("heap_in_use_after", after.HeapInuse),
			slog.Uint64("released", after.HeapReleased-min(after.HeapReleased, before.HeapReleased)))
	}
}
