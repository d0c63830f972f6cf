package l2

import (
	"errors"
)

// Sentinel errors; per-key errors wrap them with %w.
var (
	ErrBadConfig    = errors.New("l2: bad adapter config")
	ErrUnknownType  = errors.New("l2: unknown adapter type")
	ErrClosed       = errors.New("l2: adapter closed")
	ErrHeld         = errors.New("l2: key is held by a lookup")
	ErrNotReported  = errors.New("l2: backend returned without a result for the key")
	ErrBufferSize   = errors.New("l2: buffer size does not match the object")
	ErrBadBatch     = errors.New("l2: keys and buffers differ in length")
	ErrUnavailable  = errors.New("l2: backend unavailable")
	ErrNotSupported = errors.New("l2: operation not supported by the backend")
	// ErrFull: the backend refused a store for want of space (its cap, or
	// its own out-of-memory answer). A backend's own sentinel wraps it.
	ErrFull = errors.New("l2: backend full")
	// ErrCorrupt: an object's bytes are not the object its key names
	// (truncated, foreign, failed checksum): a miss, and the object is dropped.
	ErrCorrupt = errors.New("l2: corrupt object")
)
