package shim

import (
	"bytes"
	"slices"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/tier"
)

// savePrompt saves the 3 chunks of tokens from blocks, each rank's blocks
// filled from seed+rank, and returns the chunk hashes.
func savePrompt(t *testing.T, r *rig, req string, tokens []uint32, blocks []int64, seed uint64) []kv.Hash {
	t.Helper()
	for rank, c := range r.caches {
		for _, b := range blocks {
			c.fill(int(b), seed+uint64(rank))
		}
	}
	assert.Equal(t, r.match(t, req, tokens, Extras{}, 0), 0)
	assert.NilError(t, r.sched.AfterAlloc(req, blocks, 1, 0, 0))
	r.step(t, &Step{Requests: []StepRequest{{Req: req, Blocks: blocks, Scheduled: len(tokens)}}})
	r.sched.Finished(req)
	r.step(t, &Step{})
	hs, err := ChunkHashes(r.sched.ns, tokens, tChunk, Extras{})
	assert.NilError(t, err)
	return hs
}

// l1Object pins the L1 object (rank, h) of the rig's namespace and hands
// its bytes (the server's mapping of the shared segment) to f.
func l1Object(t *testing.T, r *rig, rank uint32, h kv.Hash, f func(obj []byte)) {
	t.Helper()
	o, ok := r.srv.Core.Pin(r.sched.ns, rank, h)
	assert.Assert(t, ok, "object (rank %d, %x) not resident", rank, h[:4])
	defer r.srv.Core.Unpin([]tier.Object{o})
	f(o.Mem)
}

// Bytes bound to keys, on the load path: a retrieved object that is intact
// (header and payload checksums verify, same layout) but names another
// key (another prompt's chunk, another rank's, another namespace's) is a
// load error for its chunk and every later one; no byte of it reaches the
// KV cache, the mismatch is counted, and the chunk before it loads.
func TestConnectorObjectOfAnotherKeyIsALoadError(t *testing.T) {
	r := newRig(t, 2)
	other := savePrompt(t, r, "other", tokensOf(5, 2), seq(0, 6), 200)
	cases := []struct {
		name   string
		damage func(hs []kv.Hash)
	}{
		{"another prompt's chunk 1", func(hs []kv.Hash) {
			l1Object(t, r, 0, other[1], func(src []byte) {
				l1Object(t, r, 0, hs[1], func(dst []byte) { copy(dst, src) })
			})
		}},
		{"rank 1's chunk 1", func(hs []kv.Hash) {
			l1Object(t, r, 1, hs[1], func(src []byte) {
				l1Object(t, r, 0, hs[1], func(dst []byte) { copy(dst, src) })
			})
		}},
		{"another namespace's chunk 1", func(hs []kv.Hash) {
			// The same payload, sealed under another namespace: only the
			// key in the header differs.
			l1Object(t, r, 0, hs[1], func(obj []byte) {
				key := kv.Key{Namespace: r.sched.ns, Rank: 0, Hash: hs[1]}
				key.Namespace[0] ^= 1
				assert.NilError(t, r.workers[0].Layout().SealObject(obj, key))
			})
		}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tokens := tokensOf(7, uint32(1000*(i+1)))
			src := seq(6, 6)
			hs := savePrompt(t, r, "save", tokens, src, uint64(10*(i+1)))
			c.damage(hs)
			before := r.workers[0].Stats()

			n := r.match(t, "load", tokens, Extras{}, 0)
			assert.Equal(t, n, 3*tChunk-1) // a full hit: vLLM computes the last token
			dst := seq(20, 6)
			for rank, cache := range r.caches {
				for _, b := range dst {
					cache.fill(int(b), 999+uint64(rank))
				}
			}
			assert.NilError(t, r.sched.AfterAlloc("load", dst, 1, -1, n))
			recv, errBlocks := r.step(t, &Step{})
			r.sched.Finished("load")
			assert.Equal(t, recv["load"], 2)
			// Rank 0: chunk 1 names another key, so chunks 1 and 2
			// (blocks 2..5) are load errors; rank 1 loads everything.
			slices.Sort(errBlocks)
			assert.DeepEqual(t, errBlocks, dst[2:])
			after := r.workers[0].Stats()
			assert.Equal(t, after.KeyMismatches-before.KeyMismatches, uint64(1))
			assert.Equal(t, after.FailedLoads-before.FailedLoads, uint64(2))
			assert.Equal(t, after.LoadedChunks-before.LoadedChunks, uint64(1))
			assert.Equal(t, r.workers[1].Stats().KeyMismatches, uint64(0))
			for layer := range tLayers {
				for k, b := range dst {
					got := r.caches[0].block(layer, int(b))
					if k < 2 { // chunk 0: the saved bytes
						assert.Assert(t, bytes.Equal(got, r.caches[0].block(layer, int(src[k]))), "layer %d block %d", layer, k)
						continue
					}
					// Not one byte of the other key's object was written.
					r.caches[0].fill(int(b), 999)
					assert.Assert(t, bytes.Equal(got, r.caches[0].block(layer, int(b))), "layer %d block %d was written", layer, k)
				}
				for k, b := range dst { // rank 1 restores all three chunks
					assert.Assert(t, bytes.Equal(r.caches[1].block(layer, int(b)), r.caches[1].block(layer, int(src[k]))), "rank 1 layer %d block %d", layer, k)
				}
			}
		})
	}
}

