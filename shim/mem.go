package shim

import (
	"errors"
	"fmt"
	"log/slog"
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
// memory. Segments announced later (L1 grows) are pinned on first use. A
// segment is unregistered when it is closed (its session ended), before it
// is unmapped: the driver's registration would otherwise outlive the
// mapping, keep its pages pinned and, were a new segment mapped at the same
// address, still name the old pages. Entries are per segment, not per
// address, for the same reason.
type pinner struct {
	eng  *cuda.DeviceEngine
	mu   sync.Mutex
	done map[*ipc.Segment]bool
}

func (p *pinner) pin(c *ipc.Client, loc ipc.Loc) error {
	if p == nil {
		return nil
	}
	seg, ok := c.Segments().Get(loc.Segment)
	if !ok {
		return nil // Resolve reports the unknown segment
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[seg] {
		return nil
	}
	base := addrOf(seg.Mem())
	if err := p.eng.RegisterHost(base, seg.Size()); err != nil {
		return err
	}
	if !seg.OnUnmap(func() { p.unpin(seg, base) }) {
		p.unregister(seg, base) // closed meanwhile
		return fmt.Errorf("%w: segment %d closed", ipc.ErrClosed, seg.ID())
	}
	p.done[seg] = true
	return nil
}

// unpin runs when seg is closed, before it is unmapped. UnregisterHost
// first waits for the engine's copies, which may still use the segment.
func (p *pinner) unpin(seg *ipc.Segment, base uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.done, seg)
	p.unregister(seg, base)
}

func (p *pinner) unregister(seg *ipc.Segment, base uint64) {
	// ErrClosed: the engine closed first and unregistered everything.
	if err := p.eng.UnregisterHost(base); err != nil && !errors.Is(err, cuda.ErrClosed) {
		slog.Error("kvshim: unregister L1 segment", "segment", seg.ID(), "err", err)
	}
}

// resolve maps loc to bytes, pinning its segment for GPU copies.
func (w *Worker) resolve(c *ipc.Client, loc ipc.Loc) ([]byte, error) {
	obj, err := c.Resolve(loc)
	if err != nil {
		return nil, err
	}
	return obj, w.pins.pin(c, loc)
}
