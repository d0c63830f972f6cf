package shim

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
)

// KV events (events.go) against a real server with real workers on host
// caches: a chunk is announced once every KV rank committed it, never for
// a skipped save, and a reset announces that everything is gone. What a
// real vLLM makes of them: tests/vllm/test_events.py.

// reports takes every worker's save reports, as vLLM's
// KVOutputAggregator hands them to the scheduler in one step.
func (r *rig) reports(t *testing.T, ranks ...int) []SaveReport {
	t.Helper()
	var out []SaveReport
	for _, i := range ranks {
		out = append(out, r.workers[i].TakeSaveReports()...)
	}
	return out
}

func startEvents(t *testing.T, r *rig) {
	t.Helper()
	ev := r.sched.TakeEvents()
	assert.Equal(t, len(ev.Events), 0)
	for _, w := range r.workers {
		assert.Equal(t, len(w.TakeSaveReports()), 0)
	}
}

func TestEventsStoredOnceEveryRankCommitted(t *testing.T) {
	r := newRig(t, 2)
	startEvents(t, r)
	tokens := tokensOf(7, 1)
	_, saved := saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)

	// Rank 0's commits alone: the chunks are not complete anywhere yet.
	assert.NilError(t, r.sched.SaveReports(r.reports(t, 0)))
	ev := r.sched.TakeEvents()
	assert.Equal(t, len(ev.Events), 0)
	assert.Equal(t, ev.Pending, 3)
	assert.DeepEqual(t, ev.Done, []string{})

	assert.NilError(t, r.sched.SaveReports(r.reports(t, 1)))
	ev = r.sched.TakeEvents()
	cb := tChunk / tBS
	assert.Equal(t, len(ev.Events), 1)
	assert.Equal(t, len(ev.Events[0].Chunks), 3) // the chunk hashes, for BlockRemoved later
	ev.Events[0].Chunks = nil
	assert.DeepEqual(t, ev.Events, []Event{{Kind: "stored", Req: "A", FirstBlock: 0, Blocks: 3 * cb, Medium: MediumL1}})
	assert.DeepEqual(t, ev.Done, []string{"A"}) // finished, nothing left to announce
	assert.Equal(t, ev.Pending, 0)
}

func TestEventsNothingForSkippedSave(t *testing.T) {
	r := newRig(t, 1)
	startEvents(t, r)
	tokens := tokensOf(9, 2)
	// Two requests with the same prompt, both missed, saved in one step:
	// the server stages the chunks for one of them; the other's save is
	// skipped (in flight or resident already) and announces nothing.
	cb := tChunk / tBS
	step := &Step{}
	for i, req := range []string{"A", "B"} {
		blocks := seq(i*8, 2*cb)
		for _, b := range blocks {
			r.caches[0].fill(int(b), 5)
		}
		assert.Equal(t, r.match(t, req, tokens, Extras{}, 0), 0)
		assert.NilError(t, r.sched.AfterAlloc(req, blocks, 1, 0, 0))
		step.Requests = append(step.Requests, StepRequest{Req: req, Blocks: blocks, Scheduled: 2 * tChunk})
	}
	r.step(t, step)
	r.sched.Finished("A")
	r.sched.Finished("B")
	st := r.workers[0].Stats()
	assert.Equal(t, st.SavedChunks, uint64(2))
	assert.Equal(t, st.SkippedChunks, uint64(2))
	reps := r.reports(t, 0)
	assert.Equal(t, len(reps), 4)
	assert.NilError(t, r.sched.SaveReports(reps))
	ev := r.sched.TakeEvents()
	assert.Equal(t, len(ev.Events), 1, "%+v", ev.Events)
	won := ev.Events[0].Req
	for _, rep := range reps {
		assert.Equal(t, rep.OK, rep.Req == won, "%+v", rep)
	}
	assert.Equal(t, len(ev.Events[0].Chunks), 2)
	ev.Events[0].Chunks = nil
	assert.DeepEqual(t, ev.Events[0], Event{Kind: "stored", Req: won, FirstBlock: 0, Blocks: 2 * cb, Medium: MediumL1})
	assert.Equal(t, len(ev.Done), 2)
	assert.Equal(t, ev.Pending, 0)
}

func TestEventsClearedOnReset(t *testing.T) {
	r := newRig(t, 1)
	startEvents(t, r)
	saveChunks(t, r, "A", tokensOf(3, 3), 1)
	reps := r.reports(t, 0) // not delivered before the reset
	_, err := r.sched.Reset()
	assert.NilError(t, err)
	// Reports of chunks keyed before the reset announce nothing after it.
	assert.NilError(t, r.sched.SaveReports(reps))
	ev := r.sched.TakeEvents()
	assert.DeepEqual(t, ev.Events, []Event{{Kind: "cleared"}})
	assert.Equal(t, ev.Pending, 0)
}

