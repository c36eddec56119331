// Package cliflags holds the command-line flags that expertd's client
// commands (expertd-load, expertbench) share: where the daemon is and how
// to authenticate to it. It sits outside client/ so the SDK keeps its
// dependencies to the wire contract.
package cliflags

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc/credentials"

	"github.com/expertd/expertd/client"
)

// Dial is the daemon's address and the client's TLS and bearer-token
// settings.
type Dial struct {
	Addr       string
	TLSCA      string
	TLSCert    string
	TLSKey     string
	ServerName string
	TokenFile  string
}

// Register adds -addr (default addr), -tls-ca, -tls-cert, -tls-key,
// -server-name and -token-file to fs. tokenUsage says what the command's
// token is for (the role its RPCs need).
func (d *Dial) Register(fs *flag.FlagSet, addr, tokenUsage string) {
	fs.StringVar(&d.Addr, "addr", addr, "expertd gRPC address: host:port, or unix:///path for a Unix socket")
	fs.StringVar(&d.TLSCA, "tls-ca", "", "PEM roots to verify the daemon's certificate (turns TLS on)")
	fs.StringVar(&d.TLSCert, "tls-cert", "", "client certificate for mutual TLS (PEM; turns TLS on)")
	fs.StringVar(&d.TLSKey, "tls-key", "", "client key for mutual TLS (PEM)")
	fs.StringVar(&d.ServerName, "server-name", "", "name to verify in the daemon's certificate (default: the host of -addr)")
	fs.StringVar(&d.TokenFile, "token-file", "", tokenUsage)
}

// Check reports flag combinations that cannot work.
func (d *Dial) Check() error {
	if (d.TLSCert == "") != (d.TLSKey == "") {
		return errors.New("-tls-cert and -tls-key go together")
	}
	if d.ServerName != "" && !d.tls() {
		return errors.New("-server-name needs TLS (-tls-ca or -tls-cert)")
	}
	return nil
}

func (d *Dial) tls() bool { return d.TLSCA != "" || d.TLSCert != "" }

// Options reads the files the flags name and returns the client options
// they make: TLS credentials, a bearer token.
func (d *Dial) Options() ([]client.Option, error) {
	if err := d.Check(); err != nil {
		return nil, err
	}
	var opts []client.Option
	if d.tls() {
		tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: d.ServerName}
		if d.TLSCA != "" {
			pem, err := os.ReadFile(d.TLSCA)
			if err != nil {
				return nil, fmt.Errorf("-tls-ca: %w", err)
			}
			tc.RootCAs = x509.NewCertPool()
			if !tc.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("-tls-ca %s holds no PEM certificate", d.TLSCA)
			}
		}
		if d.TLSCert != "" {
			cert, err := tls.LoadX509KeyPair(d.TLSCert, d.TLSKey)
			if err != nil {
				return nil, fmt.Errorf("-tls-cert, -tls-key: %w", err)
			}
			tc.Certificates = []tls.Certificate{cert}
		}
		opts = append(opts, client.WithTransportCredentials(credentials.NewTLS(tc)))
	}
	if d.TokenFile != "" {
		b, err := os.ReadFile(d.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("-token-file: %w", err)
		}
		tok := strings.TrimSpace(string(b))
		if tok == "" {
			return nil, fmt.Errorf("-token-file %s is empty", d.TokenFile)
		}
		opts = append(opts, client.WithBearerToken(tok))
	}
	return opts, nil
}
