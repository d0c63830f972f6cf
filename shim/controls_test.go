package shim

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server"
)

// vLLM's controls on the scheduler side, against a real server with a real
// fs L2 (controls.go, server/reset.go): reset_cache and the hit sources.

// newL2Rig is a one-rank rig whose server writes through to an fs L2 and
// keeps what it fills from L2 resident (so a later lookup finds it in L1).
func newL2Rig(t *testing.T) *rig {
	t.Helper()
	dir := t.TempDir()
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk}
	return newRigWith(t, ns, func(c *server.Config) {
		c.L2Adapters = []string{fmt.Sprintf(`{"type":"fs","base_path":%q}`, dir)}
		c.L2PrefetchRetain = true
	}, nil)
}

func (r *rig) flushL2(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	assert.NilError(t, r.srv.Core.Writer().Flush(ctx))
}

// clearL1 drops every unheld L1 object (OpClear), as `kvshim` tools do.
func (r *rig) clearL1(t *testing.T) {
	t.Helper()
	c, err := ipc.Dial(r.cfg.Socket, ipc.Hello{Version: ipc.ProtocolVersion, Role: ipc.RoleTool, Instance: uuid.New()}, 2*time.Second)
	assert.NilError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = c.Clear(ctx)
	assert.NilError(t, err)
}

// load plans req's load of n tokens into fresh blocks and runs it.
func (r *rig) load(t *testing.T, req string, n int) {
	t.Helper()
	assert.NilError(t, r.sched.AfterAlloc(req, seq(40, (n+tBS-1)/tBS+1), 1, 0, n))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv[req], 1)
	assert.Equal(t, len(errs), 0)
}

// loadHit matches req over withTail(tokens), wants a hit of chunks full
// chunks and loads it; returns the tokens loaded.
func (r *rig) loadHit(t *testing.T, req string, tokens []uint32, chunks int) int {
	t.Helper()
	n := r.match(t, req, withTail(tokens), Extras{}, 0)
	assert.Equal(t, n, chunks*tChunk)
	r.load(t, req, n)
	return n
}

// withTail is tokens and a partial chunk after them (so a hit of every
// full chunk loads all of them).
func withTail(tokens []uint32) []uint32 { return append(append([]uint32{}, tokens...), 1, 2, 3) }

func TestHitSourcesSplitByTier(t *testing.T) {
	r := newL2Rig(t)
	tokens := tokensOf(31, 4) // 3 chunks
	_, saved := saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)
	r.flushL2(t)

	// From L1: every token is a host hit.
	n := r.loadHit(t, "B", tokens, 3)
	assert.DeepEqual(t, r.sched.HitSources("B", n), map[HitSource]int{SourceHost: 3 * tChunk})
	r.sched.Finished("B")

	// L1 emptied; chunk 0 comes back from disk (and stays resident).
	r.clearL1(t)
	n = r.match(t, "C", tokens[:tChunk+1], Extras{}, 0)
	assert.Equal(t, n, tChunk)
	r.load(t, "C", n)
	assert.DeepEqual(t, r.sched.HitSources("C", n), map[HitSource]int{SourceDisk: tChunk})
	r.sched.Finished("C")

	// A hit that spans tiers: chunk 0 from L1, chunks 1 and 2 from disk,
	// vLLM having the first block itself (local hit): counts sum to the load.
	n = r.match(t, "D", withTail(tokens), Extras{}, tBS)
	assert.Equal(t, n, 3*tChunk-tBS)
	assert.NilError(t, r.sched.AfterAlloc("D", seq(40, 7), 1, tBS, n))
	assert.DeepEqual(t, r.sched.HitSources("D", n), map[HitSource]int{SourceHost: tChunk - tBS, SourceDisk: 2 * tChunk})
	r.step(t, &Step{})
	r.sched.Finished("D")
	// A request kvshim does not know: all of it unspecified, never dropped.
	assert.DeepEqual(t, r.sched.HitSources("nobody", 5), map[HitSource]int{SourceUnspecified: 5})
	assert.DeepEqual(t, r.sched.HitSources("nobody", 0), map[HitSource]int{})
}

func TestResetMakesEveryTierMiss(t *testing.T) {
	r := newL2Rig(t)
	// Another instance of the same deployment on the same server.
	other, err := NewScheduler(SchedulerConfig{Socket: r.cfg.Socket, Namespace: r.sched.cfg.Namespace, BlockSize: tBS,
		Timeout: 2 * time.Second, Instance: uuid.New()})
	assert.NilError(t, err)
	t.Cleanup(func() { other.Close() })
	otherMatch := func(req string, tokens []uint32) int {
		var n int
		testkit.Eventually(t, 5*time.Second, "the lookup of "+req+" to be answered", func() bool {
			var pending bool
			var err error
			n, pending, err = other.Match(req, tokens, Extras{}, 0)
			assert.NilError(t, err)
			return !pending
		})
		other.Finished(req)
		return n
	}
	tokens := tokensOf(17, 9)
	_, saved := saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)
	r.flushL2(t)
	assert.Equal(t, otherMatch("O1", withTail(tokens)), 3*tChunk) // the other instance hits too

	gen, err := r.sched.Reset()
	assert.NilError(t, err)
	assert.Assert(t, gen > 0)
	// Neither from L1 nor refilled from the fs L2 (which still has the bytes).
	assert.Equal(t, r.match(t, "B", withTail(tokens), Extras{}, 0), 0)
	r.sched.Finished("B")
	assert.Equal(t, r.srv.Core.PrefetchController().Stats().ChunksOK[0], int64(0))
	// The other instance's first answer after the reset is stale (keyed
	// under the old generation): a miss, and it takes the new generation.
	assert.Equal(t, otherMatch("O2", withTail(tokens)), 0)
	assert.Equal(t, other.Generation(), gen)

	// What is saved after the reset is found again, by both instances.
	_, saved = saveChunks(t, r, "C", tokens, 3)
	assert.Equal(t, saved, 3)
	assert.Equal(t, r.match(t, "D", withTail(tokens), Extras{}, 0), 3*tChunk)
	r.sched.Finished("D")
	assert.Equal(t, otherMatch("O3", withTail(tokens)), 3*tChunk)

	// A second reset moves past the first.
	gen2, err := r.sched.Reset()
	assert.NilError(t, err)
	assert.Assert(t, gen2 > gen)

	// No server: the reset did not happen, and says so.
	assert.NilError(t, r.srv.Close())
	_, err = r.sched.Reset()
	assert.ErrorIs(t, err, ErrUnavailable)
}

// A scheduler that starts after a reset keys with the new generation from
// its first request (it asks the server before keying).
func TestResetSeenByALaterInstance(t *testing.T) {
	r := newL2Rig(t)
	tokens := tokensOf(5, 1)
	_, saved := saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)
	gen, err := r.sched.Reset()
	assert.NilError(t, err)
	later, err := NewScheduler(SchedulerConfig{Socket: r.cfg.Socket, Namespace: r.sched.cfg.Namespace, BlockSize: tBS,
		Timeout: 2 * time.Second, Instance: uuid.New()})
	assert.NilError(t, err)
	t.Cleanup(func() { later.Close() })
	_, _, err = later.Match("L", withTail(tokens), Extras{}, 0)
	assert.NilError(t, err)
	assert.Equal(t, later.Generation(), gen)
	later.Finished("L")
}
