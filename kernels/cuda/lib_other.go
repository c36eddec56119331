//go:build !((linux || darwin) && (amd64 || arm64))

package cuda

import "errors"

// openLibrary fails: purego loads shared libraries only on the platforms
// lib.go is built for, so the CUDA backend reports itself unavailable and
// backend=auto serves on the CPU.
func openLibrary(string) (*library, error) {
	return nil, errors.Join(errNoLibrary, errors.New("cuda: the CUDA backend needs linux or darwin on amd64 or arm64"))
}
