package batch

import (
	"runtime"
	"testing"
	"time"
)

// BenchmarkIdleWait times a wait of d that starts after the process has
// been idle for 3 ms, by runtime timer and by polling as the batcher's
// pause does below a millisecond (timerResolution):
//
//	go test -run '^$' -bench IdleWait -benchtime 200x ./kernels/batch/
func BenchmarkIdleWait(b *testing.B) {
	for _, d := range []time.Duration{200 * time.Microsecond, 500 * time.Microsecond, time.Millisecond} {
		waits := []struct {
			name string
			wait func()
		}{
			{"timer", func() {
				t := time.NewTimer(d)
				<-t.C
			}},
			{"poll", func() {
				for end := time.Now().Add(d); time.Now().Before(end); runtime.Gosched() {
				}
			}},
		}
		for _, w := range waits {
			b.Run(w.name+"/"+d.String(), func(b *testing.B) {
				for range b.N {
					b.StopTimer()
					time.Sleep(3 * time.Millisecond) // every P parks
					b.StartTimer()
					w.wait()
				}
			})
		}
	}
}
