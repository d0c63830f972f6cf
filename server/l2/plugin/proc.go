package plugin

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os/exec"
	"sync"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
)

// Operations of the host protocol (host/kvshim_l2_host.c).
const (
	opOpen   = 1
	opLookup = 2
	opStore  = 3
	opLoad   = 4
	opRemove = 5
)

// recordSize is one key of a batch request: ns[16] rank u32 hash[32] off
// u64 len u64.
const recordSize = 68

// maxFrame bounds a reply (the host bounds requests the same way).
const maxFrame = 64 << 20

// Per-key status codes of kvshim_l2.h.
const (
	stOK      = 0
	stMiss    = 1
	stEIO     = -1
	stESize   = -2
	stENoSpc  = -3
	stEBusy   = -4
	stEInval  = -5
	stEUnav   = -6
	rcBadConf = -100
)

func statusName(s int32) string {
	switch s {
	case stEIO:
		return "KVSHIM_L2_EIO"
	case stESize:
		return "KVSHIM_L2_ESIZE"
	case stENoSpc:
		return "KVSHIM_L2_ENOSPC"
	case stEBusy:
		return "KVSHIM_L2_EBUSY"
	case stEInval:
		return "KVSHIM_L2_EINVAL"
	case stEUnav:
		return "KVSHIM_L2_EUNAVAIL"
	case rcBadConf:
		return "KVSHIM_L2_EBADCONFIG"
	}
	return fmt.Sprintf("status %d", s)
}

// record is one key of a request and its window range.
type record struct {
	key      kv.Key
	off, len uint64
}

// reply is the host's answer, or dead when the host died first.
type reply struct {
	rc     int32
	status []int32
	sizes  []uint64
	msg    string
	dead   error
}

// proc is one host process and its outstanding requests.
type proc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	wmu    sync.Mutex
	exited chan struct{}
	stderr *tail

	mu      sync.Mutex
	pending map[uint64]chan reply
	dead    error
}

func (p *proc) err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dead
}

// send writes a request and returns the channel its reply arrives on.
func (p *proc) send(id uint64, op uint32, recs []record, cfg []byte) (chan reply, error) {
	n := len(recs)
	if op == opOpen {
		n = len(cfg)
	}
	body := 16 + n
	if op != opOpen {
		body = 16 + n*recordSize
	}
	buf := make([]byte, 4+body)
	le := binary.LittleEndian
	le.PutUint32(buf, uint32(body))
	le.PutUint64(buf[4:], id)
	le.PutUint32(buf[12:], op)
	le.PutUint32(buf[16:], uint32(n))
	if op == opOpen {
		copy(buf[20:], cfg)
	} else {
		for i, r := range recs {
			b := buf[20+i*recordSize:]
			copy(b, r.key.Namespace[:])
			le.PutUint32(b[16:], r.key.Rank)
			copy(b[20:], r.key.Hash[:])
			le.PutUint64(b[52:], r.off)
			le.PutUint64(b[60:], r.len)
		}
	}
	ch := make(chan reply, 1)
	p.mu.Lock()
	if p.dead != nil {
		err := p.dead
		p.mu.Unlock()
		return nil, err
	}
	p.pending[id] = ch
	p.mu.Unlock()
	p.wmu.Lock()
	_, err := p.stdin.Write(buf)
	p.wmu.Unlock()
	if err != nil {
		p.mu.Lock()
		delete(p.pending, id)
		p.mu.Unlock()
		return nil, fmt.Errorf("%w: plugin host: write: %w%s", l2.ErrUnavailable, err, p.stderr.suffix())
	}
	return ch, nil
}

func (p *proc) readLoop(r *bufio.Reader) {
	for {
		id, rep, err := readReply(r)
		if err != nil {
			p.die(err)
			return
		}
		p.mu.Lock()
		ch := p.pending[id]
		delete(p.pending, id)
		p.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

// die fails every pending request once the host's stdout ends; the exit
// status, when known within a moment, names a crash's signal.
func (p *proc) die(cause error) {
	why := cause.Error()
	select {
	case <-p.exited:
		why = p.cmd.ProcessState.String() // "signal: segmentation fault", "exit status 2"
	case <-time.After(time.Second):
	}
	p.mu.Lock()
	p.dead = fmt.Errorf("%w: plugin host exited (%s)%s", l2.ErrUnavailable, why, p.stderr.suffix())
	for id, ch := range p.pending {
		ch <- reply{dead: p.dead}
		delete(p.pending, id)
	}
	p.mu.Unlock()
}

func readReply(r *bufio.Reader) (uint64, reply, error) {
	var rep reply
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, rep, err
	}
	le := binary.LittleEndian
	n := le.Uint32(hdr[:])
	if n < 20 || n > maxFrame {
		return 0, rep, fmt.Errorf("plugin host: reply frame of %d bytes", n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return 0, rep, err
	}
	id := le.Uint64(b)
	rep.rc = int32(le.Uint32(b[8:]))
	k := int(le.Uint32(b[12:]))
	if 16+k*12+4 > len(b) {
		return 0, rep, fmt.Errorf("plugin host: reply of %d bytes for %d keys", n, k)
	}
	rep.status = make([]int32, k)
	rep.sizes = make([]uint64, k)
	for i := range k {
		rep.status[i] = int32(le.Uint32(b[16+i*12:]))
		rep.sizes[i] = le.Uint64(b[20+i*12:])
	}
	m := int(le.Uint32(b[16+k*12:]))
	if 20+k*12+m != len(b) {
		return 0, rep, fmt.Errorf("plugin host: reply message of %d bytes in a %d-byte frame", m, n)
	}
	rep.msg = string(b[20+k*12:])
	return id, rep, nil
}

// stop closes stdin (the host waits for its batches, calls close() and
// exits) and kills it after timeout.
func (p *proc) stop(timeout time.Duration) {
	_ = p.stdin.Close()
	select {
	case <-p.exited:
		return
	case <-time.After(timeout):
	}
	p.kill()
}

// kill ends the host at once (SIGKILL) and waits for it, bounded.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
	}
}

// tail keeps the last bytes of the host's stderr.
type tail struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > t.max {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-t.max:]...)
	}
	return len(p), nil
}

func (t *tail) suffix() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := string(t.buf)
	if len(s) > 600 {
		s = s[len(s)-600:]
	}
	if s == "" {
		return ""
	}
	return "; host stderr: " + s
}
