package cuda

import (
	"fmt"
	"unsafe"

	"github.com/kvshim/kvshim/internal/ntcopy"
	"github.com/kvshim/kvshim/kv"
)

// Raw addresses. Spans name memory by address (uint64) because it is never
// Go-managed: torch CPU tensors (allocated by PyTorch's C++ allocator),
// mmap'd shared-memory segments (L1), pinned or device allocations made by
// the driver. The Go garbage collector neither moves nor frees such memory,
// so turning an address into a pointer and a slice over it is sound for as
// long as its owner keeps it mapped — which the connector guarantees for the
// life of a job (vLLM keeps its blocks until get_finished reports the job,
// the server keeps a read hold or staging space until COMMIT/RELEASE).
// Never pass the address of Go-allocated memory: the collector does not see
// a uint64 as a reference.

// pointer converts an address to unsafe.Pointer without a uintptr ->
// unsafe.Pointer conversion expression (which vet rightly flags for Go
// memory; this memory is not Go's).
func pointer(addr uint64) unsafe.Pointer {
	a := uintptr(addr)
	return *(*unsafe.Pointer)(unsafe.Pointer(&a))
}

// bytesAt is the n bytes at addr as a slice.
func bytesAt(addr, n uint64) []byte {
	return unsafe.Slice((*byte)(pointer(addr)), n)
}

// memmove copies one span on the CPU. Spans are tens of KiB (one block of
// one layer) and a job's spans far outgrow the caches: ntcopy stores around
// the cache instead of first reading every destination line.
func memmove(s kv.Span) {
	ntcopy.Copy(uintptr(s.Dst), uintptr(s.Src), uintptr(s.Len))
}

func errorf(sentinel error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", sentinel, fmt.Sprintf(format, args...))
}
