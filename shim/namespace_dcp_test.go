package shim

import (
	"bytes"
	"testing"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// Decode context parallelism (vLLM's decode_context_parallel_size): the TP
// ranks of a stage form groups of DCPSize consecutive ranks, and each rank
// of a group holds a slice of every scheduler block's tokens (vLLM's
// scheduler block is DCPSize of the ranks' blocks; v1/worker/block_table.py
// computes the slots). So every rank's KV differs, MLA's too.

func TestNamespaceDCP(t *testing.T) {
	spec := func(world, tp, dcp int, mla bool) NamespaceSpec {
		s := baseSpec()
		s.WorldSize, s.TPSize, s.DCPSize, s.MLA = world, tp, dcp, mla
		return s
	}
	// DCP 0 and 1 are "none": the namespace of every existing deployment
	// is unchanged.
	assert.Equal(t, mustNS(t, spec(4, 4, 0, false)), mustNS(t, spec(4, 4, 1, false)))
	// DCP changes the bytes of a rank: its own namespace.
	assert.Check(t, mustNS(t, spec(4, 4, 2, false)) != mustNS(t, spec(4, 4, 1, false)))
	assert.Check(t, mustNS(t, spec(4, 4, 2, false)) != mustNS(t, spec(4, 4, 4, false)))
	// MLA under DCP is not shared: its namespace is per TP shape.
	assert.Check(t, !spec(4, 4, 2, true).SharedMLA())
	assert.Check(t, spec(4, 4, 1, true).SharedMLA())
	assert.Check(t, mustNS(t, spec(4, 4, 2, true)) != mustNS(t, spec(8, 8, 2, true)))
	assert.Check(t, is.Equal(spec(4, 4, 2, true).KVWorldSize(), 4))
	assert.Check(t, is.Equal(spec(8, 4, 2, false).RankChunkTokens(), 128))
	assert.Check(t, is.Equal(spec(8, 4, 1, false).RankChunkTokens(), 256))

	for _, tc := range []struct {
		s    NamespaceSpec
		want string
	}{
		{spec(4, 4, 3, false), "DCP size 3"},
		{spec(4, 4, 8, false), "DCP size 8"},
		{spec(4, 4, -1, false), "DCP size -1"},
	} {
		_, err := tc.s.Namespace()
		assert.Check(t, is.ErrorIs(err, ErrBadNamespaceSpec))
		assert.Check(t, is.ErrorContains(err, tc.want))
	}
	s := spec(4, 4, 2, false)
	s.ChunkSize = 255
	assert.Check(t, is.ErrorContains(s.Validate(), "chunk size 255"))
}

func TestKVRankDCP(t *testing.T) {
	ranks := func(s NamespaceSpec) (kv []uint32, writers []bool) {
		for r := 0; r < s.WorldSize; r++ {
			k, w, err := s.KVRank(r)
			assert.NilError(t, err)
			kv, writers = append(kv, k), append(writers, w)
		}
		return kv, writers
	}
	s := baseSpec()
	s.WorldSize, s.TPSize, s.DCPSize = 8, 4, 2 // 2 stages × TP 4, DCP groups {0,1} {2,3}
	for _, mla := range []bool{false, true} {
		s.MLA = mla
		kv, w := ranks(s)
		// every rank its own objects, MLA or not: the DCP ranks hold other
		// tokens, the stages other layers
		assert.DeepEqual(t, kv, []uint32{0, 1, 2, 3, 4, 5, 6, 7})
		assert.DeepEqual(t, w, []bool{true, true, true, true, true, true, true, true})
	}
}

// TestConnectorSharedMLAReadersReleaseTheirHolds: MLA at TP=2 stores one
// object (rank 0 writes it) and both ranks restore it; the server holds it
// once per reader, and each reader's RELEASE must drop its own hold (a
// reader that named the object's rank, 0, instead of its own released
// rank 0's row twice and leaked rank 1's).
func TestConnectorSharedMLAReadersReleaseTheirHolds(t *testing.T) {
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 2, ChunkSize: tChunk, MLA: true}
	r := newRigNS(t, ns)
	tokens := tokensOf(3, 11) // 3 chunks
	src := seq(0, 3*tChunk/tBS)
	for _, c := range r.caches { // identical latent KV on both ranks
		for _, b := range src {
			c.fill(int(b), 77)
		}
	}
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	assert.NilError(t, r.sched.AfterAlloc("A", src, 1, 0, 0))
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: src, Scheduled: len(tokens)}}})
	r.sched.Finished("A")
	assert.Equal(t, r.workers[0].Stats().SavedChunks, uint64(3))
	assert.Equal(t, r.workers[1].Stats().SavedChunks, uint64(0)) // stored once

	q := append(append([]uint32{}, tokens...), 5, 6, 7)
	n := r.match(t, "B", q, Extras{}, 0)
	assert.Equal(t, n, 3*tChunk)
	dst := seq(30, 3*tChunk/tBS)
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, n))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["B"], 2)
	assert.Equal(t, len(errs), 0)
	for rank, c := range r.caches {
		for k := range dst {
			assert.Assert(t, bytes.Equal(c.block(0, int(dst[k])), c.block(0, int(src[k]))), "rank %d block %d", rank, k)
		}
	}
	r.sched.Finished("B")
	assert.Equal(t, holds(t, r.srv), 0.0)
}

// TestConnectorDCPSaveRestore: TP=2 with DCP=2, one scheduler block = one
// block of each rank (tBS tokens each, 2*tBS in all), a chunk = tChunk
// tokens = tChunk/2 on each rank. Each rank saves its own slice and
// restores it byte for byte into other blocks; a rank that loses a save
// shortens every rank's hit (the fold).
func TestConnectorDCPSaveRestore(t *testing.T) {
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 2, ChunkSize: tChunk, DCPSize: 2}
	r := newRigNS(t, ns)
	cb := tChunk / (tBS * 2) // scheduler blocks per chunk
	assert.Equal(t, r.workers[0].Layout().ChunkBlocks(), cb)
	tokens := tokensOf(5, 1) // 3 chunks
	src := seq(2, 3*cb)
	for rank, c := range r.caches { // a different token slice on each rank
		for _, b := range src {
			c.fill(int(b), uint64(100+rank))
		}
	}
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	assert.NilError(t, r.sched.AfterAlloc("A", src, 1, 0, 0))
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: src, Scheduled: len(tokens)}}})
	r.sched.Finished("A")
	for _, w := range r.workers {
		assert.Equal(t, w.Stats().SavedChunks, uint64(3))
	}
	q := append(append([]uint32{}, tokens...), 9)
	n := r.match(t, "B", q, Extras{}, 0)
	assert.Equal(t, n, 3*tChunk)
	dst := seq(40, 3*cb)
	assert.NilError(t, r.sched.AfterAlloc("B", dst, 1, -1, n))
	recv, errs := r.step(t, &Step{})
	assert.Equal(t, recv["B"], 2)
	assert.Equal(t, len(errs), 0)
	for rank, c := range r.caches {
		for i := range tLayers {
			for k := range dst {
				assert.Assert(t, bytes.Equal(c.block(i, int(dst[k])), c.block(i, int(src[k]))), "rank %d layer %d block %d", rank, i, k)
			}
		}
		// the blocks after the restored ones are untouched
		assert.Assert(t, !bytes.Equal(c.block(0, int(dst[len(dst)-1])+1), c.block(0, int(src[0]))))
	}
	r.sched.Finished("B")
	assert.Equal(t, holds(t, r.srv), 0.0)
	assert.Equal(t, r.sched.Requests(), 0)
}
