package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// TestMethodRoles checks every ExpertService method has a role decided on
// purpose, and that what is not listed fails closed.
func TestMethodRoles(t *testing.T) {
	sd := pb.ExpertService_ServiceDesc
	var names []string
	for _, m := range sd.Methods {
		names = append(names, m.MethodName)
	}
	for _, s := range sd.Streams {
		names = append(names, s.StreamName)
	}
	for _, n := range names {
		if _, ok := methodRoles["/"+sd.ServiceName+"/"+n]; !ok {
			t.Errorf("%s has no entry in methodRoles", n)
		}
	}
	tests := []struct {
		method string
		want   role
	}{
		{pb.ExpertService_LoadExperts_FullMethodName, roleAdmin},
		{pb.ExpertService_UnloadExperts_FullMethodName, roleAdmin},
		{pb.ExpertService_FusedMoE_FullMethodName, roleUser},
		{pb.ExpertService_FusedMoEStream_FullMethodName, roleUser},
		{pb.ExpertService_ListExperts_FullMethodName, roleUser},
		{pb.ExpertService_GetServerInfo_FullMethodName, roleUser},
		{reflectionpb.ServerReflection_ServerReflectionInfo_FullMethodName, roleUser},
		{pb.ExpertService_RegisterSharedMemory_FullMethodName, roleUser},
		{pb.ExpertService_UnregisterSharedMemory_FullMethodName, roleUser},
		{pb.ExpertService_ListSharedMemory_FullMethodName, roleUser},
		{"/expertd.v1.ExpertService/AddedLater", roleAdmin},
		{"/some.Other/Method", roleAdmin},
		// Not served: authenticated callers hear Unimplemented.
		{"/expertd.v1.ExpertService/Nope", roleUser},
	}
	served := func(m string) bool { return m != "/expertd.v1.ExpertService/Nope" }
	for _, tt := range tests {
		if got := requiredRole(tt.method, served); got != tt.want {
			t.Errorf("requiredRole(%s) = %v, want %v", tt.method, got, tt.want)
		}
	}
}

func newToken(t *testing.T) string {
	t.Helper()
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func TestParseTokens(t *testing.T) {
	user, admin := newToken(t), newToken(t)
	tests := []struct {
		name     string
		file     string
		want     []role // roles in file order
		wantErr  string
		noLeaked string // must not appear in the error
	}{
		{"two roles with comments", "# callers\n" + user + " user\n\n  " + admin + "\tadmin  \n", []role{roleUser, roleAdmin}, "", ""},
		{"unknown role", user + " root\n", nil, `line 1: role "root"`, user},
		{"missing role", "\n" + user + "\n", nil, "line 2: want `token role`", user},
		{"extra field", user + " user extra\n", nil, "line 1: want `token role`", user},
		{"short token", "hunter2 admin\n", nil, "line 1: token shorter than 16", "hunter2"},
		{"duplicate", user + " user\n" + user + " admin\n", nil, "line 2: same token as line 1", user},
		{"empty", "# nothing yet\n", nil, "no tokens", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseTokens(strings.NewReader(tt.file))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseTokens = %v, want an error containing %q", err, tt.wantErr)
				}
				if tt.noLeaked != "" && strings.Contains(err.Error(), tt.noLeaked) {
					t.Errorf("error %q echoes the token", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var roles []role
			for _, e := range got {
				roles = append(roles, e.role)
			}
			if fmt.Sprint(roles) != fmt.Sprint(tt.want) {
				t.Errorf("roles %v, want %v", roles, tt.want)
			}
		})
	}
}

func TestTokenRole(t *testing.T) {
	user, admin := newToken(t), newToken(t)
	entries, err := parseTokens(strings.NewReader(user + " user\n" + admin + " admin\n"))
	if err != nil {
		t.Fatal(err)
	}
	a := &authorizer{tokens: entries}
	tests := []struct {
		token string
		want  role
	}{
		{user, roleUser},
		{admin, roleAdmin},
		{user[:len(user)-1], roleNone},
		{user + "x", roleNone},
		{strings.ToUpper(admin), roleNone},
		{"", roleNone},
	}
	for _, tt := range tests {
		if got := a.tokenRole(tt.token); got != tt.want {
			t.Errorf("tokenRole(%d-char token) = %v, want %v", len(tt.token), got, tt.want)
		}
	}
}

// writeTokens writes a tokens file with one user and one admin token.
func writeTokens(t *testing.T) (path, user, admin string) {
	t.Helper()
	user, admin = newToken(t), newToken(t)
	path = filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("# expertd callers\n"+user+" user\n"+admin+" admin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path, user, admin
}

// inlineRequest is a small valid FusedMoE call carrying its own weights.
func inlineRequest(rng *mrand.Rand) *pb.FusedMoERequest {
	const e, k, n, m = 4, 32, 16, 3
	fp8 := pb.DataType_DATA_TYPE_FLOAT8_E4M3FN
	return &pb.FusedMoERequest{
		Experts: &pb.FusedMoERequest_Weights{Weights: &pb.ExpertWeights{
			Activation: pb.Activation_ACTIVATION_RELU2,
			W13:        tensor(fp8, randFP8(rng, e*n*k), e, n, k),
			W2:         tensor(fp8, randFP8(rng, e*k*n), e, k, n),
			W13Scale:   tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(0.001)),
			W2Scale:    tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(0.002)),
		}},
		HiddenStates: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*k)...), m, k),
		RouterLogits: tensor(pb.DataType_DATA_TYPE_FLOAT32, f32(randF32(rng, m*e)...), m, e),
		Routing:      &pb.Routing{TopK: 2, Renormalize: true},
	}
}

