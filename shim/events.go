package shim

import (
	"encoding/hex"
	"fmt"
	"time"

	"github.com/kvshim/kvshim/kv"
)

// KV events: the scheduler's side of vLLM's take_events (BlockStored,
// AllBlocksCleared in vLLM's vocabulary; Python converts them into
// vllm.distributed.kv_events dataclasses). A chunk is announced only once
// every KV rank's worker reported its COMMIT (SaveReport, carried to the
// scheduler in vLLM's KVConnectorWorkerMetadata): a save that was skipped
// (resident already, no space), failed or never reported is never
// announced. Both sides record nothing until events are asked for the
// first time (TakeEvents, TakeSaveReports), so a deployment without
// --kv-events-config pays nothing.

// SaveReport is how one chunk of one save job ended on one KV rank.
type SaveReport struct {
	Req   string `json:"r"`
	Group uint32 `json:"g"`
	Rank  uint32 `json:"k"`
	Hash  string `json:"h"` // hex of the chunk hash
	OK    bool   `json:"ok"`
}

// Event is one KV event for vLLM: Kind "stored" (blocks [FirstBlock,
// FirstBlock+Blocks) of request Req in KV-cache group Group are now held
// by Medium, "CPU" for kvshim's L1) or "cleared" (every block announced
// before is gone: a reset).
type Event struct {
	Kind       string `json:"kind"`
	Req        string `json:"req,omitempty"`
	Group      uint32 `json:"group"`
	FirstBlock int    `json:"first_block"`
	Blocks     int    `json:"blocks"`
	Medium     string `json:"medium,omitempty"`
}

// Events is one TakeEvents answer: the events since the last call, the
// requests finished with nothing left to announce (Python drops its
// reference to them) and how many chunks went unannounced since the last
// call because their reports never came (expired) or the table was full.
type Events struct {
	Events   []Event  `json:"events"`
	Done     []string `json:"done"`
	Dropped  int      `json:"dropped"`
	Pending  int      `json:"pending"`
	Reported int      `json:"reported"`
}

// MediumL1 is vLLM's medium name for kvshim's L1 (host memory).
const MediumL1 = "CPU"

// maxPendingEvents bounds the chunks waiting for their ranks' reports;
// pendingEventTTL is how long one waits (a copy stuck for good never
// reports; its chunk is dropped, never announced).
const (
	maxPendingEvents = 1 << 16
	maxEvents        = 1 << 16
	pendingEventTTL  = 2 * time.Minute
)

type evKey struct {
	req   string
	group uint32
	hash  kv.Hash
}

type evPending struct {
	chunk int
	ranks []uint32 // the KV ranks that reported the commit
	at    time.Time
}

// evState is the scheduler's events state; nil until TakeEvents is called.
type evState struct {
	pending map[evKey]*evPending
	perReq  map[string]int  // request -> chunks pending
	ended   map[string]bool // requests finished (FinishedSaving) with chunks pending
	events  []Event
	done    []string
	dropped int
	report  int
}

// announce records the chunks of svs as waiting for their commits. s.mu held.
func (s *Scheduler) announce(svs []SaveSpec) {
	e := s.ev
	if e == nil {
		return
	}
	now := time.Now()
	for _, sv := range svs {
		for j, h := range sv.Hashes {
			k := evKey{sv.Req, sv.Group, kv.Hash(h)}
			if _, ok := e.pending[k]; ok {
				continue
			}
			if len(e.pending) >= maxPendingEvents {
				e.dropped++
				continue
			}
			e.pending[k] = &evPending{chunk: int(sv.First) + j, at: now}
			e.perReq[sv.Req]++
		}
	}
}

// resolve forgets a pending chunk. s.mu held.
func (e *evState) resolve(k evKey) {
	delete(e.pending, k)
	if e.perReq[k.req]--; e.perReq[k.req] <= 0 {
		delete(e.perReq, k.req)
		if e.ended[k.req] {
			delete(e.ended, k.req)
			e.done = append(e.done, k.req)
		}
	}
}

// eventFinished notes that req finished: once nothing of it is pending,
// it is in the next answer's Done. s.mu held.
func (s *Scheduler) eventFinished(req string) {
	e := s.ev
	if e == nil {
		return
	}
	if e.perReq[req] > 0 {
		e.ended[req] = true
		return
	}
	e.done = append(e.done, req)
}

// eventsCleared answers a reset: every chunk announced before is gone and
// none pending will be found (its key is of the old generation). s.mu held.
func (s *Scheduler) eventsCleared() {
	e := s.ev
	if e == nil {
		return
	}
	for k := range e.pending {
		e.resolve(k)
	}
	e.events = append(e.events[:0], Event{Kind: "cleared"})
}

