package shim

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
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
// memory. A segment is unregistered when it is closed (its session ended),
// before it is unmapped: the driver's registration would otherwise outlive
// the mapping, keep its pages pinned and, were a new segment mapped at the
// same address, still name the old pages. Entries are per segment, not per
// address, for the same reason.
//
// Registration is off the copies' path where it can be: once the pinner
// has seen a client (watch; the first resolve at the latest), every
// segment the client has mapped, and every one announced later (L1 grows;
// the server prepares segments ahead of use), is queued and registered by
// a background goroutine, in id order, while the client is in use (Use:
// the segment cannot be unmapped under the registration). A copy whose
// segment is not registered yet registers it itself (pin), as before; one
// whose segment the background is registering waits for that. The copy
// engine runs every driver call on one thread, so a copy submitted while a
// background registration runs still waits for it there: the gain is that
// the registrations happen when segments are announced (at the server's
// start-up, or a watermark ahead of use), not when a request first copies.
type pinner struct {
	eng  *cuda.DeviceEngine
	mu   sync.Mutex // serialises registrations; guards done
	done map[*ipc.Segment]bool

	qmu     sync.Mutex                 // guards watched, queue, running
	watched map[*ipc.Client]func()     // client -> cancel of its subscription
	last    atomic.Pointer[ipc.Client] // the client watch saw last (fast path)
	queue   []pinJob
	running bool

	// Registrations made by the background and by copies (tests).
	bgPins, copyPins atomic.Uint64
}

type pinJob struct {
	c   *ipc.Client
	seg *ipc.Segment
}

// watch subscribes to c's segments: each one mapped now or later is queued
// for registration in the background. Later calls for c return at once.
func (p *pinner) watch(c *ipc.Client) {
	if p == nil || p.last.Load() == c {
		return
	}
	p.qmu.Lock()
	if _, ok := p.watched[c]; ok {
		p.qmu.Unlock()
		p.last.Store(c)
		return
	}
	if p.watched == nil {
		p.watched = map[*ipc.Client]func(){}
	}
	var ended []func()
	for old, cancel := range p.watched { // sessions that ended
		select {
		case <-old.Done():
			if cancel != nil {
				ended = append(ended, cancel)
			}
			delete(p.watched, old)
		default:
		}
	}
	p.watched[c] = nil // subscribing: a concurrent watch of c returns
	p.qmu.Unlock()
	// Not under qmu: a subscription's callback takes qmu under its table's
	// lock, which Subscribe and cancel take.
	for _, cancel := range ended {
		cancel()
	}
	cancel := c.Segments().Subscribe(func(seg *ipc.Segment) { p.enqueue(c, seg) })
	p.qmu.Lock()
	_, still := p.watched[c]
	if still {
		p.watched[c] = cancel
	}
	p.qmu.Unlock()
	if !still { // c ended and was pruned meanwhile
		cancel()
	}
	p.last.Store(c)
}

// enqueue queues seg of c for background registration (called under c's
// segment table lock: it must not block).
func (p *pinner) enqueue(c *ipc.Client, seg *ipc.Segment) {
	p.qmu.Lock()
	defer p.qmu.Unlock()
	p.queue = append(p.queue, pinJob{c, seg})
	if !p.running {
		p.running = true
		go p.drain()
	}
}

// drain registers queued segments until the queue is empty.
func (p *pinner) drain() {
	for {
		p.qmu.Lock()
		if len(p.queue) == 0 {
			p.running = false
			p.queue = nil
			p.qmu.Unlock()
			return
		}
		j := p.queue[0]
		p.queue[0] = pinJob{}
		p.queue = p.queue[1:]
		p.qmu.Unlock()
		p.pinAhead(j)
	}
}

// pinAhead registers j.seg unless a copy did already, holding a use of
// the client so the segment stays mapped meanwhile; a session that ended
// has nothing left to register.
func (p *pinner) pinAhead(j pinJob) {
	release, err := j.c.Use()
	if err != nil {
		return
	}
	defer release()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[j.seg] {
		return
	}
	if err := p.registerLocked(j.seg); err != nil {
		// The first copy into the segment registers it and reports failure.
		if !errors.Is(err, cuda.ErrClosed) && !errors.Is(err, ipc.ErrClosed) {
			slog.Warn("kvshim: registering an L1 segment ahead of use", "segment", j.seg.ID(), "err", err)
		}
		return
	}
	p.bgPins.Add(1)
}

// pin registers loc's segment for a copy, unless it is already.
func (p *pinner) pin(c *ipc.Client, loc ipc.Loc) error {
	if p == nil {
		return nil
	}
	p.watch(c)
	seg, ok := c.Segments().Get(loc.Segment)
	if !ok {
		return nil // Resolve reports the unknown segment
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[seg] {
		return nil
	}
	if err := p.registerLocked(seg); err != nil {
		return err
	}
	p.copyPins.Add(1)
	return nil
}

// registerLocked registers seg with the driver, and unregisters it when it
// is closed, before it is unmapped.
func (p *pinner) registerLocked(seg *ipc.Segment) error {
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