// TestTokenAuth runs every RPC against a daemon with -auth-tokens-file
// under each kind of caller: health needs nothing, the rest a known
// token, and unloading the admin role.
func TestTokenAuth(t *testing.T) {
	path, user, admin := writeTokens(t)
	addr, logs := startDaemon(t, "-auth-tokens-file", path)
	conn := dial(t, addr, insecure.NewCredentials())
	rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 2))

	calls := []struct {
		name string
		call func(context.Context) error
	}{
		{"Health", func(ctx context.Context) error {
			_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: pb.ExpertService_ServiceDesc.ServiceName})
			return err
		}},
		{"GetServerInfo", func(ctx context.Context) error {
			_, err := pb.NewExpertServiceClient(conn).GetServerInfo(ctx, &pb.GetServerInfoRequest{})
			return err
		}},
		{"ListExperts", func(ctx context.Context) error {
			_, err := pb.NewExpertServiceClient(conn).ListExperts(ctx, &pb.ListExpertsRequest{})
			return err
		}},
		{"FusedMoE", func(ctx context.Context) error {
			_, err := pb.NewExpertServiceClient(conn).FusedMoE(ctx, inlineRequest(rng))
			return err
		}},
		{"FusedMoEStream", func(ctx context.Context) error {
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			s, err := pb.NewExpertServiceClient(conn).FusedMoEStream(ctx)
			if err != nil {
				return err
			}
			if err := s.Send(inlineRequest(rng)); err != nil && err != io.EOF {
				return err
			}
			_, err = s.Recv()
			return err
		}},
		{"UnloadExperts", func(ctx context.Context) error {
			_, err := pb.NewExpertServiceClient(conn).UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: "absent"})
			return err
		}},
		{"unknown method", func(ctx context.Context) error {
			return conn.Invoke(ctx, "/expertd.v1.ExpertService/Nope", &pb.ListExpertsRequest{}, &pb.ListExpertsResponse{})
		}},
		{"unknown service", func(ctx context.Context) error {
			return conn.Invoke(ctx, "/nope.v1.Nope/Nope", &pb.ListExpertsRequest{}, &pb.ListExpertsResponse{})
		}},
		{"Reflection", func(ctx context.Context) error {
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			s, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
			if err != nil {
				return err
			}
			if err := s.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil && err != io.EOF {
				return err
			}
			_, err = s.Recv()
			return err
		}},
	}
	un, ok, denied, unimpl := codes.Unauthenticated, codes.OK, codes.PermissionDenied, codes.Unimplemented
	refused := []codes.Code{ok, un, un, un, un, un, un, un, un}
	tests := []struct {
		name string
		auth []string // the authorization metadata values
		// want is each call's code, in the order of calls.
		want []codes.Code
	}{
		{"no credentials", nil, refused},
		{"unknown token", []string{"Bearer " + newToken(t)}, refused},
		{"wrong scheme", []string{"Basic " + user}, refused},
		{"no scheme", []string{user}, refused},
		{"user", []string{"Bearer " + user}, []codes.Code{ok, ok, ok, ok, ok, denied, unimpl, unimpl, ok}},
		{"user, lowercase scheme", []string{"bearer " + user}, []codes.Code{ok, ok, ok, ok, ok, denied, unimpl, unimpl, ok}},
		// The admin reaches the handler, which has no set named "absent".
		{"admin", []string{"Bearer " + admin}, []codes.Code{ok, ok, ok, ok, ok, codes.NotFound, unimpl, unimpl, ok}},
		// Issue 14: with several values, none is taken on trust.
		{"valid then invalid", []string{"Bearer " + admin, "Bearer " + newToken(t)}, refused},
		{"invalid then valid", []string{"Bearer " + newToken(t), "Bearer " + admin}, refused},
		{"valid twice", []string{"Bearer " + user, "Bearer " + user}, refused},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			for _, v := range tt.auth {
				ctx = metadata.AppendToOutgoingContext(ctx, "authorization", v)
			}
			for i, c := range calls {
				err := c.call(ctx)
				if got := status.Code(err); got != tt.want[i] {
					t.Errorf("%s: %v, want %v", c.name, err, tt.want[i])
				}
				msg := status.Convert(err).Message()
				if strings.Contains(msg, user) || strings.Contains(msg, admin) {
					t.Errorf("%s: message %q echoes a token", c.name, msg)
				}
				if len(tt.auth) > 1 && status.Code(err) == un && !strings.Contains(msg, "send one authorization value") {
					t.Errorf("%s: message %q does not say to send one value", c.name, msg)
				}
			}
		})
	}
	if out := logs.String(); strings.Contains(out, user) || strings.Contains(out, admin) {
		t.Errorf("a token appears in the logs:\n%s", out)
	} else if !strings.Contains(out, `"grpc.code":"PermissionDenied"`) || !strings.Contains(out, `"grpc.code":"Unauthenticated"`) {
		t.Errorf("refused calls are not logged with their codes:\n%s", out)
	}
}

