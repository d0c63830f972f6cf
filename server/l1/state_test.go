package l1

import (
	"errors"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func newTestCache(t *testing.T) (*Cache, Shard) {
	t.Helper()
	c := New(HeapSource{}, Config{Capacity: 1 << 20, SegmentSize: 256 << 10, SlabSize: 64 << 10,
		HighWatermark: 1, LowWatermark: 0.9})
	t.Cleanup(func() { assert.NilError(t, c.Close()) })
	sh, _ := c.Shard(kv.Namespace{7}, true)
	return c, sh
}

// reach returns a new object of hash h in state s (Free: one freed).
func reach(t *testing.T, c *Cache, sh Shard, h byte, s State) uint32 {
	t.Helper()
	i, ok := c.Reserve(sh, 0, &kv.Hash{h}, 5000, false)
	assert.Assert(t, ok)
	switch s {
	case Resident:
		ok, err := c.Publish(i)
		assert.NilError(t, err)
		assert.Assert(t, ok)
	case Temporary:
		assert.NilError(t, c.MakeTemporary(i))
	case Fenced:
		assert.NilError(t, c.Fence(i))
	}
	return i
}

// TestTransitions walks every (state, operation) pair: the allowed ones
// reach their state and keep the counters and the table right; the others
// fail with ErrTransition and change nothing.
func TestTransitions(t *testing.T) {
	ops := []struct {
		name string
		do   func(c *Cache, i uint32) error
	}{
		{"publish", func(c *Cache, i uint32) error { _, err := c.Publish(i); return err }},
		{"temporary", (*Cache).MakeTemporary},
		{"fence", (*Cache).Fence},
	}
	want := map[State]map[string]State{ // from → op → to; absent: ErrTransition
		Staging: {"publish": Resident, "temporary": Temporary, "fence": Fenced},
	}
	for _, from := range []State{Staging, Resident, Temporary, Fenced} {
		for _, op := range ops {
			t.Run(from.String()+"/"+op.name, func(t *testing.T) {
				c, sh := newTestCache(t)
				i := reach(t, c, sh, 1, from)
				before := c.Stats()
				err := op.do(c, i)
				to, ok := want[from][op.name]
				if !ok {
					assert.Assert(t, errors.Is(err, ErrTransition), "%v", err)
					assert.Equal(t, c.Get(i).State, from)
					assert.DeepEqual(t, c.Stats(), before)
					return
				}
				assert.NilError(t, err)
				assert.Equal(t, c.Get(i).State, to)
				s := c.Stats()
				assert.Equal(t, s.Objects[from], before.Objects[from]-1)
				assert.Equal(t, s.Objects[to], before.Objects[to]+1)
				assert.Equal(t, s.ObjectBytes[to], before.ObjectBytes[to]+5000)
				_, found := c.Find(sh, &kv.Hash{1}, 0)
				assert.Equal(t, found, to == Resident, "findable only when resident")
			})
		}
	}
}

// TestFreeFromEveryState: Free leaves no trace from any live state.
func TestFreeFromEveryState(t *testing.T) {
	for _, from := range []State{Staging, Resident, Temporary, Fenced} {
		t.Run(from.String(), func(t *testing.T) {
			c, sh := newTestCache(t)
			i := reach(t, c, sh, 1, from)
			c.Free(i)
			s := c.Stats()
			assert.Equal(t, s.Objects, [NumStates]uint64{})
			assert.Equal(t, s.ObjectBytes, [NumStates]uint64{})
			assert.Equal(t, s.Used, uint64(0))
			_, found := c.Find(sh, &kv.Hash{1}, 0)
			assert.Assert(t, !found)
			assert.Equal(t, c.lru.head, Nil)
		})
	}
}

// TestPublishFirstWins: a second copy of a resident key is discarded.
func TestPublishFirstWins(t *testing.T) {
	c, sh := newTestCache(t)
	first := reach(t, c, sh, 1, Resident)
	second := reach(t, c, sh, 1, Staging)
	ok, err := c.Publish(second)
	assert.NilError(t, err)
	assert.Assert(t, !ok)
	s := c.Stats()
	assert.Equal(t, s.Discarded, uint64(1))
	assert.Equal(t, s.DiscardedBytes, uint64(5000))
	assert.Equal(t, s.Objects[Resident], uint64(1))
	assert.Equal(t, s.Objects[Staging], uint64(0))
	i, found := c.Find(sh, &kv.Hash{1}, 0)
	assert.Assert(t, found)
	assert.Equal(t, i, first)
}

// TestHolds: an unheld temporary object goes with its last hold; a
// resident one stays; held objects are never evicted or cleared.
func TestHolds(t *testing.T) {
	tests := []struct {
		state State
		gone  bool // after Hold(2), Unhold, Unhold
	}{
		{Resident, false},
		{Temporary, true},
		{Staging, false},
	}
	for _, tc := range tests {
		t.Run(tc.state.String(), func(t *testing.T) {
			c, sh := newTestCache(t)
			i := reach(t, c, sh, 1, tc.state)
			c.Hold(i, 2)
			assert.Equal(t, c.Stats().Holds, uint64(2))
			n, _ := c.Clear()
			assert.Equal(t, n, uint64(0), "held: not cleared")
			c.Unhold(i)
			assert.Equal(t, c.Stats().Objects[tc.state], uint64(1))
			c.Unhold(i)
			assert.Equal(t, c.Stats().Holds, uint64(0))
			assert.Equal(t, c.Stats().Objects[tc.state] == 0, tc.gone)
		})
	}
}

// TestFillBytes: a fill's reservation counts in PrefetchBytes until it is
// published resident or freed; as a temporary object it still counts.
func TestFillBytes(t *testing.T) {
	tests := []struct {
		name string
		end  func(c *Cache, i uint32)
		want uint64
	}{
		{"published", func(c *Cache, i uint32) { _, _ = c.Publish(i) }, 0},
		{"temporary", func(c *Cache, i uint32) { _ = c.MakeTemporary(i) }, 8192},
		{"freed", (*Cache).Free, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, sh := newTestCache(t)
			i, ok := c.Reserve(sh, 0, &kv.Hash{1}, 5000, true)
			assert.Assert(t, ok)
			assert.Equal(t, c.PrefetchBytes(), uint64(8192))
			tc.end(c, i)
			assert.Equal(t, c.PrefetchBytes(), tc.want)
		})
	}
}

