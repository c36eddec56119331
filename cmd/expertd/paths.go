package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/expertd/expertd/internal/capfile"
	"github.com/expertd/expertd/internal/pemfile"
)

// Caps on the files the daemon reads by flag, each far above a real one.
const (
	// maxManifestBytes: a manifest is a few lines per set.
	maxManifestBytes = 4 << 20
	// maxTokensFileBytes: a tokens file is a line per client.
	maxTokensFileBytes = 4 << 20
	// maxLibraryBytes: the CUDA kernel library with its fat binaries is
	// tens of megabytes.
	maxLibraryBytes = 4 << 30
)

// checkPaths checks, before anything starts, that every path flag names
// what it should: an existing, readable directory or regular file (of at
// most its cap), so a typo is a one-line error naming the flag at start
// instead of a failure at the first load, a hang on a FIFO, or a
// gigabyte read.
func (c Config) checkPaths() error {
	var errs []error
	file := func(flag, path string, max int64) {
		if path == "" {
			return
		}
		f, err := capfile.Open(path, max)
		if err != nil {
			errs = append(errs, fmt.Errorf("-%s: %w", flag, err))
			return
		}
		f.Close()
	}
	if c.WeightsDir != "" {
		if err := checkDir(c.WeightsDir, true); err != nil {
			errs = append(errs, fmt.Errorf("-weights-dir: %w", err))
		}
	}
	file("manifest", c.Manifest, maxManifestBytes)
	file("auth-tokens-file", c.AuthTokensFile, maxTokensFileBytes)
	file("tls-cert", c.TLSCert, pemfile.MaxBytes)
	file("tls-key", c.TLSKey, pemfile.MaxBytes)
	file("tls-client-ca", c.TLSClientCA, pemfile.MaxBytes)
	file("library-path", c.Kernels.LibraryPath, maxLibraryBytes)
	if network, address, err := listenAddress(c.Listen); err == nil && network == "unix" {
		if err := checkDir(filepath.Dir(address), false); err != nil {
			errs = append(errs, fmt.Errorf("-listen %s: the socket's directory: %w", c.Listen, err))
		}
	}
	return errors.Join(errs...)
}

// checkDir reports whether path is a directory this process can open and,
// with list, read the entries of.
func checkDir(path string, list bool) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("%s: not a directory", path)
	}
	if !list {
		return nil
	}
	d, err := os.Open(path)
	if err != nil {
		return err
	}
	defer d.Close()
	if _, err := d.Readdirnames(1); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
