package ipc

import "golang.org/x/sys/unix"

// osYield offers this OS thread's core to another runnable thread.
func osYield() { _, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }
