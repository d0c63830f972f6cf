package ipc

import (
	"fmt"

	"github.com/google/uuid"
)

// CodecVersion is the first byte of every ring frame. A frame with another
// version is malformed for this build.
const CodecVersion uint8 = 1

// FrameHeaderLen is the fixed size of FrameHeader on the wire.
const FrameHeaderLen = 16

// Frame flags.
const (
	// FlagResponse marks completion-ring frames.
	FlagResponse uint8 = 1 << 0
)

// Limits on variable-length fields.
const (
	MaxErrorMsg = 4096 // bytes of the message in a non-OK response
	MaxStatName = 256  // bytes of one Stat name
)

// FrameHeader starts every ring record (type RecordFrame):
//
//	u8 version | u8 flags | u16 op | i32 status | u64 request id
//
// Requests carry status 0. A response echoes ReqID and Op. A response with
// a non-OK Status carries a UTF-8 error message as its body instead of the
// op's typed answer.
type FrameHeader struct {
	Flags  uint8
	Op     Op
	Status Status
	ReqID  uint64
}

// AppendFrameHeader appends h's 16 bytes to dst.
func AppendFrameHeader(dst []byte, h FrameHeader) []byte {
	dst = append(dst, CodecVersion, h.Flags)
	dst = putU16(dst, uint16(h.Op))
	dst = putU32(dst, uint32(h.Status))
	return putU64(dst, h.ReqID)
}

// DecodeFrame splits a ring record into its header and body.
func DecodeFrame(b []byte) (FrameHeader, []byte, error) {
	d := newDec("frame", b)
	v := d.u8()
	h := FrameHeader{Flags: d.u8(), Op: Op(d.u16()), Status: Status(d.u32()), ReqID: d.u64()}
	if d.err != nil {
		return FrameHeader{}, nil, d.err
	}
	if v != CodecVersion {
		return FrameHeader{}, nil, fmt.Errorf("%w: frame codec version %d, want %d", ErrMalformed, v, CodecVersion)
	}
	if h.Flags&^(FlagResponse|FlagEventsPending) != 0 || (h.Flags&FlagEventsPending != 0 && h.Flags&FlagResponse == 0) {
		return FrameHeader{}, nil, fmt.Errorf("%w: frame flags %#x", ErrMalformed, h.Flags)
	}
	return h, b[FrameHeaderLen:], nil
}

// Role says which kind of client connects.
type Role uint8

const (
	RoleScheduler Role = 1
	RoleWorker    Role = 2
	RoleTool      Role = 3
)

func (r Role) String() string {
	switch r {
	case RoleScheduler:
		return "scheduler"
	case RoleWorker:
		return "worker"
	case RoleTool:
		return "tool"
	}
	return fmt.Sprintf("role(%d)", uint8(r))
}

// Hello is the client's first socket message.
type Hello struct {
	Version  uint32    // ProtocolVersion of the sender
	Role     Role      // scheduler, worker or tool
	PID      uint32    // sender's pid (informational; never a key)
	Instance uuid.UUID // unique per connector instance; the session's Owner tag
	Flags    HelloFlags
}

// HelloFlags are the client's statements about itself in a hello.
type HelloFlags uint8

// HelloDrained says that every earlier session of this Instance has ended
// on the client's side and its mappings of L1 are gone, so no late write of
// it can land in L1 any more: the server may reuse the staging slots it
// fenced when those sessions ended (see server/doc.go, "Fencing").
const HelloDrained HelloFlags = 1 << 0

const helloFlagsKnown = HelloDrained

const helloMagic uint32 = 0x4853564b // "KVSH"

// HelloLen is the wire size of a version-1 hello.
const HelloLen = 32

// AppendHello encodes h: u32 magic | u32 version | u8 role | u8 flags | 2 pad | u32 pid | 16 instance.
func AppendHello(dst []byte, h Hello) []byte {
	dst = putU32(dst, helloMagic)
	dst = putU32(dst, h.Version)
	dst = append(dst, byte(h.Role), byte(h.Flags), 0, 0)
	dst = putU32(dst, h.PID)
	return append(dst, h.Instance[:]...)
}

// DecodeHello decodes a hello. Magic and version come first so that a
// mismatch is reported (wrapping ErrVersion, with both versions) even when
// the rest of the format differs; the returned Hello then has only Version.
func DecodeHello(b []byte) (Hello, error) {
	d := newDec("hello", b)
	if m := d.u32(); d.err == nil && m != helloMagic {
		d.fail("bad magic %#x", m)
	}
	h := Hello{Version: d.u32()}
	if d.err != nil {
		return Hello{}, d.err
	}
	if h.Version < MinProtocolVersion || h.Version > ProtocolVersion {
		return h, fmt.Errorf("%w: peer speaks version %d, this side speaks version %d (and back to %d)", ErrVersion, h.Version, ProtocolVersion, MinProtocolVersion)
	}
	h.Role = Role(d.u8())
	if h.Flags = HelloFlags(d.u8()); h.Flags&^helloFlagsKnown != 0 {
		d.fail("unknown flags %#x", h.Flags)
	}
	if pad := d.take(2); pad != nil && (pad[0]|pad[1]) != 0 {
		d.fail("non-zero padding")
	}
	h.PID = d.u32()
	d.fixed(h.Instance[:])
	if err := d.done(); err != nil {
		return Hello{}, err
	}
	if h.Role < RoleScheduler || h.Role > RoleTool {
		return Hello{}, fmt.Errorf("%w: hello: unknown role %d", ErrMalformed, h.Role)
	}
	return h, nil
}

// AppendError encodes the body of a non-OK response (truncated to MaxErrorMsg).
func AppendError(dst []byte, msg string) []byte {
	if len(msg) > MaxErrorMsg {
		msg = msg[:MaxErrorMsg]
	}
	return append(dst, msg...)
}

// DecodeError decodes the body of a non-OK response.
func DecodeError(b []byte) (string, error) {
	if len(b) > MaxErrorMsg {
		return "", fmt.Errorf("%w: error message %d bytes exceeds %d", ErrMalformed, len(b), MaxErrorMsg)
	}
	return string(b), nil
}
