package cuda

import (
	"bytes"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

func TestHostEngineCopies(t *testing.T) {
	const n = 8 << 20
	src, sa := mmapTB(t, n, rw())
	dst, da := mmapTB(t, n, rw())
	fill(src, 1)
	// One large span (split into pieces), many small scattered ones, and a
	// span that ends exactly at the end of the mapping.
	spans := []kv.Span{{Src: sa, Dst: da + 4<<20, Len: 3 << 20}}
	for i := uint64(0); i < 200; i++ {
		spans = append(spans, kv.Span{Src: sa + 3<<20 + i*8192, Dst: da + i*12288, Len: 4096 + i})
	}
	spans = append(spans, kv.Span{Src: sa + n - 1000, Dst: da + n - 1000, Len: 1000})
	for _, workers := range []int{1, 2, 5} {
		clear(dst)
		e := NewHostEngine(workers, WithMinPiece(64<<10))
		j, err := e.Submit(spans, kv.Save)
		assert.NilError(t, err)
		assert.NilError(t, j.Wait(10*time.Second))
		assert.Assert(t, j.Done())
		assert.NilError(t, j.Err())
		want := make([]byte, n)
		for _, s := range spans {
			copy(want[s.Dst-da:s.Dst-da+s.Len], src[s.Src-sa:s.Src-sa+s.Len])
		}
		assert.Assert(t, bytes.Equal(dst, want), "workers %d", workers)
		assert.NilError(t, e.Close())
		assert.NilError(t, e.Close())
	}
}

func TestHostEngineConcurrent(t *testing.T) {
	const n = 1 << 20
	src, sa := mmapTB(t, n, rw())
	dst, da := mmapTB(t, n, rw())
	fill(src, 2)
	e := NewHostEngine(3, WithMinPiece(4096))
	defer e.Close()
	var wg sync.WaitGroup
	for g := uint64(0); g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			part := uint64(n / 8)
			for r := 0; r < 20; r++ {
				j, err := e.Submit([]kv.Span{{Src: sa + g*part, Dst: da + g*part, Len: part}}, kv.Load)
				assert.Check(t, err)
				assert.Check(t, j.Wait(10*time.Second))
			}
		}()
	}
	wg.Wait()
	assert.Assert(t, bytes.Equal(src, dst))
}

func TestHostEngineRefuses(t *testing.T) {
	_, a := mmapTB(t, 4096, rw())
	e := NewHostEngine(2)
	tests := []struct {
		name  string
		spans []kv.Span
		dir   kv.Direction
	}{
		{"empty span", []kv.Span{{Src: a, Dst: a + 2048, Len: 0}}, kv.Save},
		{"null", []kv.Span{{Src: 0, Dst: a, Len: 8}}, kv.Save},
		{"wraps", []kv.Span{{Src: ^uint64(0) - 4, Dst: a, Len: 8}}, kv.Save},
		{"direction", []kv.Span{{Src: a, Dst: a + 2048, Len: 8}}, 9},
	}
	for _, tc := range tests {
		_, err := e.Submit(tc.spans, tc.dir)
		assert.ErrorIs(t, err, ErrBadSpan, tc.name)
	}
	assert.ErrorIs(t, e.WaitEvent(kv.Save, 0x1234), ErrBadSpan, "a CUDA event")
	assert.NilError(t, e.WaitEvent(kv.Save, 0))
	j, err := e.Submit(nil, kv.Save) // nothing to copy: done at once
	assert.NilError(t, err)
	assert.Assert(t, j.Done())
	assert.NilError(t, e.Close())
	_, err = e.Submit([]kv.Span{{Src: a, Dst: a + 2048, Len: 8}}, kv.Save)
	assert.ErrorIs(t, err, ErrClosed)
}

func TestHostEngineFaultIsAnError(t *testing.T) {
	_, good := mmapTB(t, 1<<20, rw())
	_, bad := mmapTB(t, 1<<20, syscall.PROT_NONE)
	e := NewHostEngine(2, WithMinPiece(4096))
	defer e.Close()
	spans := []kv.Span{{Src: good, Dst: good + 512<<10, Len: 256 << 10}, {Src: bad, Dst: good, Len: 256 << 10}}
	j, err := e.Submit(spans, kv.Save)
	assert.NilError(t, err)
	err = j.Wait(10 * time.Second)
	assert.ErrorIs(t, err, ErrBadSpan)
	assert.Check(t, is.ErrorContains(err, "faulted"))
	// The engine keeps working.
	j, err = e.Submit(spans[:1], kv.Save)
	assert.NilError(t, err)
	assert.NilError(t, j.Wait(10*time.Second))
}

func TestHostEngineWaitTimeout(t *testing.T) {
	const n = 256 << 20
	_, sa := mmapTB(t, n, rw())
	_, da := mmapTB(t, n, rw())
	e := NewHostEngine(1, WithMinPiece(n))
	defer e.Close()
	j, err := e.Submit([]kv.Span{{Src: sa, Dst: da, Len: n}}, kv.Save)
	assert.NilError(t, err)
	err = j.Wait(time.Microsecond)
	assert.ErrorIs(t, err, ErrTimeout)
	assert.NilError(t, j.Wait(30*time.Second))
}
