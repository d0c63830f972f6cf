package kv

// Span is one contiguous copy: Len bytes from address Src to address Dst.
// layout's plans are []Span and cuda's engines take []Span, so a plan goes
// to a copy engine without a conversion.
type Span struct {
	Src, Dst, Len uint64
}

// Direction says which way a copy moves KV bytes.
type Direction uint8

const (
	// Save copies KV blocks into an object (device to host for CUDA).
	Save Direction = 1
	// Load copies an object back into KV blocks (host to device for CUDA).
	Load Direction = 2
)

func (d Direction) String() string {
	switch d {
	case Save:
		return "save"
	case Load:
		return "load"
	}
	return "direction(?)"
}
