package l1

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

type failingSource struct{ HeapSource }

func (failingSource) NewSegment(uint32, uint64) ([]byte, error) { return nil, errors.New("no memfd") }

func TestAllocatorGrowsLazilyAndReturnsSlabs(t *testing.T) {
	var announced []uint32
	a := newAllocator(HeapSource{}, 1<<20, 256<<10, 64<<10)
	a.onSegment = func(id uint32, mem []byte) { announced = append(announced, id); assert.Equal(t, len(mem), 256<<10) }
	assert.Equal(t, a.stats().Mapped, uint64(0))
	type ref struct{ slab, slot uint32 }
	var refs []ref
	for range 100 { // 100 × 8 KiB = 800 KiB
		s, sl, ok, err := a.alloc(8000)
		assert.NilError(t, err)
		assert.Assert(t, ok)
		seg, off := a.loc(s, sl)
		assert.Assert(t, seg >= 1 && off%PageSize == 0)
		refs = append(refs, ref{s, sl})
	}
	assert.DeepEqual(t, announced, []uint32{1, 2, 3, 4})
	st := a.stats()
	assert.Equal(t, st.Used, uint64(100*8192))
	assert.Equal(t, st.Requested, uint64(100*8000))
	// Full: 128 slots of 8 KiB exist; a 512 KiB object never fits a 256 KiB segment.
	_, _, ok, err := a.alloc(300 << 10)
	assert.NilError(t, err)
	assert.Assert(t, !ok)
	for range 28 {
		_, _, ok, _ := a.alloc(8192)
		assert.Assert(t, ok)
	}
	_, _, ok, _ = a.alloc(8192)
	assert.Assert(t, !ok)
	for _, r := range refs {
		a.free(r.slab, r.slot, 8000)
	}
	st = a.stats()
	assert.Equal(t, st.Used, uint64(28*8192))
	// Different class after frees: slabs came back to the segments.
	s, sl, ok, err := a.alloc(64 << 10)
	assert.NilError(t, err)
	assert.Assert(t, ok)
	a.free(s, sl, 64<<10)
}

func TestAllocatorSegmentSourceError(t *testing.T) {
	a := newAllocator(failingSource{}, 1<<20, 256<<10, 64<<10)
	_, _, ok, err := a.alloc(4096)
	assert.Assert(t, !ok)
	assert.Assert(t, errors.Is(err, ErrSegment))
	// The cache turns it into "no space" and counts it.
	c := New(failingSource{}, Config{Capacity: 1 << 20, SegmentSize: 256 << 10, SlabSize: 64 << 10})
	sh, _ := c.Shard(kv.Namespace{1}, true)
	_, ok = c.Reserve(sh, 0, &kv.Hash{1}, 4096, false)
	assert.Assert(t, !ok)
	assert.Equal(t, c.Stats().Objects[Staging], uint64(0))
	assert.Equal(t, c.Stats().SegmentErrors, uint64(1))
	assert.ErrorContains(t, c.LastSegmentError(), "no memfd")
}

// FuzzAllocator drives random alloc/free sequences and checks that live
// slots never overlap and that freeing everything returns every byte.
func FuzzAllocator(f *testing.F) {
	f.Add([]byte{1, 2, 3, 200, 9, 9, 9, 255, 0, 17})
	f.Add([]byte{0, 0, 0, 0, 128, 128, 128})
	f.Fuzz(func(t *testing.T, ops []byte) {
		a := newAllocator(HeapSource{}, 2<<20, 512<<10, 64<<10)
		type live struct {
			slab, slot uint32
			size       uint64
		}
		var lv []live
		rng := rand.New(rand.NewPCG(uint64(len(ops)), 1))
		for _, b := range ops {
			if b&1 == 1 && len(lv) > 0 {
				i := int(b>>1) % len(lv)
				a.free(lv[i].slab, lv[i].slot, lv[i].size)
				lv = append(lv[:i], lv[i+1:]...)
				continue
			}
			size := uint64(b>>1)*1024 + uint64(rng.IntN(1024)) + 1
			s, sl, ok, err := a.alloc(size)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				lv = append(lv, live{s, sl, size})
			}
		}
		type span struct {
			seg      uint32
			off, end uint64
		}
		seen := map[uint32][]span{}
		for _, l := range lv {
			seg, off := a.loc(l.slab, l.slot)
			if off%PageSize != 0 {
				t.Fatalf("unaligned offset %d", off)
			}
			end := off + RoundPage(l.size)
			for _, o := range seen[seg] {
				if off < o.end && o.off < end {
					t.Fatalf("overlap in segment %d: [%d,%d) and [%d,%d)", seg, off, end, o.off, o.end)
				}
			}
			seen[seg] = append(seen[seg], span{seg, off, end})
		}
		for _, l := range lv {
			a.free(l.slab, l.slot, l.size)
		}
		st := a.stats()
		if st.Used != 0 || st.Requested != 0 || st.Slab != 0 || st.Slabs != 0 || st.Classes != 0 {
			t.Fatalf("leak after freeing all: %+v", st)
		}
		for _, sg := range a.segs {
			if len(sg.free) != 1 || sg.free[0].off != 0 || sg.free[0].len != uint64(len(sg.mem)) {
				t.Fatalf("segment %d free list not coalesced: %+v", sg.id, sg.free)
			}
		}
	})
}
