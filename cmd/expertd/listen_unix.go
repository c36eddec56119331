//go:build unix

package main

import (
	"net"
	"os"
	"syscall"
)

// listenUnixMode binds the socket under a umask that leaves at most mode's
// bits, so the file is never more open than asked, not even between bind
// and chmod. The umask is the process's; nothing else creates files while
// the daemon starts its listener.
func listenUnixMode(path string, mode os.FileMode) (net.Listener, error) {
	old := syscall.Umask(int(^mode & 0o777))
	defer syscall.Umask(old)
	return net.Listen("unix", path)
}
