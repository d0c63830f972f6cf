package server

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l1"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/tier"
)

// Options are the core's collaborators.
type Options struct {
	// Source provides L1 segments (default l1.HeapSource).
	Source l1.SegmentSource
	// OnSegment, when set, is called for every new segment, with the core's
	// lock held: it must not block or call back into the core. The session
	// loop uses it to announce segments to every client.
	OnSegment func(id uint32, mem []byte)
	// Filler, when set, is asked to fill the missing suffix of every
	// lookup (the fill seam). Nil: lookups are final at once. Not with L2
	// adapters (the core then uses its prefetch controller).
	Filler tier.Filler
	// OnCommit, when set, receives the objects each COMMIT publishes, each
	// pinned (see Pin): it is called without the core's lock, must not
	// block, and must Unpin every object once. Not with L2 adapters (the
	// core then uses its writer).
	OnCommit func(objs []tier.Object)
	// L2Adapters, when set, are used instead of opening Config.L2Adapters
	// (tests, custom backends); the core closes them.
	L2Adapters []*l2.Adapter
	// L2BeforeLoad is tier.PrefetchConfig.BeforeLoad (tests, tracing).
	L2BeforeLoad func(keys []kv.Key)
}

// Core is the server core: sessions, lookups and their holds over the L1
// cache (l1.Cache), and the L2 tier. Every operation is safe for
// concurrent use; one mutex guards all of it and every operation is O(its
// keys).
type Core struct {
	cfg      Config
	filler   tier.Filler
	onCommit func(objs []tier.Object)
	tier     *l2Tier // nil: L1 only
	metrics  *metrics
	trace    traceSink // lifecycle records (trace.go)

	mu         sync.Mutex
	closed     bool
	l1         *l1.Cache // allocator, object table, LRU, object states
	staging    map[stageKey]stageEntry
	sessions   map[kv.Tag]*Session
	fences     map[*Session][]uint32   // ended sessions' fenced slots (fence.go)
	pinned     map[uint32]uint32       // object → pins (see Pin)
	gens       map[kv.Namespace]uint64 // namespace generations (reset.go)
	looks      map[lookKey]uint32      // lookups of each object, with --l2-store-after-lookups (admit.go)
	admitted   []tier.Object           // objects admitted to L2 by their lookups, not handed over yet
	announced  map[evKey][]*Session    // KV events: the sessions that announced each chunk (events.go)
	evSessions int                     // sessions with events on
	written    l2Written               // chunks the L2 writer wrote lately, while evSessions > 0
	cnt        counters
	now        func() time.Time

	stop chan struct{}
	done chan struct{}
}

// counters are the core's accounting beyond L1's (l1.Stats), guarded by
// mu.
type counters struct {
	lookupsNow uint64 // live lookups
	pending    uint64 // lookups waiting for a fill

	lookups, hitChunks, missedChunks uint64
	allocOK, allocResident           uint64
	allocInProgress, allocNoSpace    uint64
	commits, aborts                  uint64
	ttlHolds, ttlStaging             uint64
	pins                             uint64 // holds owned by the writer
	cleared, clearedBytes            uint64
	resets                           uint64 // namespaces reset (OpReset with Bump)
	admittedL2                       uint64 // objects handed to the L2 writer by their lookups (admit.go)
	sessionsOpened, sessionsClosed   uint64
	fencesExited, fencesDrained      uint64 // fenced sessions released by the writer's exit / its own word
}

// NewCore validates cfg and returns a core with no L1 mapped yet (it grows
// on demand). Close it to stop its reaper and release its segments.
func NewCore(cfg Config, o Options) (*Core, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if o.Source == nil {
		o.Source = l1.HeapSource{}
	}
	core := &Core{
		cfg:       cfg,
		filler:    o.Filler,
		staging:   map[stageKey]stageEntry{},
		sessions:  map[kv.Tag]*Session{},
		fences:    map[*Session][]uint32{},
		announced: map[evKey][]*Session{},
		now:       time.Now,
		stop:      make(chan struct{}),
		done:      make(chan struct{}),
	}
	core.l1 = l1.New(o.Source, l1.Config{
		Capacity: cfg.capacity(), SegmentSize: cfg.SegmentSize, SlabSize: cfg.SlabSize,
		HighWatermark: cfg.HighWatermark, LowWatermark: cfg.LowWatermark,
		OnSegment: o.OnSegment, OnEvict: core.onEvict,
	})
	core.metrics = newMetrics(core)
	if err := core.openTier(o); err != nil {
		return nil, err
	}
	go core.reaper()
	return core, nil
}

