package shim

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/tier"
)

// kvshim.verify on the worker: where payload CRCs are computed and checked.

// loadAll restores the 3 chunks of tokens into dst and returns the blocks
// that failed.
func loadAll(t *testing.T, r *rig, req string, tokens []uint32, dst []int64) []int64 {
	t.Helper()
	n := r.match(t, req, tokens, Extras{}, 0)
	assert.Equal(t, n, 3*tChunk-1)
	for _, b := range dst {
		r.caches[0].fill(int(b), 999)
	}
	assert.NilError(t, r.sched.AfterAlloc(req, dst, 1, -1, n))
	recv, errBlocks := r.step(t, &Step{})
	assert.Equal(t, recv[req], 1)
	r.sched.Finished(req)
	slices.Sort(errBlocks)
	return errBlocks
}

// Default (l2): saves seal headers only (the payload CRC slot stays empty
// in L1 with no L2 to set it) and loads check headers only: a payload byte
// changed in L1 is not re-read by the CPU on the restore path.
func TestConnectorVerifyL2SealsAndChecksHeadersOnly(t *testing.T) {
	r := newRig(t, 1)
	assert.Equal(t, r.workers[0].cfg.Verify, objfmt.VerifyL2)
	tokens := tokensOf(17, 4)
	src := seq(0, 6)
	hs := savePrompt(t, r, "save", tokens, src, 21)
	for _, h := range hs {
		l1Object(t, r, 0, h, func(obj []byte) {
			hd, err := objfmt.VerifyHeader(obj, kv.Key{Namespace: r.sched.ns, Hash: h})
			assert.NilError(t, err)
			assert.Assert(t, !hd.HasPayloadCRC, "a save computed a payload CRC under kvshim.verify=l2")
		})
	}
	l1Object(t, r, 0, hs[1], func(obj []byte) { obj[objfmt.HeaderSize+5] ^= 0x20 })
	dst := seq(20, 6)
	assert.Equal(t, len(loadAll(t, r, "load", tokens, dst)), 0)
	assert.Assert(t, !bytes.Equal(r.caches[0].block(0, int(dst[2])), r.caches[0].block(0, int(src[2]))))
}

// always: saves set the payload CRC before COMMIT and every load verifies
// it: a payload byte changed in L1, or an object without a payload CRC,
// is a load error for its chunk and every later one.
func TestConnectorVerifyAlways(t *testing.T) {
	r := newRig(t, 1)
	r.workers[0].cfg.Verify = objfmt.VerifyAlways
	for i, damage := range []func(obj []byte){
		func(obj []byte) { obj[objfmt.HeaderSize+5] ^= 0x20 },
		func(obj []byte) { clear(obj[objfmt.HeaderSize-8 : objfmt.HeaderSize]) },
	} {
		tokens := tokensOf(19, uint32(100*i))
		src := seq(0, 6)
		hs := savePrompt(t, r, fmt.Sprint("save", i), tokens, src, 23)
		for _, h := range hs {
			l1Object(t, r, 0, h, func(obj []byte) {
				_, err := objfmt.Verify(obj, kv.Key{Namespace: r.sched.ns, Hash: h})
				assert.NilError(t, err)
			})
		}
		l1Object(t, r, 0, hs[1], damage)
		dst := seq(20, 6)
		assert.DeepEqual(t, loadAll(t, r, fmt.Sprint("load", i), tokens, dst), dst[2:])
		for layer := range tLayers {
			for k := range 2 {
				assert.Assert(t, bytes.Equal(r.caches[0].block(layer, int(dst[k])), r.caches[0].block(layer, int(src[k]))))
			}
		}
	}
}

