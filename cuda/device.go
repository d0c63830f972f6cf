package cuda

/*
#include "loader.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvshim/kvshim/kv"
)

// maxBatch bounds the descriptors of one cuMemcpyBatchAsync call.
const maxBatch = 8192

// DeviceEngine copies between one CUDA device and (pinned) host memory. All
// driver calls run on one goroutine locked to its OS thread with the
// device's primary context current (the context PyTorch uses too). Each
// direction has its own non-blocking stream, so saves and loads overlap.
type DeviceEngine struct {
	drv     *driver
	ordinal int
	dev     C.int
	ctx     uint64
	streams [3]uint64 // by kv.Direction
	batch   atomic.Int32

	reqs      chan func()
	quit      chan struct{}
	exited    chan struct{}
	closeOnce sync.Once

	// worker-thread state
	freeEvents []uint64
	allEvents  []uint64
	dsts, srcs []uint64
	lens       []uint64
	registered map[uint64]uint64

	drained atomic.Bool // teardown saw every stream finish

	spans atomic.Uint64 // spans submitted
	calls atomic.Uint64 // driver copy calls made
}

// DeviceOption configures a DeviceEngine.
type DeviceOption func(*DeviceEngine)

// WithoutBatch makes the engine submit one cuMemcpy*Async per span even
// when the driver has cuMemcpyBatchAsync (for comparisons and fallbacks).
func WithoutBatch() DeviceOption { return func(e *DeviceEngine) { e.batch.Store(0) } }

// NewDeviceEngine opens an engine on CUDA device ordinal (torch's cuda:N).
// Without a driver or device the error wraps ErrNotSupported.
func NewDeviceEngine(ordinal int, opts ...DeviceOption) (*DeviceEngine, error) {
	drv, err := defaultDriver()
	if err != nil {
		return nil, err
	}
	e := &DeviceEngine{drv: drv, ordinal: ordinal, reqs: make(chan func()), quit: make(chan struct{}),
		exited: make(chan struct{}), registered: map[uint64]uint64{}}
	e.batch.Store(int32(drv.batch))
	for _, o := range opts {
		o(e)
	}
	ready := make(chan error, 1)
	go e.serve(ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return e, nil
}

// serve is the engine's driver thread.
func (e *DeviceEngine) serve(ready chan<- error) {
	runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
	defer close(e.exited)
	d := e.drv.d
	var ctx C.uint64_t
	var dev C.int
	if err := e.drv.check(fmt.Sprintf("cuDevicePrimaryCtxRetain(device %d)", e.ordinal),
		C.kvs_primary_ctx_retain(d, C.int(e.ordinal), &ctx, &dev)); err != nil {
		ready <- err
		return
	}
	e.ctx, e.dev = uint64(ctx), dev
	err := e.drv.check("cuCtxSetCurrent", C.kvs_ctx_set_current(d, ctx))
	for _, dir := range []kv.Direction{kv.Save, kv.Load} {
		if err == nil {
			var s C.uint64_t
			err = e.drv.check("cuStreamCreate", C.kvs_stream_create(d, &s))
			e.streams[dir] = uint64(s)
		}
	}
	if err != nil {
		e.teardown()
		ready <- err
		return
	}
	ready <- nil
	for {
		select {
		case f := <-e.reqs:
			f()
		case <-e.quit:
			e.teardown()
			return
		}
	}
}

// teardown runs on the driver thread: let copies finish (bounded), then
// release everything this engine created.
func (e *DeviceEngine) teardown() {
	d := e.drv.d
	e.drained.Store(e.drain(drainLimit))
	for _, s := range e.streams[1:] {
		if s != 0 {
			C.kvs_stream_destroy(d, C.uint64_t(s))
		}
	}
	for _, ev := range e.allEvents {
		C.kvs_event_destroy(d, C.uint64_t(ev))
	}
	for p := range e.registered {
		C.kvs_host_unregister(d, C.uint64_t(p))
	}
	if e.ctx != 0 {
		C.kvs_primary_ctx_release(d, e.dev)
	}
}

// drainLimit bounds how long teardown and UnregisterHost wait for copies.
const drainLimit = 30 * time.Second

// drain waits until both streams are idle or timeout passes (driver
// thread); it reports whether they are idle.
func (e *DeviceEngine) drain(timeout time.Duration) bool {
	d := e.drv.d
	idle := func() bool {
		for _, s := range e.streams[1:] {
			if s != 0 && C.kvs_stream_query(d, C.uint64_t(s)) == cudaErrorNotReady {
				return false
			}
		}
		return true
	}
	return waitPoll(idle, timeout)
}

// do runs f on the driver thread and returns its error.
func (e *DeviceEngine) do(f func() error) error {
	errc := make(chan error, 1)
	select {
	case e.reqs <- func() { errc <- f() }:
	case <-e.exited:
		return ErrClosed
	}
	return <-errc // f always answers once started
}

// Close waits up to 30 s for in-flight copies, unregisters host memory,
// destroys streams and events and releases the primary context.
func (e *DeviceEngine) Close() error {
	e.closeOnce.Do(func() { close(e.quit) })
	<-e.exited
	return nil
}

// Ordinal is the device this engine copies to and from.
func (e *DeviceEngine) Ordinal() int { return e.ordinal }

// BatchAPI names the batched-copy entry point in use ("" = per-span).
func (e *DeviceEngine) BatchAPI() string { return batchName(int(e.batch.Load())) }

// Stats returns spans submitted and driver copy calls made so far.
func (e *DeviceEngine) Stats() (spans, calls uint64) { return e.spans.Load(), e.calls.Load() }

// RegisterHost pins [addr, addr+size) for DMA with cuMemHostRegister
// (PORTABLE: usable from every context). Call it once per L1 segment;
// registering a range twice is not an error.
func (e *DeviceEngine) RegisterHost(addr, size uint64) error {
	if addr == 0 || size == 0 {
		return errorf(ErrBadSpan, "register host [%#x, +%d)", addr, size)
	}
	return e.do(func() error {
		r := C.kvs_host_register(e.drv.d, C.uint64_t(addr), C.uint64_t(size), C.KVS_CU_MEMHOSTREGISTER_PORTABLE)
		if r == cudaErrorAlreadyHostReg {
			return nil
		}
		if err := e.drv.check("cuMemHostRegister", r); err != nil {
			return err
		}
		e.registered[addr] = size
		return nil
	})
}

// UnregisterHost undoes RegisterHost for the range starting at addr. It
// first waits (up to 30 s) for the engine's copies, which may still read or
// write that memory: call it before the memory is unmapped.
func (e *DeviceEngine) UnregisterHost(addr uint64) error {
	return e.do(func() error {
		if _, ok := e.registered[addr]; !ok {
			return errorf(ErrBadSpan, "host range %#x not registered by this engine", addr)
		}
		if !e.drain(drainLimit) {
			return errorf(ErrTimeout, "unregister host range %#x: copies still running after %v", addr, drainLimit)
		}
		delete(e.registered, addr)
		return e.drv.check("cuMemHostUnregister", C.kvs_host_unregister(e.drv.d, C.uint64_t(addr)))
	})
}

// WaitEvent enqueues cuStreamWaitEvent(stream[dir], event): copies
// submitted in that direction afterwards start only once event, as
// recorded when WaitEvent runs, has completed. event may be destroyed as
// soon as WaitEvent returns (CUDA captures the event's state at the call).
func (e *DeviceEngine) WaitEvent(dir kv.Direction, event uint64) error {
	if dir != kv.Save && dir != kv.Load {
		return errorf(ErrBadSpan, "direction %d", dir)
	}
	if event == 0 {
		return nil
	}
	return e.do(func() error {
		return e.drv.check("cuStreamWaitEvent", C.kvs_stream_wait_event(e.drv.d, C.uint64_t(e.streams[dir]), C.uint64_t(event)))
	})
}

// Submit enqueues the spans on the direction's stream and records a
// completion event. Save copies device to host, Load host to device. The
// spans are consumed before Submit returns.
//
// Submit returns an error only when no copy can have started. A driver
// error part-way through the spans fails the job instead, and the job is
// done only when the copies already queued have finished: until then they
// may still read or write the memory, so the caller must not reuse it.
func (e *DeviceEngine) Submit(spans []kv.Span, dir kv.Direction) (Job, error) {
	if _, err := checkSpans(spans, dir); err != nil {
		return nil, err
	}
	j := &deviceJob{e: e}
	err := e.do(func() error {
		d, s := e.drv.d, C.uint64_t(e.streams[dir])
		j.failed = e.enqueue(spans, dir, s)
		ev, err := e.event()
		if err == nil {
			if err = e.drv.check("cuEventRecord", C.kvs_event_record(d, C.uint64_t(ev), s)); err != nil {
				e.freeEvents = append(e.freeEvents, ev)
			}
		}
		if err != nil {
			// No completion event: wait here for what may have been queued.
			if !e.drain(drainLimit) {
				err = fmt.Errorf("%w (copies still running after %v)", err, drainLimit)
			}
			return errors.Join(j.failed, err)
		}
		j.ev = ev
		return nil
	})
	if err != nil {
		return nil, err
	}
	return j, nil
}

// enqueue issues the copies (driver thread).
func (e *DeviceEngine) enqueue(spans []kv.Span, dir kv.Direction, s C.uint64_t) error {
	e.spans.Add(uint64(len(spans)))
	e.dsts, e.srcs, e.lens = e.dsts[:0], e.srcs[:0], e.lens[:0]
	for _, sp := range spans {
		e.dsts = append(e.dsts, sp.Dst)
		e.srcs = append(e.srcs, sp.Src)
		e.lens = append(e.lens, sp.Len)
	}
	order := C.int(C.KVS_SRC_ACCESS_ORDER_STREAM) // D2H: vLLM's writes are stream-ordered
	if dir == kv.Load {
		order = C.KVS_SRC_ACCESS_ORDER_ANY // H2D: the object is held stable by the server
	}
	for off := 0; off < len(spans); {
		n := min(len(spans)-off, maxBatch)
		dp := (*C.uint64_t)(unsafe.Pointer(&e.dsts[off]))
		sp := (*C.uint64_t)(unsafe.Pointer(&e.srcs[off]))
		lp := (*C.uint64_t)(unsafe.Pointer(&e.lens[off]))
		var failed C.size_t
		if e.batch.Load() != 0 && n > 1 {
			e.calls.Add(1)
			r := C.kvs_copy_batch(e.drv.d, dp, sp, lp, C.size_t(n), order, s, &failed)
			if r == cudaErrorNotSupported {
				e.batch.Store(0) // this driver/memory combination: per-span from now on
			} else {
				if err := e.drv.check(fmt.Sprintf("%s(%s, %d spans)", e.BatchAPI(), dir, n), r); err != nil {
					return err
				}
				off += n
				continue
			}
		}
		e.calls.Add(uint64(n))
		h2d := C.int(0)
		op := "cuMemcpyDtoHAsync"
		if dir == kv.Load {
			h2d, op = 1, "cuMemcpyHtoDAsync"
		}
		if r := C.kvs_copy_spans(e.drv.d, h2d, dp, sp, lp, C.size_t(n), s, &failed); r != cudaSuccess {
			i := off + int(failed)
			return e.drv.check(fmt.Sprintf("%s(span %d: src %#x dst %#x len %d)", op, i, spans[i].Src, spans[i].Dst, spans[i].Len), r)
		}
		off += n
	}
	return nil
}

// event takes a completion event from the pool (driver thread).
func (e *DeviceEngine) event() (uint64, error) {
	if n := len(e.freeEvents); n > 0 {
		ev := e.freeEvents[n-1]
		e.freeEvents = e.freeEvents[:n-1]
		return ev, nil
	}
	var ev C.uint64_t
	if err := e.drv.check("cuEventCreate", C.kvs_event_create(e.drv.d, &ev, C.KVS_CU_EVENT_DISABLE_TIMING)); err != nil {
		return 0, err
	}
	e.allEvents = append(e.allEvents, uint64(ev))
	return uint64(ev), nil
}

type deviceJob struct {
	e      *DeviceEngine
	ev     uint64
	failed error // enqueue error, reported once the queued copies are done
	done   atomic.Bool
	mu     sync.Mutex
	err    error
}

// Done queries the completion event (cuEventQuery on the driver thread).
func (j *deviceJob) Done() bool {
	if j.done.Load() {
		return true
	}
	err := j.e.do(func() error {
		if j.done.Load() {
			return nil
		}
		r := C.kvs_event_query(j.e.drv.d, C.uint64_t(j.ev))
		if r == cudaErrorNotReady {
			return errNotReady
		}
		err := j.e.drv.check("cuEventQuery", r)
		if err == nil {
			err = j.failed
		}
		j.finish(err)
		j.e.freeEvents = append(j.e.freeEvents, j.ev)
		return nil
	})
	if err == ErrClosed {
		if j.e.drained.Load() {
			err = j.failed // Close waited for the copy
		}
		j.finish(err)
	}
	return j.done.Load()
}

var errNotReady = fmt.Errorf("not ready")

func (j *deviceJob) finish(err error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if !j.done.Load() {
		j.err = err
		j.done.Store(true)
	}
}

func (j *deviceJob) Wait(timeout time.Duration) error {
	if !waitPoll(j.Done, timeout) {
		return errorf(ErrTimeout, "device copy not done after %v", timeout)
	}
	return j.Err()
}

func (j *deviceJob) Err() error {
	if !j.done.Load() {
		return nil
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.err
}

var _ Engine = (*DeviceEngine)(nil)
