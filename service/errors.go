package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/expertd/expertd/internal/clip"
	"github.com/expertd/expertd/kernels"
)

// requestError is a failure the caller caused or a limit it hit. It stays a
// plain error inside the package and becomes a status only in toStatus, so
// helpers can wrap and test it without importing gRPC semantics.
type requestError struct {
	code  codes.Code
	field string
	msg   string
	// quota names the daemon flag of the limit a ResourceExhausted error
	// hit, and limit is its value; empty for none.
	quota string
	limit int64
	// retry > 0 is how long the caller should wait before the same call
	// may succeed; 0 means retrying it will not help.
	retry time.Duration
}

func (e *requestError) Error() string {
	if e.field == "" {
		return e.msg
	}
	return e.field + ": " + e.msg
}

// invalidf reports a malformed request field.
func invalidf(field, format string, args ...any) error {
	return &requestError{code: codes.InvalidArgument, field: field, msg: fmt.Sprintf(format, args...)}
}

// exhaustedf reports a request over a configured limit.
func exhaustedf(field, format string, args ...any) error {
	return &requestError{code: codes.ResourceExhausted, field: field, msg: fmt.Sprintf(format, args...)}
}

// limitf reports a request over the limit set by the daemon's flag quota
// (of value limit). retry > 0 says the same call may succeed after that
// delay; 0 says it will not until the caller changes it or something
// else changes on the server.
func limitf(field, quota string, limit int64, retry time.Duration, format string, args ...any) error {
	return &requestError{code: codes.ResourceExhausted, field: field, msg: fmt.Sprintf(format, args...), quota: quota, limit: limit, retry: retry}
}

// status is e as a gRPC status with AIP-193 details, so callers act on it
// without parsing the message: google.rpc.BadRequest naming the field of
// an InvalidArgument, google.rpc.QuotaFailure naming the limit and
// google.rpc.RetryInfo with the delay of a ResourceExhausted.
func (e *requestError) status() error {
	st := status.New(e.code, e.Error())
	var details []protoadapt.MessageV1
	if e.code == codes.InvalidArgument && e.field != "" {
		details = append(details, &errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{
			Field: e.field, Description: e.msg,
		}}})
	}
	if e.quota != "" {
		subject := e.field
		if subject == "" {
			subject = "server"
		}
		details = append(details, &errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
			Subject: subject, Description: e.msg, QuotaId: e.quota, QuotaValue: e.limit,
		}}})
	}
	if e.retry > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(e.retry)})
	}
	if len(details) == 0 {
		return st.Err()
	}
	if wd, err := st.WithDetails(details...); err == nil {
		st = wd
	}
	return st.Err()
}

// codedf reports any other caller-visible condition (NotFound,
// AlreadyExists, FailedPrecondition, Unavailable).
func codedf(code codes.Code, field, format string, args ...any) error {
	return &requestError{code: code, field: field, msg: fmt.Sprintf(format, args...)}
}

// errDraining is returned for new calls once Shutdown has begun.
var errDraining = codedf(codes.Unavailable, "", "server is draining; retry on another replica")

// toStatus converts an error to the status a handler returns. Anything not
// classified is our fault: it is logged in full and reported as Internal
// without internal detail.
func (s *Server) toStatus(ctx context.Context, method string, err error) error {
	if err == nil {
		return nil
	}
	var re *requestError
	switch {
	case errors.As(err, &re):
		return re.status()
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	case errors.Is(err, kernels.ErrUnsupported):
		return status.Errorf(codes.FailedPrecondition, "backend %s: %v", s.backend.Name(), err)
	case errors.Is(err, kernels.ErrOutOfMemory):
		return status.Errorf(codes.ResourceExhausted, "backend %s: %v", s.backend.Name(), err)
	}
	if st, ok := status.FromError(err); ok {
		return st.Err()
	}
	s.log.ErrorContext(ctx, "internal error", slog.String("method", method), slog.Any("err", err))
	return status.Errorf(codes.Internal, "%s: internal error (logged on the server)", method)
}

// Quote is how every string a client controls (names, keys, paths,
// templates, tensor names) enters a status message: clip.Quote.
func Quote(s string) string { return clip.Quote(s) }

// Clip is Quote without the quotes, for log attributes, which the log
// handler quotes itself.
func Clip(s string) string { return clip.To(s, clip.Quoted) }

// ClipTo is Clip keeping up to n bytes, for text that is mostly the
// server's own (an error chain, say) but may carry a client's string.
func ClipTo(s string, n int) string { return clip.To(s, n) }

// maxNameBytes bounds every name a request looks up (expert sets,
// shared-memory regions): longer than any name LoadExperts or
// RegisterSharedMemory accepts, so it can only be a mistake or an attack.
const maxNameBytes = 256

// checkLen refuses a client string over max bytes before it is looked up,
// compared or echoed.
func checkLen(field, s string, max int) error {
	if len(s) > max {
		return invalidf(field, "%s: %d bytes, want at most %d", Quote(s), len(s), max)
	}
	return nil
}
