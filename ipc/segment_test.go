package ipc

import (
	"errors"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"
)

func TestSegmentMemfdAndFallback(t *testing.T) {
	for _, fallback := range []bool{false, true} {
		memfdUnsupported.Store(fallback)
		s, err := CreateSegment(7, 5000)
		memfdUnsupported.Store(false)
		assert.NilError(t, err)
		assert.Equal(t, s.ID(), uint32(7))
		assert.Equal(t, s.Size(), uint64(8192)) // rounded to pages
		s.Mem()[100] = 9
		// A second mapping of the same fd (what a peer does) shares bytes.
		fd, err := unix.Dup(s.Fd())
		assert.NilError(t, err)
		m, err := MapSegment(7, fd, s.Size())
		assert.NilError(t, err)
		assert.Equal(t, m.Mem()[100], byte(9))
		// Lying about the size is refused before mapping.
		fd2, _ := unix.Dup(s.Fd())
		_, err = MapSegment(7, fd2, s.Size()+4096)
		assert.Assert(t, errors.Is(err, ErrRange), "%v", err)
		if !fallback { // memfd is sealed: the peer cannot shrink it under us
			assert.Assert(t, unix.Ftruncate(m.Fd(), 0) != nil)
		}
		assert.NilError(t, m.Close())
		assert.NilError(t, s.Close())
		assert.NilError(t, s.Close()) // idempotent
	}
}

func TestSegmentTable(t *testing.T) {
	tab := NewSegmentTable()
	s, err := CreateSegment(3, 4096)
	assert.NilError(t, err)
	for _, tc := range []struct {
		loc Loc
		ok  bool
	}{
		{Loc{Segment: 3, Offset: 0, Size: 4096}, true},
		{Loc{Segment: 3, Offset: 4095, Size: 1}, true},
		{Loc{Segment: 3, Offset: 4096, Size: 0}, true},
		{Loc{Segment: 3, Offset: 4096, Size: 1}, false},
		{Loc{Segment: 3, Offset: 1, Size: ^uint64(0)}, false},
		{Loc{Segment: 3, Offset: ^uint64(0), Size: 2}, false},
		{Loc{Segment: 4, Offset: 0, Size: 1}, false},
	} {
		_, err := s.Resolve(tc.loc)
		if tc.loc.Segment == 3 {
			assert.Equal(t, err == nil, tc.ok, "%+v: %v", tc.loc, err)
		}
		_, err = tab.Resolve(tc.loc)
		assert.Assert(t, errors.Is(err, ErrRange)) // not added yet
	}
	go func() { time.Sleep(20 * time.Millisecond); tab.Add(s) }()
	b, err := tab.ResolveWait(Loc{Segment: 3, Offset: 8, Size: 8}, 5*time.Second)
	assert.NilError(t, err)
	assert.Equal(t, len(b), 8)
	assert.ErrorContains(t, tab.Add(s), "already")
	assert.NilError(t, tab.CloseAll())
	assert.Equal(t, tab.Len(), 0)
}

// TestSegmentOnUnmap: hooks run once, in order, while the memory is still
// mapped; a hook added after Close starts is refused.
func TestSegmentOnUnmap(t *testing.T) {
	s, err := CreateSegment(7, 1<<20)
	assert.NilError(t, err)
	s.Mem()[0] = 42
	var seen []byte
	for i := range 2 {
		assert.Assert(t, s.OnUnmap(func() { seen = append(seen, s.Mem()[0]+byte(i)) }))
	}
	assert.NilError(t, s.Close())
	assert.NilError(t, s.Close())
	assert.DeepEqual(t, seen, []byte{42, 43})
	assert.Assert(t, !s.OnUnmap(func() { t.Error("hook after Close ran") }))
}
