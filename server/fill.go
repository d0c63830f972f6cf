package server

import (
	"context"
	"fmt"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
	"github.com/kvshim/kvshim/server/tier"
)

// FillTask is the L1 side of the fill seam, as package tier sees it.
var _ tier.Fill = (*FillTask)(nil)

type fillKey struct{ rank, chunk uint32 }

// FillTask is one lookup's fill, the L1 side of the fill seam (tier.Fill,
// handed to the tier.Filler): chunks [Start, Start+len(Hashes)) are the
// suffix that L1 lacked on at least one rank when the lookup arrived.
type FillTask struct {
	Namespace kv.Namespace
	WorldSize uint32 // readers
	MLA       bool   // objects are stored once, under rank 0
	Start     uint32 // lookup index of Hashes[0]
	Hashes    []kv.Hash

	core     *Core
	lk       *lookup             // nil once the lookup is gone or answered (guarded by core.mu)
	done     bool                // Done was called
	answered bool                // the lookup was made final (Answer or Done)
	staged   map[fillKey]uint32  // reserved, not yet committed
	filled   map[fillKey]uint32  // committed temporary objects, not yet held
	from     map[uint32]ipc.Tier // chunk → the tier an L2 load of it came from (Served)

	cancelled bool               // the lookup was dropped (cancelLocked)
	ctx       context.Context    // made by Context, ended by cancelLocked
	cancel    context.CancelFunc // ends ctx; nil until Context
}

// Ranks is the number of ranks objects are stored under (1 for MLA).
func (t *FillTask) Ranks() uint32 {
	if t.MLA {
		return 1
	}
	return t.WorldSize
}

// Reserve stages size bytes for (rank, chunk) and returns the memory to
// fill. temporary objects serve only this lookup and are
// freed once its holds are gone; the others become resident on Commit.
// It fails with ErrFill when the task is finished or cancelled, the chunk is
// out of range, already resident, or already reserved; with
// ErrBadRequest for a bad size; and reports ok=false when L1 has no space.
func (t *FillTask) Reserve(rank, chunk uint32, size uint64, temporary bool) (mem []byte, ok bool, err error) {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	k := fillKey{rank, chunk}
	switch {
	case t.done || t.answered || t.lk == nil || core.closed:
		return nil, false, fmt.Errorf("%w: task finished or cancelled", ErrFill)
	case rank >= t.Ranks() || chunk < t.Start || chunk-t.Start >= uint32(len(t.Hashes)):
		return nil, false, fmt.Errorf("%w: (rank %d, chunk %d) is outside the task", ErrFill, rank, chunk)
	case size == 0 || size > core.l1.MaxObject():
		return nil, false, fmt.Errorf("%w: fill size %d", ErrBadRequest, size)
	}
	if _, dup := t.staged[k]; dup {
		return nil, false, fmt.Errorf("%w: (rank %d, chunk %d) already reserved", ErrFill, rank, chunk)
	}
	if _, dup := t.filled[k]; dup {
		return nil, false, fmt.Errorf("%w: (rank %d, chunk %d) already filled", ErrFill, rank, chunk)
	}
	h := t.Hashes[chunk-t.Start]
	sh, _ := core.l1.Shard(t.Namespace, true)
	if _, res := core.l1.Find(sh, &h, rank); res {
		return nil, false, fmt.Errorf("%w: (rank %d, chunk %d) is resident", ErrFill, rank, chunk)
	}
	idx, ok := core.l1.Reserve(sh, rank, &h, size, true)
	if !ok {
		return nil, false, nil
	}
	if temporary {
		// Marked by the high bit until Commit; state stays staging.
		t.staged[k] = idx | tempBit
	} else {
		t.staged[k] = idx
	}
	return core.l1.Bytes(idx), true, nil
}

// Served records that chunk's object on some rank came from an L2 adapter
// of adapterType (tier.SourceRecorder): the lookup's answer names that tier
// as the chunk's source (a chunk loaded from L2 on any rank is an L2 hit).
func (t *FillTask) Served(chunk uint32, adapterType string) {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	if t.from == nil {
		t.from = map[uint32]ipc.Tier{}
	}
	src := tierOf(adapterType)
	if cur, ok := t.from[chunk]; !ok || src > cur {
		t.from[chunk] = src
	}
}

// tempBit marks a staged fill object as temporary. Arena indices stay
// below 2^31 (that many objects would need far more than 64 TiB).
const tempBit = 1 << 31

