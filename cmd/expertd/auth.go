package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/selector"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/internal/capfile"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service"
)

// role is what a caller may do. Roles are ordered: admin may do all a
// user may.
type role int

const (
	roleNone role = iota
	roleUser
	roleAdmin
)

func (r role) String() string {
	switch r {
	case roleUser:
		return "user"
	case roleAdmin:
		return "admin"
	}
	return "none"
}

// methodRoles is the role each ExpertService method needs. A method not
// listed (one added to the proto later) needs admin until someone decides
// otherwise: the table fails closed. TestMethodRoles checks every method of
// the service is here.
//
// Shared-memory registration is a user's: a region belongs to the
// connection that registered it and serves only that connection's own
// FusedMoE calls, so it gives nothing over other callers (as in Triton,
// which asks no more of it than of inference). What it lends the caller
// is the daemon's right to open objects under /dev/shm, which is why it is
// off without -shared-memory, refused to peers that are not local, and why
// the README says to run the daemon as its own Unix user.
var methodRoles = map[string]role{
	pb.ExpertService_FusedMoE_FullMethodName:               roleUser,
	pb.ExpertService_FusedMoEStream_FullMethodName:         roleUser,
	pb.ExpertService_ListExperts_FullMethodName:            roleUser,
	pb.ExpertService_GetServerInfo_FullMethodName:          roleUser,
	pb.ExpertService_RegisterSharedMemory_FullMethodName:   roleUser,
	pb.ExpertService_UnregisterSharedMemory_FullMethodName: roleUser,
	pb.ExpertService_ListSharedMemory_FullMethodName:       roleUser,
	pb.ExpertService_AttachRing_FullMethodName:             roleUser,
	pb.ExpertService_OpenLane_FullMethodName:               roleUser,
	pb.ExpertService_LoadExperts_FullMethodName:            roleAdmin,
	pb.ExpertService_UnloadExperts_FullMethodName:          roleAdmin,
}

// requiredRole is the role fullMethod ("/service/method") needs. Server
// reflection needs only to be authenticated: it describes the API, and
// who may call it has been decided already. So does a method the server
// does not serve (registered reports which it does): any authenticated
// caller learns it is Unimplemented, nobody else learns anything.
func requiredRole(fullMethod string, registered func(string) bool) role {
	if r, ok := methodRoles[fullMethod]; ok {
		return r
	}
	if strings.HasPrefix(fullMethod, "/grpc.reflection.") || (registered != nil && !registered(fullMethod)) {
		return roleUser
	}
	return roleAdmin
}

// learnMethods records the methods gs serves, for requiredRole; call it
// once every service is registered, before Serve.
func (a *authorizer) learnMethods(gs *grpc.Server) {
	if a == nil {
		return
	}
	served := servedMethods(gs)
	a.registered = func(m string) bool { return served[m] }
}

// servedMethods is the set of full method names ("/service/method") gs
// serves.
func servedMethods(gs *grpc.Server) map[string]bool {
	served := map[string]bool{}
	for svc, info := range gs.GetServiceInfo() {
		for _, m := range info.Methods {
			served["/"+svc+"/"+m.Name] = true
		}
	}
	return served
}

// unknownMethod answers calls to methods the server does not serve. As a
// grpc.UnknownServiceHandler it runs behind the interceptors, so with
// authorization on such a call must authenticate first, and it is logged
// like any other. The method name is the caller's: it is bounded.
func unknownMethod(_ any, ss grpc.ServerStream) error {
	m, _ := grpc.MethodFromServerStream(ss)
	return status.Errorf(codes.Unimplemented, "unknown method %s", service.Quote(m))
}

// tokenEntry is one line of the tokens file. Only the token's SHA-256 is
// kept: comparing fixed-length digests in constant time reveals neither
// the tokens nor their lengths through timing.
type tokenEntry struct {
	digest [sha256.Size]byte
	role   role
	line   int
}

// authorizer decides who is calling and whether they may. It is nil when
// neither -auth-tokens-file nor -tls-client-ca is set, and then nothing is
// checked.
type authorizer struct {
	tokens []tokenEntry
	// mtls: every connection carries a verified client certificate, which
	// grants user, or admin when one of its names is in admins.
	mtls   bool
	admins map[string]bool
	// looseMode is the tokens file's permission bits when group or others
	// may read or write it, for a warning; 0 otherwise.
	looseMode os.FileMode
	// registered reports whether the server serves a method (learnMethods);
	// nil until then, when every method not in methodRoles needs admin.
	registered func(string) bool
}

