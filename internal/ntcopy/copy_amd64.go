package ntcopy

// copyNT copies n bytes (a multiple of 64) to a 16-byte aligned dst with
// MOVNTDQ, then SFENCE (copy_amd64.s). SSE2 is part of amd64.
//
//go:noescape
func copyNT(dst, src, n uintptr)

const available = true
