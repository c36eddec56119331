package cliflags

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"io"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
	d.Register(fs, "localhost:1", "token")
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
		{name: "ca not pem", args: []string{"-tls-ca", notPEM}, options: "holds no PEM certificate"},
		{name: "ca missing", args: []string{"-tls-ca", filepath.Join(dir, "nope")}, options: "-tls-ca:"},
		{name: "key mismatch", args: []string{"-tls-cert", cert, "-tls-key", cert}, options: "-tls-cert, -tls-key:"},
		{name: "empty token", args: []string{"-token-file", empty}, options: "is empty"},
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
