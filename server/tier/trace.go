package tier

import (
	"time"

	"github.com/kvshim/kvshim/kv"
)

// L2Tracer is implemented by an L1 host that records lifecycle traces
// (server.Core): the writer reports each L2 write's end to it.
type L2Tracer interface {
	// TraceL2Saved: the L2 write of key (bytes) by adapter ended; err is
	// nil when it is saved.
	TraceL2Saved(adapter string, key kv.Key, bytes int, err error)
}

// traceSaved reports one L2 write's end to the host, if it traces.
func (wr *Writer) traceSaved(a int, key kv.Key, bytes int, err error) {
	if t, ok := wr.l1.(L2Tracer); ok {
		t.TraceL2Saved(wr.adapters[a].Name(), key, bytes, err)
	}
}

// Admission is a fill's admission decision (traces): Cells (chunk × rank)
// were planned from L2 at worst-case Bytes; Result admitted (Staged cells
// got L1 staging, the rest did not), rejected (over the byte budget after
// waiting), l1_full (admitted, no staging for the first chunk), cancelled
// (the lookup was dropped) or no_l2 (nothing to load); Waited is the time
// spent waiting for budget.
type Admission struct {
	Cells, Staged int
	Bytes         uint64
	Result        string
	Waited        time.Duration
}
