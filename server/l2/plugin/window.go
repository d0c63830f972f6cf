package plugin

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// windowPage is the window's allocation unit: every buffer a plugin gets
// starts on a page boundary (O_DIRECT-friendly for 4 KiB devices).
const windowPage = 64 << 10

var errWindowFull = errors.New("plugin: window full")

// window is the shared memory the host maps (its fd 3): the only kvshim
// memory a plugin can reach. Ranges are handed to one call each and freed
// when the host answers it (or dies).
type window struct {
	f    *os.File
	mem  []byte
	used []bool
	mu   chanMutex
	wake chan struct{} // closed and replaced on every free
}

// chanMutex is a mutex (a buffered channel of one) so that alloc can wait
// for a free and the context at once.
type chanMutex chan struct{}

func (m chanMutex) lock()   { m <- struct{}{} }
func (m chanMutex) unlock() { <-m }

func newWindow(size int) (*window, error) {
	size = max(windowPage, (size+windowPage-1)/windowPage*windowPage)
	fd, err := unix.MemfdCreate("kvshim-l2-plugin-window", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("plugin: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "kvshim-l2-plugin-window")
	if err := f.Truncate(int64(size)); err != nil {
		f.Close()
		return nil, fmt.Errorf("plugin: window of %d bytes: %w", size, err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("plugin: mmap window: %w", err)
	}
	return &window{f: f, mem: mem, used: make([]bool, size/windowPage), mu: make(chanMutex, 1), wake: make(chan struct{})}, nil
}

func (w *window) pages(n int) int { return max(1, (n+windowPage-1)/windowPage) }

// alloc returns the offset of n free contiguous bytes. With wait it waits
// (bounded by ctx) for frees when the window is full; without, it returns
// errWindowFull.
func (w *window) alloc(ctx context.Context, n int, wait bool) (int, error) {
	pages := w.pages(n)
	if pages > len(w.used) {
		return 0, fmt.Errorf("plugin: an object of %d bytes exceeds window_bytes %d", n, len(w.mem))
	}
	for {
		w.mu.lock()
		run := 0
		for i := range w.used {
			if w.used[i] {
				run = 0
				continue
			}
			run++
			if run == pages {
				first := i - pages + 1
				for j := first; j <= i; j++ {
					w.used[j] = true
				}
				w.mu.unlock()
				return first * windowPage, nil
			}
		}
		wake := w.wake
		w.mu.unlock()
		if !wait {
			return 0, errWindowFull
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return 0, fmt.Errorf("plugin: waiting for window space: %w", ctx.Err())
		}
	}
}

func (w *window) free(off, n int) {
	w.mu.lock()
	for j := off / windowPage; j < off/windowPage+w.pages(n); j++ {
		w.used[j] = false
	}
	close(w.wake)
	w.wake = make(chan struct{})
	w.mu.unlock()
}

func (w *window) close() {
	_ = unix.Munmap(w.mem)
	_ = w.f.Close()
}
