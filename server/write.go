package server

import (
	"fmt"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/tier"
)

// Alloc reserves staging space for one rank's new objects (OpAlloc). Per
// key, in order: StatusResident (already published: skip the write),
// StatusInProgress (this writer tag already stages the key), StatusOK with
// the Loc to write, or StatusNoSpace (L1 full even after evicting every
// unheld resident object; every later new key of the batch gets NoSpace
// too, since a chunk after a gap is useless to a prefix lookup). A malformed
// request changes nothing and fails with ErrBadRequest.
func (core *Core) Alloc(s *Session, req *ipc.AllocReq) (*ipc.AllocResp, error) {
	defer core.metrics.observe(opAlloc, time.Now())
	n := len(req.Hashes)
	if n != len(req.Sizes) {
		return nil, fmt.Errorf("%w: alloc: %d hashes, %d sizes", ErrBadRequest, n, len(req.Sizes))
	}
	if n > ipc.MaxKeys {
		return nil, fmt.Errorf("%w: alloc: %d keys > %d", ErrBadRequest, n, ipc.MaxKeys)
	}
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	maxObj := core.l1.MaxObject()
	for i, sz := range req.Sizes {
		if sz == 0 || sz > maxObj {
			return nil, fmt.Errorf("%w: alloc: key %d: size %d not in [1, %d]", ErrBadRequest, i, sz, maxObj)
		}
	}
	resp := &ipc.AllocResp{Status: make([]ipc.Status, n), Locs: make([]ipc.Loc, n)}
	sh, _ := core.l1.Shard(req.Namespace, true)
	now := core.now().UnixNano()
	full := false
	for i, h := range req.Hashes {
		if _, ok := core.l1.Find(sh, &h, req.Rank); ok {
			resp.Status[i] = ipc.StatusResident
			core.cnt.allocResident++
			continue
		}
		k := stageKey{shard: sh, rank: req.Rank, hash: h, tag: req.Tag}
		if _, ok := core.staging[k]; ok {
			resp.Status[i] = ipc.StatusInProgress
			core.cnt.allocInProgress++
			continue
		}
		var idx uint32
		if !full {
			idx, full = core.l1.Reserve(sh, req.Rank, &h, req.Sizes[i], false)
			full = !full
		}
		if full {
			resp.Status[i] = ipc.StatusNoSpace
			core.cnt.allocNoSpace++
			continue
		}
		core.staging[k] = stageEntry{idx: idx, owner: s, since: now}
		resp.Locs[i] = core.l1.Loc(idx)
		core.cnt.allocOK++
	}
	core.l1.MaybeEvict()
	return resp, nil
}

// Commit publishes a writer's staging objects (OpCommit): the first valid
// publisher of a key makes it resident; a later publisher's copy is
// discarded and its space freed (StatusOK either way: the data is in L1).
// A key this session's writer tag does not stage is StatusNotFound.
func (core *Core) Commit(s *Session, req *ipc.CommitReq) (*ipc.CommitResp, error) {
	defer core.metrics.observe(opCommit, time.Now())
	resp, pins, err := core.finishWrite(s, req, true)
	core.traceCommit(s, req, resp, err)
	if len(pins) > 0 {
		core.onCommit(pins) // outside the lock
	}
	return resp, err
}

// Abort drops a writer's staging objects and frees their space (OpAbort).
func (core *Core) Abort(s *Session, req *ipc.CommitReq) (*ipc.CommitResp, error) {
	defer core.metrics.observe(opAbort, time.Now())
	resp, _, err := core.finishWrite(s, req, false)
	return resp, err
}

// finishWrite publishes or drops; with OnCommit set, every object it
// publishes is pinned and returned for the hook.
func (core *Core) finishWrite(s *Session, req *ipc.CommitReq, publish bool) (*ipc.CommitResp, []tier.Object, error) {
	n := len(req.Hashes)
	if n > ipc.MaxKeys {
		return nil, nil, fmt.Errorf("%w: commit: %d keys > %d", ErrBadRequest, n, ipc.MaxKeys)
	}
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, nil, err
	}
	var pins []tier.Object
	resp := &ipc.CommitResp{Status: make([]ipc.Status, n)}
	sh, ok := core.l1.Shard(req.Namespace, false)
	if !ok {
		for i := range resp.Status {
			resp.Status[i] = ipc.StatusNotFound
		}
		return resp, nil, nil
	}
	// Publish in reverse so the batch's first chunk ends up most recently
	// used: eviction then takes a prefix's tail before its head.
	for i := n - 1; i >= 0; i-- {
		k := stageKey{shard: sh, rank: req.Rank, hash: req.Hashes[i], tag: req.Tag}
		e, ok := core.staging[k]
		if !ok || e.owner != s {
			resp.Status[i] = ipc.StatusNotFound
			continue
		}
		delete(core.staging, k)
		if !publish {
			core.l1.Free(e.idx)
			core.cnt.aborts++
			continue
		}
		core.cnt.commits++
		published, err := core.l1.Publish(e.idx)
		if err != nil {
			// Staging objects are always staging: a bug. Keep the slot.
			resp.Status[i] = ipc.StatusInternal
			continue
		}
		if !published { // a copy already resident: discarded
			continue
		}
		if core.onCommit != nil && core.storeAfter() == 0 {
			pins = append(pins, core.pinLocked(e.idx))
		}
	}
	if publish {
		core.l1.MaybeEvict()
	}
	return resp, pins, nil
}
