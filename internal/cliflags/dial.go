// Package cliflags holds the command-line flags that expertd's client
// commands (expertd-load, expertbench) share: where the daemon is and how
// to authenticate to it. It sits outside client/ so the SDK keeps its
// dependencies to the wire contract.
package cliflags

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/internal/capfile"
	"github.com/expertd/expertd/internal/pemfile"
)

// maxTokenFileBytes bounds -token-file: a token is a line.
const maxTokenFileBytes = 64 << 10

// Dial is the daemon's address and the client's TLS and bearer-token
// settings.
type Dial struct {
	Addr       string
	TLSCA      string
	TLSCert    string
	TLSKey     string
	ServerName string
	TokenFile  string
	// Timeout bounds the dial and each call (-timeout): a daemon that is
	// down, or a peer that accepts connections and never answers, ends
	// the command with an error instead of holding it.
	Timeout time.Duration
}

// Register adds -addr (default addr), -tls-ca, -tls-cert, -tls-key,
// -server-name, -token-file and -timeout (default timeout) to fs.
// tokenUsage says what the command's token is for (the role its RPCs
// need), timeoutUsage what one of its calls is.
func (d *Dial) Register(fs *flag.FlagSet, addr, tokenUsage string, timeout time.Duration, timeoutUsage string) {
	fs.StringVar(&d.Addr, "addr", addr, "expertd gRPC address: host:port, or unix:///path for a Unix socket")
	fs.StringVar(&d.TLSCA, "tls-ca", "", "PEM roots to verify the daemon's certificate (turns TLS on)")
	fs.StringVar(&d.TLSCert, "tls-cert", "", "client certificate for mutual TLS (PEM; turns TLS on)")
	fs.StringVar(&d.TLSKey, "tls-key", "", "client key for mutual TLS (PEM)")
	fs.StringVar(&d.ServerName, "server-name", "", "name to verify in the daemon's certificate (default: the host of -addr)")
	fs.StringVar(&d.TokenFile, "token-file", "", tokenUsage)
	fs.DurationVar(&d.Timeout, "timeout", timeout, "deadline of the connection to the daemon and of "+timeoutUsage)
}

// Check reports flag combinations that cannot work.
func (d *Dial) Check() error {
	if (d.TLSCert == "") != (d.TLSKey == "") {
		return errors.New("-tls-cert and -tls-key go together")
	}
	if d.ServerName != "" && !d.tls() {
		return errors.New("-server-name needs TLS (-tls-ca or -tls-cert)")
	}
	if d.Timeout <= 0 {
		return fmt.Errorf("-timeout %v: want > 0", d.Timeout)
	}
	return nil
}

// Connect reads the files the flags name and dials the daemon, waiting at
// most -timeout for the connection; extra options follow the flags'.
func (d *Dial) Connect(ctx context.Context, extra ...client.Option) (*client.Client, error) {
	opts, err := d.Options()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, d.Timeout)
	defer cancel()
	c, err := client.Dial(ctx, d.Addr, append(opts, extra...)...)
	if err != nil {
		return nil, fmt.Errorf("no connection to %s within -timeout %v: %w", d.Addr, d.Timeout, err)
	}
	return c, nil
}

// Call is ctx with the deadline of one call, -timeout from now.
func (d *Dial) Call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.Timeout)
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
			pool, err := pemfile.CertPool(d.TLSCA)
			if err != nil {
				return nil, fmt.Errorf("-tls-ca %s: %w", d.TLSCA, err)
			}
			tc.RootCAs = pool
		}
		if d.TLSCert != "" {
			cert, err := pemfile.KeyPair(d.TLSCert, d.TLSKey)
			if err != nil {
				return nil, fmt.Errorf("-tls-cert, -tls-key: %w", err)
			}
			tc.Certificates = []tls.Certificate{cert}
		}
		opts = append(opts, client.WithTransportCredentials(credentials.NewTLS(tc)))
	}
	if d.TokenFile != "" {
		b, err := capfile.ReadAll(d.TokenFile, maxTokenFileBytes)
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
