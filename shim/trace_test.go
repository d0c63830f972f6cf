package shim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/cli"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/tier"
	"github.com/kvshim/kvshim/trace"
)

// The four state records, produced for real and read back
// through `kvshim trace --json`: a successful restore, a mismatch (an
// object of another layout under the same key), a partial load failure
// (a chunk whose payload checksum fails: the prefix before it loads) and
// a cancel (a request aborted between lookup and load).

// tracedRig is a rig whose server and workers write traces into dir; read
// closes the writers and returns kvshim trace --json's report.
func tracedRig(t *testing.T, world int) (*rig, func() traceJSON) {
	r := newRig(t, world)
	dir := t.TempDir()
	sw, err := trace.Open(dir, trace.Options{Source: "server"})
	assert.NilError(t, err)
	r.srv.Core.SetTrace(sw)
	for _, w := range r.workers {
		assert.NilError(t, w.OpenTrace(dir))
	}
	return r, func() traceJSON {
		for _, w := range r.workers {
			assert.NilError(t, w.CloseTrace())
		}
		r.srv.Core.SetTrace(nil)
		assert.NilError(t, sw.Close())
		var out, errb bytes.Buffer
		assert.Equal(t, cli.Trace([]string{"--json", dir}, &out, &errb), 0, errb.String())
		var rep traceJSON
		assert.NilError(t, json.Unmarshal(out.Bytes(), &rep), out.String())
		return rep
	}
}

type traceJSON struct {
	Summary struct {
		Lookups        int               `json:"lookups"`
		HitsFound      uint64            `json:"hits_found"`
		HitsUsed       uint64            `json:"hits_used"`
		HitsLoaded     uint64            `json:"hits_loaded"`
		Failures       map[string]uint64 `json:"failures_by_result"`
		BytesLoaded    uint64            `json:"bytes_loaded"`
		BytesSaved     uint64            `json:"bytes_saved"`
		Cancels        int               `json:"cancels"`
		DroppedRecords uint64            `json:"dropped_records"`
	} `json:"summary"`
	Requests []struct {
		RequestID string  `json:"request_id"`
		LookupID  uint64  `json:"lookup_id"`
		Asked     uint32  `json:"asked_chunks"`
		Found     *uint32 `json:"found_chunks"`
		Used      *uint32 `json:"used_chunks"`
		Loaded    *uint32 `json:"loaded_chunks"`
		Stop      string  `json:"stop"`
		Cancelled bool    `json:"cancelled"`
		Saved     uint32  `json:"saved_chunks"`
		Failures  []struct {
			Rank   int32  `json:"rank"`
			Chunk  int32  `json:"chunk"`
			Result string `json:"result"`
			Reason string `json:"reason"`
		} `json:"failures"`
		Timeline []struct {
			Source  string `json:"source"`
			Kind    string `json:"kind"`
			Event   string `json:"event"`
			Result  string `json:"result"`
			Chunk   *int32 `json:"chunk"`
			Matched uint32 `json:"matched"`
		} `json:"timeline"`
	} `json:"requests"`
}

func (rep traceJSON) request(t *testing.T, id string) int {
	t.Helper()
	for i, q := range rep.Requests {
		if q.RequestID == id {
			return i
		}
	}
	t.Fatalf("no request %q in the trace: %+v", id, rep.Requests)
	return -1
}

func u32p(p *uint32) int {
	if p == nil {
		return -1
	}
	return int(*p)
}

// events lists "source kind event[=result]" of a request's timeline.
func (rep traceJSON) events(i int) []string {
	var out []string
	for _, e := range rep.Requests[i].Timeline {
		s := e.Source + " " + e.Kind + " " + e.Event
		if e.Result != "" {
			s += "=" + e.Result
		}
		out = append(out, s)
	}
	return out
}

