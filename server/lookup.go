package server

import (
	"fmt"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
)

// MaxLookupCells bounds chunks × readers of one lookup (its hold table is
// 4 bytes a cell).
const MaxLookupCells = 1 << 20

// ErrLookupLimit: a LOOKUP that would take its session past
// Config.MaxLookupsPerSession or MaxLookupCellsPerSession. It is a bad
// request (StatusBadRequest, which the client counts as a miss); the
// message names the limit and its flag. Nothing was registered.
var ErrLookupLimit = fmt.Errorf("%w: lookup limit", ErrBadRequest)

// Lookup limits, the "limit" label of kvshim_lookups_rejected_total.
const (
	limitLookups = iota // MaxLookupsPerSession
	limitCells          // MaxLookupCellsPerSession
	numLookupLimits
)

var lookupLimitNames = [numLookupLimits]string{"lookups", "cells"}

// lookupUsage is the accounting behind the lookup limits, guarded by
// Core.mu. Session has no field for it, so it hangs off the core's
// metrics; a session's entry exists while it has live lookups (dropLookup
// deletes it with the session's last one, so a closed session leaves none).
type lookupUsage struct {
	cells    map[*Session]uint64 // hold-table cells of the session's live lookups
	total    uint64              // cells of every live lookup
	rejected [numLookupLimits]uint64
}

// cells is the size of lk's hold table (chunks × readers): the unit of
// MaxLookupCellsPerSession.
func (lk *lookup) cells() uint64 { return uint64(len(lk.hashes)) * uint64(lk.world) }

// admit checks a new lookup of chunks × readers hold cells against s's
// limits and counts a refusal.
func (core *Core) admit(s *Session, chunks int, readers uint32) error {
	u := &core.metrics.usage
	if n := len(s.lookups); n >= core.cfg.MaxLookupsPerSession {
		u.rejected[limitLookups]++
		return fmt.Errorf("%w: the session has %d live lookups, the most it may have (--max-lookups-per-session %d); read or FREE finished ones first",
			ErrLookupLimit, n, core.cfg.MaxLookupsPerSession)
	}
	cells := uint64(chunks) * uint64(readers)
	if held, most := u.cells[s], uint64(core.cfg.MaxLookupCellsPerSession); held+cells > most {
		u.rejected[limitCells]++
		return fmt.Errorf("%w: %d chunks × %d readers would take the hold cells of the session's live lookups from %d to %d, over --max-lookup-cells-per-session %d",
			ErrLookupLimit, chunks, readers, held, held+cells, most)
	}
	return nil
}

type lookupState uint8

const (
	lkPending  lookupState = iota // a fill is running
	lkFinal                       // answer ready, not yet read
	lkConsumed                    // answer read once; holds may remain
)

// lookup is one registered LOOKUP and the read holds it owns.
type lookup struct {
	owner   *Session
	id      uint64
	ns      kv.Namespace
	world   uint32 // readers: one hold per reader rank
	mla     bool   // stored once under rank 0
	hashes  []kv.Hash
	state   lookupState
	chunks  uint32          // final answer
	gen     uint64          // the namespace's generation at registration (reset.go)
	sources []ipc.SourceRun // the tier of each chunk [0, chunks) (hit sources)
	held    [][]uint32      // [reader rank][chunk] object index, l1.Nil = no hold
	holds   uint64          // holds still owned
	freed   []bool          // chunks FREEd while pending (nil: none)
	since   int64           // registration, unix nanoseconds (hold TTL)
	fill    *FillTask
	dropped bool
}

// ranks is the number of ranks objects are stored under.
func (lk *lookup) ranks() uint32 {
	if lk.mla {
		return 1
	}
	return lk.world
}

