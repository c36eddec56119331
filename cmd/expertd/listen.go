package main

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"time"
)

// listen opens the gRPC listener of cfg.Listen (checked by validate).
func listen(cfg Config, log *slog.Logger) (net.Listener, error) {
	network, address, err := listenAddress(cfg.Listen)
	if err != nil {
		return nil, err
	}
	if network == "tcp" {
		return net.Listen("tcp", address)
	}
	return listenUnix(address, cfg.UnixMode, log)
}

// listenUnix serves on a Unix socket at path with permissions mode. A
// socket file left by a daemon that died is removed first; anything else
// at path (a regular file, a directory, a socket someone still serves
// on) is refused, so a typo cannot delete a file or steal a live
// daemon's address. The listener unlinks the file when it is closed,
// which gRPC's Stop and GracefulStop do.
func listenUnix(path string, mode os.FileMode, log *slog.Logger) (net.Listener, error) {
	if err := removeStaleSocket(path, log); err != nil {
		return nil, err
	}
	lis, err := listenUnixMode(path, mode)
	if err != nil {
		return nil, err
	}
	// The umask of listenUnixMode can only take bits away; chmod sets
	// exactly the bits asked for (group write included).
	if err := os.Chmod(path, mode); err != nil {
		lis.Close()
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return lis, nil
}

// removeStaleSocket removes path if it is a socket nobody accepts on.
func removeStaleSocket(path string, log *slog.Logger) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket (mode %v); remove it or pick another -listen path", path, fi.Mode())
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		conn.Close()
		return fmt.Errorf("%s: another process is serving on this socket", path)
	}
	log.Info("removing a stale socket file", slog.String("path", path), slog.Any("dial_err", err))
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing stale socket %s: %w", path, err)
	}
	return nil
}

// grpcTarget is the gRPC dial target of a bound listener's address.
func grpcTarget(addr net.Addr) string {
	if u, ok := addr.(*net.UnixAddr); ok {
		return "unix:" + u.Name
	}
	return addr.String()
}