func TestTraceSuccessfulRestore(t *testing.T) {
	r, read := tracedRig(t, 1)
	tokens := tokensOf(31, 7)
	savePrompt(t, r, "save", tokens, seq(0, 6), 5)
	assert.Equal(t, len(loadAll(t, r, "load", tokens, seq(20, 6))), 0)
	rep := read()
	i := rep.request(t, "load")
	q := rep.Requests[i]
	assert.Equal(t, q.Asked, uint32(3))
	assert.Equal(t, u32p(q.Found), 3)
	assert.Equal(t, u32p(q.Used), 3)
	assert.Equal(t, u32p(q.Loaded), 3)
	assert.Equal(t, len(q.Failures), 0)
	assert.Assert(t, !q.Cancelled)
	assert.Equal(t, q.Stop, "full")
	assert.DeepEqual(t, rep.events(i), []string{
		"server lookup registered", "server hold taken", "server lookup final=full", "server lookup consumed",
		"worker_r0 load planned", "server hold released", "worker_r0 load chunk=ok", "worker_r0 load chunk=ok", "worker_r0 load chunk=ok", "worker_r0 load done=ok",
	})
	for _, e := range q.Timeline {
		if e.Kind == "hold" { // 3 chunks × 1 reader taken, then released by rank 0
			assert.Equal(t, e.Matched, uint32(3), e.Event)
		}
	}
	s := rep.Requests[rep.request(t, "save")]
	assert.Equal(t, s.Saved, uint32(3))
	assert.Equal(t, rep.Summary.HitsLoaded, uint64(3))
	assert.Assert(t, rep.Summary.BytesLoaded > 0 && rep.Summary.BytesSaved > 0)
	assert.Equal(t, rep.Summary.DroppedRecords, uint64(0))
}

// An object sealed by another layout (another fingerprint) under the same
// key: the lookup finds it, the load refuses it.
func TestTraceLayoutMismatch(t *testing.T) {
	r, read := tracedRig(t, 1)
	tokens := tokensOf(37, 9)
	hs := savePrompt(t, r, "save", tokens, seq(0, 6), 5)
	l1Object(t, r, 0, hs[1], func(obj []byte) {
		h, err := layout.DecodeHeader(obj)
		assert.NilError(t, err)
		h.Fingerprint[0] ^= 1
		assert.NilError(t, objfmt.SealHeader(obj, h))
	})
	failed := loadAll(t, r, "load", tokens, seq(20, 6))
	assert.DeepEqual(t, failed, seq(22, 4))
	rep := read()
	q := rep.Requests[rep.request(t, "load")]
	assert.Equal(t, u32p(q.Found), 3)
	assert.Equal(t, u32p(q.Used), 3)
	assert.Equal(t, u32p(q.Loaded), 1)
	assert.Equal(t, len(q.Failures), 1, "%+v", q.Failures)
	assert.Equal(t, q.Failures[0].Chunk, int32(1))
	assert.Equal(t, q.Failures[0].Result, "fingerprint_mismatch", q.Failures[0].Reason)
	assert.Equal(t, rep.Summary.Failures["fingerprint_mismatch"], uint64(1))
}

// A partial load failure: chunk 1's payload no longer matches its checksum
// (kvshim.verify=always), so chunk 0 loads and chunks 1.. are recomputed.
func TestTracePartialLoadFailure(t *testing.T) {
	r, read := tracedRig(t, 1)
	r.workers[0].cfg.Verify = objfmt.VerifyAlways
	tokens := tokensOf(41, 3)
	hs := savePrompt(t, r, "save", tokens, seq(0, 6), 5)
	l1Object(t, r, 0, hs[1], func(obj []byte) { obj[objfmt.HeaderSize+9] ^= 0x10 })
	failed := loadAll(t, r, "load", tokens, seq(20, 6))
	assert.DeepEqual(t, failed, seq(22, 4))
	rep := read()
	i := rep.request(t, "load")
	q := rep.Requests[i]
	assert.Equal(t, u32p(q.Loaded), 1)
	assert.Equal(t, len(q.Failures), 1, "%+v", q.Failures)
	assert.Equal(t, q.Failures[0].Chunk, int32(1))
	assert.Equal(t, q.Failures[0].Result, "checksum", q.Failures[0].Reason)
	ev := rep.events(i)
	assert.DeepEqual(t, ev[len(ev)-4:], []string{"worker_r0 load chunk=ok", "worker_r0 load chunk=checksum", "worker_r0 load chunk=not_loaded", "worker_r0 load done=partial"})
}

