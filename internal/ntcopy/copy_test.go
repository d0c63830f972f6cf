package ntcopy

import (
	"bytes"
	"runtime/debug"
	"syscall"
	"testing"
	"unsafe"

	"gotest.tools/v3/assert"
)

func mapped(t testing.TB, n int) ([]byte, uintptr) {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	assert.NilError(t, err)
	t.Cleanup(func() { syscall.Munmap(b) })
	return b, uintptr(unsafe.Pointer(&b[0]))
}

// TestCopy: every length around the thresholds and every alignment of
// either side copies exactly [dst, dst+n) and nothing next to it.
func TestCopy(t *testing.T) {
	const size = 64 << 10
	src, sa := mapped(t, size)
	dst, da := mapped(t, size)
	for i := range src {
		src[i] = byte(i*131 + i>>8)
	}
	lengths := []uintptr{0, 1, 15, 63, 64, 65, Min - 1, Min, Min + 1, Min + 63, 3*Min + 17, 32 << 10}
	for _, n := range lengths {
		for _, so := range []uintptr{0, 1, 8, 15, 16, 63} {
			for _, do := range []uintptr{0, 1, 7, 16, 33, 64} {
				for i := range dst {
					dst[i] = 0xAA
				}
				Copy(da+do, sa+so, n)
				want := bytes.Repeat([]byte{0xAA}, size)
				copy(want[do:do+n], src[so:so+n])
				assert.Assert(t, bytes.Equal(dst, want), "n %d src+%d dst+%d", n, so, do)
			}
		}
	}
}

// TestCopyFault: a bad address is a recoverable panic under
// SetPanicOnFault (the host engine turns it into a job error).
func TestCopyFault(t *testing.T) {
	_, da := mapped(t, 2*Min)
	b, sa := mapped(t, 2*Min)
	assert.NilError(t, syscall.Munmap(b))
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() { assert.Assert(t, recover() != nil, "no panic on a fault") }()
	Copy(da, sa, 2*Min)
}

// BenchmarkCopy: 32 KiB spans (a Llama-3-8B block of one layer) gathered
// from scattered places into one destination, as a save plan does.
func BenchmarkCopy(b *testing.B) {
	const span, spans = 32 << 10, 2048
	src, sa := mapped(b, 2*span*spans)
	dst, da := mapped(b, span*spans)
	for i := range src { // real pages, not the shared zero page
		src[i] = byte(i)
	}
	clear(dst)
	for _, bc := range []struct {
		name string
		f    func(dst, src, n uintptr)
	}{{"builtin", func(d, s, n uintptr) { copy(bytesAt(d, n), bytesAt(s, n)) }}, {"nontemporal", Copy}} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(span * spans)
			for b.Loop() {
				for i := uintptr(0); i < spans; i++ {
					bc.f(da+i*span, sa+((i*7919)%(2*spans))*span, span)
				}
			}
		})
	}
}