// newAuthorizer reads the tokens file and the admin identities.
func newAuthorizer(c Config) (*authorizer, error) {
	if c.AuthTokensFile == "" && c.TLSClientCA == "" {
		return nil, nil
	}
	a := &authorizer{mtls: c.TLSClientCA != "", admins: map[string]bool{}}
	for _, id := range c.AdminIdentities {
		a.admins[id] = true
	}
	if c.AuthTokensFile != "" {
		f, err := capfile.Open(c.AuthTokensFile, maxTokensFileBytes)
		if err != nil {
			return nil, fmt.Errorf("-auth-tokens-file: %w", err)
		}
		defer f.Close()
		if fi, err := f.Stat(); err == nil && fi.Mode().Perm()&0o077 != 0 {
			a.looseMode = fi.Mode().Perm()
		}
		if a.tokens, err = parseTokens(io.LimitReader(f, maxTokensFileBytes)); err != nil {
			return nil, fmt.Errorf("-auth-tokens-file %s: %w", c.AuthTokensFile, err)
		}
	}
	return a, nil
}

// minTokenLen refuses tokens a person might type or guess; 16 random
// characters are ~95 bits from base64.
const minTokenLen = 16

// parseTokens reads `token role` lines; blank lines and lines starting
// with # are skipped. Errors name the line, never the token.
func parseTokens(r io.Reader) ([]tokenEntry, error) {
	var out []tokenEntry
	seen := map[[sha256.Size]byte]int{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			return nil, fmt.Errorf("line %d: want `token role`, got %d fields", n, len(fields))
		}
		var r role
		switch fields[1] {
		case "user":
			r = roleUser
		case "admin":
			r = roleAdmin
		default:
			return nil, fmt.Errorf("line %d: role %q: want user or admin", n, fields[1])
		}
		if len(fields[0]) < minTokenLen {
			return nil, fmt.Errorf("line %d: token shorter than %d characters", n, minTokenLen)
		}
		d := sha256.Sum256([]byte(fields[0]))
		if prev, ok := seen[d]; ok {
			return nil, fmt.Errorf("line %d: same token as line %d", n, prev)
		}
		seen[d] = n
		out = append(out, tokenEntry{digest: d, role: r, line: n})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no tokens: every call would be refused")
	}
	return out, nil
}

// tokenRole is the role of a presented token, roleNone when unknown.
// Every entry is compared, so the time taken does not depend on which
// one matched.
func (a *authorizer) tokenRole(token string) role {
	d := sha256.Sum256([]byte(token))
	found := roleNone
	for _, e := range a.tokens {
		if subtle.ConstantTimeCompare(d[:], e.digest[:]) == 1 {
			found = e.role
		}
	}
	return found
}

// certRole is the role a verified client certificate grants.
func (a *authorizer) certRole(ctx context.Context) role {
	p, ok := peer.FromContext(ctx)
	if !a.mtls || !ok {
		return roleNone
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return roleNone
	}
	return a.leafRole(ti.State.VerifiedChains[0][0])
}

func (a *authorizer) leafRole(leaf *x509.Certificate) role {
	for _, id := range certIdentities(leaf) {
		if a.admins[id] {
			return roleAdmin
		}
	}
	return roleUser
}

// authenticate is the auth.AuthFunc: it finds the caller's role from a
// bearer token and/or the client certificate and checks it against the
// method's. A token that is sent must be valid even when a certificate
// would do: a wrong credential is a mistake worth reporting.
func (a *authorizer) authenticate(ctx context.Context) (context.Context, error) {
	method, ok := grpc.Method(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "authorization: no method in the call context")
	}
	got := a.certRole(ctx)
	switch vals := metadata.ValueFromIncomingContext(ctx, "authorization"); {
	case len(vals) > 1:
		// Checking only one of several would let a valid token vouch for
		// an invalid one (or the reverse, depending on order): refuse.
		return nil, status.Errorf(codes.Unauthenticated, "authorization metadata has %d values: send one authorization value", len(vals))
	case len(vals) == 1:
		token, err := auth.AuthFromMD(ctx, "bearer")
		if err != nil {
			return nil, status.Error(codes.Unauthenticated, "authorization metadata: want `Bearer <token>`")
		}
		r := a.tokenRole(token)
		if r == roleNone {
			return nil, status.Error(codes.Unauthenticated, "bearer token not recognized")
		}
		got = max(got, r)
	}
	if got == roleNone {
		return nil, status.Error(codes.Unauthenticated, "no credentials: send `authorization: Bearer <token>` metadata")
	}
	if want := requiredRole(method, a.registered); got < want {
		return nil, status.Errorf(codes.PermissionDenied, "%s needs the %s role; this caller has %s", service.Clip(method), want, got)
	}
	return ctx, nil
}

