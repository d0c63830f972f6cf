package server

import (
	"errors"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/l1"
)

// Sentinel errors. Operations wrap them with %w and context; StatusOf maps
// them to the frame status a response carries.
var (
	// ErrBadRequest: a malformed or out-of-range request (bad sizes, too many
	// keys, world size 0, duplicate lookup id, ...). Nothing was changed.
	ErrBadRequest = errors.New("server: bad request")
	// ErrUnknownLookup: no live lookup with that owner and id.
	ErrUnknownLookup = errors.New("server: unknown lookup")
	// ErrSessionClosed: the session was closed (its peer is gone).
	ErrSessionClosed = errors.New("server: session closed")
	// ErrDuplicateSession: a live session already has that instance id.
	ErrDuplicateSession = errors.New("server: duplicate session instance id")
	// ErrClosed: the core was closed.
	ErrClosed = errors.New("server: closed")
	// ErrConfig: an invalid configuration value.
	ErrConfig = errors.New("server: invalid config")
	// ErrSegment: the segment source failed to provide memory (l1's
	// sentinel: errors.Is matches either name).
	ErrSegment = l1.ErrSegment
	// ErrFill: a prefetch fill call was not valid (task finished, chunk out
	// of range, chunk already present or being filled).
	ErrFill = errors.New("server: invalid fill")
)

// StatusOf maps an operation error to the frame status of its response:
// nil → OK, ErrBadRequest → BadRequest, ErrUnknownLookup → Unknown, anything
// else → Internal (the error's text is the message).
func StatusOf(err error) ipc.Status {
	switch {
	case err == nil:
		return ipc.StatusOK
	case errors.Is(err, ErrBadRequest):
		return ipc.StatusBadRequest
	case errors.Is(err, ErrUnknownLookup):
		return ipc.StatusUnknown
	default:
		return ipc.StatusInternal
	}
}
