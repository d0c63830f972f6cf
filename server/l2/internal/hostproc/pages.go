package hostproc

import (
	"context"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Memfd creates and maps an anonymous shared-memory file of size bytes
// (the child maps the same file: its fd passed down, or /proc/PID/fd/N).
func Memfd(name string, size int) (*os.File, []byte, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("%s of %d bytes: %w", name, size, err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("mmap %s: %w", name, err)
	}
	return f, mem, nil
}

// Pages hands out page-aligned ranges of Mem, one per buffer of a call,
// freed when the child has answered the call (or died).
type Pages struct {
	Mem  []byte
	page int
	used []bool
	mu   chanMutex
	wake chan struct{} // closed and replaced on every free
}

// chanMutex is a mutex (a buffered channel of one) so that a full Alloc
// can wait on a free and its context at once.
type chanMutex chan struct{}

func (m chanMutex) lock()   { m <- struct{}{} }
func (m chanMutex) unlock() { <-m }

// NewPages divides mem into pages of page bytes (a partial last page is
// not used).
func NewPages(mem []byte, page int) *Pages {
	return &Pages{Mem: mem, page: page, used: make([]bool, len(mem)/page), mu: make(chanMutex, 1), wake: make(chan struct{})}
}

func (p *Pages) pages(n int) int { return max(1, (n+p.page-1)/p.page) }

// Alloc returns the offset of n free contiguous bytes. With wait it waits
// (bounded by ctx) for frees when none are; without, it returns ErrFull.
// A size larger than the whole area is ErrTooLarge, waiting or not.
func (p *Pages) Alloc(ctx context.Context, n int, wait bool) (int, error) {
	pages := p.pages(n)
	if pages > len(p.used) {
		return 0, fmt.Errorf("%w: %d bytes, %d in all", ErrTooLarge, n, len(p.used)*p.page)
	}
	for {
		p.mu.lock()
		run := 0
		for i := range p.used {
			if p.used[i] {
				run = 0
				continue
			}
			run++
			if run == pages {
				first := i - pages + 1
				for j := first; j <= i; j++ {
					p.used[j] = true
				}
				p.mu.unlock()
				return first * p.page, nil
			}
		}
		wake := p.wake
		p.mu.unlock()
		if !wait {
			return 0, ErrFull
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return 0, fmt.Errorf("hostproc: waiting for space: %w", ctx.Err())
		}
	}
}

// Free returns the range Alloc(n) gave at off.
func (p *Pages) Free(off, n int) {
	p.mu.lock()
	for j := off / p.page; j < off/p.page+p.pages(n); j++ {
		p.used[j] = false
	}
	close(p.wake)
	p.wake = make(chan struct{})
	p.mu.unlock()
}
