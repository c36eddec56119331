// Package pemfile reads the PEM files of TLS flags, the daemon's and the
// client commands' alike, through capfile: a certificate, key or CA bundle
// is a regular file of at most MaxBytes.
package pemfile

import (
	"crypto/tls"
	"crypto/x509"
	"errors"

	"github.com/expertd/expertd/internal/capfile"
)

// MaxBytes bounds one PEM file: a CA bundle of the whole public web is
// about 250 KiB.
const MaxBytes = 4 << 20

// KeyPair reads a certificate (chain) and its private key.
func KeyPair(certFile, keyFile string) (tls.Certificate, error) {
	cert, err := capfile.ReadAll(certFile, MaxBytes)
	if err != nil {
		return tls.Certificate{}, err
	}
	key, err := capfile.ReadAll(keyFile, MaxBytes)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(cert, key)
}

// CertPool reads a bundle of CA certificates.
func CertPool(file string) (*x509.CertPool, error) {
	b, err := capfile.ReadAll(file, MaxBytes)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, errors.New("no PEM certificate in the file")
	}
	return pool, nil
}
