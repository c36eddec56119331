// Package clitest holds what the tests of the commands (expertd-load,
// expertbench, the client flags) share: a peer that never answers, and a
// check that printed lines are bounded.
package clitest

import (
	"net"
	"strings"
	"testing"

	"github.com/expertd/expertd/internal/clip"
)

// SilentPeer is the address of a TCP listener that accepts connections
// and never writes a byte: a dial to it neither fails nor completes. It
// closes when the test ends.
func SilentPeer(t testing.TB) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		lis.Close()
		<-done
	})
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	return lis.Addr().String()
}

// CheckLines fails t for each line of out longer than a cut line
// (clip.Line bytes and the note of the original length).
func CheckLines(t testing.TB, out string) {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if len(l) > clip.Line+40 {
			t.Errorf("a printed line of %d bytes: %.100q", len(l), l)
		}
	}
}
