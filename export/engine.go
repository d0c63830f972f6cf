package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// The copy engine alone, for a worker handle: the plans the worker would
// copy for the same chunks and blocks, executed by an engine of the kind
// and size the worker uses (host engine with GOMAXPROCS goroutines for CPU
// caches, a CUDA engine for device caches), between the registered KV
// cache and caller memory laid out as objects. No server, no lookup, no
// checksum, no holds: the reference the demo measures the library's
// restores and saves against, in the same run.

// benchEngines are the engines of kvshim_worker_engine_copy, one per worker
// handle, created on first use and closed with the handle.
var benchEngines struct {
	mu sync.Mutex
	m  map[*workerState]cuda.Engine
}

func benchEngineOf(in *instance, ws *workerState, l *layout.Layout) (cuda.Engine, error) {
	benchEngines.mu.Lock()
	defer benchEngines.mu.Unlock()
	if e := benchEngines.m[ws]; e != nil {
		return e, nil
	}
	var e cuda.Engine
	switch dev := l.Device(); dev.Kind {
	case layout.CPU:
		e = cuda.NewHostEngine(0)
	default:
		de, err := cuda.NewDeviceEngine(dev.Index)
		if err != nil {
			return nil, fmt.Errorf("KV cache on %s: %w", dev, err)
		}
		e = de
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closers == nil { // the handle is closing: its closers already ran or are running
		_ = e.Close()
		return nil, fmt.Errorf("handle %d is closing: %w", in.id, os.ErrClosed)
	}
	if benchEngines.m == nil {
		benchEngines.m = map[*workerState]cuda.Engine{}
	}
	benchEngines.m[ws] = e
	in.closers = append(in.closers, func() error {
		benchEngines.mu.Lock()
		delete(benchEngines.m, ws)
		benchEngines.mu.Unlock()
		return e.Close()
	})
	return e, nil
}

// engineCopy plans chunk i of blockIDs against the object at objects +
// i*stride and runs one job, as Worker.load and Worker.save submit one job
// per request; it returns the time from the first plan to the copy's end.
func engineCopy(in *instance, ws *workerState, direction int, objects unsafe.Pointer, stride uint64,
	blockIDs []int64, timeout time.Duration) (time.Duration, error) {
	l := ws.w.Layout()
	if l == nil {
		return 0, fmt.Errorf("engine copy before kvshim_worker_register: %w", errInvalid)
	}
	if direction != int(kv.Save) && direction != int(kv.Load) {
		return 0, fmt.Errorf("direction %d: want 1 (save: KV cache to objects) or 2 (load: objects to KV cache): %w", direction, errInvalid)
	}
	dir := kv.Direction(direction)
	if objects == nil {
		return 0, fmt.Errorf("objects is NULL: %w", errInvalid)
	}
	cb := l.ChunkBlocks()
	if len(blockIDs) == 0 || len(blockIDs)%cb != 0 {
		return 0, fmt.Errorf("%d block ids: want a positive multiple of the %d blocks of a chunk: %w", len(blockIDs), cb, errInvalid)
	}
	size, err := l.ObjectSize(l.ChunkTokens())
	if err != nil {
		return 0, fmt.Errorf("%w: %w", err, errInvalid)
	}
	if stride < size {
		return 0, fmt.Errorf("object_stride %d is smaller than an object (%d bytes: header and one chunk): %w", stride, size, errInvalid)
	}
	if timeout <= 0 {
		return 0, fmt.Errorf("timeout_ms must be positive: %w", errInvalid)
	}
	eng, err := benchEngineOf(in, ws, l)
	if err != nil {
		return 0, err
	}
	base := uint64(uintptr(objects))
	spans := make([]kv.Span, 0, 64*len(blockIDs))
	start := time.Now()
	for i := 0; i < len(blockIDs)/cb; i++ {
		if spans, err = l.AppendPlan(spans, blockIDs[i*cb:(i+1)*cb], base+uint64(i)*stride, dir); err != nil {
			return 0, fmt.Errorf("chunk %d: %w: %w", i, err, errInvalid) // both sentinels kept
		}
	}
	job, err := eng.Submit(spans, kv.Direction(dir))
	if err != nil {
		return 0, err
	}
	err = job.Wait(timeout)
	if errors.Is(err, cuda.ErrTimeout) {
		// Return only once the copy has stopped reading and writing the
		// caller's memory, as Worker.copy does.
		if werr := job.Wait(time.Minute); errors.Is(werr, cuda.ErrTimeout) {
			return 0, fmt.Errorf("copy still running a minute past timeout_ms %v (objects and blocks may still be in use): %w",
				timeout, os.ErrDeadlineExceeded)
		}
		return 0, fmt.Errorf("copy slower than timeout_ms %v: %w", timeout, os.ErrDeadlineExceeded)
	}
	if err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

//export kvshim_worker_engine_copy
func kvshim_worker_engine_copy(h C.int64_t, direction C.int, objects unsafe.Pointer, objectStride C.uint64_t,
	blockIDs *C.int64_t, nBlocks C.size_t, timeoutMS C.int64_t, elapsedNs *C.uint64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		ids, err := cSlice[int64](unsafe.Pointer(blockIDs), uint64(nBlocks), "block_ids")
		if err != nil {
			return err
		}
		if elapsedNs == nil {
			return fmt.Errorf("elapsed_ns is NULL: %w", errInvalid)
		}
		d, err := engineCopy(in, ws, int(direction), objects, uint64(objectStride), ids,
			time.Duration(timeoutMS)*time.Millisecond)
		if err != nil {
			return err
		}
		*elapsedNs = C.uint64_t(d.Nanoseconds())
		return nil
	})
}
