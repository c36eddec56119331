//go:build !unix

package main

import (
	"net"
	"os"
)

// listenUnixMode binds the socket; listenUnix then sets mode.
func listenUnixMode(path string, _ os.FileMode) (net.Listener, error) {
	return net.Listen("unix", path)
}
