package kv

// Loc is where an object lives in L1: (segment id, offset) and its size,
// always range-checked by whoever maps it against the segments it has. The
// wire (ipc.Loc) and L1's bookkeeping (server/l1) share this one type.
type Loc struct {
	Segment uint32
	Offset  uint64
	Size    uint64
}
