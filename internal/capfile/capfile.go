// Package capfile opens and reads files that a request or a flag names
// (a config, an index, a manifest, a token file) with a size cap: only
// regular files are opened for reading, the size is checked before the
// first byte is read, and the read itself stops at the cap, so a FIFO
// cannot block the caller and a huge (or sparse) file is never read whole.
//
// Errors name the file by its base name only, never the absolute path,
// and say the cap; they wrap ErrNotRegular or ErrTooLarge where those
// apply, and the open's own error (fs.ErrNotExist, say) otherwise.
package capfile

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

var (
	// ErrNotRegular is wrapped by the errors for anything but a regular
	// file (a directory, a FIFO, a device, a socket).
	ErrNotRegular = errors.New("not a regular file")
	// ErrTooLarge is wrapped by the errors for a file over its cap.
	ErrTooLarge = errors.New("over the size cap")
)

// Open opens the file at path for reading if it is a regular file of at
// most max bytes. The open does not block: O_NONBLOCK lets a FIFO with no
// writer open at once, and the fstat on the open descriptor (not the path,
// which may change in between) then refuses it.
func Open(path string, max int64) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("%s: %w", quote(path), err)
	}
	if _, err := Check(f, max); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ReadAll returns the contents of the regular file at path, refusing one
// of more than max bytes.
func ReadAll(path string, max int64) ([]byte, error) {
	f, err := Open(path, max)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return read(f, max)
}

// Check refuses f unless it is a regular file of at most max bytes; it is
// for files opened some other way (through an os.Root, say). It returns
// f's FileInfo.
func Check(f *os.File, max int64) (fs.FileInfo, error) {
	st, err := f.Stat()
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("%s: %w", quote(f.Name()), err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %w (%s)", quote(f.Name()), ErrNotRegular, kind(st.Mode()))
	}
	if st.Size() > max {
		return nil, tooLarge(f.Name(), st.Size(), max)
	}
	return st, nil
}

// ReadOpened is ReadAll for a file opened some other way: it checks f as
// Check does, then reads it from its current offset.
func ReadOpened(f *os.File, max int64) ([]byte, error) {
	if _, err := Check(f, max); err != nil {
		return nil, err
	}
	return read(f, max)
}

// read reads f to its end with the cap enforced: a file that grows past
// max after the check is refused, not read on.
func read(f *os.File, max int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("%s: %w", quote(f.Name()), err)
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%s grew while it was read, %w of %s", quote(f.Name()), ErrTooLarge, Size(max))
	}
	return b, nil
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

func tooLarge(name string, size, max int64) error {
	return fmt.Errorf("%s is %d bytes, %w of %s", quote(name), size, ErrTooLarge, Size(max))
}

// Size writes a byte count as the caps are written: whole MiB or KiB
// where it divides, else bytes.
func Size(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatInt(n>>20, 10) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatInt(n>>10, 10) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " bytes"
}

// quote is the base name of path, quoted so a control character in it
// cannot forge a line.
func quote(path string) string {
	return strconv.Quote(filepath.Base(path))
}
