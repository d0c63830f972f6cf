package shim

import (
	"sync"
	"unsafe"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/ipc"
)

// addrOf is the address of a mapped segment's bytes. Segments are mmap'd
// outside the Go heap, so the address stays valid while the segment is
// mapped (for the life of the session).
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// pinner registers every L1 segment a GPU worker copies to or from with
// cuMemHostRegister, once per mapping, so the copies are DMA from pinned
// memory. Segments announced later (L1 grows) are pinned on first use.
type pinner struct {
	eng  *cuda.DeviceEngine
	mu   sync.Mutex
	done map[uint64]bool // mapping base addresses already registered
}

func (p *pinner) pin(c *ipc.Client, loc ipc.Loc) error {
	if p == nil {
		return nil
	}
	seg, ok := c.Segments().Get(loc.Segment)
	if !ok {
		return nil // Resolve reports the unknown segment
	}
	base := addrOf(seg.Mem())
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[base] {
		return nil
	}
	if err := p.eng.RegisterHost(base, seg.Size()); err != nil {
		return err
	}
	p.done[base] = true
	return nil
}

// resolve maps loc to bytes, pinning its segment for GPU copies.
func (w *Worker) resolve(c *ipc.Client, loc ipc.Loc) ([]byte, error) {
	obj, err := c.Resolve(loc)
	if err != nil {
		return nil, err
	}
	return obj, w.pins.pin(c, loc)
}