// A cancel: the request is aborted after its lookup answered and before
// any load (vLLM finished it): the holds are FREEd, nothing loads.
func TestTraceCancelBetweenLookupAndLoad(t *testing.T) {
	r, read := tracedRig(t, 1)
	tokens := tokensOf(43, 1)
	savePrompt(t, r, "save", tokens, seq(0, 6), 5)
	assert.Equal(t, r.match(t, "gone", tokens, Extras{}, 0), 3*tChunk-1)
	r.sched.Finished("gone") // aborted: no AfterAlloc, no load
	rep := read()
	var cancelled []int
	for i, q := range rep.Requests {
		if q.Cancelled {
			cancelled = append(cancelled, i)
		}
	}
	assert.Equal(t, len(cancelled), 1, "%+v", rep.Requests)
	i := cancelled[0]
	q := rep.Requests[i]
	assert.Equal(t, u32p(q.Found), 3)
	assert.Equal(t, u32p(q.Used), -1) // no load
	assert.DeepEqual(t, rep.events(i), []string{"server lookup registered", "server hold taken", "server lookup final=full", "server lookup consumed", "server cancel free=consumed"})
	assert.Equal(t, rep.Summary.Cancels, 1)
}

// The third "done" of a save (L2 saved) and the L2 side of a partial
// restore: with an fs L2, the server's records show each chunk's L2 write;
// after a restart with chunk 1 corrupt in L2, the lookup's fill and final
// records show the prefix stopping at chunk 1.
func TestTraceL2SavedAndCorruptL2Chunk(t *testing.T) {
	r := newRig(t, 1)
	dir, l2dir := t.TempDir(), t.TempDir()
	var writers []*trace.Writer
	restart := func() {
		assert.NilError(t, r.srv.Close())
		r.cfg.L2Adapters = []string{fmt.Sprintf(`{"type":"fs","base_path":%q}`, l2dir)}
		srv, err := server.Start(r.cfg, nil, server.Options{})
		assert.NilError(t, err)
		t.Cleanup(func() { srv.Close() })
		r.srv = srv
		sw, err := trace.Open(dir, trace.Options{Source: "server"})
		assert.NilError(t, err)
		srv.Core.SetTrace(sw)
		writers = append(writers, sw)
	}
	restart()
	assert.NilError(t, r.workers[0].OpenTrace(dir))
	tokens := tokensOf(53, 2)
	saveAfterRestart(t, r, "save", tokens, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	assert.NilError(t, r.srv.Core.Writer().Flush(ctx))
	restart()

	// Chunk 1 in L2: one payload byte changed, rewritten through the
	// adapter (as TestL2CorruptChunkIsNeverRestored does).
	hs, err := ChunkHashes(r.sched.ns, tokens, tChunk, Extras{})
	assert.NilError(t, err)
	be, err := fs.Open(fs.Config{BasePath: l2dir})
	assert.NilError(t, err)
	key := tier.Key(r.sched.ns, 0, hs[1])
	file, err := os.ReadFile(be.Path(key))
	assert.NilError(t, err)
	obj := file[:len(file)-16]
	obj[objfmt.HeaderSize+77] ^= 0x04
	assert.NilError(t, os.Remove(be.Path(key)))
	st := r.srv.Core.L2Adapters()[0].Store(ctx, []kv.Key{key}, [][]byte{obj})
	<-st.Done()
	assert.Assert(t, st.Results()[0].OK())

	req, n := firstHitAfterRestart(t, r, tokens)
	assert.Equal(t, n, tChunk)
	assert.NilError(t, r.sched.AfterAlloc(req, seq(20, 6), 1, -1, n))
	r.step(t, &Step{})
	r.sched.Finished(req)
	assert.NilError(t, r.workers[0].CloseTrace())
	for _, w := range writers {
		r.srv.Core.SetTrace(nil)
		assert.NilError(t, w.Close())
	}
	var out, errb bytes.Buffer
	assert.Equal(t, cli.Trace([]string{"--json", dir}, &out, &errb), 0, errb.String())
	var rep struct {
		Summary struct {
			L2Saved    uint64 `json:"chunks_l2_saved"`
			HitsLoaded uint64 `json:"hits_loaded"`
		} `json:"summary"`
		Requests []struct {
			RequestID string  `json:"request_id"`
			Found     *uint32 `json:"found_chunks"`
			Loaded    *uint32 `json:"loaded_chunks"`
			Stop      string  `json:"stop"`
			Timeline  []struct {
				Kind    string `json:"kind"`
				Event   string `json:"event"`
				Matched uint32 `json:"matched"`
				Chunks  uint32 `json:"chunks"`
			} `json:"timeline"`
		} `json:"requests"`
	}
	assert.NilError(t, json.Unmarshal(out.Bytes(), &rep))
	assert.Equal(t, rep.Summary.L2Saved, uint64(3))
	assert.Equal(t, rep.Summary.HitsLoaded, uint64(1))
	var found bool
	for _, q := range rep.Requests {
		if q.Loaded == nil {
			continue
		}
		found = true
		assert.Equal(t, *q.Found, uint32(1))
		assert.Equal(t, q.Stop, "missing: chunk 1 absent on rank 0")
		var fill []string
		for _, e := range q.Timeline {
			if e.Kind == "lookup" || e.Kind == "fill" {
				fill = append(fill, fmt.Sprintf("%s %s %d/%d", e.Kind, e.Event, e.Matched, e.Chunks))
			}
		}
		assert.DeepEqual(t, fill, []string{"lookup registered 0/3", "lookup pending 0/3", "fill admission 3/3", "fill done 1/3", "lookup final 1/3", "lookup consumed 1/3"})
	}
	assert.Assert(t, found, out.String())
}

// A preemption is on the worker's record: vLLM preempted the request and the
// worker waited for its copies before vLLM reused the blocks.
func TestTracePreempted(t *testing.T) {
	r, read := tracedRig(t, 1)
	assert.NilError(t, r.workers[0].WaitFor([]string{"P"}, time.Second))
	rep := read()
	i := rep.request(t, "P")
	assert.DeepEqual(t, rep.events(i), []string{"worker_r0 cancel preempted=ok"})
}

// A lookup that is never loaded (a miss, or a request aborted before its
// load) joins its request through the scheduler's record: the server's
// records carry no request id.
func TestTraceSchedulerJoinsUnloadedLookups(t *testing.T) {
	r := newRig(t, 1)
	dir := t.TempDir()
	sw, err := trace.Open(dir, trace.Options{Source: "server"})
	assert.NilError(t, err)
	cw, err := trace.Open(dir, trace.Options{Source: "scheduler"})
	assert.NilError(t, err)
	r.srv.Core.SetTrace(sw)
	r.sched.SetTrace(cw)
	assert.Equal(t, r.match(t, "never-loaded", tokensOf(7, 3), Extras{}, 0), 0) // a miss: nothing stored
	r.sched.SetTrace(nil)
	r.srv.Core.SetTrace(nil)
	assert.NilError(t, sw.Close())
	assert.NilError(t, cw.Close())
	var out, errb bytes.Buffer
	assert.Equal(t, cli.Trace([]string{"--json", dir}, &out, &errb), 0, errb.String())
	var rep traceJSON
	assert.NilError(t, json.Unmarshal(out.Bytes(), &rep))
	i := rep.request(t, "never-loaded")
	ev := rep.events(i)
	joined := strings.Join(ev, "|")
	assert.Assert(t, strings.Contains(joined, "scheduler lookup request"), "%v", ev)
	assert.Assert(t, strings.Contains(joined, "server lookup registered"), "%v", ev)
}
