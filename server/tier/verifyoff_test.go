package tier_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/tier"
)

// recordFill is a tier.Fill over heap buffers that records each chunk's
// verdict.
type recordFill struct {
	mu   sync.Mutex
	ok   map[uint32]bool
	done chan struct{}
}

func (f *recordFill) Reserve(rank, chunk uint32, size uint64, temporary bool) ([]byte, bool, error) {
	return make([]byte, size), true, nil
}

func (f *recordFill) Commit(rank, chunk uint32, ok bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ok[chunk] = ok
	return nil
}

func (f *recordFill) Answer()                       {}
func (f *recordFill) Done()                         { close(f.done) }
func (f *recordFill) Context() context.Context      { return nil }
func (f *recordFill) TraceAdmission(tier.Admission) {}

type noL1 struct{}

func (noL1) Unpin([]tier.Object)   {}
func (noL1) PrefetchBytes() uint64 { return 0 }

// The fill's payload check follows PrefetchConfig.Verify: under the
// default an L2 object whose payload CRC is missing or wrong is a failed
// chunk; under VerifyOff only header, key and size are checked (the
// payloads are served unchecked), and an object of another key is still
// refused.
func TestFillPayloadCheckFollowsVerifyPolicy(t *testing.T) {
	ad, err := l2.OpenJSON(fsConfig(t.TempDir()), l2.Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { ad.Close() })
	hs := hashes("policy", 4)
	corrupt := pattern(hs[2], 0)
	corrupt[objfmt.HeaderSize+1] ^= 1
	objs := [][]byte{pattern(hs[0], 0), bare(hs[1], 0), corrupt, pattern(hashes("policy other", 1)[0], 0)}
	keys := make([]kv.Key, len(hs))
	for i, h := range hs {
		keys[i] = tier.Key(ns1, 0, h)
	}
	for _, c := range []struct {
		policy objfmt.VerifyPolicy
		want   map[uint32]bool
	}{
		{objfmt.VerifyOff, map[uint32]bool{0: true, 1: true, 2: true, 3: false}},
		{objfmt.VerifyL2, map[uint32]bool{0: true, 1: false, 2: false, 3: false}},
		{objfmt.VerifyAlways, map[uint32]bool{0: true, 1: false, 2: false, 3: false}},
	} {
		t.Run(c.policy.String(), func(t *testing.T) {
			// (again: each fill deletes the objects it rejects)
			st := ad.Store(t.Context(), keys, objs)
			<-st.Done()
			for i, r := range st.Results() {
				assert.Assert(t, r.OK(), "store %d: %v", i, r.Err)
			}
			pc, err := tier.NewPrefetchController(noL1{}, []*l2.Adapter{ad},
				tier.PrefetchConfig{Budget: 1 << 30, Verify: c.policy}, nil, nil)
			assert.NilError(t, err)
			t.Cleanup(pc.Close)
			f := &recordFill{ok: map[uint32]bool{}, done: make(chan struct{})}
			assert.Assert(t, pc.Fill(tier.FillRequest{Namespace: ns1, Ranks: 1, Hashes: []kv.Hash(hs)}, f))
			select {
			case <-f.done:
			case <-time.After(20 * time.Second):
				t.Fatal("fill not done")
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			assert.DeepEqual(t, f.ok, c.want)
		})
	}
}
