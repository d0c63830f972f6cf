package server

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// The object table against a reference model: random operation sequences,
// every observable answer and the accounting compared after each step. L1
// is large enough that nothing is evicted (eviction has its own tests).

type mKey struct {
	rank uint32
	c    int // index into the hash pool
}

type mStage struct {
	tag byte
	k   mKey
}

type mLookup struct {
	world uint32
	mla   bool
	n     int
	state lookupState
	final int
	held  [][]bool // [reader][chunk]
}

type model struct {
	resident map[mKey]ipc.Loc
	staging  map[mStage]mStaged
	holds    map[mKey]int
	lookups  []map[uint64]*mLookup // per session slot
}

type mStaged struct {
	sess int
	loc  ipc.Loc
}

func (m *model) storedRank(lk *mLookup, r uint32) uint32 {
	if lk.mla {
		return 0
	}
	return r
}

func (m *model) release(lk *mLookup, r uint32, start, end int) {
	for c := start; c < min(end, lk.n); c++ {
		if lk.held[r][c] {
			lk.held[r][c] = false
			m.holds[mKey{m.storedRank(lk, r), c}]--
		}
	}
}

func (m *model) maybeForget(sess int, id uint64) {
	lk := m.lookups[sess][id]
	if lk.state != lkConsumed {
		return
	}
	for _, row := range lk.held {
		for _, h := range row {
			if h {
				return
			}
		}
	}
	delete(m.lookups[sess], id)
}

func (m *model) totalHolds() int {
	n := 0
	for _, v := range m.holds {
		n += v
	}
	return n
}

func TestModelRandomized(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) { runModel(t, seed, 2500, false) })
	}
	// Every table key shared by many objects: the collision chains.
	t.Run("colliding keys", func(t *testing.T) { runModel(t, 1, 2500, true) })
}

