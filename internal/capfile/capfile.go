// Package capfile opens the files a command or the daemon reads by flag
// or on request: only regular files (a FIFO, a device or a directory
// would block the reader or never end), only up to a size the caller
// names, and with that size enforced while reading, so a file that grows
// after it was opened cannot push the reader past it either.
package capfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// ErrTooLarge is wrapped by the error of a file over its cap.
var ErrTooLarge = errors.New("file too large")

// Open opens path for reading when it is a regular file of at most max
// bytes. The open itself does not block on a FIFO (see openFlags), and the
// kind is checked on the opened file, so a path swapped after a check
// cannot slip past it.
func Open(path string, max int64) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|openFlags, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if err := check(path, fi, max); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ReadFile reads the whole of path, a regular file of at most max bytes.
func ReadFile(path string, max int64) ([]byte, error) {
	f, err := Open(path, max)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, &fs.PathError{Op: "read", Path: path, Err: fmt.Errorf("%w: grew past %d bytes while read", ErrTooLarge, max)}
	}
	return b, nil
}

// Check reports whether path names a regular file of at most max bytes,
// without opening it: for a start-up check of a file read later by
// someone else (a library the dynamic loader maps, say).
func Check(path string, max int64) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	return check(path, fi, max)
}

func check(path string, fi fs.FileInfo, max int64) error {
	if !fi.Mode().IsRegular() {
		return &fs.PathError{Op: "open", Path: path, Err: fmt.Errorf("not a regular file (%s)", kind(fi.Mode()))}
	}
	if fi.Size() > max {
		return &fs.PathError{Op: "open", Path: path, Err: fmt.Errorf("%w: %d bytes, more than %d", ErrTooLarge, fi.Size(), max)}
	}
	return nil
}

// kind names a file type for an error message.
func kind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	}
	return "type " + m.Type().String()
}
