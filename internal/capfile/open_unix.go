//go:build unix

package capfile

import "syscall"

// openFlags makes opening a FIFO return at once instead of waiting for a
// writer; the kind check then refuses it. Reads of a regular file ignore
// O_NONBLOCK.
const openFlags = syscall.O_NONBLOCK