// TestTokenAuthSDK loads an expert set through the SDK's WithBearerToken:
// a user may not load or unload, an admin may, and a user may then run
// the set by name.
func TestTokenAuthSDK(t *testing.T) {
	path, user, admin := writeTokens(t)
	addr, _ := startDaemon(t, "-auth-tokens-file", path)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	dialAs := func(token string) *client.Client {
		c, err := client.Dial(ctx, addr, client.WithBearerToken(token))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	asUser, asAdmin := dialAs(user), dialAs(admin)

	rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 3))
	const e, k, n, m = 4, 32, 16, 2
	w := &client.ExpertWeights{
		Activation: moe.SiluGated,
		W13:        client.FromFP8(randFP8(rng, e*2*n*k), e, 2*n, k),
		W2:         client.FromFP8(randFP8(rng, e*k*n), e, k, n),
		W13Scale:   client.FromFloat32([]float32{0.001, 0.002, 0.003, 0.004}, e),
		W2Scale:    client.FromFloat32([]float32{0.004, 0.003, 0.002, 0.001}, e),
	}
	if _, err := asUser.LoadExperts(ctx, "layer0", w); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("LoadExperts as user: %v, want PermissionDenied", err)
	}
	if _, err := asAdmin.LoadExperts(ctx, "layer0", w); err != nil {
		t.Fatalf("LoadExperts as admin: %v", err)
	}
	res, err := asUser.FusedMoE(ctx, &client.FusedMoERequest{
		ExpertSet:    "layer0",
		Hidden:       client.FromFloat32(randF32(rng, m*k), m, k),
		RouterLogits: client.FromFloat32(randF32(rng, m*e), m, e),
		Routing:      client.Routing{TopK: 2},
		OutputDType:  moe.Float32,
	})
	if err != nil {
		t.Fatalf("FusedMoE as user: %v", err)
	}
	if got, err := res.Output.Float32s(); err != nil || len(got) != m*k {
		t.Errorf("FusedMoE output: %d values, %v; want %d", len(got), err, m*k)
	}
	if _, err := asUser.UnloadExperts(ctx, "layer0"); status.Code(err) != codes.PermissionDenied {
		t.Errorf("UnloadExperts as user: %v, want PermissionDenied", err)
	}
	if _, err := asAdmin.UnloadExperts(ctx, "layer0"); err != nil {
		t.Errorf("UnloadExperts as admin: %v", err)
	}
}

