package plugin

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
)

// windowPage is the window's allocation unit: every buffer a plugin gets
// starts on a page boundary (O_DIRECT-friendly for 4 KiB devices).
const windowPage = 64 << 10

// window is the shared memory the host maps (its fd 3): the only kvshim
// memory a plugin can reach. Ranges are handed to one call each and freed
// when the host answers it (or dies).
type window struct {
	f *os.File
	*hostproc.Pages
}

func newWindow(size int) (*window, error) {
	size = max(windowPage, (size+windowPage-1)/windowPage*windowPage)
	f, mem, err := hostproc.Memfd("kvshim-l2-plugin-window", size)
	if err != nil {
		return nil, fmt.Errorf("plugin: window: %w", err)
	}
	return &window{f: f, Pages: hostproc.NewPages(mem, windowPage)}, nil
}

func (w *window) close() {
	_ = unix.Munmap(w.Mem)
	_ = w.f.Close()
}