// SaveReports takes the workers' reports of one engine step (every rank's,
// as vLLM aggregated them): a chunk every KV rank committed becomes a
// stored event, one a rank did not commit is forgotten. Reports of chunks
// not pending (events not asked for yet, a reset since, another rank
// failed it already) are passed over. A hash that is no chunk hash is
// ErrBadMeta, and the rest of the reports are still taken.
func (s *Scheduler) SaveReports(reports []SaveReport) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.ev
	if e == nil {
		return nil
	}
	world := s.cfg.Namespace.KVWorldSize()
	var bad error
	for _, r := range reports {
		var h kv.Hash
		if n, err := hex.Decode(h[:], []byte(r.Hash)); err != nil || n != len(h) || len(r.Hash) != 2*len(h) {
			bad = fmt.Errorf("%w: save report of %q: hash %q is no chunk hash", ErrBadMeta, r.Req, r.Hash)
			continue
		}
		k := evKey{r.Req, r.Group, h}
		p := e.pending[k]
		if p == nil {
			continue
		}
		e.report++
		if !r.OK {
			e.resolve(k)
			continue
		}
		seen := false
		for _, rk := range p.ranks {
			seen = seen || rk == r.Rank
		}
		if !seen {
			p.ranks = append(p.ranks, r.Rank)
		}
		if len(p.ranks) < world {
			continue
		}
		e.resolve(k)
		s.stored(r.Req, r.Group, p.chunk)
	}
	return bad
}

// stored adds the event of one chunk, merged into the last event when it
// continues it (vLLM's BlockStored covers a run of blocks). s.mu held.
func (s *Scheduler) stored(req string, group uint32, chunk int) {
	e := s.ev
	cb := s.chunk / s.cfg.BlockSize
	first := chunk * cb
	if n := len(e.events); n > 0 {
		last := &e.events[n-1]
		if last.Kind == "stored" && last.Req == req && last.Group == group && last.FirstBlock+last.Blocks == first {
			last.Blocks += cb
			return
		}
	}
	if len(e.events) >= maxEvents {
		e.dropped++
		return
	}
	e.events = append(e.events, Event{Kind: "stored", Req: req, Group: group, FirstBlock: first, Blocks: cb, Medium: MediumL1})
}

// TakeEvents returns the events since the last call and starts recording
// them on the first call. Chunks waiting longer than pendingEventTTL for
// their reports are dropped (never announced).
func (s *Scheduler) TakeEvents() *Events {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.ev
	if e == nil {
		s.ev = &evState{pending: map[evKey]*evPending{}, perReq: map[string]int{}, ended: map[string]bool{}}
		return &Events{Events: []Event{}, Done: []string{}}
	}
	now := time.Now()
	for k, p := range e.pending {
		if now.Sub(p.at) > pendingEventTTL {
			e.resolve(k)
			e.dropped++
		}
	}
	out := &Events{Events: e.events, Done: e.done, Dropped: e.dropped, Pending: len(e.pending), Reported: e.report}
	if out.Events == nil {
		out.Events = []Event{}
	}
	if out.Done == nil {
		out.Done = []string{}
	}
	e.events, e.done, e.dropped, e.report = nil, nil, 0, 0
	return out
}

// maxSaveReports bounds the reports a worker keeps between two
// TakeSaveReports calls (vLLM takes them every engine step).
const maxSaveReports = 1 << 16

// reportSave records how sv's chunks ended: committed ones OK, the rest
// not (skipped, failed, stuck).
func (w *Worker) reportSave(sv *SaveSpec, committed []kv.Hash) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.reportsOn {
		return
	}
	for _, h := range sv.Hashes {
		if len(w.saveReports) >= maxSaveReports {
			w.reportsLost++
			continue
		}
		ok := false
		for _, c := range committed {
			ok = ok || c == kv.Hash(h)
		}
		w.saveReports = append(w.saveReports, SaveReport{Req: sv.Req, Group: sv.Group, Rank: w.kvRank, Hash: hex.EncodeToString(h[:]), OK: ok})
	}
}

// reporting reports whether save reports are recorded.
func (w *Worker) reporting() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.reportsOn
}

// TakeSaveReports returns the save reports since the last call; the first
// call starts recording them.
func (w *Worker) TakeSaveReports() []SaveReport {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.reportsOn = true
	out := w.saveReports
	w.saveReports = nil
	if out == nil {
		out = []SaveReport{}
	}
	return out
}