// authExempt is what is served without credentials: health checks, so
// load balancers and orchestrators can probe without a secret.
var authExempt = selector.MatchFunc(func(_ context.Context, c interceptors.CallMeta) bool {
	return c.Service != healthpb.Health_ServiceDesc.ServiceName
})

// serverOptions are the TLS credentials and authorization interceptors the
// security flags ask for; none with no flags set.
func (a *authorizer) serverOptions() []grpc.ServerOption {
	if a == nil {
		return nil
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(selector.UnaryServerInterceptor(auth.UnaryServerInterceptor(a.authenticate), authExempt)),
		grpc.ChainStreamInterceptor(selector.StreamServerInterceptor(auth.StreamServerInterceptor(a.authenticate), authExempt)),
	}
}

// hasAdmin reports whether any caller can have the admin role.
func (a *authorizer) hasAdmin() bool {
	for _, e := range a.tokens {
		if e.role == roleAdmin {
			return true
		}
	}
	return len(a.admins) > 0
}

// security is the daemon's TLS and authorization, built once at start.
type security struct {
	creds credentials.TransportCredentials
	authz *authorizer
}

// newSecurity loads certificates and tokens; a missing or malformed file
// stops the daemon before it listens.
func newSecurity(c Config) (*security, error) {
	creds, err := c.serverCredentials()
	if err != nil {
		return nil, err
	}
	authz, err := newAuthorizer(c)
	if err != nil {
		return nil, err
	}
	return &security{creds: creds, authz: authz}, nil
}

// serverOptions are the grpc.Server options for TLS and authorization.
func (s *security) serverOptions() []grpc.ServerOption {
	opts := s.authz.serverOptions()
	if s.creds != nil {
		opts = append(opts, grpc.Creds(s.creds))
	}
	return opts
}

// logPosture says once how the daemon is protected, and warns loudly
// about a listener others can reach without TLS or authorization: anyone
// who connects could then load, run and unload expert sets.
func (s *security) logPosture(log *slog.Logger, c Config, addr net.Addr) {
	hasTLS, mtls, tokens := s.creds != nil, c.TLSClientCA != "", s.authz != nil && len(s.authz.tokens) > 0
	log.Info("security", slog.Bool("tls", hasTLS), slog.Bool("mtls", mtls), slog.Bool("bearer_tokens", tokens),
		slog.Int("admin_identities", len(c.AdminIdentities)))
	local := isLoopback(addr)
	switch {
	case !local && !hasTLS && s.authz == nil:
		log.Warn("expertd is reachable from other hosts with neither TLS nor authorization: anyone who can connect may load, run and unload experts; set -tls-cert/-tls-key and -auth-tokens-file or -tls-client-ca, or listen on 127.0.0.1",
			slog.String("listen", addr.String()), slog.Bool("tls", false), slog.Bool("auth", false))
	case !local && !hasTLS && tokens:
		log.Warn("bearer tokens travel in plaintext to a non-loopback listener; set -tls-cert and -tls-key",
			slog.String("listen", addr.String()), slog.Bool("tls", false))
	}
	if s.authz != nil && s.authz.looseMode != 0 {
		log.Warn("the tokens file is readable or writable by group or others; chmod 600 it",
			slog.String("file", c.AuthTokensFile), slog.String("mode", s.authz.looseMode.String()))
	}
	if s.authz != nil && !s.authz.hasAdmin() {
		log.Warn("no caller has the admin role: LoadExperts and UnloadExperts will be refused; add an admin token or -admin-identities")
	}
}
