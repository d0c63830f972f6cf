package ntcopy

import "unsafe"

// Min is the smallest copy for which Copy uses non-temporal stores; below
// it, Copy is the built-in copy.
const Min = 4096

// Copy copies n bytes from src to dst; the ranges must not overlap. The
// memory is addressed by integers: it is not Go's (mmap'd segments, torch
// tensors), so the collector has nothing to track.
func Copy(dst, src, n uintptr) {
	if !available || n < Min {
		copy(bytesAt(dst, n), bytesAt(src, n))
		return
	}
	head := -dst & 15 // MOVNTDQ needs dst 16-byte aligned
	copy(bytesAt(dst, head), bytesAt(src, head))
	body := (n - head) &^ 63
	copyNT(dst+head, src+head, body)
	tail := n - head - body
	copy(bytesAt(dst+head+body, tail), bytesAt(src+head+body, tail))
}

// bytesAt is n bytes at addr as a slice (the uintptr -> pointer conversion
// through memory keeps vet quiet about memory that is not Go's).
func bytesAt(addr, n uintptr) []byte {
	return unsafe.Slice(*(**byte)(unsafe.Pointer(&addr)), n)
}
