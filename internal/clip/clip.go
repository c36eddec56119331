// Package clip bounds text that may carry a string someone else chose
// (a client's name, a file's contents, a server's message) before it
// enters a status, a log attribute or a printed line: the daemon and the
// commands share these cuts so that no line they write grows with an
// input.
package clip

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Quoted is how many bytes of a foreign string Quote keeps: enough to
// recognise a name, too few for a hostile one to bloat a status or a log
// line.
const Quoted = 128

// Line bounds one log attribute or one printed line: room for any error
// chain the daemon or a command builds, far below what a request or a
// file can carry.
const Line = 2048

// Quote is s %q-quoted, so control characters and quotes cannot forge a
// line, and cut to Quoted bytes with the original length after it, so a
// megabyte name costs a megabyte nowhere but its source.
func Quote(s string) string {
	head, n := cut(s, Quoted)
	if n < 0 {
		return strconv.Quote(s)
	}
	return strconv.Quote(head) + "... (" + strconv.Itoa(n) + " bytes)"
}

// To is s cut to n bytes, on a UTF-8 boundary, with the original length
// after it; s itself when it is short enough.
func To(s string, n int) string {
	head, l := cut(s, n)
	if l < 0 {
		return s
	}
	return head + "... (" + strconv.Itoa(l) + " bytes)"
}

// cut returns s's first n bytes, ending on a UTF-8 boundary, and len(s);
// or s and -1 when s is short enough to keep whole.
func cut(s string, n int) (string, int) {
	if len(s) <= n {
		return s, -1
	}
	i := n
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i], len(s)
}

// Fprintf is fmt.Fprintf with the text cut to Line bytes, a final newline
// kept: how a command prints a line that holds text from elsewhere (a
// name, a server's message).
func Fprintf(w io.Writer, format string, a ...any) (int, error) {
	s := fmt.Sprintf(format, a...)
	body, nl := strings.CutSuffix(s, "\n")
	s = To(body, Line)
	if nl {
		s += "\n"
	}
	return io.WriteString(w, s)
}

// LineWriter is w with every line written through it cut to Line bytes:
// for text a command prints but does not format itself, such as the flag
// package's messages, which quote a bad value whole.
func LineWriter(w io.Writer) io.Writer { return &lineWriter{w: w} }

type lineWriter struct {
	w   io.Writer
	n   int  // bytes of the current line written
	cut bool // the current line has been cut
}

func (l *lineWriter) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		body, rest, nl := strings.Cut(string(p), "\n")
		if room := Line - l.n; len(body) > room {
			if !l.cut {
				head, _ := cut(body, max(room, 0))
				if _, err := io.WriteString(l.w, head+"..."); err != nil {
					return 0, err
				}
				l.cut = true
			}
		} else if _, err := io.WriteString(l.w, body); err != nil {
			return 0, err
		}
		l.n += len(body)
		if nl {
			if _, err := io.WriteString(l.w, "\n"); err != nil {
				return 0, err
			}
			l.n, l.cut = 0, false
		}
		p = p[len(p)-len(rest):]
		if !nl {
			break
		}
	}
	return total, nil
}