func runModel(t *testing.T, seed uint64, steps int, collide bool) {
	const nSess, nHash, maxRank = 3, 12, 3
	rng := rand.New(rand.NewPCG(seed, 0x6b7673))
	st := newCore(t, 8, Options{}, func(c *Config) { c.HighWatermark, c.LowWatermark = 1, 0.9 })
	if collide {
		st.l1.NarrowKeys(1)
	}
	pool := hashes(fmt.Sprint("model", seed), nHash)
	sess := make([]*Session, nSess)
	m := &model{resident: map[mKey]ipc.Loc{}, staging: map[mStage]mStaged{}, holds: map[mKey]int{},
		lookups: make([]map[uint64]*mLookup, nSess)}
	for i := range sess {
		sess[i] = open(t, st, i)
		m.lookups[i] = map[uint64]*mLookup{}
	}
	randKeys := func() []int {
		n := rng.IntN(5) + 1
		out := make([]int, n)
		for i := range out {
			out[i] = rng.IntN(nHash)
		}
		return out
	}
	sel := func(cs []int) []kv.Hash {
		out := make([]kv.Hash, len(cs))
		for i, c := range cs {
			out[i] = pool[c]
		}
		return out
	}
	for step := range steps {
		si := rng.IntN(nSess)
		s := sess[si]
		where := func() string { return fmt.Sprintf("seed %d step %d", seed, step) }
		switch op := rng.IntN(11); op {
		case 0, 1: // ALLOC
			tag, rank, cs := byte(rng.IntN(3)+1), uint32(rng.IntN(maxRank)), randKeys()
			resp, err := st.Alloc(s, &ipc.AllocReq{Tag: kv.Tag{tag}, Namespace: ns1, Rank: rank, Hashes: sel(cs), Sizes: sizes(len(cs))})
			assert.NilError(t, err, where())
			for i, c := range cs {
				k := mKey{rank, c}
				want := ipc.StatusOK
				if _, ok := m.resident[k]; ok {
					want = ipc.StatusResident
				} else if _, ok := m.staging[mStage{tag, k}]; ok {
					want = ipc.StatusInProgress
				} else {
					m.staging[mStage{tag, k}] = mStaged{si, resp.Locs[i]}
				}
				assert.Equal(t, resp.Status[i], want, where())
			}
		case 2, 3: // COMMIT / ABORT
			tag, rank, cs := byte(rng.IntN(3)+1), uint32(rng.IntN(maxRank)), randKeys()
			req := &ipc.CommitReq{Tag: kv.Tag{tag}, Namespace: ns1, Rank: rank, Hashes: sel(cs)}
			var resp *ipc.CommitResp
			var err error
			if op == 2 {
				resp, err = st.Commit(s, req)
			} else {
				resp, err = st.Abort(s, req)
			}
			assert.NilError(t, err, where())
			// The core handles a batch last key first; so does the model.
			for i := len(cs) - 1; i >= 0; i-- {
				sk := mStage{tag, mKey{rank, cs[i]}}
				e, ok := m.staging[sk]
				want := ipc.StatusNotFound
				if ok && e.sess == si {
					want = ipc.StatusOK
					delete(m.staging, sk)
					if _, res := m.resident[sk.k]; op == 2 && !res {
						m.resident[sk.k] = e.loc
					}
				}
				assert.Equal(t, resp.Status[i], want, where())
			}
		case 4: // LOOKUP
			id := uint64(rng.IntN(4))
			lk := &mLookup{world: uint32(rng.IntN(maxRank) + 1), mla: rng.IntN(3) == 0, n: rng.IntN(nHash + 1)}
			err := st.Lookup(s, &ipc.LookupReq{LookupID: id, Namespace: ns1, WorldSize: lk.world, MLA: lk.mla, Hashes: pool[:lk.n]})
			if _, dup := m.lookups[si][id]; dup {
				assert.Equal(t, StatusOf(err), ipc.StatusBadRequest, where())
				break
			}
			assert.NilError(t, err, where())
			ranks := lk.world
			if lk.mla {
				ranks = 1
			}
		prefix:
			for ; lk.final < lk.n; lk.final++ {
				for r := range ranks {
					if _, ok := m.resident[mKey{r, lk.final}]; !ok {
						break prefix
					}
				}
			}
			lk.held = make([][]bool, lk.world)
			for r := range lk.world {
				lk.held[r] = make([]bool, lk.n)
				for c := range lk.final {
					lk.held[r][c] = true
					m.holds[mKey{m.storedRank(lk, r), c}]++
				}
			}
			lk.state = lkFinal
			m.lookups[si][id] = lk
		case 5: // LOOKUP_RESULT
			id := uint64(rng.IntN(4))
			resp, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: id})
			assert.NilError(t, err, where())
			lk := m.lookups[si][id]
			switch {
			case lk == nil || lk.state == lkConsumed:
				assert.Equal(t, resp.Status, ipc.StatusUnknown, where())
			default:
				assert.Equal(t, resp.Status, ipc.StatusOK, where())
				assert.Equal(t, resp.Chunks, uint32(lk.final), where())
				var srcs uint32
				for _, run := range resp.Sources {
					srcs += run.Chunks
				}
				assert.Equal(t, srcs, resp.Chunks, "sources cover the answer: %s", where())
				lk.state = lkConsumed
				m.maybeForget(si, id)
			}
		case 6: // FREE
			id := uint64(rng.IntN(4))
			a, b := rng.IntN(nHash+1), rng.IntN(nHash+2)
			end := uint32(b)
			if b == nHash+1 {
				end = ^uint32(0)
			}
			err := st.Free(s, &ipc.FreeReq{LookupID: id, Start: uint32(a), End: end})
			lk := m.lookups[si][id]
			switch {
			case uint32(a) > end:
				assert.Equal(t, StatusOf(err), ipc.StatusBadRequest, where())
			case lk == nil:
				assert.Assert(t, errors.Is(err, ErrUnknownLookup), where())
			default:
				assert.NilError(t, err, where())
				for r := range lk.world {
					m.release(lk, r, a, int(min(end, uint32(nHash))))
				}
				m.maybeForget(si, id)
			}
		case 7, 8: // RETRIEVE / RELEASE, from any session, naming an owner
			oi := rng.IntN(nSess)
			id, rank := uint64(rng.IntN(4)), uint32(rng.IntN(maxRank))
			lk := m.lookups[oi][id]
			if op == 7 {
				resp, err := st.Retrieve(s, &ipc.RetrieveReq{Owner: sess[oi].ID(), LookupID: id, Rank: rank, End: ^uint32(0)})
				switch {
				case lk == nil:
					assert.Assert(t, errors.Is(err, ErrUnknownLookup), where())
				case rank >= lk.world:
					assert.Equal(t, StatusOf(err), ipc.StatusBadRequest, where())
				default:
					assert.NilError(t, err, where())
					assert.Equal(t, len(resp.Status), lk.n, where())
					for c := range lk.n {
						if lk.held[rank][c] {
							assert.Equal(t, resp.Status[c], ipc.StatusOK, where())
							assert.Equal(t, resp.Locs[c], m.resident[mKey{m.storedRank(lk, rank), c}], where())
						} else {
							assert.Equal(t, resp.Status[c], ipc.StatusNotFound, where())
						}
					}
				}
				break
			}
			err := st.Release(s, &ipc.ReleaseReq{Owner: sess[oi].ID(), LookupID: id, Rank: rank})
			switch {
			case lk == nil:
				assert.Assert(t, errors.Is(err, ErrUnknownLookup), where())
			case rank >= lk.world:
				assert.Equal(t, StatusOf(err), ipc.StatusBadRequest, where())
			default:
				assert.NilError(t, err, where())
				m.release(lk, rank, 0, lk.n)
				m.maybeForget(oi, id)
			}
		case 9: // session dies and reconnects
			if rng.IntN(4) != 0 {
				break
			}
			st.CloseSession(s)
			for id, lk := range m.lookups[si] {
				for r := range lk.world {
					m.release(lk, r, 0, lk.n)
				}
				delete(m.lookups[si], id)
			}
			for k, e := range m.staging {
				if e.sess == si {
					delete(m.staging, k)
				}
			}
			sess[si] = open(t, st, si)
		case 10: // CLEAR
			if rng.IntN(5) != 0 {
				break
			}
			resp, err := st.Clear(s)
			assert.NilError(t, err, where())
			n := uint64(0)
			for k := range m.resident {
				if m.holds[k] == 0 {
					delete(m.resident, k)
					n++
				}
			}
			assert.Equal(t, resp.Objects, n, where())
		}
		// Accounting.
		assert.Equal(t, used(t, st), float64((len(m.resident)+len(m.staging))*objSize), where())
		assert.Equal(t, holds(t, st), float64(m.totalHolds()), where())
		assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=resident}"), float64(len(m.resident)), where())
		assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), float64(len(m.staging)), where())
		live := 0
		for _, l := range m.lookups {
			live += len(l)
		}
		assert.Equal(t, stat(t, st, "kvshim_lookups_live"), float64(live), where())
	}
	assert.Assert(t, stat(t, st, "kvshim_lookup_hit_chunks_total") > 0, "the model never hit")
	assert.Assert(t, stat(t, st, "kvshim_l1_commits_total") > 0)
	// Everything released, everything cleared: back to zero.
	for i, s := range sess {
		st.CloseSession(s)
		sess[i] = open(t, st, i)
	}
	_, err := st.Clear(sess[0])
	assert.NilError(t, err)
	assert.Equal(t, used(t, st), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_slab_bytes"), 0.0)
}