// TestNoAuthUnchanged checks a daemon without security flags still takes
// calls without credentials, LoadExperts included.
func TestNoAuthUnchanged(t *testing.T) {
	addr, _ := startDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	_, err := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials())).UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: "absent"})
	if got := status.Code(err); got != codes.NotFound {
		t.Errorf("UnloadExperts without auth configured: %v, want NotFound from the handler", err)
	}
}

// TestSecurityWarnings checks the loud warnings: a listener reachable
// from other hosts with no protection, tokens in plaintext to one, and a
// configuration where nobody is admin, and a tokens file others can read.
func TestSecurityWarnings(t *testing.T) {
	userOnly := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(userOnly, []byte(newToken(t)+" user\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	withAdmin, _, _ := writeTokens(t)
	loose, _, _ := writeTokens(t)
	if err := os.Chmod(loose, 0o644); err != nil {
		t.Fatal(err)
	}
	const (
		open      = "reachable from other hosts with neither TLS nor authorization"
		plaintext = "bearer tokens travel in plaintext"
		noAdmin   = "no caller has the admin role"
		readable  = "the tokens file is readable or writable by group or others"
	)
	tests := []struct {
		name      string
		args      []string
		want, not []string
	}{
		{"loopback, nothing set", nil, nil, []string{open, plaintext, noAdmin, readable}},
		{"all interfaces, nothing set", []string{"-listen", "0.0.0.0:0"}, []string{open}, []string{plaintext}},
		{"all interfaces, tokens without TLS", []string{"-listen", "0.0.0.0:0", "-auth-tokens-file", withAdmin}, []string{plaintext}, []string{open, noAdmin}},
		{"loopback, user tokens only", []string{"-auth-tokens-file", userOnly}, []string{noAdmin}, []string{open, plaintext, readable}},
		{"tokens file mode 644", []string{"-auth-tokens-file", loose}, []string{readable, "-rw-r--r--"}, []string{open, plaintext, noAdmin}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, logs := startDaemon(t, tt.args...)
			out := logs.String()
			for _, w := range tt.want {
				if !strings.Contains(out, w) {
					t.Errorf("logs lack %q:\n%s", w, out)
				}
			}
			for _, w := range tt.not {
				if strings.Contains(out, w) {
					t.Errorf("logs have %q:\n%s", w, out)
				}
			}
		})
	}
}

// TestPayloadsNotLogged sends a call whose hidden states spell a marker
// and checks that, even at debug level, neither the marker (raw, base64
// or hex) nor the token reaches the log, while the call itself is logged.
func TestPayloadsNotLogged(t *testing.T) {
	path, user, _ := writeTokens(t)
	addr, logs := startDaemon(t, "-auth-tokens-file", path, "-log-level", "debug")
	const marker = "PAYLOADMARKERXYZ" // 16 bytes: four finite float32s
	req := inlineRequest(mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 4)))
	copy(req.HiddenStates.GetData(), marker)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+user)
	if _, err := pb.NewExpertServiceClient(dial(t, addr, insecure.NewCredentials())).FusedMoE(ctx, req); err != nil {
		t.Fatalf("FusedMoE: %v", err)
	}
	out := logs.String()
	if !strings.Contains(out, `"grpc.method":"FusedMoE"`) {
		t.Fatalf("the call was not logged, so the check below proves nothing:\n%s", out)
	}
	for _, secret := range []string{marker, base64.StdEncoding.EncodeToString([]byte(marker))[:20], hex.EncodeToString([]byte(marker)), user} {
		if strings.Contains(out, secret) {
			t.Errorf("logs contain %q:\n%s", secret, out)
		}
	}
}

