package cuda

import (
	"syscall"
	"testing"
	"unsafe"

	"gotest.tools/v3/assert"
)

// mmapTB maps n bytes of anonymous memory: not Go-managed, like torch CPU
// tensors and L1 segments.
func mmapTB(t testing.TB, n int, prot int) ([]byte, uint64) {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, prot, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	assert.NilError(t, err)
	t.Cleanup(func() { _ = syscall.Munmap(b) })
	return b, uint64(uintptr(unsafe.Pointer(&b[0])))
}

func rw() int { return syscall.PROT_READ | syscall.PROT_WRITE }

func fill(b []byte, seed byte) {
	x := uint32(seed) + 1
	for i := range b {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
}
