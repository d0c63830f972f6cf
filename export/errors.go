package main

import (
	"context"
	"errors"
	"os"
	"sync"
	"syscall"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/export/connector"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l1"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/shim"
)

// Return codes; kvshim.h declares the same values (TestCodesMatchHeader).
const (
	codeOK       = 0
	codeInval    = -1  // bad argument (null pointer, malformed JSON, bad geometry)
	codeBadH     = -2  // unknown or closed handle
	codePanic    = -3  // a panic inside the library, recovered
	codeRange    = -4  // caller's buffer too small; output truncated
	codeNotSup   = -5  // not supported here (e.g. no CUDA driver)
	codeTimedOut = -6  // a wait ran past its timeout
	codeIO       = -7  // the server or a peer failed
	codeNoSpace  = -8  // no space: the kernel refused memory or disk, or an L2 backend is full
	codeClosed   = -9  // the handle or its connection is shutting down
	codeInternal = -10 // anything else
)

// codeNames are the header's names of the codes (the Go test checks them
// against kvshim.h).
var codeNames = map[int]string{
	codeOK:       "KVSHIM_OK",
	codeInval:    "KVSHIM_EINVAL",
	codeBadH:     "KVSHIM_EBADH",
	codePanic:    "KVSHIM_EPANIC",
	codeRange:    "KVSHIM_ERANGE",
	codeNotSup:   "KVSHIM_ENOTSUP",
	codeTimedOut: "KVSHIM_ETIMEDOUT",
	codeIO:       "KVSHIM_EIO",
	codeNoSpace:  "KVSHIM_ENOSPC",
	codeClosed:   "KVSHIM_ECLOSED",
	codeInternal: "KVSHIM_EINTERNAL",
}

// Sentinel errors of this package; they map to codes like every other
// package's (codeTable).
var (
	errInvalid   = errors.New("invalid argument")
	errBadHandle = errors.New("unknown or closed handle")
	errRange     = errors.New("buffer too small")
)

// sentinel is one row of codeTable: an error value, the name it is
// declared under (package.Name; TestCodeTableCoversEverySentinel checks the
// names against the sources) and the code a failure wrapping it returns.
type sentinel struct {
	name string
	err  error
	code int
}