// Config returns the effective configuration (defaults filled in).
func (core *Core) Config() Config { return core.cfg }

// Close closes every session, stops the reaper and closes the segment
// source. Operations after Close fail with ErrClosed.
func (core *Core) Close() error {
	core.mu.Lock()
	if core.closed {
		core.mu.Unlock()
		return nil
	}
	for _, s := range core.sessions {
		core.closeSessionLocked(s)
	}
	core.closed = true
	core.mu.Unlock()
	close(core.stop)
	<-core.done
	var terr error
	if core.tier != nil {
		terr = core.tier.close() // before the segments go: L2 I/O uses them
	}
	return errors.Join(terr, core.l1.Close())
}

// Session is one client connection (one connector instance). Its id is the
// instance id from the hello; other sessions name its lookups by it.
type Session struct {
	id        kv.Tag
	opts      SessionOptions
	closed    bool // guarded by Core.mu
	lookups   map[uint64]*lookup
	fenced    []uint32      // staging the reaper took from a live writer (fence.go)
	ev        *sessEvents   // KV events (events.go); nil until the session's first OpEvents
	evPending atomic.Bool   // events queued: read without mu by the answers' header flag
	lifted    chan struct{} // closed when its fence is lifted (ends the exit watch)
}

// ID is the session's instance id.
func (s *Session) ID() kv.Tag { return s.id }

// OpenSession registers a session of an in-process caller, whose writes to
// L1 end before its calls return (no fencing). Two live sessions cannot
// share an id.
func (core *Core) OpenSession(id kv.Tag) (*Session, error) {
	return core.OpenSessionWith(id, SessionOptions{})
}

// OpenSessionWith registers a session described by o. Two live sessions
// cannot share an id.
func (core *Core) OpenSessionWith(id kv.Tag, o SessionOptions) (*Session, error) {
	core.mu.Lock()
	defer core.mu.Unlock()
	if core.closed {
		return nil, ErrClosed
	}
	if _, ok := core.sessions[id]; ok {
		return nil, fmt.Errorf("%w: %x", ErrDuplicateSession, id)
	}
	if o.Drained {
		core.unfenceDrained(id)
	}
	s := &Session{id: id, opts: o, lookups: map[uint64]*lookup{}}
	core.sessions[id] = s
	core.cnt.sessionsOpened++
	return s, nil
}

// CloseSession releases everything s owns: its staging objects, its
// lookups and their holds (including holds taken for other sessions'
// RETRIEVEs of those lookups). It is idempotent.
func (core *Core) CloseSession(s *Session) {
	core.mu.Lock()
	defer core.mu.Unlock()
	core.closeSessionLocked(s)
}

func (core *Core) closeSessionLocked(s *Session) {
	if s.closed {
		return
	}
	s.closed = true
	for _, lk := range s.lookups {
		core.dropLookup(lk)
	}
	for k, e := range core.staging {
		if e.owner == s {
			delete(core.staging, k)
			core.releaseStaging(s, e.idx)
		}
	}
	core.fenceClosed(s)
	core.eventsClosed(s)
	delete(core.sessions, s.id)
	core.cnt.sessionsClosed++
}

// check returns an error when the core or s is closed.
func (core *Core) check(s *Session) error {
	if core.closed {
		return ErrClosed
	}
	if s == nil || s.closed {
		return ErrSessionClosed
	}
	return nil
}

// LastSegmentError returns the most recent failure of the segment source
// (nil if none): ALLOCs answered NoSpace because L1 could not grow.
func (core *Core) LastSegmentError() error {
	core.mu.Lock()
	defer core.mu.Unlock()
	return core.l1.LastSegmentError()
}

// memAt returns the bytes at loc (tests and in-process callers).
func (core *Core) memAt(loc ipc.Loc) []byte {
	core.mu.Lock()
	defer core.mu.Unlock()
	return core.l1.At(loc)
}

// stageKey names a staging object: (namespace, rank, hash) plus writer tag.
type stageKey struct {
	shard l1.Shard
	rank  uint32
	hash  kv.Hash
	tag   kv.Tag
}

type stageEntry struct {
	idx   uint32
	owner *Session
	since int64 // unix nanoseconds
}
