// Package ntcopy copies memory with non-temporal stores: the destination
// bypasses the CPU caches. For copies far larger than the caches (KV-cache
// blocks into L1 objects and back) this avoids reading every destination
// line from memory before overwriting it, as Go's own memmove does for
// copies of 1 MiB and more. It is assembly, not cgo, so a fault on a bad
// address stays a Go panic that debug.SetPanicOnFault can recover.
package ntcopy
