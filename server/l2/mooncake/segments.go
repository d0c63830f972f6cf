package mooncake

import (
	"sync"
	"unsafe"
)

// segment is shared memory both processes map: the bounce area (id 0) or an
// L1 segment the server registered.
type segment struct {
	id   int
	fd   int
	base uintptr
	mem  []byte
}

type segments struct {
	mu   sync.RWMutex
	list []segment
}

func (s *segments) add(seg segment) {
	s.mu.Lock()
	s.list = append(s.list, seg)
	s.mu.Unlock()
}

func (s *segments) all() []segment {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return append([]segment(nil), s.list...)
}

// find returns the segment and offset holding b, or ok=false.
func (s *segments) find(b []byte) (id, off int, ok bool) {
	if len(b) == 0 {
		return 0, 0, true
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, seg := range s.list {
		if p >= seg.base && p+uintptr(len(b)) <= seg.base+uintptr(len(seg.mem)) {
			return seg.id, int(p - seg.base), true
		}
	}
	return 0, 0, false
}

// bouncePage is the bounce buffer's allocation unit.
const bouncePage = 64 << 10
