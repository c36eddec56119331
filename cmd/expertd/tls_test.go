package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/service/servicetest"
)

// testCA is a throwaway certificate authority living in a test's temp dir.
type testCA struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	pemPath string
	dir     string
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	ca := &testCA{cert: cert, key: key, dir: dir, pemPath: filepath.Join(dir, name+"-ca.pem")}
	writePEM(t, ca.pemPath, "CERTIFICATE", der)
	return ca
}

func serial(t *testing.T) *big.Int {
	n, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// leaf is an issued certificate: its files and the tls.Certificate.
type leaf struct {
	certPath, keyPath string
	tls               tls.Certificate
}

// issue signs a certificate for cn; server certificates name 127.0.0.1
// and localhost, client ones carry the given URI SANs.
func (ca *testCA) issue(t *testing.T, cn string, server bool, uris ...string) leaf {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
		tmpl.DNSNames = []string{"localhost"}
	}
	for _, u := range uris {
		pu, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = append(tmpl.URIs, pu)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	l := leaf{certPath: filepath.Join(ca.dir, cn+".pem"), keyPath: filepath.Join(ca.dir, cn+"-key.pem")}
	writePEM(t, l.certPath, "CERTIFICATE", der)
	writePEM(t, l.keyPath, "EC PRIVATE KEY", keyDER)
	if l.tls, err = tls.LoadX509KeyPair(l.certPath, l.keyPath); err != nil {
		t.Fatal(err)
	}
	return l
}

// pool trusts only ca.
func (ca *testCA) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// startDaemon runs the real daemon on 127.0.0.1:0 with args added and
// stops it when the test ends.
func startDaemon(t *testing.T, args ...string) (string, *servicetest.LogBuffer) {
	t.Helper()
	addrs, logs := startDaemonAddrs(t, args...)
	return addrs.grpc, logs
}

// startDaemonAddrs is startDaemon returning both addresses (pass
// -admin-addr 127.0.0.1:0 to serve /metrics).
func startDaemonAddrs(t *testing.T, args ...string) (listening, *servicetest.LogBuffer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logs := &servicetest.LogBuffer{}
	ready := make(chan listening, 1)
	done := make(chan error, 1)
	args = append([]string{"-listen", "127.0.0.1:0", "-admin-addr", "", "-backend", "cpu", "-threads", "2", "-log-format", "json"}, args...)
	go func() { done <- run(ctx, args, func(string) string { return "" }, logs, ready) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(defaultTestTimeout):
			t.Error("daemon did not stop")
		}
	})
	select {
	case a := <-ready:
		return a, logs
	case err := <-done:
		t.Fatalf("run exited early: %v\n%s", err, logs.String())
	case <-time.After(defaultTestTimeout):
		t.Fatal("daemon not ready")
	}
	return listening{}, nil
}

// dial connects with creds; calls fail, not Dial, when the handshake does.
func dial(t *testing.T, addr string, creds credentials.TransportCredentials, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestTLS checks a TLS daemon serves clients that trust its CA over TLS
// 1.3 (and 1.2), and refuses plaintext, TLS 1.1 and clients trusting
// another CA.
func TestTLS(t *testing.T) {
	ca, other := newTestCA(t, "expertd-test"), newTestCA(t, "other")
	srv := ca.issue(t, "expertd-server", true)
	addr, _ := startDaemon(t, "-tls-cert", srv.certPath, "-tls-key", srv.keyPath)

	tests := []struct {
		name        string
		creds       credentials.TransportCredentials
		wantCode    codes.Code
		wantVersion uint16
	}{
		{"tls 1.3", credentials.NewTLS(&tls.Config{RootCAs: ca.pool()}), codes.OK, tls.VersionTLS13},
		{"tls 1.2", credentials.NewTLS(&tls.Config{RootCAs: ca.pool(), MaxVersion: tls.VersionTLS12}), codes.OK, tls.VersionTLS12},
		{"tls 1.1", credentials.NewTLS(&tls.Config{RootCAs: ca.pool(), MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11}), codes.Unavailable, 0},
		{"plaintext", insecure.NewCredentials(), codes.Unavailable, 0},
		{"untrusted server", credentials.NewTLS(&tls.Config{RootCAs: other.pool()}), codes.Unavailable, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			var p peer.Peer
			_, err := pb.NewExpertServiceClient(dial(t, addr, tt.creds)).GetServerInfo(ctx, &pb.GetServerInfoRequest{}, grpc.Peer(&p))
			if got := status.Code(err); got != tt.wantCode {
				t.Fatalf("GetServerInfo: %v, want code %v", err, tt.wantCode)
			}
			if tt.wantVersion != 0 {
				if got := tlsVersion(&p); got != tt.wantVersion {
					t.Errorf("TLS version %s, want %s", tls.VersionName(got), tls.VersionName(tt.wantVersion))
				}
			}
		})
	}
}

