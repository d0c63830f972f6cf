package ipc

import "errors"

// Sentinel errors. Functions wrap them with %w and context; test with errors.Is.
var (
	// ErrMalformed: a message or record failed validation (codec or ring).
	ErrMalformed = errors.New("ipc: malformed message")
	// ErrCorrupt: a ring header or record header is inconsistent (bad magic,
	// impossible length or counter). The session must be closed.
	ErrCorrupt = errors.New("ipc: corrupt ring")
	// ErrRingFull: the producer waited its whole timeout for free space.
	// Nothing was written; the caller decides (nothing is dropped silently).
	ErrRingFull = errors.New("ipc: ring full")
	// ErrTimeout: a wait (read, call, handshake) ran past its deadline.
	ErrTimeout = errors.New("ipc: timeout")
	// ErrTooLarge: a record does not fit in the ring (see Ring.MaxRecord).
	ErrTooLarge = errors.New("ipc: record too large")
	// ErrPeerStalled: the peer left an in-progress record unfinished past
	// the stall timeout (it died or hung mid-write).
	ErrPeerStalled = errors.New("ipc: peer stalled mid-record")
	// ErrPeerGone: the peer closed the session, died, or missed heartbeats.
	ErrPeerGone = errors.New("ipc: peer gone")
	// ErrNoHeartbeat (with ErrPeerGone): the peer's heartbeat is older than
	// the limit: it died, or it is stalled (SIGSTOP, a frozen cgroup, a
	// debugger, heavy swapping) and may still resume.
	ErrNoHeartbeat = errors.New("no heartbeat")
	// ErrClosed: this side closed the object.
	ErrClosed = errors.New("ipc: closed")
	// ErrVersion: protocol version mismatch in the hello.
	ErrVersion = errors.New("ipc: protocol version mismatch")
	// ErrRefused: the server refused the connection (message says why).
	ErrRefused = errors.New("ipc: connection refused")
	// ErrPermission: peer uid check failed or socket directory unsafe.
	ErrPermission = errors.New("ipc: permission denied")
	// ErrRange: a Loc lies outside its segment, or names an unknown segment.
	ErrRange = errors.New("ipc: location out of range")
	// ErrRemote: the server answered a call with a non-OK frame status.
	ErrRemote = errors.New("ipc: remote error")
	// ErrLimit: a server limit (e.g. sessions per uid) refused the request.
	ErrLimit = errors.New("ipc: over a server limit")
	// ErrConfig: a client option (or its environment override) is invalid.
	ErrConfig = errors.New("ipc: bad configuration")
)
