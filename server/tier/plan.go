package tier

import "github.com/kvshim/kvshim/server/l2"

// planPrefix sets src and size of cells (ordered by chunk, then rank; results[a]
// is adapter a's lookup of them, nil when it did not answer) and returns
// how many cells form the plan: the longest run of whole chunks whose
// every cell some adapter holds (the first one wins) with a known size
// (the lookup's, else hint(rank)), whose slot bytes fit budget.
func planPrefix(cells []cell, results [][]l2.Result, budget uint64, hint func(rank uint32) uint64) (n int, bytes uint64) {
	for j := 0; j < len(cells); {
		c := cells[j].chunk
		var chunkBytes uint64
		k := j
		for ; k < len(cells) && cells[k].chunk == c; k++ {
			cl := &cells[k]
			cl.src, cl.size = -1, 0
			for a := range results {
				if results[a] != nil && results[a][k].OK() {
					cl.src, cl.size = a, uint64(max(results[a][k].Bytes, 0))
					break
				}
			}
			if cl.src >= 0 && cl.size == 0 {
				cl.size = hint(cl.rank)
			}
			if cl.src < 0 || cl.size == 0 {
				return n, bytes
			}
			chunkBytes += page(cl.size)
		}
		if bytes+chunkBytes > budget {
			return n, bytes
		}
		bytes += chunkBytes
		n, j = k, k
	}
	return n, bytes
}

// toRelease returns, per adapter, the indices of cells whose L2 hold to
// drop: with others (right after planning, from = the plan's length) every
// held cell outside the plan plus the planned cells held by an adapter that
// is not their source; without (cells is the plan) the cells from on, held
// by their source. The three calls a prefetch makes — (all cells, n, true),
// (plan, m, false), (plan[:m], 0, false) — drop every hold exactly once.
func toRelease(results [][]l2.Result, cells []cell, from int, others bool) [][]int {
	out := make([][]int, len(results))
	for a, res := range results {
		if res == nil {
			continue
		}
		for k := range cells {
			if k >= len(res) || !res[k].OK() {
				continue
			}
			switch {
			case k >= from && (others || cells[k].src == a):
				out[a] = append(out[a], k)
			case k < from && others && cells[k].src != a:
				out[a] = append(out[a], k)
			}
		}
	}
	return out
}
