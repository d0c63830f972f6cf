package server

import (
	"testing"

	"github.com/kvshim/kvshim/ipc"
)

// BenchmarkEventsAnnounce is the server's part of a saved chunk's events:
// its announce (OpEvents' bookkeeping, no transport) and, once L1 evicts
// it, the removal queued for its announcer. ns/op is per chunk.
func BenchmarkEventsAnnounce(b *testing.B) {
	st := newCore(b, 64, Options{})
	s := open(b, st, 1)
	hs := hashes("bench", 8)
	save(b, st, s, 1, 0, hs)
	keys := evKeys(hs)
	b.ResetTimer()
	for i := 0; i < b.N; i += len(keys) {
		if _, err := st.Events(s, &ipc.EventsReq{Keys: keys}); err != nil {
			b.Fatal(err)
		}
		st.mu.Lock()
		for _, h := range hs {
			st.chunkGone(evKey{ns1, h, ipc.MediumL1})
		}
		st.mu.Unlock()
	}
}
