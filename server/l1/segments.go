package l1

import (
	"errors"
	"fmt"
)

// ErrSegment: the segment source failed to provide memory (the allocation
// that needed it finds no space).
var ErrSegment = errors.New("l1: segment source failed")

// SegmentSource provides L1 memory, one segment at a time, as L1 grows.
// The server wires ipc.CreateSegment behind it (server.IPCSource, which
// announces each new segment to every session); tests use HeapSource.
type SegmentSource interface {
	// NewSegment returns size bytes of memory for segment id. The memory
	// must stay valid until Close.
	NewSegment(id uint32, size uint64) (mem []byte, err error)
	// Close releases every segment. Cache.Close calls it.
	Close() error
}

// HeapSource is a SegmentSource over plain Go byte slices (tests,
// benchmarks, single-process use with no peer mapping the memory).
type HeapSource struct{}

// NewSegment allocates a zeroed slice.
func (HeapSource) NewSegment(id uint32, size uint64) ([]byte, error) {
	if size == 0 || size > 1<<40 {
		return nil, fmt.Errorf("heap segment %d: bad size %d", id, size)
	}
	return make([]byte, size), nil
}

// Close does nothing; the garbage collector frees the slices.
func (HeapSource) Close() error { return nil }
