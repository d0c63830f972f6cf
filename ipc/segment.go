package ipc

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Segment is one shared-memory mapping backed by a memfd (or, where
// memfd_create is missing, an unlinked /dev/shm file). The creator seals its
// size so a peer holding the fd cannot shrink it under us (SIGBUS).
type Segment struct {
	id   uint32
	fd   int
	mem  []byte
	once sync.Once

	hookMu  sync.Mutex
	closing bool
	onUnmap []func()
}

// pageSize is the mapping granularity; segment and ring sizes are multiples.
var pageSize = uint64(os.Getpagesize())

const sealAll = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// memfdUnsupported is set (tests) to force the /dev/shm fallback.
var memfdUnsupported atomic.Bool

var shmSeq atomic.Uint64

// CreateSegment creates and maps a new shared segment of size bytes
// (rounded up to a page) under the given id.
func CreateSegment(id uint32, size uint64) (*Segment, error) {
	if size == 0 || size > 1<<46 {
		return nil, fmt.Errorf("ipc: create segment %d: bad size %d", id, size)
	}
	size = (size + pageSize - 1) &^ (pageSize - 1)
	fd, sealed, err := createFd(fmt.Sprintf("kvshim-seg-%d", id), size)
	if err != nil {
		return nil, fmt.Errorf("ipc: create segment %d: %w", id, err)
	}
	if sealed {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, sealAll); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("ipc: seal segment %d: %w", id, err)
		}
	}
	s, err := mapFd(id, fd, size)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return s, nil
}

func createFd(name string, size uint64) (fd int, sealed bool, err error) {
	if !memfdUnsupported.Load() {
		fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err == nil {
			if err = unix.Ftruncate(fd, int64(size)); err != nil {
				unix.Close(fd)
				return -1, false, fmt.Errorf("ftruncate: %w", err)
			}
			return fd, true, nil
		}
		if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
			return -1, false, fmt.Errorf("memfd_create: %w", err)
		}
	}
	// Fallback: a /dev/shm file, unlinked at once so only fds keep it alive.
	p := "/dev/shm/" + name + "-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatUint(shmSeq.Add(1), 10)
	fd, err = unix.Open(p, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return -1, false, fmt.Errorf("open %s: %w", p, err)
	}
	unix.Unlink(p)
	if err = unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return -1, false, fmt.Errorf("ftruncate: %w", err)
	}
	return fd, false, nil
}

// MapSegment maps a segment received from a peer. It takes ownership of fd
// (closed on error and by Close). The file must be at least size bytes.
func MapSegment(id uint32, fd int, size uint64) (*Segment, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ipc: map segment %d: fstat: %w", id, err)
	}
	if size == 0 || st.Size < 0 || uint64(st.Size) < size {
		unix.Close(fd)
		return nil, fmt.Errorf("%w: segment %d: size %d, file has %d", ErrRange, id, size, st.Size)
	}
	s, err := mapFd(id, fd, size)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return s, nil
}

func mapFd(id uint32, fd int, size uint64) (*Segment, error) {
	if size > uint64(^uint(0)>>1) {
		return nil, fmt.Errorf("ipc: map segment %d: size %d too large", id, size)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("ipc: mmap segment %d (%d bytes): %w", id, size, err)
	}
	return &Segment{id: id, fd: fd, mem: mem}, nil
}

// ID is the segment id that Locs name.
func (s *Segment) ID() uint32 { return s.id }

// Mem is the whole mapping. It is invalid after Close.
func (s *Segment) Mem() []byte { return s.mem }

// Size is len(Mem()).
func (s *Segment) Size() uint64 { return uint64(len(s.mem)) }

// Fd is the backing file descriptor (owned by the Segment; dup it to keep it).
func (s *Segment) Fd() int { return s.fd }

// OnUnmap registers f to run when the segment is closed, before its memory
// is unmapped: a GPU worker unregisters the segment from the CUDA driver
// there, because memory unmapped while registered leaves the driver's pinned
// pages behind (and a later mapping at the same address would not be the
// memory the driver copies to). It returns false, and does not keep f, when
// the segment is already closing.
func (s *Segment) OnUnmap(f func()) bool {
	s.hookMu.Lock()
	defer s.hookMu.Unlock()
	if s.closing {
		return false
	}
	s.onUnmap = append(s.onUnmap, f)
	return true
}

// Close runs the OnUnmap hooks, unmaps the segment and closes its fd. Safe
// to call more than once.
func (s *Segment) Close() error {
	var err error
	s.once.Do(func() {
		s.hookMu.Lock()
		s.closing = true
		hooks := s.onUnmap
		s.onUnmap = nil
		s.hookMu.Unlock()
		for _, f := range hooks {
			f()
		}
		if s.mem != nil {
			err = unix.Munmap(s.mem)
		}
		if cerr := unix.Close(s.fd); err == nil {
			err = cerr
		}
	})
	return err
}

