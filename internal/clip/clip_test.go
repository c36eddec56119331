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

func TestLineWriter(t *testing.T) {
	var b strings.Builder
	w := LineWriter(&b)
	w.Write([]byte("short\n" + strings.Repeat("y", 3*Line)))
	w.Write([]byte(strings.Repeat("z", Line) + "\nlast"))
	lines := strings.Split(b.String(), "\n")
	if len(lines) != 3 || lines[0] != "short" || lines[2] != "last" {
		t.Fatalf("lines %d: %.40q", len(lines), lines)
	}
	if l := lines[1]; len(l) != Line+3 || !strings.HasSuffix(l, "y...") {
		t.Errorf("the long line is %d bytes ending %q; want %d ending y...", len(l), l[len(l)-10:], Line+3)
	}
}
