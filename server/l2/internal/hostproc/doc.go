// Package hostproc is what the out-of-process L2 backends (server/l2/plugin's
// kvshim-l2-host and server/l2/mooncake's Python helper) share: they run a
// child process that serves batches over a pipe and reaches kvshim's bytes
// only through shared memory. The two had grown the same code twice; it
// lives here once:
//
//	Supervisor  the current process; a dead one is restarted at most once
//	            per Every, callers in between fail fast with the death's cause
//	Calls       the table of requests in flight, failed together when the
//	            process's output ends
//	Child       a started command: Stop (stdin EOF, then SIGKILL) and Kill
//	Pages       a page allocator over a shared-memory area (the plugin's
//	            window, Mooncake's bounce buffer); Memfd makes such an area
//	Tail        the last bytes of the child's stderr, for error messages
//
// The wire protocols differ (binary frames vs JSON lines) and stay in their
// packages. Errors wrap l2's sentinels and this package's with %w, so
// errors.Is sees both the backend-level class (l2.ErrUnavailable,
// l2.ErrClosed) and the cause (ErrNotRunning, ErrFull, ErrTooLarge).
package hostproc

import (
	"fmt"

	"github.com/kvshim/kvshim/server/l2"
)

// Sentinel errors. Each wraps one of l2's, so the C ABI's code table names
// them without importing this package (export/errors.go).
var (
	// ErrNotRunning: no process is serving (it died and has not been
	// restarted yet).
	ErrNotRunning = fmt.Errorf("hostproc: process not running: %w", l2.ErrUnavailable)
	// ErrFull: a Pages area has no free run of the size asked for (for
	// now: callers send what they placed and retry the rest).
	ErrFull = fmt.Errorf("hostproc: shared area full: %w", l2.ErrUnavailable)
	// ErrTooLarge: the size asked for exceeds the whole Pages area (its
	// configured size: window_bytes, bounce_buffer_size).
	ErrTooLarge = fmt.Errorf("hostproc: larger than the shared area: %w", l2.ErrBadConfig)
)
