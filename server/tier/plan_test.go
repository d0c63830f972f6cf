package tier

import (
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/server/l2"
)

// fuzzCells builds ranks × chunks cells (dropping the L1-resident ones
// named by mask) and adapter results from data.
func fuzzCells(data []byte, ranks, chunks, adapters int) ([]cell, [][]l2.Result) {
	next := func() byte {
		if len(data) == 0 {
			return 0
		}
		b := data[0]
		data = data[1:]
		return b
	}
	var cells []cell
	for c := range chunks {
		for r := range ranks {
			if next()%4 == 0 {
				continue // resident in L1
			}
			cells = append(cells, cell{rank: uint32(r), chunk: uint32(c), src: -1})
		}
	}
	results := make([][]l2.Result, adapters)
	for a := range results {
		if next()%8 == 0 {
			continue // adapter did not answer in time
		}
		results[a] = make([]l2.Result, len(cells))
		for k := range cells {
			switch b := next(); b % 3 {
			case 0:
				results[a][k] = l2.Result{Status: l2.StatusOK, Bytes: int(b%5) * 3000} // 0: size unknown
			case 1:
				results[a][k] = l2.Result{Status: l2.StatusMiss}
			default:
				results[a][k] = l2.Result{Status: l2.StatusFailed}
			}
		}
	}
	return cells, results
}

// FuzzPlanAndRelease checks planPrefix (whole chunks, contiguous, held by
// their source, within budget) and that every L2 hold is released exactly
// once on the load path and on the rejected path.
func FuzzPlanAndRelease(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9}, uint8(2), uint8(3), uint8(2), uint16(20), uint8(1), uint8(0))
	f.Add([]byte{0, 0, 0, 0}, uint8(1), uint8(4), uint8(1), uint16(2), uint8(3), uint8(1))
	f.Add([]byte("the partial-hit counter-example, more or less"), uint8(1), uint8(4), uint8(3), uint16(100), uint8(0), uint8(2))
	f.Fuzz(func(t *testing.T, data []byte, ranks, chunks, adapters uint8, budgetPages uint16, hintK, cut uint8) {
		R, C, A := int(ranks%4)+1, int(chunks%8)+1, int(adapters%3)+1
		cells, results := fuzzCells(data, R, C, A)
		budget := uint64(budgetPages) * 4096
		hint := uint64(hintK%3) * 5000
		n, bytes := planPrefix(cells, results, budget, func(uint32) uint64 { return hint })
		assert.Assert(t, n >= 0 && n <= len(cells))
		assert.Assert(t, bytes <= budget)
		var sum uint64
		for k, cl := range cells[:n] {
			assert.Assert(t, cl.src >= 0 && results[cl.src][k].OK(), "cell %d", k)
			for a := 0; a < cl.src; a++ {
				assert.Assert(t, results[a] == nil || !results[a][k].OK(), "cell %d: not the first adapter", k)
			}
			assert.Assert(t, cl.size > 0)
			sum += page(cl.size)
		}
		assert.Equal(t, sum, bytes)
		if n > 0 && n < len(cells) {
			assert.Assert(t, cells[n].chunk != cells[n-1].chunk, "plan ends inside a chunk")
		}
		m := 0
		if n > 0 {
			m = int(cut) % (n + 1)
		}
		held := map[[2]int]int{}
		for a, res := range results {
			for k := range res {
				if res[k].OK() {
					held[[2]int{a, k}] = 0
				}
			}
		}
		count := func(rel [][]int) {
			for a, ks := range rel {
				for _, k := range ks {
					key := [2]int{a, k}
					_, ok := held[key]
					assert.Assert(t, ok, "released a key not held: %v", key)
					held[key]++
				}
			}
		}
		check := func(path string) {
			for key, c := range held {
				assert.Equal(t, c, 1, "%s: key %v released %d times", path, key, c)
				held[key] = 0
			}
		}
		// load path: outside the plan, then the unreserved tail, then the rest
		count(toRelease(results, cells, n, true))
		count(toRelease(results, cells[:n], m, false))
		count(toRelease(results, cells[:m], 0, false))
		check("load")
		// rejected path: outside the plan, then the whole plan
		count(toRelease(results, cells, n, true))
		count(toRelease(results, cells[:n], 0, false))
		check("rejected")
	})
}

func TestParseStorePolicy(t *testing.T) {
	for _, c := range []struct {
		name string
		none bool
		err  bool
	}{{"", false, false}, {"default", false, false}, {"all", false, false}, {"none", true, false}, {"some", false, true}} {
		p, err := ParseStorePolicy(c.name)
		if c.err {
			assert.ErrorContains(t, err, "store policy")
			continue
		}
		assert.NilError(t, err)
		assert.Equal(t, IsNone(p), c.none)
	}
}
