package ipc

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PopulateMode says how a client fills the page tables of an L1 segment it
// maps (Client: every announced segment, before it is added to the table).
//
// Without it, the worker's first write to each 4 KiB page of its own
// mapping takes a minor fault (the server's fallocate allocated the pages,
// but page tables are per mapping): about 8,200 faults per 32 MiB chunk,
// which held a CPU save at a fifth of the copy engine's speed. Populating
// moves that work to the time the segment is announced (the server's
// start-up, or a watermark ahead of use), off the save's path.
type PopulateMode int

const (
	// PopulateOff leaves the mapping to fault on first touch (a client that
	// writes no L1: a scheduler; ClientConfig's zero value).
	PopulateOff PopulateMode = iota
	// PopulateAuto: madvise(MADV_POPULATE_WRITE) (Linux 5.14), one pass in
	// the kernel; where the kernel lacks it, PopulateRead.
	PopulateAuto
	// PopulateRead is the fallback: one read per page. A read fault of a
	// shared shmem mapping maps the page writable (shmem has no dirty
	// tracking, so its PTEs are writable from the start), so a later write
	// takes no fault.
	PopulateRead
)

// PopulateEnv overrides the mode of every client in the process that asked
// to populate (ClientConfig.Populate not off): "auto", "read" (forces the
// fallback: tests, kernels whose POPULATE_WRITE misbehaves) or "off".
const PopulateEnv = "KVSHIM_POPULATE"

func (m PopulateMode) String() string {
	switch m {
	case PopulateAuto:
		return "auto"
	case PopulateRead:
		return "read"
	case PopulateOff:
		return "off"
	}
	return fmt.Sprintf("PopulateMode(%d)", int(m))
}

// ParsePopulateMode reads "auto", "read", "off".
func ParsePopulateMode(s string) (PopulateMode, error) {
	switch s {
	case "auto":
		return PopulateAuto, nil
	case "read":
		return PopulateRead, nil
	case "off":
		return PopulateOff, nil
	}
	return PopulateAuto, fmt.Errorf("%w: %s=%q: want auto, read or off", ErrConfig, PopulateEnv, s)
}

// populateMode is the mode of a client that asked for want: PopulateEnv,
// when set, overrides it (a bad value is an error of the Dial).
func populateMode(want PopulateMode) (PopulateMode, error) {
	if want == PopulateOff {
		return PopulateOff, nil
	}
	if v, ok := os.LookupEnv(PopulateEnv); ok && v != "" {
		return ParsePopulateMode(v)
	}
	return want, nil
}

// populateWriteMissing is set once the kernel has refused
// MADV_POPULATE_WRITE, so later segments go straight to the fallback.
var populateWriteMissing atomic.Bool

// PopulateStats counts what Populate did in this process (tests, docs).
type PopulateStats struct {
	Segments, Bytes uint64
	Kernel, Read    uint64 // segments populated by MADV_POPULATE_WRITE / by reads
	Nanos           uint64 // time spent populating
}

var popSegs, popBytes, popKernel, popRead, popNanos atomic.Uint64

// PopulateCounters returns the process's populate counters.
func PopulateCounters() PopulateStats {
	return PopulateStats{Segments: popSegs.Load(), Bytes: popBytes.Load(), Kernel: popKernel.Load(), Read: popRead.Load(), Nanos: popNanos.Load()}
}

// Populate fills this mapping's page tables for every page of the segment
// (mode: how), so that copies into it take no page fault. It never changes
// the segment's bytes. The pages of a segment the server has not faulted
// in are allocated here (as the first write would have).
func (s *Segment) Populate(mode PopulateMode) error {
	if mode == PopulateOff || len(s.mem) == 0 {
		return nil
	}
	t0 := time.Now()
	how := &popRead
	if mode == PopulateAuto && !populateWriteMissing.Load() {
		err := unix.Madvise(s.mem, unix.MADV_POPULATE_WRITE)
		switch {
		case err == nil:
			how = &popKernel
		case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP):
			populateWriteMissing.Store(true) // an older kernel: read instead
		default:
			// ENOMEM/EFAULT/EHWPOISON: the memory cannot be made present; a
			// copy into it would fault (SIGBUS) the same way: say so now.
			return fmt.Errorf("ipc: populate segment %d (%d bytes): %w", s.id, len(s.mem), err)
		}
	}
	if how == &popRead {
		touchPages(s.mem)
	}
	how.Add(1)
	popSegs.Add(1)
	popBytes.Add(uint64(len(s.mem)))
	popNanos.Add(uint64(time.Since(t0)))
	return nil
}

