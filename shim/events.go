package shim

import (
	"context"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/kvshim/kvshim/ipc"
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
// by Medium, "CPU" for kvshim's L1; Chunks names the chunk hashes they
// make up, in order), "cleared" (every block announced before is gone: a
// reset), "removed" (the chunk Chunk left Medium: an L1 eviction, whoever
// caused it, or an L2 drop) or "stored_chunk" (the chunk Chunk announced
// in L1 is in Medium "STORAGE" too: the L2 writer wrote it). Python turns
// the last two into BlockRemoved / BlockStored with the block hashes it
// announced for that chunk.
type Event struct {
	Kind       string   `json:"kind"`
	Req        string   `json:"req,omitempty"`
	Group      uint32   `json:"group"`
	FirstBlock int      `json:"first_block"`
	Blocks     int      `json:"blocks"`
	Medium     string   `json:"medium,omitempty"`
	Chunks     []string `json:"chunks,omitempty"`
	Chunk      string   `json:"chunk,omitempty"`
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

// MediumL1 and MediumL2 are vLLM's medium names for kvshim's L1 (host
// memory) and its L2 adapters.
const (
	MediumL1 = "CPU"
	MediumL2 = "STORAGE"
)

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
	// announce: the chunks announced since the server last heard of them
	// (OpEvents tells it, so that their eviction comes back as "removed").
	announce []ipc.EventKey
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
		s.stored(r.Req, r.Group, p.chunk, h)
	}
	return bad
}

// stored adds the event of one chunk, merged into the last event when it
// continues it (vLLM's BlockStored covers a run of blocks). s.mu held.
func (s *Scheduler) stored(req string, group uint32, chunk int, h kv.Hash) {
	e := s.ev
	cb := s.chunk / s.cfg.BlockSize
	first := chunk * cb
	hx := hex.EncodeToString(h[:])
	if len(e.announce) < maxPendingEvents && int(group) < len(s.gns) {
		e.announce = append(e.announce, ipc.EventKey{Namespace: s.gns[group], Hash: h, Medium: ipc.MediumL1})
	}
	if n := len(e.events); n > 0 {
		last := &e.events[n-1]
		if last.Kind == "stored" && last.Req == req && last.Group == group && last.FirstBlock+last.Blocks == first {
			last.Blocks += cb
			last.Chunks = append(last.Chunks, hx)
			return
		}
	}
	if len(e.events) >= maxEvents {
		e.dropped++
		return
	}
	e.events = append(e.events, Event{Kind: "stored", Req: req, Group: group, FirstBlock: first, Blocks: cb, Medium: MediumL1, Chunks: []string{hx}})
}

// serverEvents tells the server of the chunks announced since the last
// call and takes what it queued for this scheduler's session (removals,
// STORAGE copies). It calls only when there is something to say or the
// server flagged events on an answer: nothing is polled. A failed call
// keeps the announcements for the next one. force: call anyway (the
// first call, which turns the session's events on: from then on the server
// records which chunks the L2 writer wrote). Called without s.mu.
func (s *Scheduler) serverEvents(ann []ipc.EventKey, force bool) (out []Event, lost int) {
	c := s.link.current()
	if !force && len(ann) == 0 && (c == nil || !c.EventsPending()) {
		return nil, 0
	}
	var resp *ipc.EventsResp
	err := s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		resp, err = c.Events(ctx, &ipc.EventsReq{Keys: ann})
		return err
	})
	if err != nil {
		s.mu.Lock()
		if e := s.ev; e != nil && len(e.announce)+len(ann) <= maxPendingEvents {
			e.announce = append(ann, e.announce...)
		} else {
			lost = len(ann)
		}
		s.mu.Unlock()
		return nil, lost
	}
	for _, ev := range resp.Events {
		m := MediumL1
		if ev.Key.Medium == ipc.MediumL2 {
			m = MediumL2
		}
		kind := "removed"
		if ev.Kind == ipc.EventStored {
			kind = "stored_chunk"
		}
		out = append(out, Event{Kind: kind, Medium: m, Chunk: hex.EncodeToString(ev.Key.Hash[:])})
	}
	return out, lost + int(resp.Lost)
}

// TakeEvents returns the events since the last call and starts recording
// them on the first call. Chunks waiting longer than pendingEventTTL for
// their reports are dropped (never announced).
func (s *Scheduler) TakeEvents() *Events {
	out, ann := s.takeEvents()
	if out.Events == nil { // the first call: turn the server's side on too
		out.Events = []Event{}
		_, _ = s.serverEvents(nil, true)
		return out
	}
	more, lost := s.serverEvents(ann, false)
	out.Events = append(out.Events, more...)
	out.Dropped += lost
	return out
}

func (s *Scheduler) takeEvents() (*Events, []ipc.EventKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.ev
	if e == nil {
		s.ev = &evState{pending: map[evKey]*evPending{}, perReq: map[string]int{}, ended: map[string]bool{}}
		return &Events{Done: []string{}}, nil
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
	ann := e.announce
	e.events, e.done, e.dropped, e.report, e.announce = nil, nil, 0, 0, nil
	return out, ann
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