// lruOrder is the hashes' first bytes on the LRU list, head first.
func lruOrder(c *Cache) []byte {
	var out []byte
	for i := c.lru.head; i != Nil; i = c.objs.get(i).next {
		out = append(out, c.Get(i).Hash[0])
	}
	return out
}

// TestLRU: Publish puts an object at the head; Touch in chunk order makes
// a prefix's head the most recent; eviction takes unheld resident objects
// from the tail, skipping held ones.
func TestLRU(t *testing.T) {
	c, sh := newTestCache(t)
	var objs []uint32
	for h := range byte(4) {
		objs = append(objs, reach(t, c, sh, h, Resident))
	}
	assert.DeepEqual(t, lruOrder(c), []byte{3, 2, 1, 0})
	at := Nil
	for _, i := range objs[:2] {
		at = c.Touch(at, i)
	}
	assert.DeepEqual(t, lruOrder(c), []byte{0, 1, 3, 2})
	// Touching the same prefix again changes nothing.
	at = Nil
	for _, i := range objs[:2] {
		at = c.Touch(at, i)
	}
	assert.DeepEqual(t, lruOrder(c), []byte{0, 1, 3, 2})
	c.Hold(objs[3], 1)
	assert.Assert(t, c.evictOne())
	assert.DeepEqual(t, lruOrder(c), []byte{0, 1, 3})
	assert.Assert(t, c.evictOne())
	assert.DeepEqual(t, lruOrder(c), []byte{0, 3})
	assert.Assert(t, c.evictOne())
	assert.Assert(t, !c.evictOne(), "only the held object is left")
	assert.DeepEqual(t, lruOrder(c), []byte{3})
	assert.Equal(t, c.Stats().Evictions, uint64(3))
	// Touch does nothing to an object that is not resident.
	st := reach(t, c, sh, 9, Staging)
	assert.Equal(t, c.Touch(Nil, st), Nil)
}

// TestCollisions: objects sharing a table key are told apart by hash and
// rank, and unlinking one keeps the others findable.
func TestCollisions(t *testing.T) {
	c, sh := newTestCache(t)
	c.NarrowKeys(0) // every hash shares one key
	var objs []uint32
	for h := range byte(3) {
		for r := range uint32(2) {
			i, ok := c.Reserve(sh, r, &kv.Hash{h}, 100, false)
			assert.Assert(t, ok)
			_, err := c.Publish(i)
			assert.NilError(t, err)
			objs = append(objs, i)
		}
	}
	c.Free(objs[2]) // hash 1, rank 0: mid-chain
	out := make([]uint32, 2)
	for h := range byte(3) {
		c.FindRanks(sh, &kv.Hash{h}, out)
		for r := range uint32(2) {
			i, found := c.Find(sh, &kv.Hash{h}, r)
			gone := h == 1 && r == 0
			assert.Equal(t, found, !gone, "hash %d rank %d", h, r)
			assert.Equal(t, out[r] == Nil, gone)
			if found {
				assert.Equal(t, i, objs[int(h)*2+int(r)])
			}
		}
	}
	_, found := c.Find(NoShard, &kv.Hash{0}, 0)
	assert.Assert(t, !found)
}
