package shim

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/trace"
)

// The worker's lifecycle records (package trace, kinds load and save).
// The worker's code calls the hooks below in one line each; they cost an
// atomic load and a branch while no worker of the process traces.

// workerTrace is one worker's trace writer and its loads and saves in
// flight, keyed by their spec (unique while the job runs).
type workerTrace struct {
	w     *trace.Writer
	src   string
	mu    sync.Mutex
	loads map[*LoadSpec]*loadTrace
	saves map[*SaveSpec]*saveTrace
}

type loadTrace struct {
	t0, tRetrieved, tChecked int64
	failAt                   int
	why                      error
	checkErrs                []error
	bytes                    uint64
	failed                   bool
}

type saveTrace struct {
	done bool
}

var (
	traces   sync.Map     // *Worker -> *workerTrace
	tracesOn atomic.Int32 // workers of this process with a trace open
)

// OpenTrace makes w write its lifecycle records (loads, saves) into dir
// (kvshim.trace_dir); "" does nothing. CloseTrace closes the writer.
func (w *Worker) OpenTrace(dir string) error {
	if dir == "" {
		return nil
	}
	src := fmt.Sprintf("worker_r%d", w.cfg.Rank)
	tw, err := trace.Open(dir, trace.Options{Source: src})
	if err != nil {
		return err
	}
	if _, dup := traces.LoadOrStore(w, &workerTrace{w: tw, src: src, loads: map[*LoadSpec]*loadTrace{}, saves: map[*SaveSpec]*saveTrace{}}); dup {
		tw.Close()
		return errors.New("trace already open")
	}
	tracesOn.Add(1)
	return nil
}

// CloseTrace writes what is queued and closes w's trace (if any).
func (w *Worker) CloseTrace() error {
	v, ok := traces.LoadAndDelete(w)
	if !ok {
		return nil
	}
	tracesOn.Add(-1)
	return v.(*workerTrace).w.Close()
}

// TraceStats are the counters of w's trace writer (zero when off).
func (w *Worker) TraceStats() trace.Stats {
	if t := w.tracer(); t != nil {
		return t.w.Stats()
	}
	return trace.Stats{}
}

func (w *Worker) tracer() *workerTrace {
	if tracesOn.Load() == 0 {
		return nil
	}
	v, ok := traces.Load(w)
	if !ok {
		return nil
	}
	return v.(*workerTrace)
}

func (w *Worker) loadRecord(ev string, ld *LoadSpec) trace.Record {
	return trace.Record{Kind: trace.KindLoad, Event: ev, RequestID: ld.Req, LookupID: ld.Lookup,
		Owner: hex.EncodeToString(ld.Owner[:]), Namespace: hex.EncodeToString(w.ns[:]), Rank: int32(w.kvRank),
		Start: ld.Start, End: ld.End, Chunks: ld.End - ld.Start, Blocks: uint32(len(ld.Blocks)), Chunk: -1, StopRank: -1}
}

// traceLoad records a load as planned; the function it returns (deferred
// by load) records each chunk's result and the load's end.
func (w *Worker) traceLoad(ld *LoadSpec) func() {
	start := time.Now()
	t := w.tracer()
	if t == nil {
		return func() { w.lat.observe(&w.lat.load, time.Since(start)) }
	}
	lt := &loadTrace{t0: trace.Mono(), failAt: int(ld.End - ld.Start)}
	t.mu.Lock()
	t.loads[ld] = lt
	t.mu.Unlock()
	t.w.Emit(w.loadRecord("planned", ld))
	return func() {
		w.lat.observe(&w.lat.load, time.Since(start))
		t.mu.Lock()
		delete(t.loads, ld)
		t.mu.Unlock()
		end := trace.Mono()
		n := int(ld.End - ld.Start)
		for k := range n {
			r := w.loadRecord("chunk", ld)
			r.Chunk = int32(ld.Start) + int32(k)
			switch {
			case k < lt.failAt:
				r.Result = "ok"
			case k == lt.failAt:
				r.Result, r.Reason = loadResult(lt.why), errText(lt.why)
			case k < len(lt.checkErrs) && lt.checkErrs[k] != nil:
				r.Result, r.Reason = loadResult(lt.checkErrs[k]), "after chunk "+fmt.Sprint(int(ld.Start)+lt.failAt)+": "+lt.checkErrs[k].Error()
			default:
				r.Result = "not_loaded"
				r.Reason = fmt.Sprintf("after failed chunk %d", int(ld.Start)+lt.failAt)
			}
			t.w.Emit(r)
		}
		r := w.loadRecord("done", ld)
		r.Matched, r.Bytes = uint32(lt.failAt), lt.bytes
		switch {
		case lt.failAt >= n:
			r.Result = "ok"
		case lt.failAt == 0:
			r.Result, r.Reason = "failed", errText(lt.why)
		default:
			r.Result, r.Reason = "partial", errText(lt.why)
		}
		tr, tc := lt.tRetrieved, lt.tChecked
		if tr == 0 {
			tr = end
		}
		if tc == 0 {
			tc = max(tr, end)
		}
		r.RetrieveNS, r.CheckNS, r.CopyNS = tr-lt.t0, max(0, tc-tr), max(0, end-tc)
		t.w.Emit(r)
	}
}

func (t *workerTrace) load(ld *LoadSpec) *loadTrace {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.loads[ld]
}

// traceLoadRetrieved marks the end of the RETRIEVE round trip.
func (w *Worker) traceLoadRetrieved(ld *LoadSpec) {
	if t := w.tracer(); t != nil {
		if lt := t.load(ld); lt != nil {
			lt.tRetrieved = trace.Mono()
		}
	}
}

