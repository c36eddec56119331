package client

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is what the SDK's calls return for a failed call: the method and
// the server's gRPC status (status.Code and status.Convert see through
// it), with accessors for the AIP-193 details the daemon attaches, so a
// caller acts on a failure without parsing its message. Get it with
// errors.As.
type Error struct {
	// Method is the RPC, e.g. "FusedMoE".
	Method string
	// Err is the status error (or, for a malformed response, the
	// client's own error).
	Err error
}

func (e *Error) Error() string {
	msg := "expertd " + e.Method + ": " + e.Err.Error()
	// grpc-go refuses a request over the server's message limit before
	// any of the daemon's code runs, with a status that says only the
	// sizes: say what bounds it and what to do instead.
	if e.Code() == codes.ResourceExhausted && strings.Contains(e.Err.Error(), "received message larger than max") {
		msg += " (" + oversizedHint + ")"
	}
	return msg
}

// oversizedHint follows a server's "received message larger than max".
const oversizedHint = "the server's -max-message-bytes bounds every message, see ServerInfo().Limits.MaxMessageBytes: " +
	"split the batch, pass tensors in shared memory, or load weights with LoadExperts, which sends them in chunks"

// Unwrap returns Err.
func (e *Error) Unwrap() error { return e.Err }

// Code is the status code; Unknown for an error that is not a status.
func (e *Error) Code() codes.Code { return status.Code(e.Err) }

// FieldViolations are the request fields an InvalidArgument names
// (google.rpc.BadRequest): Field is a path such as "hidden_states" or
// "weights.w13_scale", Description what is wrong with it.
func (e *Error) FieldViolations() []*errdetails.BadRequest_FieldViolation {
	var vs []*errdetails.BadRequest_FieldViolation
	for _, br := range detailsOf[*errdetails.BadRequest](e) {
		vs = append(vs, br.GetFieldViolations()...)
	}
	return vs
}

// Field is the first field FieldViolations names, or "".
func (e *Error) Field() string {
	if vs := e.FieldViolations(); len(vs) > 0 {
		return vs[0].GetField()
	}
	return ""
}

// QuotaViolations are the limits a ResourceExhausted hit
// (google.rpc.QuotaFailure): QuotaId is the daemon's flag
// ("max-queued", "max-tokens", "max-loaded-bytes", or
// "regions-per-connection"), QuotaValue its value.
func (e *Error) QuotaViolations() []*errdetails.QuotaFailure_Violation {
	var vs []*errdetails.QuotaFailure_Violation
	for _, qf := range detailsOf[*errdetails.QuotaFailure](e) {
		vs = append(vs, qf.GetViolations()...)
	}
	return vs
}

// RetryDelay is how long the server asks the caller to wait before trying
// the same call again (google.rpc.RetryInfo), and whether it asked: a
// full queue does; a call over a fixed limit does not, since it would
// fail again.
func (e *Error) RetryDelay() (time.Duration, bool) {
	for _, ri := range detailsOf[*errdetails.RetryInfo](e) {
		if ri.GetRetryDelay() != nil {
			return max(ri.GetRetryDelay().AsDuration(), 0), true
		}
	}
	return 0, false
}

// detailsOf are the details of e's status of type T.
func detailsOf[T any](e *Error) []T {
	var out []T
	for _, d := range status.Convert(e.Err).Details() {
		if v, ok := d.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

// wrap names the method in an error while keeping its gRPC status, so
// status.Code(err) still works on what the SDK returns.
func wrap(method string, err error) error {
	return &Error{Method: method, Err: err}
}

// retryAfter waits as long as err's RetryInfo asks, with ±20% jitter so
// callers refused together do not come back together, and reports whether
// the call should be tried again: false when err has no RetryInfo or ctx
// ends first.
func retryAfter(ctx context.Context, err error) bool {
	d, ok := (&Error{Err: err}).RetryDelay()
	if !ok || errors.Is(err, context.Canceled) {
		return false
	}
	d = time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
	if dl, has := ctx.Deadline(); has && time.Until(dl) < d {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
