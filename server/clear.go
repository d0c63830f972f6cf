package server

import (
	"time"

	"github.com/kvshim/kvshim/ipc"
)

// Clear drops every resident object that has no holds (OpClear). Staging,
// temporary and held objects stay.
func (core *Core) Clear(s *Session) (*ipc.ClearResp, error) {
	defer core.metrics.observe(opClear, time.Now())
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	var r ipc.ClearResp
	r.Objects, r.Bytes = core.l1.Clear()
	core.cnt.cleared += r.Objects
	core.cnt.clearedBytes += r.Bytes
	return &r, nil
}
