package servicetest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestLogBufferWaitFor: WaitFor returns once a Write, made while it
// waits, satisfies cond, and with ctx's error if none does.
func TestLogBufferWaitFor(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var l LogBuffer
	l.Write([]byte("starting\n"))
	has := func(s string) func(string) bool { return func(log string) bool { return strings.Contains(log, s) } }
	if err := l.WaitFor(ctx, has("starting")); err != nil {
		t.Fatalf("WaitFor what is already written: %v", err)
	}
	checked := make(chan string, 8)
	done := make(chan error, 1)
	go func() {
		done <- l.WaitFor(ctx, func(log string) bool { checked <- log; return strings.Contains(log, "ready") })
	}()
	<-checked // WaitFor has looked and is waiting
	for _, line := range []string{"busy\n", "ready\n"} {
		l.Write([]byte(line))
		if got := <-checked; !strings.HasSuffix(got, line) {
			t.Fatalf("WaitFor checked %q after writing %q", got, line)
		}
	}
	if err := <-done; err != nil {
		t.Fatalf("WaitFor: %v", err)
	}

	cancelled, stop := context.WithCancel(ctx)
	stop()
	if err := l.WaitFor(cancelled, has("never")); !errors.Is(err, context.Canceled) {
		t.Errorf("WaitFor with an ended context: %v, want %v", err, context.Canceled)
	}
}
