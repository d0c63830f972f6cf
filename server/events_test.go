package server

import (
	"sort"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func evKeys(hs []kv.Hash) []ipc.EventKey {
	out := make([]ipc.EventKey, len(hs))
	for i, h := range hs {
		out[i] = ipc.EventKey{Namespace: ns1, Hash: h}
	}
	return out
}

func takeEvents(t *testing.T, st *Core, s *Session, announce []ipc.EventKey) *ipc.EventsResp {
	t.Helper()
	r, err := st.Events(s, &ipc.EventsReq{Keys: announce})
	assert.NilError(t, err)
	return r
}

// removedSet is the set of hashes an answer reports removed from medium m.
func removedSet(r *ipc.EventsResp, m ipc.Medium) map[kv.Hash]bool {
	out := map[kv.Hash]bool{}
	for _, e := range r.Events {
		if e.Kind == ipc.EventRemoved && e.Key.Medium == m {
			out[e.Key.Hash] = true
		}
	}
	return out
}

// Two instances announce the same chunks (one wrote them, the other's save
// found them resident: both told their routers); a third instance's saves
// evict them. Both announcers are told, each exactly once per chunk, and
// the one that never announced is told nothing.
func TestEventsEvictionByAnotherInstanceReachesEveryAnnouncer(t *testing.T) {
	st := newCore(t, 0.25, Options{}, func(c *Config) { c.HighWatermark, c.LowWatermark = 0.9, 0.5 })
	a, b, c := open(t, st, 1), open(t, st, 2), open(t, st, 3)
	shared := hashes("shared", 4)
	save(t, st, a, 1, 0, shared)
	onlyB := hashes("onlyB", 2)
	save(t, st, b, 2, 0, onlyB)

	assert.Equal(t, len(takeEvents(t, st, a, evKeys(shared)).Events), 0)
	assert.Equal(t, len(takeEvents(t, st, b, evKeys(append(append([]kv.Hash{}, shared...), onlyB...))).Events), 0)
	assert.Equal(t, len(takeEvents(t, st, c, nil).Events), 0) // c has events on, announced nothing
	assert.Assert(t, !a.EventsPending() && !b.EventsPending())

	for i := range 10 { // c's saves churn L1: 256 KiB holds 32 objects
		save(t, st, c, 3, 0, hashes(string(rune('a'+i)), 8))
	}
	assert.Assert(t, stat(t, st, "kvshim_l1_evictions_total") >= 6)
	assert.Assert(t, a.EventsPending() && b.EventsPending())
	assert.Assert(t, !c.EventsPending())

	ra, rb := takeEvents(t, st, a, nil), takeEvents(t, st, b, nil)
	assert.DeepEqual(t, removedSet(ra, ipc.MediumL1), map[kv.Hash]bool{shared[0]: true, shared[1]: true, shared[2]: true, shared[3]: true})
	assert.Equal(t, len(ra.Events), 4) // once each
	want := map[kv.Hash]bool{}
	for _, h := range append(append([]kv.Hash{}, shared...), onlyB...) {
		want[h] = true
	}
	assert.DeepEqual(t, removedSet(rb, ipc.MediumL1), want)
	assert.Equal(t, len(rb.Events), 6)
	assert.Equal(t, len(takeEvents(t, st, c, nil).Events), 0)
	assert.Assert(t, !a.EventsPending() && !b.EventsPending())
	// Reported chunks are forgotten: a second eviction cycle adds nothing.
	n, q := st.EventsState(a)
	assert.Equal(t, n+q, 0)
}

// A chunk evicted between its COMMIT and its announce is reported removed
// at once (no later eviction would name it).
func TestEventsAnnounceOfEvictedChunkIsRemoved(t *testing.T) {
	st := newCore(t, 1, Options{})
	a := open(t, st, 1)
	hs := hashes("x", 3)
	save(t, st, a, 1, 0, hs[:2])
	r := takeEvents(t, st, a, evKeys(hs)) // hs[2] was never (or no longer) in L1
	assert.DeepEqual(t, removedSet(r, ipc.MediumL1), map[kv.Hash]bool{hs[2]: true})
	n, _ := st.EventsState(a)
	assert.Equal(t, n, 2)
}

// The bounds: announcing past maxAnnounced reports the oldest as removed
// (a router's view stays a subset of L1); a queue past maxQueued counts
// what it could not hold in Lost.
func TestEventsBounds(t *testing.T) {
	defer func(a, q int) { maxAnnounced, maxQueued = a, q }(maxAnnounced, maxQueued)
	maxAnnounced, maxQueued = 4, 3
	st := newCore(t, 1, Options{})
	a := open(t, st, 1)
	hs := hashes("b", 6)
	save(t, st, a, 1, 0, hs)
	r := takeEvents(t, st, a, evKeys(hs))
	assert.DeepEqual(t, removedSet(r, ipc.MediumL1), map[kv.Hash]bool{hs[0]: true, hs[1]: true})
	n, _ := st.EventsState(a)
	assert.Equal(t, n, 4)
	assert.Equal(t, r.Lost, uint64(0))
	// Clearing L1 does not go through eviction; churn it instead with a
	// small one: 4 announced chunks evicted, 3 fit in the queue.
	st2 := newCore(t, 0.25, Options{}, func(c *Config) { c.HighWatermark, c.LowWatermark = 0.9, 0.5 })
	b := open(t, st2, 2)
	save(t, st2, b, 1, 0, hs[:4])
	assert.Equal(t, len(takeEvents(t, st2, b, evKeys(hs[:4])).Events), 0)
	for i := range 10 {
		save(t, st2, b, 2, 0, hashes(string(rune('k'+i)), 8))
	}
	r = takeEvents(t, st2, b, nil)
	assert.Equal(t, len(r.Events), 3)
	assert.Equal(t, r.Lost, uint64(1))
	assert.Equal(t, takeEvents(t, st2, b, nil).Lost, uint64(0)) // counted once
}

// A session's events state is dropped with it: its keys leave the index,
// so a later eviction queues nothing for it and the survivor still hears.
func TestEventsDeadSessionCleanup(t *testing.T) {
	st := newCore(t, 0.25, Options{}, func(c *Config) { c.HighWatermark, c.LowWatermark = 0.9, 0.5 })
	a, b := open(t, st, 1), open(t, st, 2)
	hs := hashes("d", 3)
	save(t, st, a, 1, 0, hs)
	takeEvents(t, st, a, evKeys(hs))
	takeEvents(t, st, b, evKeys(hs))
	st.mu.Lock()
	assert.Equal(t, len(st.announced), 3)
	assert.Equal(t, len(st.announced[evKey{ns1, hs[0], ipc.MediumL1}]), 2)
	st.mu.Unlock()
	st.CloseSession(a)
	st.mu.Lock()
	assert.Equal(t, len(st.announced[evKey{ns1, hs[0], ipc.MediumL1}]), 1)
	assert.Assert(t, a.ev == nil)
	st.mu.Unlock()
	_, err := st.Events(a, &ipc.EventsReq{})
	assert.ErrorIs(t, err, ErrSessionClosed)
	st.CloseSession(b)
	st.mu.Lock()
	assert.Equal(t, len(st.announced), 0)
	st.mu.Unlock()
	c := open(t, st, 3)
	for i := range 10 {
		save(t, st, c, 2, 0, hashes(string(rune('p'+i)), 8))
	}
	assert.Assert(t, stat(t, st, "kvshim_l1_evictions_total") > 0)
}

// L2: a written object of an announced chunk is a STORAGE stored event;
// its drop a STORAGE removed event (the hooks the tier and fs call).
func TestEventsStorage(t *testing.T) {
	st := newCore(t, 1, Options{})
	a, b := open(t, st, 1), open(t, st, 2)
	hs := hashes("s", 2)
	save(t, st, a, 1, 0, hs)
	takeEvents(t, st, a, evKeys(hs))
	takeEvents(t, st, b, nil)
	for _, h := range hs {
		st.l2Stored(kv.Key{Namespace: ns1, Rank: 0, Hash: h})
		st.l2Stored(kv.Key{Namespace: ns1, Rank: 1, Hash: h}) // another rank: once per chunk
	}
	st.l2Stored(kv.Key{Namespace: ns1, Hash: hashes("other", 1)[0]}) // announced by nobody
	assert.Assert(t, a.EventsPending() && !b.EventsPending())
	r := takeEvents(t, st, a, nil)
	var got []kv.Hash
	for _, e := range r.Events {
		assert.Equal(t, e.Kind, ipc.EventStored)
		assert.Equal(t, e.Key.Medium, ipc.MediumL2)
		got = append(got, e.Key.Hash)
	}
	sort.Slice(got, func(i, j int) bool { return string(got[i][:]) < string(got[j][:]) })
	want := append([]kv.Hash{}, hs...)
	sort.Slice(want, func(i, j int) bool { return string(want[i][:]) < string(want[j][:]) })
	assert.DeepEqual(t, got, want)
	st.l2Dropped(kv.Key{Namespace: ns1, Hash: hs[1]})
	r = takeEvents(t, st, a, nil)
	assert.DeepEqual(t, removedSet(r, ipc.MediumL2), map[kv.Hash]bool{hs[1]: true})
	assert.Equal(t, len(r.Events), 1)
}