// TestLogLinesBounded sends the issue 14 probe's strings (a 1 MiB
// expert_set, a 1 MiB header.name, a 64 KiB unknown method name) and
// checks each call is answered with a short status and logged on a short
// line.
func TestLogLinesBounded(t *testing.T) {
	path, user, admin := writeTokens(t)
	addr, logs := startDaemon(t, "-auth-tokens-file", path)
	conn := dial(t, addr, insecure.NewCredentials(), grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
	c := pb.NewExpertServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	mib := strings.Repeat("a", 1<<20)
	req := inlineRequest(mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 5)))
	req.Experts = &pb.FusedMoERequest_ExpertSet{ExpertSet: mib}
	calls := []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"FusedMoE 1 MiB expert_set", func() error {
			_, err := c.FusedMoE(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+user), req)
			return err
		}, codes.InvalidArgument},
		{"LoadExperts 1 MiB header.name", func() error {
			s, err := c.LoadExperts(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+admin))
			if err != nil {
				return err
			}
			s.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Header_{Header: &pb.LoadExpertsRequest_Header{Name: mib}}}) //nolint:errcheck // the answer says
			_, err = s.CloseAndRecv()
			return err
		}, codes.InvalidArgument},
		{"64 KiB unknown method", func() error {
			return conn.Invoke(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+user), "/x/"+strings.Repeat("m", 64<<10), &pb.ListExpertsRequest{}, &pb.ListExpertsResponse{})
		}, codes.Unimplemented},
	}
	for _, tt := range calls {
		err := tt.call()
		if got, msg := status.Code(err), status.Convert(err).Message(); got != tt.want || len(msg) > 1024 {
			t.Errorf("%s: %v with a %d-byte message, want %v with at most 1024", tt.name, got, len(msg), tt.want)
		}
	}
	out := logs.String()
	for _, line := range strings.Split(out, "\n") {
		if len(line) > 8<<10 {
			t.Errorf("a log line of %d bytes: %.300s...", len(line), line)
		}
	}
	if !strings.Contains(out, `"grpc.code":"InvalidArgument"`) || !strings.Contains(out, `"grpc.code":"Unimplemented"`) {
		t.Errorf("the refused calls are not logged with their codes")
	}
}

// TestOversizedLogged: a unary request over -max-message-bytes is refused
// by grpc-go before any interceptor, so the call log cannot see it; the
// daemon still logs it, with the method and what to do.
func TestOversizedLogged(t *testing.T) {
	addr, logs := startDaemon(t, "-max-message-bytes", "1MiB")
	conn := dial(t, addr, insecure.NewCredentials(), grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	defer cancel()
	req := inlineRequest(mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 6)))
	req.HiddenStates.Source = &pb.Tensor_Data{Data: make([]byte, 2<<20)}
	_, err := pb.NewExpertServiceClient(conn).FusedMoE(ctx, req)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a 2 MiB FusedMoE: %v, want ResourceExhausted", err)
	}
	// The stats handler logs after the status is sent.
	if err := logs.WaitFor(ctx, func(log string) bool { return strings.Contains(log, "call refused before its handler") }); err != nil {
		t.Fatalf("waiting for the refusal's log: %v\n%s", err, logs.String())
	}
	out := logs.String()
	for _, want := range []string{`"msg":"call refused before its handler"`, `"grpc.method":"/expertd.v1.ExpertService/FusedMoE"`, `"grpc.code":"ResourceExhausted"`, "-max-message-bytes"} {
		if !strings.Contains(out, want) {
			t.Errorf("the log lacks %s:\n%s", want, out)
		}
	}
}
