package server

import (
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

// KV events for vLLM's routers (OpEvents, protocol 4). A scheduler session
// announces the chunks its instance told vLLM's KV-event publisher it
// holds (BlockStored, medium "CPU"); the core remembers, per session, the
// keys it announced, and in an index key → sessions which sessions
// announced each key. When L1 evicts an object of an announced chunk (any
// rank's: the chunk is then no hit), every announcing session gets a
// "removed" event queued, whichever instance's saves caused the eviction;
// when the L2 writer has written an object of an announced chunk, a
// "stored" event with medium L2 ("STORAGE"). The session's pending flag
// rides in the header of every answer to it (ipc.FlagEventsPending; a
// direct session's client is marked instead), so the client fetches the
// queue with one OpEvents only when something is there.
//
// Ownership and bounds: the state belongs to the session and is dropped
// with it (eventsClosed, from closeSessionLocked: its keys leave the
// index). A session announces at most maxAnnounced keys; announcing one
// more reports the oldest as removed (so a router's view of an instance
// stays a subset of what is there: a worse route, never a wrong hit) and
// forgets it. A queue holds at most maxQueued events; more are counted in
// the answer's Lost (the router then keeps those blocks until the next
// AllBlocksCleared: again a worse route only).

// Bounds of one session's events state, and of the core's record of
// chunks the L2 writer wrote recently (tests lower them).
var (
	maxAnnounced = 1 << 16
	maxQueued    = 1 << 16
	maxL2Written = 1 << 16
)

// l2Written remembers the chunks the L2 writer wrote while some session
// had events on, most recent last: a chunk's L2 write usually ends before
// its scheduler announces it (the workers' reports reach the scheduler a
// step later), so the announce looks here for its STORAGE event. Bounded:
// a chunk written longer ago than maxL2Written writes is not announced in
// STORAGE (a router then routes by its CPU copy only). Guarded by mu.
type l2Written struct {
	set   map[evKey]struct{}
	order []evKey
}

func (w *l2Written) add(k evKey) {
	if w.set == nil {
		w.set = map[evKey]struct{}{}
	}
	if _, ok := w.set[k]; ok {
		return
	}
	w.set[k] = struct{}{}
	w.order = append(w.order, k)
	for len(w.set) > maxL2Written {
		delete(w.set, w.order[0])
		w.order = w.order[1:]
	}
	if len(w.order) > 2*maxL2Written {
		kept := make([]evKey, 0, len(w.set))
		for _, o := range w.order {
			if _, ok := w.set[o]; ok {
				kept = append(kept, o)
			}
		}
		w.order = kept
	}
}

// evKey names an announced chunk on one medium.
type evKey struct {
	ns     kv.Namespace
	hash   kv.Hash
	medium ipc.Medium
}

// sessEvents is one session's events state (guarded by Core.mu).
type sessEvents struct {
	set   map[evKey]struct{}
	order []evKey // announce order; keys no longer in set are skipped
	queue []ipc.Event
	lost  uint64
}

// Events answers OpEvents for s: it records r's keys as announced by s
// and returns (and empties) s's queue. The first call turns s's events on.
func (core *Core) Events(s *Session, r *ipc.EventsReq) (*ipc.EventsResp, error) {
	core.mu.Lock()
	defer core.mu.Unlock()
	if err := core.check(s); err != nil {
		return nil, err
	}
	e := s.ev
	if e == nil {
		e = &sessEvents{set: map[evKey]struct{}{}}
		s.ev = e
		core.evSessions++
	}
	for _, k := range r.Keys {
		key := evKey{k.Namespace, k.Hash, k.Medium}
		if _, ok := e.set[key]; ok {
			continue
		}
		if key.medium == ipc.MediumL1 && !core.residentL1(key) {
			// Evicted between the workers' COMMIT and this announce: no
			// eviction will name it again, so it is removed now.
			core.queueEvent(s, ipc.Event{Key: k, Kind: ipc.EventRemoved})
			continue
		}
		for len(e.set) >= maxAnnounced && len(e.order) > 0 {
			old := e.order[0]
			e.order = e.order[1:]
			if _, ok := e.set[old]; ok {
				core.unannounce(s, old)
				core.queueEvent(s, ipc.Event{Key: ipc.EventKey{Namespace: old.ns, Hash: old.hash, Medium: old.medium}, Kind: ipc.EventRemoved})
			}
		}
		core.announce(s, key)
		if key.medium == ipc.MediumL1 {
			l2 := evKey{key.ns, key.hash, ipc.MediumL2}
			if _, ok := core.written.set[l2]; ok && len(e.set) < maxAnnounced {
				core.announce(s, l2)
				core.queueEvent(s, ipc.Event{Key: ipc.EventKey{Namespace: l2.ns, Hash: l2.hash, Medium: l2.medium}, Kind: ipc.EventStored})
			}
		}
	}
	out := &ipc.EventsResp{Lost: e.lost, Events: e.queue}
	e.queue, e.lost = nil, 0
	s.evPending.Store(false)
	return out, nil
}

// residentL1 reports whether rank 0's object of k is resident in L1 (every
// namespace has a rank 0; an MLA namespace stores only it). mu held.
func (core *Core) residentL1(k evKey) bool {
	sh, ok := core.l1.Shard(k.ns, false)
	if !ok {
		return false
	}
	_, ok = core.l1.Find(sh, &k.hash, 0)
	return ok
}

// announce records k as announced by s. mu held.
func (core *Core) announce(s *Session, k evKey) {
	e := s.ev
	e.set[k] = struct{}{}
	e.order = append(e.order, k)
	if len(e.order) > 2*maxAnnounced { // compact the stale entries away
		kept := e.order[:0]
		for _, o := range e.order {
			if _, ok := e.set[o]; ok {
				kept = append(kept, o)
			}
		}
		e.order = append([]evKey(nil), kept...)
	}
	core.announced[k] = append(core.announced[k], s)
}

// unannounce forgets that s announced k. mu held.
func (core *Core) unannounce(s *Session, k evKey) {
	delete(s.ev.set, k)
	ss := core.announced[k]
	for i, x := range ss {
		if x == s {
			ss[i] = ss[len(ss)-1]
			ss = ss[:len(ss)-1]
			break
		}
	}
	if len(ss) == 0 {
		delete(core.announced, k)
	} else {
		core.announced[k] = ss
	}
}

// queueEvent appends ev to s's queue and marks s pending. mu held.
func (core *Core) queueEvent(s *Session, ev ipc.Event) {
	e := s.ev
	if len(e.queue) >= maxQueued {
		e.lost++
	} else {
		e.queue = append(e.queue, ev)
	}
	if !s.evPending.Swap(true) && s.opts.OnEvents != nil {
		s.opts.OnEvents()
	}
}

// chunkGone reports k's chunk as removed from k's medium to every session
// that announced it, and forgets it. mu held.
func (core *Core) chunkGone(k evKey) {
	ss := core.announced[k]
	if len(ss) == 0 {
		return
	}
	delete(core.announced, k)
	ev := ipc.Event{Key: ipc.EventKey{Namespace: k.ns, Hash: k.hash, Medium: k.medium}, Kind: ipc.EventRemoved}
	for _, s := range ss {
		delete(s.ev.set, k)
		core.queueEvent(s, ev)
	}
}

// onEvict is L1's eviction hook (l1.Config.OnEvict; mu held): traces, and
// the chunk's removal for the sessions that announced it.
func (core *Core) onEvict(ns kv.Namespace, rank uint32, hash kv.Hash, size uint64) {
	core.traceEvict(ns, rank, size)
	if len(core.announced) > 0 {
		core.chunkGone(evKey{ns, hash, ipc.MediumL1})
	}
}

// l2Stored is the L2 writer's hook (tier.WriterConfig.OnStored, called
// without mu): an object of k's chunk is in an L2 now. The sessions that
// announced the chunk in L1 get a "stored" event for medium L2, once.
func (core *Core) l2Stored(key kv.Key) {
	core.mu.Lock()
	defer core.mu.Unlock()
	if core.evSessions == 0 {
		return
	}
	k := evKey{key.Namespace, key.Hash, ipc.MediumL2}
	core.written.add(k)
	ss := core.announced[evKey{key.Namespace, key.Hash, ipc.MediumL1}]
	if len(ss) == 0 {
		return
	}
	ev := ipc.Event{Key: ipc.EventKey{Namespace: k.ns, Hash: k.hash, Medium: k.medium}, Kind: ipc.EventStored}
	for _, s := range append([]*Session(nil), ss...) {
		if s.closed {
			continue
		}
		if _, ok := s.ev.set[k]; ok {
			continue
		}
		if len(s.ev.set) >= maxAnnounced {
			s.ev.lost++ // not announced: no removal to report later either
			continue
		}
		core.announce(s, k)
		core.queueEvent(s, ev)
	}
}

// l2Dropped is an L2 adapter's hook: key's object left that L2 (fs
// eviction). Called without mu.
func (core *Core) l2Dropped(key kv.Key) {
	core.mu.Lock()
	defer core.mu.Unlock()
	k := evKey{key.Namespace, key.Hash, ipc.MediumL2}
	delete(core.written.set, k)
	core.chunkGone(k)
}

// eventsClosed drops s's events state with it. mu held.
func (core *Core) eventsClosed(s *Session) {
	if s.ev == nil {
		return
	}
	for k := range s.ev.set {
		core.unannounce(s, k)
	}
	s.ev = nil
	if core.evSessions--; core.evSessions == 0 {
		core.written = l2Written{} // nobody listens: the record goes too
	}
}

// EventsState reports how many keys s announced and how many events it has
// queued (tests, stats).
func (core *Core) EventsState(s *Session) (announced, queued int) {
	core.mu.Lock()
	defer core.mu.Unlock()
	if s.ev == nil {
		return 0, 0
	}
	return len(s.ev.set), len(s.ev.queue)
}

// EventsPending reports whether s has events queued (the answers' flag).
func (s *Session) EventsPending() bool { return s.evPending.Load() }
