//go:build !amd64

package ntcopy

func copyNT(dst, src, n uintptr) { panic("ntcopy: no non-temporal copy on this architecture") }

const available = false