// traceLoadChecked marks the end of the checks (after chk.stop) and keeps
// each checked chunk's error.
func (w *Worker) traceLoadChecked(ld *LoadSpec, chk *checks) {
	if t := w.tracer(); t != nil {
		if lt := t.load(ld); lt != nil {
			lt.tChecked = trace.Mono()
			lt.checkErrs = make([]error, chk.n)
			for i := range chk.n {
				if chk.ready(i) {
					lt.checkErrs[i] = chk.errs[i]
				}
			}
		}
	}
}

// traceLoadFailed: chunk k and all after it are not restored (loadFailed).
func (w *Worker) traceLoadFailed(ld *LoadSpec, k int, why error) {
	if t := w.tracer(); t != nil {
		if lt := t.load(ld); lt != nil {
			lt.failAt, lt.why, lt.failed = k, why, true
		}
	}
}

// traceLoadBytes: the bytes the load copied.
func (w *Worker) traceLoadBytes(ld *LoadSpec, n uint64) {
	if t := w.tracer(); t != nil {
		if lt := t.load(ld); lt != nil {
			lt.bytes = n
		}
	}
}

// loadResult names the class of a load error.
func loadResult(err error) string {
	if err == nil {
		return "error"
	}
	msg := err.Error()
	switch {
	case errors.Is(err, layout.ErrKeyMismatch):
		return "key_mismatch"
	case errors.Is(err, layout.ErrCorrupt) && strings.Contains(msg, "fingerprint"):
		return "fingerprint_mismatch"
	case errors.Is(err, layout.ErrCorrupt) && (strings.Contains(msg, "checksum") || strings.Contains(msg, "CRC") || strings.Contains(msg, "crc")):
		return "checksum"
	case errors.Is(err, layout.ErrCorrupt):
		return "corrupt"
	case errors.Is(err, errCopyStuck), errors.Is(err, cuda.ErrTimeout):
		return "timeout"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	case strings.Contains(msg, "not held"), strings.Contains(msg, "not in the RETRIEVE"):
		return "missing"
	case errors.Is(err, cuda.ErrBadSpan), errors.Is(err, cuda.ErrClosed), errors.Is(err, cuda.ErrNotSupported):
		return "copy_error"
	}
	return "error"
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func (w *Worker) saveRecord(ev string, sv *SaveSpec) trace.Record {
	return trace.Record{Kind: trace.KindSave, Event: ev, RequestID: sv.Req, Namespace: hex.EncodeToString(w.ns[:]),
		Rank: int32(w.kvRank), Chunks: uint32(len(sv.Hashes)), Chunk: int32(sv.First), StopRank: -1}
}

// traceSaveEvent: the step's saves wait for vLLM's forward-pass event
// (the first of a save's three "done"s: GPU data produced).
func (w *Worker) traceSaveEvent(meta *StepMeta) {
	if t := w.tracer(); t != nil {
		for i := range meta.Saves {
			t.w.Emit(w.saveRecord("event", &meta.Saves[i]))
		}
	}
}

// traceSave starts a save; the function it returns (deferred by save)
// records a save that ended before COMMIT (ALLOC failed, nothing staged).
func (w *Worker) traceSave(sv *SaveSpec) func() {
	start := time.Now()
	t := w.tracer()
	if t == nil {
		return func() { w.lat.observe(&w.lat.save, time.Since(start)) }
	}
	s := &saveTrace{}
	t.mu.Lock()
	t.saves[sv] = s
	t.mu.Unlock()
	return func() {
		w.lat.observe(&w.lat.save, time.Since(start))
		t.mu.Lock()
		delete(t.saves, sv)
		t.mu.Unlock()
		if !s.done {
			r := w.saveRecord("commit", sv)
			r.Result, r.Reason = "not_staged", "ALLOC failed or every chunk was resident already or had no space"
			t.w.Emit(r)
		}
	}
}

// traceSaved: the COMMIT answer (the second "done": L1 readable).
// staged chunks were copied, saved of them committed, err the failure.
func (w *Worker) traceSaved(sv *SaveSpec, staged, saved int, size uint64, err error) {
	t := w.tracer()
	if t == nil {
		return
	}
	t.mu.Lock()
	if s := t.saves[sv]; s != nil {
		s.done = true
	}
	t.mu.Unlock()
	r := w.saveRecord("commit", sv)
	r.Matched, r.Skipped, r.Failed = uint32(saved), uint32(len(sv.Hashes)-staged), uint32(staged-saved)
	r.Bytes = uint64(saved) * size
	switch {
	case err != nil:
		r.Result, r.Reason = "failed", err.Error()
	case saved < staged:
		r.Result = "partial"
	default:
		r.Result = "ok"
	}
	t.w.Emit(r)
}

// tracePreempted records vLLM's preemption of reqs (handle_preemptions):
// the wait for their copies ended (result ok) or timed out.
func (w *Worker) tracePreempted(reqs []string, err error) {
	t := w.tracer()
	if t == nil {
		return
	}
	for _, r := range reqs {
		rec := trace.Record{Kind: trace.KindCancel, Event: "preempted", RequestID: r, Namespace: hex.EncodeToString(w.ns[:]),
			Rank: int32(w.kvRank), Chunk: -1, StopRank: -1, Result: "ok"}
		if err != nil {
			rec.Result, rec.Reason = "timeout", err.Error()
		}
		t.w.Emit(rec)
	}
}
