package server

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/l1"
)

// IPCSource is the production l1.SegmentSource: memfd segments from
// ipc.CreateSegment, each announced to every session (open and future)
// through the listener before the core hands out a Loc in it. With
// Prefault set, the L1 allocator has it prepare segments ahead of
// demand (l1.ReadySource): each is created, its pages allocated (faultIn) and
// announced from a background goroutine, and handed to the core by the
// NewSegment that follows.
type IPCSource struct {
	// Prefault is how many bytes of L1 to keep created, faulted in and
	// announced ahead of use (Config.L1PrefaultGB; 0: lazy). Set it before
	// the core is created.
	Prefault uint64

	ln      *ipc.Listener
	mu      sync.Mutex
	segs    []*ipc.Segment
	ready   map[uint32]*ipc.Segment // prepared, not yet handed to the core
	onNew   func(seg *ipc.Segment)  // L2 segment registration; must not block
	closers []func()                // run first in Close (the grower's stop)
	closed  bool
}

// setOnNew sets the new-segment hook and calls it for the segments that
// already exist (handed to the core; a prepared one gets it when the
// core takes it, as a new one does).
func (s *IPCSource) setOnNew(f func(seg *ipc.Segment)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onNew = f
	for _, seg := range s.segs {
		f(seg)
	}
}

// NewIPCSource returns a source announcing its segments on ln.
func NewIPCSource(ln *ipc.Listener) *IPCSource { return &IPCSource{ln: ln} }

// NewSegment creates, maps and announces segment id, or hands over the
// one prepare made ready.
func (s *IPCSource) NewSegment(id uint32, size uint64) ([]byte, error) {
	s.mu.Lock()
	seg := s.ready[id]
	delete(s.ready, id)
	s.mu.Unlock()
	if seg == nil {
		var err error
		if seg, err = s.create(id, size, false); err != nil {
			return nil, err
		}
	} else if seg.Size() < size {
		seg.Close()
		return nil, fmt.Errorf("prepared segment %d has %d bytes, want %d", id, seg.Size(), size)
	}
	s.mu.Lock()
	s.segs = append(s.segs, seg)
	if s.onNew != nil {
		s.onNew(seg)
	}
	s.mu.Unlock()
	return seg.Mem(), nil
}

// create makes segment id, faulted in when asked, and announces it.
func (s *IPCSource) create(id uint32, size uint64, fault bool) (*ipc.Segment, error) {
	seg, err := ipc.CreateSegment(id, size)
	if err != nil {
		return nil, err
	}
	if fault {
		if err := faultIn(seg.Fd(), seg.Mem()); err != nil {
			seg.Close()
			return nil, fmt.Errorf("fault in segment %d: %w", id, err)
		}
	}
	if err := s.ln.AddSegment(seg); err != nil {
		seg.Close()
		return nil, err
	}
	return seg, nil
}

// ReadyAhead is Prefault (l1.ReadySource).
func (s *IPCSource) ReadyAhead() uint64 { return s.Prefault }

// Prepare creates, faults in and announces segment id for a NewSegment to
// come (l1.ReadySource).
func (s *IPCSource) Prepare(id uint32, size uint64) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return ipc.ErrClosed
	}
	seg, err := s.create(id, size, true)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed { // Close ran meanwhile; cannot happen while the grower runs
		seg.Close()
		return ipc.ErrClosed
	}
	if s.ready == nil {
		s.ready = map[uint32]*ipc.Segment{}
	}
	s.ready[id] = seg
	return nil
}

// OnClose registers f to run first in Close (l1.ReadySource).
func (s *IPCSource) OnClose(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closers = append(s.closers, f)
}

// Close stops preparing segments, then unmaps every segment. Close the
// listener first.
func (s *IPCSource) Close() error {
	s.mu.Lock()
	closers := s.closers
	s.closers = nil
	s.mu.Unlock()
	for _, f := range closers {
		f()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	var errs []error
	for _, seg := range s.segs {
		errs = append(errs, seg.Close())
	}
	for _, seg := range s.ready {
		errs = append(errs, seg.Close())
	}
	s.segs, s.ready = nil, nil
	return errors.Join(errs...)
}

// faultIn allocates the pages of a new shared segment before anyone uses
// it. fallocate on its file is the cheapest way measured
// (BenchmarkFaultInMethods on a 2-core VM: 0.30-0.39 s per GiB, against
// 0.57-1.2 for MADV_POPULATE_WRITE, 0.59-1.35 for a write to every page and
// 0.95-2.1 for a MAP_POPULATE mapping): one pass in the kernel, no page
// tables, and the pages are then there for every mapping of the file, the
// clients' included; a client's first touch of a page (or its
// cuMemHostRegister) maps it instead of allocating and zeroing it. Where
// the file system cannot fallocate, or there is no file (fd < 0), it
// populates the mapping (Linux 5.14), else writes a zero to every page: the
// segment holds no object yet.
func faultIn(fd int, mem []byte) error {
	if fd >= 0 && len(mem) > 0 {
		err := unix.Fallocate(fd, 0, 0, int64(len(mem)))
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("fallocate %d bytes: %w", len(mem), err)
		}
	}
	if len(mem) == 0 {
		return nil
	}
	err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("madvise(MADV_POPULATE_WRITE) %d bytes: %w", len(mem), err)
	}
	for off := 0; off < len(mem); off += l1.PageSize {
		mem[off] = 0
	}
	return nil
}
