package cliflags

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/expertd/expertd/internal/clitest"
)

// writePair writes a self-signed certificate and its key as PEM files.
func writePair(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "expertd"},
		DNSNames: []string{"expertd"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	write(t, certFile, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})))
	write(t, keyFile, string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})))
	return certFile, keyFile
}

func write(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

func parse(t *testing.T, args ...string) (*Dial, error) {
	t.Helper()
	var d Dial
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	d.Register(fs, "localhost:1", "token", time.Minute, "each call")
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return &d, d.Check()
}

func TestDialFlags(t *testing.T) {
	dir := t.TempDir()
	cert, key := writePair(t, dir)
	token := filepath.Join(dir, "token")
	write(t, token, "  secret\n")
	empty := filepath.Join(dir, "empty")
	write(t, empty, "\n")
	notPEM := filepath.Join(dir, "not.pem")
	write(t, notPEM, "hello")
	// A sparse file far over every cap: reading it whole would take
	// seconds and gigabytes.
	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(big, 4<<30); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name    string
		args    []string
		check   string // Check's error, "" for none
		options string // Options' error, "" for none
		n       int    // options on success
	}{
		{name: "plaintext", n: 0},
		{name: "ca", args: []string{"-tls-ca", cert, "-server-name", "expertd"}, n: 1},
		{name: "mtls and token", args: []string{"-tls-ca", cert, "-tls-cert", cert, "-tls-key", key, "-token-file", token}, n: 2},
		{name: "token alone", args: []string{"-token-file", token}, n: 1},
		{name: "cert without key", args: []string{"-tls-cert", cert}, check: "-tls-cert and -tls-key go together"},
		{name: "server name without tls", args: []string{"-server-name", "x"}, check: "-server-name needs TLS"},
		{name: "ca not pem", args: []string{"-tls-ca", notPEM}, options: "no PEM certificate"},
		{name: "ca missing", args: []string{"-tls-ca", filepath.Join(dir, "nope")}, options: "-tls-ca "},
		{name: "key mismatch", args: []string{"-tls-cert", cert, "-tls-key", cert}, options: "-tls-cert, -tls-key:"},
		{name: "empty token", args: []string{"-token-file", empty}, options: "is empty"},
		{name: "token directory", args: []string{"-token-file", dir}, options: "not a regular file (a directory)"},
		{name: "token too large", args: []string{"-token-file", big}, options: "over the size cap"},
		{name: "ca too large", args: []string{"-tls-ca", big}, options: "over the size cap"},
		{name: "zero timeout", args: []string{"-timeout", "0s"}, check: "-timeout 0s: want > 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := parse(t, tc.args...)
			if tc.check != "" {
				if err == nil || !strings.Contains(err.Error(), tc.check) {
					t.Fatalf("Check() = %v, want an error with %q", err, tc.check)
				}
				return
			}
			if err != nil {
				t.Fatalf("Check() = %v", err)
			}
			opts, err := d.Options()
			if tc.options != "" {
				if err == nil || !strings.Contains(err.Error(), tc.options) {
					t.Fatalf("Options() = %v, want an error with %q", err, tc.options)
				}
				return
			}
			if err != nil || len(opts) != tc.n {
				t.Fatalf("Options() = %d options, %v; want %d", len(opts), err, tc.n)
			}
		})
	}
}

// TestConnectTimeout: a dial to a port nobody listens on, or to a peer
// that accepts TCP and never speaks HTTP/2, ends after -timeout with an
// error naming it.
func TestConnectTimeout(t *testing.T) {
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr().String()
	closed.Close()
	for _, addr := range []string{clitest.SilentPeer(t), closedAddr} {
		d, err := parse(t, "-addr", addr, "-timeout", "200ms")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			c, err := d.Connect(context.Background())
			if err == nil {
				c.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), "within -timeout 200ms") {
				t.Errorf("Connect(%s) = %v, want an error naming -timeout", addr, err)
			}
		case <-time.After(time.Minute):
			t.Fatalf("Connect(%s) still waiting a minute past -timeout 200ms", addr)
		}
	}
}
