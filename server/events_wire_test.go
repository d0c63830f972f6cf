package server

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// wireSave writes and commits hs through a worker's rings (objects of
// size bytes).
func wireSave(t *testing.T, ctx context.Context, w *ipc.Client, hs []kv.Hash, size uint64) {
	t.Helper()
	tag := kv.Tag(w.Hello().Instance)
	sz := make([]uint64, len(hs))
	for i := range sz {
		sz[i] = size
	}
	ar, err := w.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: ns1, Hashes: hs, Sizes: sz})
	assert.NilError(t, err)
	var ok []kv.Hash
	for i, st := range ar.Status {
		if st == ipc.StatusOK {
			ok = append(ok, hs[i])
		}
	}
	_, err = w.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns1, Hashes: ok})
	assert.NilError(t, err)
}

// Through a real `kvshim serve`'s rings: two scheduler sessions announce
// the chunks of one instance; another instance's saves evict them; each
// announcer learns it from the flag on an answer it asked for anyway (a
// STATS here) and fetches the removals with one OpEvents. A version-3
// client is still served and never sees the flag.
func TestEventsOverTheWire(t *testing.T) {
	_, path := startServer(t) // 8 MiB of L1
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, b := dial(t, path, ipc.RoleScheduler), dial(t, path, ipc.RoleScheduler)
	w1, w2 := dial(t, path, ipc.RoleWorker), dial(t, path, ipc.RoleWorker)
	old, err := ipc.Dial(path, ipc.Hello{Version: 3, Role: ipc.RoleScheduler, PID: uint32(os.Getpid()), Instance: uuid.New()}, 5*time.Second)
	assert.NilError(t, err)
	defer old.Close()

	hs := hashes("wire", 4)
	wireSave(t, ctx, w1, hs, 256<<10)
	for _, c := range []*ipc.Client{a, b} {
		r, err := c.Events(ctx, &ipc.EventsReq{Keys: evKeys(hs)})
		assert.NilError(t, err)
		assert.Equal(t, len(r.Events), 0)
	}
	_, err = old.Stats(ctx)
	assert.NilError(t, err)
	assert.Assert(t, !a.EventsPending() && !b.EventsPending())
	for i := range 6 { // 6 x 8 x 256 KiB: L1 turns over
		wireSave(t, ctx, w2, hashes(string(rune('a'+i))+"w2", 8), 256<<10)
	}
	for _, c := range []*ipc.Client{a, b} {
		_, err := c.Stats(ctx)
		assert.NilError(t, err)
		assert.Assert(t, c.EventsPending(), "the answer's header carries the flag")
		r, err := c.Events(ctx, &ipc.EventsReq{})
		assert.NilError(t, err)
		assert.DeepEqual(t, removedSet(r, ipc.MediumL1), map[kv.Hash]bool{hs[0]: true, hs[1]: true, hs[2]: true, hs[3]: true})
		assert.Assert(t, !c.EventsPending())
		_, err = c.Stats(ctx)
		assert.NilError(t, err)
		assert.Assert(t, !c.EventsPending(), "nothing queued: no flag")
	}
	_, err = old.Stats(ctx)
	assert.NilError(t, err)
	assert.Assert(t, !old.EventsPending())
}
