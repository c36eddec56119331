package shm

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
)

// Error is a refusal of the caller's input or of a daemon-wide cap. Field
// names the registration's or reference's field ("key", "byte_size",
// "region_name"), relative to wherever the caller's request holds it, so
// the server can prefix it ("hidden_states.shm."); Code is the status it
// stands for.
type Error struct {
	Code  codes.Code
	Field string
	Msg   string
	// Quota names the daemon flag of a per-owner limit that was hit and
	// Limit is its value; empty for none.
	Quota string
	Limit int64
}

func (e *Error) Error() string {
	if e.Field == "" {
		return e.Msg
	}
	return e.Field + ": " + e.Msg
}

func errorf(code codes.Code, field, format string, args ...any) error {
	return &Error{Code: code, Field: field, Msg: fmt.Sprintf(format, args...)}
}

func invalidf(field, format string, args ...any) error {
	return errorf(codes.InvalidArgument, field, format, args...)
}

func exhaustedf(field, format string, args ...any) error {
	return errorf(codes.ResourceExhausted, field, format, args...)
}

// ErrClosed is returned once Close has begun: the table takes no new
// registrations and resolves nothing.
var ErrClosed = errors.New("shared memory: the table is closed")