// Lookup registers a lookup (OpLookup); success is only an ack. The server
// checks every chunk on every rank, takes read holds on the longest prefix
// present on all ranks (MLA: the rank-0 object, one hold per reader),
// touches those objects in the LRU, and releases nothing else. With a
// Filler the lookup stays pending while the missing suffix is filled;
// otherwise it is final at once.
func (core *Core) Lookup(s *Session, req *ipc.LookupReq) error {
	defer core.metrics.observe(opLookup, time.Now())
	n := len(req.Hashes)
	switch {
	case n > ipc.MaxKeys:
		return fmt.Errorf("%w: lookup: %d keys > %d", ErrBadRequest, n, ipc.MaxKeys)
	case req.WorldSize == 0 || req.WorldSize > core.cfg.MaxWorldSize:
		return fmt.Errorf("%w: lookup: world size %d not in [1, %d]", ErrBadRequest, req.WorldSize, core.cfg.MaxWorldSize)
	case uint64(req.WorldSize)*uint64(n) > MaxLookupCells:
		return fmt.Errorf("%w: lookup: %d chunks × %d readers > %d", ErrBadRequest, n, req.WorldSize, MaxLookupCells)
	}
	t, err := core.register(s, req)
	if err != nil {
		return err
	}
	core.takeAdmitted()
	if t != nil && !core.filler.Fill(t.request(), t) {
		t.Done()
	}
	return nil
}

// register is Lookup's locked part; it returns the fill task to start.
func (core *Core) register(s *Session, req *ipc.LookupReq) (*FillTask, error) {
	n := len(req.Hashes)
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	if _, dup := s.lookups[req.LookupID]; dup {
		return nil, fmt.Errorf("%w: lookup id %d is in use", ErrBadRequest, req.LookupID)
	}
	if err := core.admit(s, n, req.WorldSize); err != nil {
		return nil, err
	}
	lk := &lookup{
		owner: s, id: req.LookupID, ns: req.Namespace, world: req.WorldSize, mla: req.MLA,
		hashes: req.Hashes, since: core.now().UnixNano(), gen: core.generationLocked(req.Namespace),
	}
	s.lookups[lk.id] = lk
	if cells := lk.cells(); cells > 0 {
		core.metrics.usage.cells[s] += cells
		core.metrics.usage.total += cells
	}
	core.cnt.lookupsNow++
	core.cnt.lookups++
	p := core.extend(lk, 0)
	core.countLookups(lk, p)
	if p > 0 {
		lk.sources = []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: p}}
	}
	core.cnt.hitChunks += uint64(p)
	core.cnt.missedChunks += uint64(n - int(p))
	var t *FillTask
	if p < uint32(n) && core.filler != nil {
		t = &FillTask{core: core, lk: lk, Namespace: lk.ns, WorldSize: lk.world, MLA: lk.mla,
			Start: p, Hashes: lk.hashes[p:], staged: map[fillKey]uint32{}}
		lk.fill = t
		lk.state = lkPending
		core.cnt.pending++
	} else {
		lk.chunks = p
		lk.state = lkFinal
	}
	core.traceRegistered(lk, p)
	return t, nil
}

