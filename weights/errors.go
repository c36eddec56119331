package weights

import (
	"fmt"
	"strings"

	"github.com/expertd/expertd/internal/clip"
)

// Error is a load the request got wrong: a bad field, a file that is
// missing or malformed, or no weights directory to read from. Field is
// named as the wire contract names it, so the service reports it
// unchanged.
type Error struct {
	Kind  Kind
	Field string
	Msg   string
}

func (e *Error) Error() string { return e.Field + ": " + e.Msg }

// Kind is what an Error's caller must change.
type Kind int

const (
	// Invalid is a malformed field or file.
	Invalid Kind = iota
	// NotFound is a path or layer the weights directory does not hold.
	NotFound
	// NoDir is a load from a server without a weights directory.
	NoDir
)

func invalidf(field, format string, args ...any) error {
	return &Error{Kind: Invalid, Field: field, Msg: fmt.Sprintf(format, args...)}
}

func errorf(kind Kind, field, format string, args ...any) error {
	return &Error{Kind: kind, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// quote is how every string a client controls (paths, templates, tensor
// and key names) enters a message.
func quote(s string) string { return clip.Quote(s) }

// quoteAll is quote of each of ss, for a message listing them.
func quoteAll(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = quote(s)
	}
	return "[" + strings.Join(q, " ") + "]"
}

// checkLen refuses a client string over max bytes before it is looked up,
// compared or echoed.
func checkLen(field, s string, max int) error {
	if len(s) > max {
		return invalidf(field, "%s: %d bytes, want at most %d", quote(s), len(s), max)
	}
	return nil
}