// touchSink keeps the reads of touchPages from being optimised away.
var touchSink atomic.Uint32

// touchPages reads one byte of every page of mem.
func touchPages(mem []byte) {
	var acc byte
	base := unsafe.Pointer(unsafe.SliceData(mem))
	for off := uintptr(0); off < uintptr(len(mem)); off += uintptr(pageSize) {
		acc ^= *(*byte)(unsafe.Add(base, off))
	}
	touchSink.Add(uint32(acc))
}

// populator populates a client's segments in the background, in the order
// they were mapped (the server's start-up segments first, in id order, then
// each one announced ahead of use), one at a time, holding a Use of the
// client so a segment is not unmapped under it. A copy that reaches a
// segment before its turn faults in what it touches, as without populating.
type populator struct {
	c    *Client
	mode PopulateMode

	mu      sync.Mutex
	queue   []*Segment
	running bool
	pending int           // segments queued or being populated
	idle    chan struct{} // closed when pending drops to 0; replaced when it rises
	err     error         // the first failure (also logged)
}

func newPopulator(c *Client, mode PopulateMode) *populator {
	p := &populator{c: c, mode: mode, idle: make(chan struct{})}
	close(p.idle)
	return p
}

// enqueue runs under the segment table's lock (Subscribe): it must not block.
func (p *populator) enqueue(s *Segment) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pending == 0 {
		p.idle = make(chan struct{})
	}
	p.pending++
	p.queue = append(p.queue, s)
	if !p.running {
		p.running = true
		go p.drain()
	}
}

func (p *populator) drain() {
	for {
		p.mu.Lock()
		if len(p.queue) == 0 {
			p.running = false
			p.queue = nil
			p.mu.Unlock()
			return
		}
		s := p.queue[0]
		p.queue[0] = nil
		p.queue = p.queue[1:]
		p.mu.Unlock()
		err := p.one(s)
		p.mu.Lock()
		if err != nil && p.err == nil {
			p.err = err
		}
		if p.pending--; p.pending == 0 {
			close(p.idle)
		}
		p.mu.Unlock()
	}
}

func (p *populator) one(s *Segment) error {
	if !p.c.acquire() {
		return nil // the session ended: nothing left to populate
	}
	defer p.c.release()
	if err := s.Populate(p.mode); err != nil {
		p.c.log.Warn("kvshim ipc: populating an L1 segment; copies into it fault its pages in instead", "segment", s.ID(), "err", err)
		return err
	}
	return nil
}

// WaitPopulated waits up to timeout until every segment mapped so far has
// been populated (at once when the client does not populate) and returns
// the first populate error, if any.
func (c *Client) WaitPopulated(timeout time.Duration) error {
	p := c.pop
	if p == nil {
		return nil
	}
	p.mu.Lock()
	ch := p.idle
	p.mu.Unlock()
	tm := time.NewTimer(timeout)
	defer tm.Stop()
	select {
	case <-ch:
	case <-tm.C:
		return fmt.Errorf("%w: L1 segments still being populated after %v", ErrTimeout, timeout)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// PopulateMode is how this client populates its mappings (off: it does not).
func (c *Client) PopulateMode() PopulateMode {
	if c.pop == nil {
		return PopulateOff
	}
	return c.pop.mode
}

// PopulatePending is how many of this client's segments are still queued or
// being populated (0 when it does not populate).
func (c *Client) PopulatePending() int {
	if c.pop == nil {
		return 0
	}
	c.pop.mu.Lock()
	defer c.pop.mu.Unlock()
	return c.pop.pending
}