// Resolve returns the bytes of loc within this segment, range-checked.
func (s *Segment) Resolve(loc Loc) ([]byte, error) {
	if loc.Segment != s.id {
		return nil, fmt.Errorf("%w: loc names segment %d, not %d", ErrRange, loc.Segment, s.id)
	}
	n := uint64(len(s.mem))
	if loc.Offset > n || loc.Size > n-loc.Offset {
		return nil, fmt.Errorf("%w: segment %d offset %d size %d exceeds %d", ErrRange, s.id, loc.Offset, loc.Size, n)
	}
	return s.mem[loc.Offset : loc.Offset+loc.Size : loc.Offset+loc.Size], nil
}

// SegmentTable maps segment ids to mapped segments. Client and server both
// resolve every Loc through it; lookups are lock-free (copy-on-write map).
type SegmentTable struct {
	mu      sync.Mutex // serialises writers
	m       atomic.Pointer[map[uint32]*Segment]
	changed chan struct{} // closed and replaced on every Add
	subs    map[*func(*Segment)]struct{}
}

// NewSegmentTable returns an empty table.
func NewSegmentTable() *SegmentTable {
	t := &SegmentTable{changed: make(chan struct{})}
	m := map[uint32]*Segment{}
	t.m.Store(&m)
	return t
}

// Add registers s. An id that is already present is an error.
func (t *SegmentTable) Add(s *Segment) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := *t.m.Load()
	if _, ok := old[s.id]; ok {
		return fmt.Errorf("ipc: segment %d already in table", s.id)
	}
	m := make(map[uint32]*Segment, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[s.id] = s
	t.m.Store(&m)
	close(t.changed)
	t.changed = make(chan struct{})
	for f := range t.subs {
		(*f)(s)
	}
	return nil
}

// Subscribe calls f for every segment in the table now (by id) and for
// every one added later (a client's: as each announcement is mapped), each
// once, until cancel. f runs under the table's lock, on the goroutine that
// adds the segment: it must not block or call back into the table (a GPU
// worker only queues the segment for registration with the driver on a
// goroutine of its own). cancel is idempotent; f is not called once it has
// returned.
func (t *SegmentTable) Subscribe(f func(*Segment)) (cancel func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.subs == nil {
		t.subs = map[*func(*Segment)]struct{}{}
	}
	key := &f
	t.subs[key] = struct{}{}
	m := *t.m.Load()
	for _, id := range slices.Sorted(maps.Keys(m)) {
		f(m[id])
	}
	return func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		delete(t.subs, key)
	}
}

// Get returns the segment with this id, if mapped.
func (t *SegmentTable) Get(id uint32) (*Segment, bool) {
	s, ok := (*t.m.Load())[id]
	return s, ok
}

// Len is the number of segments.
func (t *SegmentTable) Len() int { return len(*t.m.Load()) }

// Segments returns a snapshot of all segments (unordered).
func (t *SegmentTable) Segments() []*Segment {
	m := *t.m.Load()
	out := make([]*Segment, 0, len(m))
	for _, s := range m {
		out = append(out, s)
	}
	return out
}

// Resolve returns loc's bytes, range-checked; unknown segment is ErrRange.
func (t *SegmentTable) Resolve(loc Loc) ([]byte, error) {
	s, ok := t.Get(loc.Segment)
	if !ok {
		return nil, fmt.Errorf("%w: unknown segment %d", ErrRange, loc.Segment)
	}
	return s.Resolve(loc)
}

// ResolveWait is Resolve, but waits up to timeout for an unknown segment to
// be added (an announcement still in flight on the socket).
func (t *SegmentTable) ResolveWait(loc Loc, timeout time.Duration) ([]byte, error) {
	deadline := time.Now().Add(timeout)
	for {
		t.mu.Lock()
		ch := t.changed
		t.mu.Unlock()
		if s, ok := t.Get(loc.Segment); ok {
			return s.Resolve(loc)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return nil, fmt.Errorf("%w: unknown segment %d (waited %v)", ErrRange, loc.Segment, timeout)
		}
		tm := time.NewTimer(left)
		select {
		case <-ch:
		case <-tm.C:
		}
		tm.Stop()
	}
}

// CloseAll closes every segment and empties the table.
func (t *SegmentTable) CloseAll() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var first error
	for _, s := range *t.m.Load() {
		if err := s.Close(); err != nil && first == nil {
			first = err
		}
	}
	m := map[uint32]*Segment{}
	t.m.Store(&m)
	return first
}
