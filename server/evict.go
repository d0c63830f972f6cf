package server

import (
	"time"

	"github.com/kvshim/kvshim/ipc"
)

// evictOne drops the least recently used resident object that has no
// holds. Staging and temporary objects are never on the LRU list; held
// objects are skipped. It reports false when nothing is evictable.
func (st *Store) evictOne() bool {
	for i := st.lru.tail; i != nilIdx; i = st.objs.get(i).prev {
		o := st.objs.get(i)
		if o.holds != 0 {
			continue
		}
		st.traceEvict(i)
		st.cnt.evictions++
		st.cnt.evictedBytes += o.size
		st.freeObject(i)
		return true
	}
	return false
}

// maybeEvict runs watermark eviction: once the bytes in use pass the high
// watermark, evict LRU unheld resident objects until they are at or below
// the low watermark (or nothing evictable is left).
func (st *Store) maybeEvict() {
	capacity := float64(st.mem.capacity)
	if float64(st.mem.usedBytes) <= st.cfg.HighWatermark*capacity {
		return
	}
	low := uint64(st.cfg.LowWatermark * capacity)
	for st.mem.usedBytes > low && st.evictOne() {
	}
}

// Clear drops every resident object that has no holds (OpClear). Staging,
// temporary and held objects stay.
func (st *Store) Clear(s *Session) (*ipc.ClearResp, error) {
	defer st.metrics.observe(opClear, time.Now())
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.check(s); err != nil {
		return nil, err
	}
	var r ipc.ClearResp
	for i := st.lru.tail; i != nilIdx; {
		o := st.objs.get(i)
		prev := o.prev
		if o.holds == 0 {
			r.Objects++
			r.Bytes += o.size
			st.freeObject(i)
		}
		i = prev
	}
	st.cnt.cleared += r.Objects
	st.cnt.clearedBytes += r.Bytes
	return &r, nil
}
