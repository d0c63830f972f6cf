package mooncake

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// segment is shared memory both processes map: the bounce area (id 0) or an
// L1 segment the server registered.
type segment struct {
	id   int
	fd   int
	base uintptr
	mem  []byte
}

type segments struct {
	mu   sync.RWMutex
	list []segment
}

func (s *segments) add(seg segment) {
	s.mu.Lock()
	s.list = append(s.list, seg)
	s.mu.Unlock()
}

func (s *segments) all() []segment {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return append([]segment(nil), s.list...)
}

// find returns the segment and offset holding b, or ok=false.
func (s *segments) find(b []byte) (id, off int, ok bool) {
	if len(b) == 0 {
		return 0, 0, true
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, seg := range s.list {
		if p >= seg.base && p+uintptr(len(b)) <= seg.base+uintptr(len(seg.mem)) {
			return seg.id, int(p - seg.base), true
		}
	}
	return 0, 0, false
}

// memfd creates and maps an anonymous shared-memory file of size bytes.
func memfd(name string, size int) (*os.File, []byte, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		return nil, nil, err
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("mmap: %w", err)
	}
	return f, mem, nil
}

// bounce hands out page-aligned ranges of the bounce segment for buffers
// that are not in a registered segment (one copy each way).
type bounce struct {
	mem  []byte
	page int
	mu   sync.Mutex
	used []bool
	wake chan struct{} // closed and replaced on every free
}

const bouncePage = 64 << 10

var errFull = errors.New("mooncake: bounce buffer full")

func newBounce(mem []byte) *bounce {
	return &bounce{mem: mem, page: bouncePage, used: make([]bool, len(mem)/bouncePage), wake: make(chan struct{})}
}

// alloc returns the first page index of n free contiguous bytes. With
// wait, it waits (bounded by ctx) for frees when full; without, it returns
// errFull.
func (b *bounce) alloc(ctx context.Context, n int, wait bool) (int, error) {
	pages := max(1, (n+b.page-1)/b.page)
	if pages > len(b.used) {
		return 0, fmt.Errorf("mooncake: %d bytes exceed bounce_buffer_size %d (register the L1 segment instead)", n, len(b.mem))
	}
	for {
		b.mu.Lock()
		run := 0
		for i := range b.used {
			if b.used[i] {
				run = 0
				continue
			}
			run++
			if run == pages {
				first := i - pages + 1
				for j := first; j <= i; j++ {
					b.used[j] = true
				}
				b.mu.Unlock()
				return first, nil
			}
		}
		wake := b.wake
		b.mu.Unlock()
		if !wait {
			return 0, errFull
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return 0, fmt.Errorf("mooncake: waiting for bounce space: %w", ctx.Err())
		}
	}
}

func (b *bounce) free(first, n int) {
	pages := max(1, (n+b.page-1)/b.page)
	b.mu.Lock()
	for j := first; j < first+pages; j++ {
		b.used[j] = false
	}
	close(b.wake)
	b.wake = make(chan struct{})
	b.mu.Unlock()
}
