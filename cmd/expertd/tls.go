package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"

	"google.golang.org/grpc/credentials"

	"github.com/expertd/expertd/internal/pemfile"
)

// serverTLS builds the listener's TLS configuration from -tls-cert,
// -tls-key and -tls-client-ca, or returns nil for plaintext. With a client
// CA every connection must present a certificate that chains to it, so an
// unverified caller never reaches a handler, health checks included.
func (c Config) serverTLS() (*tls.Config, error) {
	if c.TLSCert == "" {
		return nil, nil
	}
	cert, err := pemfile.KeyPair(c.TLSCert, c.TLSKey)
	if err != nil {
		return nil, fmt.Errorf("-tls-cert %s, -tls-key %s: %w", c.TLSCert, c.TLSKey, err)
	}
	tc := &tls.Config{
		Certificates: []tls.Certificate{cert},
		// 1.2 still serves older clients; Go negotiates 1.3 whenever the
		// client offers it, and its 1.2 cipher suites are all AEAD.
		MinVersion: tls.VersionTLS12,
	}
	if c.TLSClientCA != "" {
		pool, err := pemfile.CertPool(c.TLSClientCA)
		if err != nil {
			return nil, fmt.Errorf("-tls-client-ca %s: %w", c.TLSClientCA, err)
		}
		tc.ClientCAs = pool
		tc.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return tc, nil
}

// serverCredentials is serverTLS as gRPC transport credentials, nil for
// plaintext. credentials.NewTLS adds the h2 ALPN protocol gRPC requires.
func (c Config) serverCredentials() (credentials.TransportCredentials, error) {
	tc, err := c.serverTLS()
	if err != nil || tc == nil {
		return nil, err
	}
	return credentials.NewTLS(tc), nil
}

// certIdentities are the names a verified client certificate proves: its
// subject common name and every subject alternative name (DNS, e-mail,
// URI such as a SPIFFE ID, IP). -admin-identities matches any of them.
func certIdentities(cert *x509.Certificate) []string {
	var ids []string
	if cert.Subject.CommonName != "" {
		ids = append(ids, cert.Subject.CommonName)
	}
	ids = append(ids, cert.DNSNames...)
	ids = append(ids, cert.EmailAddresses...)
	for _, u := range cert.URIs {
		ids = append(ids, u.String())
	}
	for _, ip := range cert.IPAddresses {
		ids = append(ids, ip.String())
	}
	return ids
}

// isLoopback reports whether a bound address is reachable only from this
// host: a loopback IP or a Unix socket. The unspecified address
// (":50051", "0.0.0.0") is not.
func isLoopback(addr net.Addr) bool {
	switch a := addr.(type) {
	case *net.TCPAddr:
		return a.IP.IsLoopback()
	case *net.UnixAddr:
		return true
	}
	return false
}

// validateSecurity checks the TLS and authorization flags go together;
// the files themselves are read by newSecurity.
func (c Config) validateSecurity() []error {
	var errs []error
	if c.TLSCert != "" && c.TLSKey == "" {
		errs = append(errs, errors.New("-tls-cert is set but -tls-key is not: TLS needs both"))
	}
	if c.TLSKey != "" && c.TLSCert == "" {
		errs = append(errs, errors.New("-tls-key is set but -tls-cert is not: TLS needs both"))
	}
	if c.TLSClientCA != "" && c.TLSCert == "" {
		errs = append(errs, errors.New("-tls-client-ca needs -tls-cert and -tls-key: mutual TLS runs over TLS"))
	}
	if len(c.AdminIdentities) > 0 && c.TLSClientCA == "" {
		errs = append(errs, errors.New("-admin-identities needs -tls-client-ca: identities come from verified client certificates"))
	}
	return errs
}
