package ipc

import (
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Futex operations (linux/futex.h). x/sys/unix does not define them. No
// FUTEX_PRIVATE_FLAG: the word lives in a MAP_SHARED mapping used by two
// processes, so the kernel must key it by the physical page.
const (
	futexWait = 0
	futexWake = 1
)

// futexWaitTimeout sleeps while *addr == val, at most d. Spurious and early
// returns are normal; callers re-check their condition.
func futexWaitTimeout(addr *atomic.Uint32, val uint32, d time.Duration) {
	if d <= 0 {
		return
	}
	ts := unix.NsecToTimespec(int64(d))
	unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWait, uintptr(val),
		uintptr(unsafe.Pointer(&ts)), 0, 0)
}

// futexWakeAll wakes every waiter on addr. FUTEX_WAKE never blocks, so it
// skips the scheduler's syscall bookkeeping (RawSyscall6).
func futexWakeAll(addr *atomic.Uint32) {
	unix.RawSyscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWake, uintptr(1<<31-1), 0, 0, 0)
}