// TestMutualTLS checks -tls-client-ca: clients without a certificate or
// with one from another CA never get a call through (health included);
// a verified certificate is a user, and one named in -admin-identities by
// its CN or a URI SAN is an admin.
func TestMutualTLS(t *testing.T) {
	ca, other := newTestCA(t, "expertd-test"), newTestCA(t, "other")
	srv := ca.issue(t, "expertd-server", true)
	const spiffe = "spiffe://example.org/loader"
	tokens, userToken, adminToken := writeTokens(t)
	addr, logs := startDaemon(t, "-tls-cert", srv.certPath, "-tls-key", srv.keyPath, "-tls-client-ca", ca.pemPath,
		"-admin-identities", "ops-admin, "+spiffe, "-auth-tokens-file", tokens)

	clientCreds := func(certs ...tls.Certificate) credentials.TransportCredentials {
		return credentials.NewTLS(&tls.Config{RootCAs: ca.pool(), Certificates: certs})
	}
	user := ca.issue(t, "inference-user", false)
	adminCN := ca.issue(t, "ops-admin", false)
	adminURI := ca.issue(t, "loader-7", false, spiffe)
	// Same CN as an admin, but signed by a CA the daemon does not trust.
	forged := other.issue(t, "ops-admin", false)

	tests := []struct {
		name                   string
		creds                  credentials.TransportCredentials
		token                  string // bearer token sent beside the certificate, if any
		wantHealth, wantInfo   codes.Code
		wantUnload             codes.Code
		wantMessageMentionsErr string
	}{
		{"no client certificate", clientCreds(), "", codes.Unavailable, codes.Unavailable, codes.Unavailable, ""},
		{"no client certificate, admin token", clientCreds(), adminToken, codes.Unavailable, codes.Unavailable, codes.Unavailable, ""},
		{"certificate from another CA", clientCreds(forged.tls), "", codes.Unavailable, codes.Unavailable, codes.Unavailable, ""},
		{"user certificate", clientCreds(user.tls), "", codes.OK, codes.OK, codes.PermissionDenied, "needs the admin role"},
		{"user certificate, user token", clientCreds(user.tls), userToken, codes.OK, codes.OK, codes.PermissionDenied, "needs the admin role"},
		// An admin unloading a set that is not there reaches the handler:
		// NotFound, not PermissionDenied.
		{"user certificate, admin token", clientCreds(user.tls), adminToken, codes.OK, codes.OK, codes.NotFound, ""},
		{"user certificate, unknown token", clientCreds(user.tls), newToken(t), codes.OK, codes.Unauthenticated, codes.Unauthenticated, "not recognized"},
		{"admin by CN", clientCreds(adminCN.tls), "", codes.OK, codes.OK, codes.NotFound, ""},
		{"admin by URI SAN", clientCreds(adminURI.tls), "", codes.OK, codes.OK, codes.NotFound, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
			defer cancel()
			if tt.token != "" {
				ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tt.token)
			}
			conn := dial(t, addr, tt.creds)
			_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
			if got := status.Code(err); got != tt.wantHealth {
				t.Errorf("health: %v, want %v", err, tt.wantHealth)
			}
			c := pb.NewExpertServiceClient(conn)
			_, err = c.GetServerInfo(ctx, &pb.GetServerInfoRequest{})
			if got := status.Code(err); got != tt.wantInfo {
				t.Errorf("GetServerInfo: %v, want %v", err, tt.wantInfo)
			}
			_, err = c.UnloadExperts(ctx, &pb.UnloadExpertsRequest{Name: "absent"})
			if got := status.Code(err); got != tt.wantUnload {
				t.Errorf("UnloadExperts: %v, want %v", err, tt.wantUnload)
			}
			if tt.wantMessageMentionsErr != "" && !strings.Contains(status.Convert(err).Message(), tt.wantMessageMentionsErr) {
				t.Errorf("UnloadExperts message %q lacks %q", status.Convert(err).Message(), tt.wantMessageMentionsErr)
			}
		})
	}
	if out := logs.String(); !strings.Contains(out, `"mtls":true`) {
		t.Errorf("logs lack the security posture line:\n%s", out)
	}
}

// tlsVersion is the TLS version a call's connection negotiated, 0 for none.
func tlsVersion(p *peer.Peer) uint16 {
	if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok {
		return ti.State.Version
	}
	return 0
}

func TestConfigSecurityErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"cert without key", []string{"-tls-cert", "c.pem"}, "-tls-key is not"},
		{"key without cert", []string{"-tls-key", "k.pem"}, "-tls-cert is not"},
		{"client CA without TLS", []string{"-tls-client-ca", "ca.pem"}, "-tls-client-ca needs -tls-cert"},
		{"admin identities without mTLS", []string{"-admin-identities", "ops"}, "-admin-identities needs -tls-client-ca"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig(tt.args, func(string) string { return "" }, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("parseConfig(%q) = %v, want an error containing %q", tt.args, err, tt.want)
			}
		})
	}
}

// TestSecurityFileErrors checks unreadable certificates, CA bundles and
// token files stop the daemon before it listens, naming the flag.
func TestSecurityFileErrors(t *testing.T) {
	ca := newTestCA(t, "expertd-test")
	srv := ca.issue(t, "expertd-server", true)
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"missing cert", Config{TLSCert: filepath.Join(dir, "absent.pem"), TLSKey: srv.keyPath}, "-tls-cert"},
		{"key of another cert", Config{TLSCert: srv.certPath, TLSKey: ca.issue(t, "x", true).keyPath}, "-tls-key"},
		{"client CA not PEM", Config{TLSCert: srv.certPath, TLSKey: srv.keyPath, TLSClientCA: notPEM}, "-tls-client-ca"},
		{"missing client CA", Config{TLSCert: srv.certPath, TLSKey: srv.keyPath, TLSClientCA: filepath.Join(dir, "absent.pem")}, "-tls-client-ca"},
		{"missing tokens file", Config{AuthTokensFile: filepath.Join(dir, "absent")}, "-auth-tokens-file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := newSecurity(tt.cfg); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("newSecurity = %v, want an error naming %s", err, tt.want)
			}
		})
	}
}

func TestCertIdentities(t *testing.T) {
	ca := newTestCA(t, "expertd-test")
	l := ca.issue(t, "loader", false, "spiffe://example.org/a")
	cert, err := x509.ParseCertificate(l.tls.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	got, want := strings.Join(certIdentities(cert), ","), "loader,spiffe://example.org/a"
	if got != want {
		t.Errorf("certIdentities = %q, want %q", got, want)
	}
}

// TestParseSecurityConfig checks the security flags and variables land in
// Config, the identity list split and trimmed.
func TestParseSecurityConfig(t *testing.T) {
	env := map[string]string{"EXPERTD_TLS_CERT": "/c.pem", "EXPERTD_TLS_KEY": "/k.pem", "EXPERTD_ADMIN_IDENTITIES": " ops , spiffe://x/y ,,"}
	got, err := parseConfig([]string{"-tls-client-ca", "/ca.pem", "-auth-tokens-file", "/tokens"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{TLSCert: "/c.pem", TLSKey: "/k.pem", TLSClientCA: "/ca.pem", AuthTokensFile: "/tokens", AdminIdentities: []string{"ops", "spiffe://x/y"}}
	if got.TLSCert != want.TLSCert || got.TLSKey != want.TLSKey || got.TLSClientCA != want.TLSClientCA ||
		got.AuthTokensFile != want.AuthTokensFile || strings.Join(got.AdminIdentities, "|") != strings.Join(want.AdminIdentities, "|") {
		t.Errorf("security config = %+v, want %+v", got, want)
	}
}
