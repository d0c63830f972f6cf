package ipc

import "runtime"

// yield lets other goroutines on this P run during a long spin.
func yield() { runtime.Gosched() }
