package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/kernels"
)

// requestError is a failure the caller caused or a limit it hit. It stays a
// plain error inside the package and becomes a status only in toStatus, so
// helpers can wrap and test it without importing gRPC semantics.
type requestError struct {
	code  codes.Code
	field string
	msg   string
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
		return status.Error(re.code, re.Error())
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
