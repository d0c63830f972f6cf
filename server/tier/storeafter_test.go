package tier_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
)

// --l2-store-after-lookups N (server/admit.go): an object reaches L2 once
// lookups found it N times; 0 writes through at COMMIT.

func storeAfterEnv(t *testing.T, n int) *env { return storeAfterEnvMiB(t, n, 8) }

func storeAfterEnvMiB(t *testing.T, n int, mib float64) *env {
	return newEnv(t, mib, func(c *server.Config) { c.L2StoreAfterLookups = n }, server.Options{}, fsConfig(t.TempDir()))
}

// lookupFree looks hs up and releases the lookup's holds.
func (e *env) lookupFree(t *testing.T, hs []kv.Hash) uint32 {
	t.Helper()
	id, n := e.lookup(t, 1, false, hs)
	if n > 0 { // (a miss holds nothing and is forgotten once read)
		assert.NilError(t, e.st.Free(e.sess, &ipc.FreeReq{LookupID: id, End: ^uint32(0)}))
	}
	return n
}

func TestStoreAfterLookups(t *testing.T) {
	for _, tc := range []struct {
		n       int
		lookups int
		saved   int64
	}{
		{0, 0, 3}, // write-through: at commit
		{2, 0, 0},
		{2, 1, 0},
		{2, 2, 3},
		{2, 5, 3}, // written once
		{1, 1, 3},
	} {
		t.Run(fmt.Sprintf("after %d, %d lookups", tc.n, tc.lookups), func(t *testing.T) {
			e := storeAfterEnv(t, tc.n)
			hs := hashes(fmt.Sprint("after", tc.n, tc.lookups), 3)
			e.put(t, 0, hs)
			for range tc.lookups {
				assert.Equal(t, e.lookupFree(t, hs), uint32(3))
			}
			e.flush(t)
			st := e.st.Writer().Stats()
			assert.Equal(t, st.Saved[0], tc.saved)
			assert.Equal(t, st.Errors[0], int64(0))
			if tc.n > 0 {
				assert.Equal(t, e.stat(t, "kvshim_l2_store_admitted_by_lookups_total"), float64(tc.saved))
			}
			// Holds: the writer's pins are gone once the writes end.
			assert.Equal(t, e.stat(t, "kvshim_l1_holds"), 0.0)
		})
	}
}

func TestStoreAfterLookupsRejectsNegative(t *testing.T) {
	cfg := server.DefaultConfig()
	cfg.L2StoreAfterLookups = -1
	assert.ErrorContains(t, cfg.Validate(), "--l2-store-after-lookups")
}

// TestBenchStoreAfterLookups (make bench-l2-admission; skipped unless
// KVSHIM_BENCH_L2_ADMISSION=1): L2 write traffic of a prefix_repetition-shaped
// run (vLLM's benchmark dataset: P shared prefixes, each request = one
// prefix + a suffix of its own) with write-through against
// --l2-store-after-lookups 1 and 2, on a real fs L2. Each request saves
// its prefix's chunks (resident: no write) and its suffix's, then later
// requests of the same prefix look the prefix up. One JSON line on stdout.
//
//	KVSHIM_BENCH_L2_ADMISSION=1 go test -run TestBenchStoreAfterLookups -v ./server/tier/
func TestBenchStoreAfterLookups(t *testing.T) {
	if os.Getenv("KVSHIM_BENCH_L2_ADMISSION") == "" {
		t.Skip("a benchmark: make bench-l2-admission")
	}
	const prefixes, reqs, prefixChunks, suffixChunks = 8, 200, 4, 2
	out := map[string]any{"workload": map[string]int{"prefixes": prefixes, "requests": reqs,
		"prefix_chunks": prefixChunks, "suffix_chunks": suffixChunks, "object_bytes": objSize}}
	{
		for _, n := range []int{0, 1, 2} {
			e := storeAfterEnvMiB(t, n, 256) // room for every object: no eviction, no busy skips
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range reqs {
				p := rng.IntN(prefixes)
				pre := hashes(fmt.Sprint("prefix", p), prefixChunks)
				e.lookupFree(t, pre)
				e.put(t, 0, pre)
				e.put(t, 0, hashes(fmt.Sprint("suffix", i), suffixChunks))
			}
			e.flush(t)
			st := e.st.Writer().Stats()
			out[fmt.Sprintf("after_%d", n)] = map[string]int64{"l2_objects": st.Saved[0], "l2_bytes": st.SavedBytes[0],
				"skipped_busy": st.SkippedBusy, "l1_evictions": int64(e.stat(t, "kvshim_l1_evictions_total"))}
			e.close(t)
		}
	}
	base := out["after_0"].(map[string]int64)["l2_bytes"]
	for _, n := range []int{1, 2} {
		m := out[fmt.Sprintf("after_%d", n)].(map[string]int64)
		out[fmt.Sprintf("saved_fraction_after_%d", n)] = 1 - float64(m["l2_bytes"])/float64(base)
	}
	line, _ := json.Marshal(out)
	fmt.Fprintln(os.Stdout, string(line))
}
