package plugin

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
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
	*hostproc.Child
	wmu    sync.Mutex // one frame at a time on stdin
	stderr *hostproc.Tail
	calls  hostproc.Calls[reply]
}

// Err is nil while the host serves calls (hostproc.Proc).
func (p *proc) Err() error { return p.calls.Err() }

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
	ch, err := p.calls.Add(id)
	if err != nil {
		return nil, err
	}
	p.wmu.Lock()
	_, err = p.Stdin.Write(buf)
	p.wmu.Unlock()
	if err != nil {
		p.calls.Drop(id)
		return nil, fmt.Errorf("%w: plugin host: write: %w%s", l2.ErrUnavailable, err, p.stderr.Suffix())
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
		p.calls.Deliver(id, rep)
	}
}

// die fails every pending request once the host's stdout ends; the exit
// status, when known within a moment, names a crash's signal.
func (p *proc) die(cause error) {
	why := cause.Error()
	select {
	case <-p.Exited:
		why = p.Cmd.ProcessState.String() // "signal: segmentation fault", "exit status 2"
	case <-time.After(time.Second):
	}
	dead := fmt.Errorf("%w: plugin host exited (%s)%s", l2.ErrUnavailable, why, p.stderr.Suffix())
	p.calls.Fail(dead, func(uint64) reply { return reply{dead: dead} })
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
