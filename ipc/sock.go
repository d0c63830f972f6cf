package ipc

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Socket messages (SOCK_SEQPACKET, one message per send, fds attached with
// SCM_RIGHTS): u32 kind | body.
const (
	sockHello   uint32 = 1 // client → server: Hello
	sockWelcome uint32 = 2 // server → client: welcome + ring pair fd
	sockRefuse  uint32 = 3 // server → client: u32 code | reason text
	sockSegment uint32 = 4 // server → client: u32 id | u32 0 | u64 size + segment fd
)

// Refusal codes carried by sockRefuse.
const (
	refuseOther      uint32 = 0
	refuseVersion    uint32 = 1
	refusePermission uint32 = 2
)

const maxSockMsg = 8192

// DefaultSocketDir is $XDG_RUNTIME_DIR/kvshim, or /tmp/kvshim-$UID when
// XDG_RUNTIME_DIR is unset.
func DefaultSocketDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "kvshim")
	}
	return filepath.Join(os.TempDir(), "kvshim-"+strconv.Itoa(os.Getuid()))
}

// DefaultSocketPath is DefaultSocketDir()/kvshim.sock.
func DefaultSocketPath() string { return filepath.Join(DefaultSocketDir(), "kvshim.sock") }

// MaxSocketPath is the longest socket path a sockaddr_un holds (108 bytes
// with the terminating NUL).
const MaxSocketPath = 107

// CheckSocketPath refuses a path the kernel cannot bind or connect to, with
// a message that says why (the kernel's own answer is "invalid argument").
func CheckSocketPath(path string) error {
	if len(path) > MaxSocketPath {
		return fmt.Errorf("ipc: socket path %q is %d bytes; a Unix socket path holds at most %d: choose a shorter directory", path, len(path), MaxSocketPath)
	}
	return nil
}

// makeSocketDir creates dir (mode 0700) if missing, but never its parents:
// a missing parent is reported as the likely typo it is.
func makeSocketDir(dir string) error {
	err := os.Mkdir(dir, 0o700)
	switch {
	case err == nil:
		slog.Info("kvshim ipc: created the socket directory", "dir", dir)
		return nil
	case errors.Is(err, os.ErrExist):
		return nil
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("ipc: socket dir %s: its parent %s does not exist (a typo?); kvshim creates only the socket's own directory", dir, filepath.Dir(dir))
	}
	return fmt.Errorf("ipc: socket dir: %w", err)
}

// EnsureSocketDir creates dir with mode 0700 if missing, and checks that it
// is a directory owned by this user with no group/other access (a
// pre-created /tmp/kvshim-UID owned by someone else is refused).
func EnsureSocketDir(dir string) error {
	if err := makeSocketDir(dir); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("ipc: socket dir: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("%w: socket dir %s is not a directory", ErrPermission, dir)
	}
	if st.Uid != uint32(os.Getuid()) {
		return fmt.Errorf("%w: socket dir %s is owned by uid %d, not %d", ErrPermission, dir, st.Uid, os.Getuid())
	}
	if st.Mode&0o077 != 0 {
		return fmt.Errorf("%w: socket dir %s has mode %#o, want 0700", ErrPermission, dir, st.Mode&0o777)
	}
	return nil
}

// CheckPeerCred accepts a peer only if its uid is ours or listed in allow.
func CheckPeerCred(cred *unix.Ucred, self uint32, allow []uint32) error {
	if cred.Uid == self {
		return nil
	}
	for _, u := range allow {
		if cred.Uid == u {
			return nil
		}
	}
	return fmt.Errorf("%w: peer pid %d runs as uid %d; this server only accepts uid %d", ErrPermission, cred.Pid, cred.Uid, self)
}

func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	if serr != nil {
		return nil, fmt.Errorf("ipc: SO_PEERCRED: %w", serr)
	}
	return cred, nil
}

func sendSock(c *net.UnixConn, kind uint32, body []byte, fd int) error {
	msg := putU32(make([]byte, 0, 4+len(body)), kind)
	msg = append(msg, body...)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	n, oobn, err := c.WriteMsgUnix(msg, oob, nil)
	if err != nil {
		return fmt.Errorf("ipc: socket send: %w", err)
	}
	if n != len(msg) || oobn != len(oob) {
		return fmt.Errorf("ipc: socket send: short write %d/%d", n, len(msg))
	}
	return nil
}

// recvSock reads one socket message. Received fds are returned; on error
// they are closed. A zero deadline means no deadline.
func recvSock(c *net.UnixConn, buf []byte, deadline time.Time) (kind uint32, body []byte, fds []int, err error) {
	if err := c.SetReadDeadline(deadline); err != nil {
		return 0, nil, nil, err
	}
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if oobn > 0 {
		if cms, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
			for i := range cms {
				if f, perr := unix.ParseUnixRights(&cms[i]); perr == nil {
					fds = append(fds, f...)
				}
			}
		}
	}
	fail := func(e error) (uint32, []byte, []int, error) {
		for _, f := range fds {
			unix.Close(f)
		}
		return 0, nil, nil, e
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fail(fmt.Errorf("%w: waiting for socket message", ErrTimeout))
		}
		return fail(fmt.Errorf("%w: socket: %v", ErrPeerGone, err))
	}
	if n == 0 && oobn == 0 {
		return fail(fmt.Errorf("%w: socket closed by peer", ErrPeerGone))
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return fail(fmt.Errorf("%w: socket message truncated", ErrMalformed))
	}
	if n < 4 {
		return fail(fmt.Errorf("%w: socket message of %d bytes", ErrMalformed, n))
	}
	return le.Uint32(buf), buf[4:n], fds, nil
}

func closeFds(fds []int) {
	for _, f := range fds {
		unix.Close(f)
	}
}

// welcome is the server's answer to a hello.
type welcome struct {
	Version    uint32
	Session    uint64
	Server     [16]byte
	SQCap      uint64
	CQCap      uint64
	Segments   uint32 // announcements that follow before the session starts
	BeatEvery  time.Duration
	BeatExpire time.Duration
}

func (w *welcome) append(b []byte) []byte {
	b = putU32(b, w.Version)
	b = putU32(b, w.Segments)
	b = putU64(b, w.Session)
	b = append(b, w.Server[:]...)
	b = putU64(b, w.SQCap)
	b = putU64(b, w.CQCap)
	b = putU64(b, uint64(w.BeatEvery))
	return putU64(b, uint64(w.BeatExpire))
}

func decodeWelcome(b []byte) (*welcome, error) {
	d := newDec("welcome", b)
	w := &welcome{Version: d.u32()}
	if d.err == nil && (w.Version < MinProtocolVersion || w.Version > ProtocolVersion) {
		return nil, fmt.Errorf("%w: server speaks version %d, this client speaks version %d", ErrVersion, w.Version, ProtocolVersion)
	}
	w.Segments = d.u32()
	w.Session = d.u64()
	d.fixed(w.Server[:])
	w.SQCap, w.CQCap = d.u64(), d.u64()
	w.BeatEvery, w.BeatExpire = time.Duration(d.u64()), time.Duration(d.u64())
	if err := d.done(); err != nil {
		return nil, err
	}
	return w, nil
}

func appendSegmentMsg(b []byte, id uint32, size uint64) []byte {
	b = putU32(b, id)
	b = putU32(b, 0)
	return putU64(b, size)
}

func decodeSegmentMsg(b []byte) (id uint32, size uint64, err error) {
	d := newDec("segment announcement", b)
	id = d.u32()
	d.u32()
	size = d.u64()
	return id, size, d.done()
}
