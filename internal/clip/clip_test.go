package clip

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestTo(t *testing.T) {
	if got := To("short", 10); got != "short" {
		t.Errorf("To(short) = %q", got)
	}
	long := strings.Repeat("é", 1000) // 2000 bytes
	got := To(long, 101)
	if !utf8.ValidString(got) || !strings.HasSuffix(got, "... (2000 bytes)") || len(got) > 101+len("... (2000 bytes)") {
		t.Errorf("To(2000 bytes, 101) = %q", got)
	}
	if q := Quote("a\nb"); q != `"a\nb"` {
		t.Errorf("Quote = %s", q)
	}
	if q := Quote(strings.Repeat("x", 1<<20)); len(q) > Quoted+40 || !strings.Contains(q, "(1048576 bytes)") {
		t.Errorf("Quote of a megabyte: %d bytes", len(q))
	}
}

func TestFprintf(t *testing.T) {
	var b strings.Builder
	Fprintf(&b, "x: %s\n", strings.Repeat("y", 1<<20))
	if s := b.String(); len(s) > Line+40 || !strings.HasSuffix(s, " bytes)\n") {
		t.Errorf("Fprintf of a megabyte printed %d bytes ending %q", len(s), s[max(0, len(s)-20):])
	}
	b.Reset()
	Fprintf(&b, "n=%d", 3)
	if b.String() != "n=3" {
		t.Errorf("Fprintf = %q", b.String())
	}
}
