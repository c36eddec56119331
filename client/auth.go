package client

import (
	"context"
	"net"
	"strings"

	"google.golang.org/grpc/credentials"
)

// WithBearerToken sends token as `authorization: Bearer <token>` on every
// call, for a daemon started with -auth-tokens-file. The token is secret:
// Dial refuses to send it over plaintext unless addr is a loopback
// address ("localhost", 127.0.0.0/8, ::1, or a unix socket), so pair it
// with WithTransportCredentials for any other host.
func WithBearerToken(token string) Option {
	return func(o *options) { o.token = token }
}

// bearer is the per-RPC credential WithBearerToken installs.
type bearer struct {
	token string
	// secure is whether gRPC must refuse to send the token over a
	// connection without TLS; false only for loopback targets.
	secure bool
}

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

func (b bearer) RequireTransportSecurity() bool { return b.secure }

var _ credentials.PerRPCCredentials = bearer{}

// isLoopbackTarget reports whether a Dial target stays on this host: a
// unix socket, or host:port whose host is localhost or a loopback IP.
// Anything it cannot read (a DNS name, a custom resolver) counts as
// remote, so a token is never sent in the clear by mistake.
func isLoopbackTarget(target string) bool {
	if strings.HasPrefix(target, "unix:") || strings.HasPrefix(target, "unix-abstract:") {
		return true
	}
	for _, scheme := range []string{"passthrough:///", "dns:///"} {
		target = strings.TrimPrefix(target, scheme)
	}
	host, _, err := net.SplitHostPort(target)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
