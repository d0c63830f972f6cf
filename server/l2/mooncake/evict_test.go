package mooncake_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/l2test"
	"github.com/kvshim/kvshim/server/l2/mooncake/mctest"
)

// Mooncake's own capacity (doc.go, "Capacity"): the pool is the helpers'
// global segments; a put that finds it full fails alone with
// NO_AVAILABLE_HANDLE and the master evicts the least recently used
// objects that hold no lease, so later puts succeed. 64 MiB of puts into
// a 16 MiB segment, with a lookup of the first batch before every batch
// (a lookup grants a lease, 500 ms here: the objects in use).
func TestMooncakeEvictsWhenFull(t *testing.T) {
	py, m := env(t, 500)
	const segment, size = 16 << 20, 1 << 20
	a := l2test.Open(t, mctest.Config(py, m, segment, 16<<20, ""))
	ctx := context.Background()
	batch := func(b int) []kv.Key {
		keys := make([]kv.Key, 4)
		for i := range keys {
			keys[i] = l2test.Key(b*4 + i)
		}
		return keys
	}
	ok, failed := 0, 0
	for b := range 16 {
		if b > 0 {
			look := a.LookupAndHold(ctx, batch(0))
			l2test.Wait(t, look)
			a.Release(batch(0))
			assert.Equal(t, look.Bitmap().Count(), 4, "batch %d: an object in use was evicted", b)
		}
		keys := batch(b)
		bufs := make([][]byte, len(keys))
		for i := range keys {
			bufs[i] = l2test.Payload(b*4+i, size)
		}
		for _, r := range l2test.Wait(t, a.Store(ctx, keys, bufs)) {
			if r.OK() {
				ok++
				continue
			}
			failed++
			assert.Assert(t, is.Contains(r.Err.Error(), "NO_AVAILABLE_HANDLE"), "%v", r.Err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	all := make([]kv.Key, 64)
	for i := range all {
		all[i] = l2test.Key(i)
	}
	res := l2test.Wait(t, a.LookupAndHold(ctx, all))
	a.Release(all)
	present := 0
	for _, r := range res {
		if r.OK() {
			present++
		}
	}
	t.Logf("puts ok %d, failed %d (NO_AVAILABLE_HANDLE); %d objects present", ok, failed, present)
	assert.Assert(t, ok >= 32, "most puts succeed once the master evicts: %d of 64", ok)
	assert.Assert(t, present*size <= segment && present >= 8, "%d objects present", present)
	assert.Assert(t, !res[4].OK() && !res[5].OK(), "the oldest objects not in use were kept")
	dst := make([]byte, size)
	ld := l2test.Wait(t, a.Load(ctx, all[:1], [][]byte{dst}))
	assert.Equal(t, ld[0].Status, l2.StatusOK, "%v", ld[0].Err)
	assert.Assert(t, bytes.Equal(dst, l2test.Payload(0, size)))
}