func TestEventsOffUntilAsked(t *testing.T) {
	r := newRig(t, 1)
	saveChunks(t, r, "A", tokensOf(5, 4), 2)
	// Nothing was recorded on either side.
	assert.Equal(t, len(r.workers[0].TakeSaveReports()), 0)
	assert.Equal(t, len(r.sched.TakeEvents().Events), 0)
	assert.Equal(t, r.sched.TakeEvents().Pending, 0)
}

func TestEventsBadReport(t *testing.T) {
	r := newRig(t, 1)
	startEvents(t, r)
	for _, h := range []string{"zz", "00", ""} {
		err := r.sched.SaveReports([]SaveReport{{Req: "A", Hash: h, OK: true}})
		assert.Assert(t, errors.Is(err, ErrBadMeta), "%q: %v", h, err)
	}
}

// FuzzSaveReports: any JSON a worker (or a corrupted metadata) hands the
// scheduler is an error or passed over, never a panic, and never an event
// for a chunk that was not announced.
func FuzzSaveReports(f *testing.F) {
	f.Add([]byte(`[{"r":"A","g":0,"k":0,"h":"` + strings.Repeat("ab", kv.HashSize) + `","ok":true}]`))
	f.Add([]byte(`[{"r":"A","h":"zz"}]`))
	f.Add([]byte(`[]`))
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk}
	s, err := NewScheduler(SchedulerConfig{Socket: "/nonexistent/kvshim.sock", Namespace: ns, BlockSize: tBS, Instance: uuid.New()})
	assert.NilError(f, err)
	defer s.Close()
	s.TakeEvents()
	var h kv.Hash
	h[0] = 0xab
	f.Fuzz(func(t *testing.T, data []byte) {
		var reps []SaveReport
		if json.Unmarshal(data, &reps) != nil {
			return
		}
		s.mu.Lock()
		s.announce([]SaveSpec{{Req: "A", Hashes: []kv.Hash{h}}})
		s.mu.Unlock()
		if err := s.SaveReports(reps); err != nil {
			assert.Assert(t, errors.Is(err, ErrBadMeta), err)
		}
		for _, ev := range s.TakeEvents().Events {
			assert.Equal(t, ev.Req, "A")
			assert.Equal(t, ev.FirstBlock, 0)
		}
	})
}

// churnL1 makes another instance (a raw worker session of another
// namespace) commit n objects of size bytes: the LRU evicts the rest.
func churnL1(t *testing.T, sock string, n int, size uint64) {
	t.Helper()
	c, err := ipc.Dial(sock, ipc.Hello{Role: ipc.RoleWorker, Instance: uuid.New()}, 5*time.Second)
	assert.NilError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	tag := kv.Tag(c.Hello().Instance)
	ns := kv.Namespace{0xee}
	for i := range n {
		h := kv.Hash{byte(i), byte(i >> 8), 0xcc}
		ar, err := c.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: ns, Hashes: []kv.Hash{h}, Sizes: []uint64{size}})
		assert.NilError(t, err)
		if ar.Status[0] != ipc.StatusOK {
			continue
		}
		_, err = c.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns, Hashes: []kv.Hash{h}})
		assert.NilError(t, err)
	}
}

// An eviction another instance's saves cause comes back from the server
// (the flag on an answer, then one OpEvents) as "removed" for exactly the
// chunks this scheduler announced.
func TestEventsRemovedWhenAnotherInstanceEvicts(t *testing.T) {
	r := newRigWith(t, NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk},
		func(c *server.Config) { c.L1SizeGB, c.SegmentSize = 16.0/1024, 4<<20 }, nil)
	startEvents(t, r)
	_, saved := saveChunks(t, r, "A", tokensOf(11, 3), 3)
	assert.Equal(t, saved, 3)
	assert.NilError(t, r.sched.SaveReports(r.reports(t, 0)))
	ev := r.sched.TakeEvents()
	assert.Equal(t, len(ev.Events), 1)
	announced := map[string]bool{}
	for _, c := range ev.Events[0].Chunks {
		announced[c] = true
	}
	assert.Equal(t, len(announced), 3)
	assert.Equal(t, len(r.sched.TakeEvents().Events), 0) // nothing evicted yet

	churnL1(t, r.cfg.Socket, 64, 1<<20) // 64 MiB through 16 MiB of L1
	// The scheduler learns of it from the flag on its next answer (any
	// call); a lookup is the call a scheduler makes anyway.
	r.match(t, "probe", tokensOf(99, 1), Extras{}, 0)
	got := map[string]bool{}
	for _, e := range r.sched.TakeEvents().Events {
		assert.Equal(t, e.Kind, "removed")
		assert.Equal(t, e.Medium, MediumL1)
		got[e.Chunk] = true
	}
	assert.DeepEqual(t, got, announced)
	assert.Equal(t, len(r.sched.TakeEvents().Events), 0) // once
}