// codeTable is the C ABI's error vocabulary in one place: every sentinel
// error of every package linked into the library, and the code a failure
// that wraps it (errors.Is, through any number of %w) returns. The first
// row that matches wins, so the order is a priority: the library's own
// argument checks first, then the outer layers (shim classifies the ipc
// and cuda failures it wraps), then the inner ones, the standard library
// last. An error that matches no row is KVSHIM_EINTERNAL.
//
// A new sentinel anywhere in the library fails the Go test until it has a
// row here; KVSHIM_EINTERNAL is a valid answer for errors only a bug can
// produce, but it has to be chosen.
var codeTable = []sentinel{
	// export: the C boundary's own checks.
	{"main.errInvalid", errInvalid, codeInval},
	{"main.errBadHandle", errBadHandle, codeBadH},
	{"main.errRange", errRange, codeRange},
	{"connector.ErrConfig", connector.ErrConfig, codeInval},

	// shim: the connector's logic. A dead or unreachable server is EIO
	// whatever the transport said underneath (a refused dial, a timeout).
	{"shim.ErrUnavailable", shim.ErrUnavailable, codeIO},
	{"shim.ErrBadMeta", shim.ErrBadMeta, codeInval},
	{"shim.ErrBadChunkSize", shim.ErrBadChunkSize, codeInval},
	{"shim.ErrBadExtras", shim.ErrBadExtras, codeInval},
	{"shim.ErrBadPrefix", shim.ErrBadPrefix, codeInval},
	{"shim.ErrStaleRoot", shim.ErrStaleRoot, codeInval}, // never returned: schedMatch keys the request again
	{"shim.ErrBadNamespaceSpec", shim.ErrBadNamespaceSpec, codeInval},
	{"shim.ErrNoChunkHash", shim.ErrNoChunkHash, codeInval},
	{"shim.ErrBadParams", shim.ErrBadParams, codeInval},
	{"shim.ErrBadRole", shim.ErrBadRole, codeInval},

	// layout: geometry of the registered KV caches (bad tensors, registered
	// twice, block ids out of range) and objects that do not verify.
	{"layout.ErrGeometry", layout.ErrGeometry, codeInval},
	{"layout.ErrCorrupt", layout.ErrCorrupt, codeIO},
	{"objfmt.ErrKeyMismatch", objfmt.ErrKeyMismatch, codeIO}, // also layout.ErrKeyMismatch (the same value)
	{"objfmt.ErrNoPayloadCRC", objfmt.ErrNoPayloadCRC, codeIO},
	{"objfmt.ErrCorrupt", objfmt.ErrCorrupt, codeIO},
	{"objfmt.ErrUnaligned", objfmt.ErrUnaligned, codeInval},

	// cuda: the driver and the copy engines.
	{"cuda.ErrNotSupported", cuda.ErrNotSupported, codeNotSup},
	{"cuda.ErrTimeout", cuda.ErrTimeout, codeTimedOut},
	{"cuda.ErrClosed", cuda.ErrClosed, codeClosed},
	{"cuda.ErrBadSpan", cuda.ErrBadSpan, codeInval},

	// server: the embedded server's configuration and start, and its
	// answers. The kernel's ENOSPC (a trace directory on a full disk at
	// kvshim_open, memory for L1) is KVSHIM_ENOSPC wherever it is wrapped
	// with %w, so it ranks before l1.ErrSegment. A save that finds L1
	// full is skipped by design (ipc.StatusNoSpace), never an error.
	{"server.ErrConfig", server.ErrConfig, codeInval},
	{"server.ErrLookupLimit", server.ErrLookupLimit, codeInval},
	{"server.ErrBadRequest", server.ErrBadRequest, codeInval},
	{"server.ErrUnknownLookup", server.ErrUnknownLookup, codeInval},
	{"server.ErrDuplicateSession", server.ErrDuplicateSession, codeInval},
	{"server.ErrSessionClosed", server.ErrSessionClosed, codeClosed},
	{"server.ErrClosed", server.ErrClosed, codeClosed},
	{"server.ErrFill", server.ErrFill, codeInternal}, // the server's own fill bookkeeping: only a bug
	{"stdlib syscall.ENOSPC", syscall.ENOSPC, codeNoSpace},
	{"l1.ErrSegment", l1.ErrSegment, codeIO},             // also server.ErrSegment (the same value)
	{"l1.ErrTransition", l1.ErrTransition, codeInternal}, // an object state change the L1 state machine refuses: only a bug

	// L2 adapters (the embedded server's --l2-adapter configs); a full
	// backend is ENOSPC.
	{"l2.ErrBadConfig", l2.ErrBadConfig, codeInval},
	{"l2.ErrUnknownType", l2.ErrUnknownType, codeInval},
	{"kv.ErrBadKey", kv.ErrBadKey, codeInval}, // a key string that does not parse (L2 names)
	{"l2.ErrBufferSize", l2.ErrBufferSize, codeInval},
	{"l2.ErrBadBatch", l2.ErrBadBatch, codeInval},
	{"l2.ErrNotSupported", l2.ErrNotSupported, codeNotSup},
	{"l2.ErrClosed", l2.ErrClosed, codeClosed},
	{"l2.ErrHeld", l2.ErrHeld, codeIO},
	{"l2.ErrNotReported", l2.ErrNotReported, codeIO},
	{"l2.ErrUnavailable", l2.ErrUnavailable, codeIO},
	{"l2.ErrFull", l2.ErrFull, codeNoSpace},
	{"l2.ErrCorrupt", l2.ErrCorrupt, codeIO},

	// ipc: the transport. A wait past its deadline is ETIMEDOUT (a full
	// ring is a producer that waited its whole timeout); a peer that broke
	// the protocol or went away is EIO.
	{"ipc.ErrTimeout", ipc.ErrTimeout, codeTimedOut},
	{"ipc.ErrRingFull", ipc.ErrRingFull, codeTimedOut},
	{"ipc.ErrClosed", ipc.ErrClosed, codeClosed},
	{"ipc.ErrTooLarge", ipc.ErrTooLarge, codeInval},
	{"ipc.ErrVersion", ipc.ErrVersion, codeNotSup},
	{"ipc.ErrMalformed", ipc.ErrMalformed, codeIO},
	{"ipc.ErrCorrupt", ipc.ErrCorrupt, codeIO},
	{"ipc.ErrPeerStalled", ipc.ErrPeerStalled, codeIO},
	{"ipc.ErrNoHeartbeat", ipc.ErrNoHeartbeat, codeIO},
	{"ipc.ErrPeerGone", ipc.ErrPeerGone, codeIO},
	{"ipc.ErrRefused", ipc.ErrRefused, codeIO},
	{"ipc.ErrPermission", ipc.ErrPermission, codeIO},
	{"ipc.ErrRange", ipc.ErrRange, codeIO},
	{"ipc.ErrRemote", ipc.ErrRemote, codeIO},
	{"ipc.ErrLimit", ipc.ErrLimit, codeIO},
	{"ipc.ErrConfig", ipc.ErrConfig, codeInval},
	{"shim.ErrLayerTimeout", shim.ErrLayerTimeout, codeTimedOut},

	// The standard library's, as the packages above wrap them.
	{"stdlib errors.ErrUnsupported", errors.ErrUnsupported, codeNotSup},
	{"stdlib os.ErrDeadlineExceeded", os.ErrDeadlineExceeded, codeTimedOut},
	{"stdlib context.DeadlineExceeded", context.DeadlineExceeded, codeTimedOut},
	{"stdlib os.ErrClosed", os.ErrClosed, codeClosed},
}

// codeOf maps an error to its return code: the first codeTable row it
// wraps, else KVSHIM_EINTERNAL.
func codeOf(err error) int {
	if err == nil {
		return codeOK
	}
	for _, s := range codeTable {
		if errors.Is(err, s.err) {
			return s.code
		}
	}
	return codeInternal
}

// globalErr is the last error of calls made without a valid handle
// (kvshim_open failures, unknown handles), read with handle 0.
var globalErr struct {
	mu  sync.Mutex
	msg string
}

func setGlobalErr(err error) {
	globalErr.mu.Lock()
	globalErr.msg = err.Error()
	globalErr.mu.Unlock()
}

// fail records err for handle h (or globally) and returns its code.
func fail(h int64, err error) int {
	if inst := handles.get(h); inst != nil {
		inst.setErr(err)
	} else {
		setGlobalErr(err)
	}
	return codeOf(err)
}