// The partial-hit counter-example (server/tier's seedCounterExample) end to end, under the default policy with the
// real fs adapter: a worker saves 3 chunks (headers only); the server's L2
// store gives them payload CRCs on their way to disk; after a restart
// (empty L1) chunk 1's payload in L2 is corrupt and chunk 2 intact. The
// lookup's prefix stops at chunk 1, chunk 0 is restored byte-exact, and no
// byte of chunk 1 or 2 reaches the KV cache.
func TestL2CorruptChunkIsNeverRestored(t *testing.T) {
	r := newRig(t, 1)
	dir := t.TempDir()
	restart := func(adapters ...string) {
		assert.NilError(t, r.srv.Close())
		r.cfg.L2Adapters = adapters
		srv, err := server.Start(r.cfg, nil, server.Options{})
		assert.NilError(t, err)
		t.Cleanup(func() { srv.Close() })
		r.srv = srv
	}
	restart(fmt.Sprintf(`{"type":"fs","base_path":%q}`, dir))
	tokens := tokensOf(29, 6)
	src := seq(0, 6)
	saveAfterRestart(t, r, "save", tokens, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	assert.NilError(t, r.srv.Core.Writer().Flush(ctx))
	assert.Equal(t, r.srv.Core.Writer().Stats().Checksummed, int64(3))
	restart(fmt.Sprintf(`{"type":"fs","base_path":%q}`, dir))

	// Chunk 1 in L2: the stored object (payload CRC set by the store) with
	// one payload byte changed, rewritten through the adapter (a valid fs
	// trailer: only the object check can tell).
	hs, err := ChunkHashes(r.sched.ns, tokens, tChunk, Extras{})
	assert.NilError(t, err)
	be, err := fs.Open(fs.Config{BasePath: dir})
	assert.NilError(t, err)
	key := tier.Key(r.sched.ns, 0, hs[1])
	file, err := os.ReadFile(be.Path(key))
	assert.NilError(t, err)
	obj := file[:len(file)-16] // the fs trailer
	_, err = objfmt.Verify(obj, kv.Key{Namespace: r.sched.ns, Hash: hs[1]})
	assert.NilError(t, err)
	obj[objfmt.HeaderSize+77] ^= 0x04
	assert.NilError(t, os.Remove(be.Path(key)))
	st := r.srv.Core.L2Adapters()[0].Store(ctx, []kv.Key{key}, [][]byte{obj})
	<-st.Done()
	assert.Assert(t, st.Results()[0].OK())

	dst := seq(20, 6)
	for _, b := range dst {
		r.caches[0].fill(int(b), 999)
	}
	req, n := firstHitAfterRestart(t, r, tokens)
	assert.Equal(t, n, tChunk, "the prefix goes past the corrupt chunk")
	assert.NilError(t, r.sched.AfterAlloc(req, dst, 1, -1, n))
	recv, errBlocks := r.step(t, &Step{})
	assert.Equal(t, recv[req], 1)
	assert.Equal(t, len(errBlocks), 0)
	r.sched.Finished(req)
	ps := r.srv.Core.PrefetchController().Stats()
	assert.Equal(t, ps.ChunksRejected[0], int64(1))
	c := r.caches[0]
	for layer := range tLayers {
		for k, b := range dst {
			got := c.block(layer, int(b))
			if k < 2 {
				assert.Assert(t, bytes.Equal(got, c.block(layer, int(src[k]))), "layer %d block %d not restored", layer, k)
				continue
			}
			c.fill(int(b), 999)
			assert.Assert(t, bytes.Equal(got, c.block(layer, int(b))), "layer %d block %d was written", layer, k)
		}
	}
}

// firstHitAfterRestart asks for tokens until the restarted server's L2 fill
// gives a hit (the scheduler redials too: up to 5 s), and returns that
// request and its hit; the misses before it are finished.
func firstHitAfterRestart(t *testing.T, r *rig, tokens []uint32) (string, int) {
	t.Helper()
	for i := 0; ; i++ {
		assert.Assert(t, i < 50, "no hit after the restart")
		time.Sleep(100 * time.Millisecond)
		req := fmt.Sprint("load", i)
		if n := r.match(t, req, tokens, Extras{}, 0); n > 0 {
			return req, n
		}
		r.sched.Finished(req)
	}
}