// extend takes holds on chunks [from, p) where p is the end of the prefix
// present on every rank (resident, or filled by lk's task), moves them to
// the LRU front in chunk order (a prefix's head is the most recent) and
// returns p. Chunks FREEd while pending count but are not held.
func (core *Core) extend(lk *lookup, from uint32) uint32 {
	ranks := lk.ranks()
	sh, _ := core.l1.Shard(lk.ns, false) // l1.NoShard (empty) when the namespace is unknown
	n := uint32(len(lk.hashes))
	if lk.held == nil {
		// One backing array; each reader's row can grow to n in place.
		lk.held = make([][]uint32, lk.world)
		back := make([]uint32, uint64(lk.world)*uint64(n))
		for r := range lk.held {
			lk.held[r] = back[uint32(r)*n : uint32(r)*n : uint32(r+1)*n]
		}
	}
	var buf [8]uint32
	found := buf[:0]
	if ranks <= uint32(len(buf)) {
		found = buf[:ranks]
	} else {
		found = make([]uint32, ranks)
	}
	p := from
scan:
	for ; p < n; p++ {
		core.l1.FindRanks(sh, &lk.hashes[p], found)
		for r, i := range found {
			if i == l1.Nil && lk.fill != nil {
				if fi, ok := lk.fill.filled[fillKey{uint32(r), p}]; ok {
					i, found[r] = fi, fi
				}
			}
			if i == l1.Nil {
				break scan
			}
		}
		freed := lk.freed != nil && lk.freed[p]
		for r, i := range found {
			if freed {
				i = l1.Nil
			}
			lk.held[r] = append(lk.held[r], i)
		}
	}
	per := uint32(1)
	if lk.mla {
		per = lk.world
		for r := uint32(1); r < lk.world; r++ {
			lk.held[r] = append(lk.held[r], lk.held[0][from:p]...)
		}
	}
	// The hit moves to the LRU front in chunk order, so the prefix's head
	// is the most recent and its tail is evicted first.
	at := l1.Nil
	for c := from; c < p; c++ {
		for r := range ranks {
			i := lk.held[r][c]
			if i == l1.Nil {
				continue
			}
			core.l1.Hold(i, per)
			lk.holds += uint64(per)
			at = core.l1.Touch(at, i)
		}
	}
	return p
}

// LookupResult answers OpLookupResult: Pending while a fill runs; OK with
// the final chunk count once (the answer is consumed); Unknown afterwards
// or for an id this session never registered.
func (core *Core) LookupResult(s *Session, req *ipc.LookupResultReq) (*ipc.LookupResultResp, error) {
	defer core.metrics.observe(opLookupResult, time.Now())
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	lk := s.lookups[req.LookupID]
	if lk == nil {
		return &ipc.LookupResultResp{Status: ipc.StatusUnknown}, nil
	}
	switch lk.state {
	case lkPending:
		return &ipc.LookupResultResp{Status: ipc.StatusPending}, nil
	case lkConsumed:
		return &ipc.LookupResultResp{Status: ipc.StatusUnknown}, nil
	}
	lk.state = lkConsumed
	core.traceConsumed(lk)
	resp := &ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: lk.chunks, Generation: lk.gen, Sources: lk.sources}
	core.maybeForget(lk)
	return resp, nil
}

// Free releases the holds of chunks [Start, End) of one of this session's
// lookups on every rank (OpFree), without loading them. End = ^uint32(0)
// means all. Chunks freed while the lookup is pending are never held.
func (core *Core) Free(s *Session, req *ipc.FreeReq) error {
	defer core.metrics.observe(opFree, time.Now())
	if req.Start > req.End {
		return fmt.Errorf("%w: free: start %d > end %d", ErrBadRequest, req.Start, req.End)
	}
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return err
	}
	lk := s.lookups[req.LookupID]
	if lk == nil {
		return fmt.Errorf("%w: free: lookup %d", ErrUnknownLookup, req.LookupID)
	}
	end := min(req.End, uint32(len(lk.hashes)))
	core.traceFree(lk, req.Start, end)
	if lk.state == lkPending && req.Start < end {
		if lk.freed == nil {
			lk.freed = make([]bool, len(lk.hashes))
		}
		for c := req.Start; c < end; c++ {
			lk.freed[c] = true
		}
	}
	for r := range lk.held {
		core.releaseRow(lk, lk.held[r], req.Start, end)
	}
	core.maybeForget(lk)
	return nil
}

// releaseRow drops the holds of row[start:end).
func (core *Core) releaseRow(lk *lookup, row []uint32, start, end uint32) {
	end = min(end, uint32(len(row)))
	for c := start; c < end; c++ {
		if i := row[c]; i != l1.Nil {
			row[c] = l1.Nil
			core.l1.Unhold(i)
			lk.holds--
		}
	}
}