// The scheduler's loads carry the hashes of exactly the chunks they load
// (here chunk 1 only: vLLM has chunk 0 itself), and the metadata refuses
// a load whose hashes do not match its chunk range.
func TestLoadSpecCarriesChunkHashes(t *testing.T) {
	r := newRig(t, 1)
	tokens := tokensOf(11, 3)
	hs := savePrompt(t, r, "save", tokens[:2*tChunk+1], seq(0, 5), 1)
	n := r.match(t, "load", tokens, Extras{}, tChunk)
	assert.Equal(t, n, tChunk)
	assert.NilError(t, r.sched.AfterAlloc("load", seq(10, 4), 1, -1, n))
	b, err := r.sched.BuildMeta(&Step{})
	assert.NilError(t, err)
	w := r.workers[0]
	m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
	assert.NilError(t, err)
	assert.Equal(t, len(m.Loads), 1)
	assert.Equal(t, m.Loads[0].Start, uint32(1))
	assert.DeepEqual(t, m.Loads[0].Hashes, []kv.Hash{kv.Hash(hs[1])})
	w.StartLoads(m)
	w.wg.Wait()
	_, recv, errBlocks := w.Poll()
	assert.DeepEqual(t, recv, []string{"load"})
	assert.Equal(t, len(errBlocks), 0)
	r.sched.Finished("load")

	for _, bad := range []string{
		`{"loads":[{"req":"a","start":0,"end":2,"hashes":["` + hex64 + `"],"blocks":[1,2,3,4]}]}`,
		`{"loads":[{"req":"a","start":0,"end":1,"hashes":["` + hex64 + `","` + hex64 + `"],"blocks":[1,2]}]}`,
	} {
		_, err := DecodeStepMeta([]byte(bad), 2, 8)
		assert.ErrorContains(t, err, "chunk hashes for chunks")
	}
}

// A load that names no chunk hashes cannot check the objects' keys: every
// chunk is a load error and nothing is written.
func TestLoadWithoutChunkHashesLoadsNothing(t *testing.T) {
	r := newRig(t, 1)
	tokens := tokensOf(13, 5)
	savePrompt(t, r, "save", tokens, seq(0, 6), 1)
	n := r.match(t, "load", tokens, Extras{}, 0)
	assert.NilError(t, r.sched.AfterAlloc("load", seq(20, 6), 1, -1, n))
	b, err := r.sched.BuildMeta(&Step{})
	assert.NilError(t, err)
	w := r.workers[0]
	m, err := DecodeStepMeta(b, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
	assert.NilError(t, err)
	m.Loads[0].Hashes = nil
	for _, blk := range seq(20, 6) {
		r.caches[0].fill(int(blk), 77)
	}
	want := r.caches[0].block(1, 20)
	w.StartLoads(m)
	w.wg.Wait()
	_, _, errBlocks := w.Poll()
	assert.DeepEqual(t, errBlocks, seq(20, 6))
	assert.Assert(t, bytes.Equal(r.caches[0].block(1, 20), want))
	r.sched.Finished("load")
}
