package server

import (
	"time"

	"github.com/kvshim/kvshim/ipc"
)

// Clear drops every resident object that has no holds (OpClear). Staging,
// temporary and held objects stay.
func (st *Core) Clear(s *Session) (*ipc.ClearResp, error) {
	defer st.metrics.observe(opClear, time.Now())
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.check(s); err != nil {
		return nil, err
	}
	var r ipc.ClearResp
	r.Objects, r.Bytes = st.l1.Clear()
	st.cnt.cleared += r.Objects
	st.cnt.clearedBytes += r.Bytes
	return &r, nil
}