// owned finds the lookup (owner, id) for RETRIEVE and RELEASE, which worker
// sessions send for lookups the scheduler's session made.
func (core *Core) owned(owner kv.Tag, id uint64) (*lookup, error) {
	os := core.sessions[owner]
	if os == nil {
		return nil, fmt.Errorf("%w: owner %x is not connected", ErrUnknownLookup, owner)
	}
	lk := os.lookups[id]
	if lk == nil {
		return nil, fmt.Errorf("%w: owner %x has no lookup %d", ErrUnknownLookup, owner, id)
	}
	return lk, nil
}

// Retrieve returns, for chunks [Start, End) of lookup (Owner, LookupID),
// the location of the object held for Rank (OpRetrieve): StatusOK with the
// Loc, or StatusNotFound for a chunk that is not held (beyond the answer,
// freed or released). End = ^uint32(0) means up to the lookup's last chunk.
func (core *Core) Retrieve(s *Session, req *ipc.RetrieveReq) (*ipc.RetrieveResp, error) {
	defer core.metrics.observe(opRetrieve, time.Now())
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	lk, err := core.owned(req.Owner, req.LookupID)
	if err != nil {
		return nil, err
	}
	end := req.End
	if end == ^uint32(0) {
		end = max(uint32(len(lk.hashes)), req.Start)
	}
	switch {
	case req.Rank >= lk.world:
		return nil, fmt.Errorf("%w: retrieve: rank %d >= world size %d", ErrBadRequest, req.Rank, lk.world)
	case req.Start > end || end-req.Start > ipc.MaxKeys:
		return nil, fmt.Errorf("%w: retrieve: bad range [%d, %d)", ErrBadRequest, req.Start, end)
	}
	n := end - req.Start
	resp := &ipc.RetrieveResp{Status: make([]ipc.Status, n), Locs: make([]ipc.Loc, n)}
	row := lk.held[req.Rank]
	for k := range n {
		c := req.Start + k
		if c < uint32(len(row)) && row[c] != l1.Nil {
			resp.Locs[k] = core.l1.Loc(row[c])
		} else {
			resp.Status[k] = ipc.StatusNotFound
		}
	}
	return resp, nil
}

// Release drops every hold Rank still has in lookup (Owner, LookupID)
// (OpRelease), once that rank's copies are done.
func (core *Core) Release(s *Session, req *ipc.ReleaseReq) error {
	defer core.metrics.observe(opRelease, time.Now())
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return err
	}
	lk, err := core.owned(req.Owner, req.LookupID)
	if err != nil {
		return err
	}
	if req.Rank >= lk.world {
		return fmt.Errorf("%w: release: rank %d >= world size %d", ErrBadRequest, req.Rank, lk.world)
	}
	core.traceRelease(lk, req.Rank)
	core.releaseRow(lk, lk.held[req.Rank], 0, ^uint32(0))
	core.maybeForget(lk)
	return nil
}

// maybeForget drops a lookup whose answer was read and that holds nothing.
func (core *Core) maybeForget(lk *lookup) {
	if lk.state == lkConsumed && lk.holds == 0 {
		core.dropLookup(lk)
	}
}

// dropLookup releases all of lk's holds, cancels its fill and forgets it.
func (core *Core) dropLookup(lk *lookup) {
	if lk.dropped {
		return
	}
	lk.dropped = true
	core.traceDrop(lk)
	for r := range lk.held {
		core.releaseRow(lk, lk.held[r], 0, ^uint32(0))
	}
	if lk.state == lkPending {
		core.cnt.pending--
	}
	if lk.fill != nil {
		lk.fill.cancelLocked()
	}
	delete(lk.owner.lookups, lk.id)
	core.cnt.lookupsNow--
	u := &core.metrics.usage
	u.total -= lk.cells()
	if left := u.cells[lk.owner] - lk.cells(); left > 0 {
		u.cells[lk.owner] = left
	} else {
		delete(u.cells, lk.owner)
	}
}
