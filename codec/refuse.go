package codec

import (
	"context"
	"sync"
	"sync/atomic"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// refused maps each message a Codec with Refuse could not parse to its
// InvalidArgument status, until an interceptor takes it; nRefused counts
// the entries, so the interceptors skip the map while it is empty, as it
// is but for malformed requests.
var (
	refused  sync.Map
	nRefused atomic.Int64
)

// takeRefused returns and forgets m's status when its request did not
// parse, nil otherwise.
func takeRefused(m any) error {
	if nRefused.Load() == 0 {
		return nil
	}
	if err, ok := refused.LoadAndDelete(m); ok {
		nRefused.Add(-1)
		return err.(error)
	}
	return nil
}

// UnaryServerInterceptor answers a unary call whose request did not parse
// (Codec.Refuse) with InvalidArgument, before its handler.
func UnaryServerInterceptor(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := takeRefused(req); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// StreamServerInterceptor makes a stream's RecvMsg of a message that did
// not parse (Codec.Refuse) fail with InvalidArgument, which the handler
// returns as it returns any receive error.
func StreamServerInterceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return handler(srv, refusingStream{ss})
}

type refusingStream struct{ grpc.ServerStream }

func (s refusingStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	return takeRefused(m)
}

// badUTF8Field is the path (a.b.c) of the first string field of b, a
// message md, that is not UTF-8, "" when there is none or b does not
// parse that far: protobuf's own error does not name the field.
func badUTF8Field(b []byte, md protoreflect.MessageDescriptor, depth int) string {
	if depth > recursionLimit {
		return ""
	}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		vn := protowire.ConsumeFieldValue(num, typ, b)
		if vn < 0 {
			return ""
		}
		fd := md.Fields().ByNumber(num)
		if fd != nil && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b)
			switch fd.Kind() {
			case protoreflect.StringKind:
				if !utf8.Valid(v) {
					return string(fd.Name())
				}
			case protoreflect.MessageKind:
				if inner := badUTF8Field(v, fd.Message(), depth+1); inner != "" {
					return string(fd.Name()) + "." + inner
				}
			}
		}
		b = b[vn:]
	}
	return ""
}
