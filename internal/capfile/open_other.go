//go:build !unix

package capfile

// openFlags: outside Unix, opening a file does not wait for a writer.
const openFlags = 0