// Commit finishes (rank, chunk): ok publishes it (resident, or temporary
// for this lookup), !ok frees it. The memory must not be written after.
func (t *FillTask) Commit(rank, chunk uint32, ok bool) error {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	k := fillKey{rank, chunk}
	v, found := t.staged[k]
	if !found {
		return fmt.Errorf("%w: (rank %d, chunk %d) was not reserved", ErrFill, rank, chunk)
	}
	delete(t.staged, k)
	idx := v &^ tempBit
	if !ok || t.lk == nil || core.closed {
		core.l1.Free(idx)
		return nil
	}
	if v&tempBit != 0 {
		if err := core.l1.MakeTemporary(idx); err != nil {
			core.l1.Free(idx)
			return err
		}
		if t.filled == nil {
			t.filled = map[fillKey]uint32{}
		}
		t.filled[k] = idx
		return nil
	}
	published, err := core.l1.Publish(idx) // false: already resident, discarded
	if err != nil {
		return err
	}
	if published {
		core.l1.MaybeEvict()
	}
	return nil
}

// Done ends the task: uncommitted reservations are freed, and the lookup
// (if still there and not answered yet) takes holds on the prefix now
// present on every rank, releases filled objects beyond it, and becomes
// final. Calls after the first do nothing.
func (t *FillTask) Done() {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	if t.done {
		return
	}
	t.done = true
	for k, v := range t.staged {
		core.l1.Free(v &^ tempBit)
		delete(t.staged, k)
	}
	t.answerLocked()
}

// Answer makes the lookup final now, as Done would, but keeps the
// reservations not yet committed: a later Commit frees its object (it is
// never published) and Done frees the rest. A filler past its deadline
// uses it while loads still write into staging buffers. Done must still be
// called.
func (t *FillTask) Answer() {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	if !t.done {
		t.answerLocked()
	}
}

func (t *FillTask) answerLocked() {
	core := t.core
	if t.answered {
		return
	}
	t.answered = true
	lk := t.lk
	if lk == nil {
		return
	}
	from := uint32(len(lk.held[0]))
	p := core.extend(lk, from)
	for c := from; c < p; c++ {
		src, ok := t.from[c]
		if !ok {
			src = ipc.TierL1 // resident when the fill ended (another writer, or retained)
		}
		lk.sources = ipc.AddSource(lk.sources, src)
	}
	core.cnt.hitChunks += uint64(p - from)
	core.cnt.missedChunks -= uint64(p - from)
	lk.chunks = p
	lk.state = lkFinal
	core.traceFinal(lk)
	core.cnt.pending--
	lk.fill = nil
	t.lk = nil
	t.dropFilled()
}

// request describes the fill to the filler (the L1 state now).
func (t *FillTask) request() tier.FillRequest {
	return tier.FillRequest{Namespace: t.Namespace, Ranks: t.Ranks(), Start: t.Start,
		Hashes: t.Hashes, Resident: t.Resident(), SizeHint: t.SizeHint()}
}

// Resident reports, for each cell (rank r, chunk Start+i) at index
// i*Ranks()+r, whether L1 has it resident now.
func (t *FillTask) Resident() []bool {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	ranks := t.Ranks()
	out := make([]bool, uint32(len(t.Hashes))*ranks)
	sh, ok := core.l1.Shard(t.Namespace, false)
	if !ok {
		return out
	}
	found := make([]uint32, ranks)
	for i := range t.Hashes {
		core.l1.FindRanks(sh, &t.Hashes[i], found)
		for r, idx := range found {
			out[uint32(i)*ranks+uint32(r)] = idx != l1.Nil
		}
	}
	return out
}

// SizeHint is the size of an object the lookup already holds (its L1
// prefix), or 0: L2 adapters that do not report sizes load with it.
func (t *FillTask) SizeHint() uint64 {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	if t.lk == nil {
		return 0
	}
	for _, row := range t.lk.held {
		for _, i := range row {
			if i != l1.Nil {
				return core.l1.Size(i)
			}
		}
	}
	return 0
}

// Context ends when the task is cancelled: its lookup was dropped (the
// session closed, the hold TTL) before the fill answered it. The
// filler then abandons its work — adapter operations, waits — and still
// calls Done; a load already writing into a reservation must report (and
// Commit) before Done frees it, as after Answer (tier.Fill).
func (t *FillTask) Context() context.Context {
	core := t.core
	core.mu.Lock()
	defer core.mu.Unlock()
	if t.ctx == nil {
		t.ctx, t.cancel = context.WithCancel(context.Background())
		if t.cancelled {
			t.cancel()
		}
	}
	return t.ctx
}

// cancelLocked detaches the task from its dropped lookup and ends its
// Context: filled objects go now, staged ones when the filler commits
// them or calls Done.
func (t *FillTask) cancelLocked() {
	t.lk = nil
	t.cancelled = true
	if t.cancel != nil {
		t.cancel()
	}
	t.dropFilled()
}

// dropFilled frees temporary objects that no hold kept.
func (t *FillTask) dropFilled() {
	for k, idx := range t.filled {
		if t.core.l1.Holds(idx) == 0 {
			t.core.l1.Free(idx)
		}
		delete(t.filled, k)
	}
}
