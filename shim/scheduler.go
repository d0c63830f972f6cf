package shim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

// SchedulerConfig configures the scheduler side of the connector.
type SchedulerConfig struct {
	Socket    string        // the server's socket
	Namespace NamespaceSpec // what makes KV bytes compatible
	BlockSize int           // vLLM's block size in tokens; divides ChunkSize
	Timeout   time.Duration // per server call, and the longest a lookup stays pending
	Instance  uuid.UUID     // this connector's id: the Owner workers retrieve with
	Role      Role          // vLLM's kv_role (options.go)
	// RingOnly asks a server in this process over the ring like any other
	// (tests and benchmarks of the ring path); by default the embedded
	// server's own scheduler calls its core directly (link.go).
	RingOnly bool
}

// Scheduler is the scheduler-side state machine: it turns vLLM's questions
// (how many tokens can be loaded? which blocks to load into? which chunks
// to save?) into server lookups and per-step metadata for the workers.
// Every method is one Python call; none blocks longer than the call timeout.
//
// With several KV-cache groups (groups.go) every group has its own
// namespace, lookup, holds, loads and saves; chunk hashes are computed
// once (from group 0's namespace) and the object key of a group's chunk is
// (the group's namespace, rank, hash). Block ids cross the C ABI in one
// form: one array of all groups with their count (splitGroups).
type Scheduler struct {
	cfg    SchedulerConfig
	ns     kv.Namespace   // group 0's: roots the chunk hashes
	groups []GroupSpec    // the KV-cache groups, in vLLM's order
	gns    []kv.Namespace // each group's namespace
	chunk  int
	link   *link

	mu         sync.Mutex
	reqs       map[string]*schedReq
	nextLookup uint64
	loads      []LoadSpec // dispatched with the next metadata
	finished   []string   // delay-freed requests, told to workers with the next metadata
	saves      []SaveSpec // saves of finished requests, dispatched with the next metadata
	orphans    []uint64   // lookups given up while pending: read once final so the server forgets them
	// fence maps a block a windowed group's save reads to the request of
	// that save. vLLM frees such blocks while the request still runs (its
	// window moved on) and may hand them out again: a step that allocates
	// one makes the workers wait for that request's copies first (the
	// request goes out in the metadata's preempted list, whose copies the
	// workers wait for before the step's loads and forward pass).
	fence map[int64]string
	// answers: lookups answered in their ack (protocol 5), not read yet.
	answers map[uint64]*ipc.LookupResultResp
	trace   schedTrace // lifecycle records (schedtrace.go)
	// gen is the generation requests are keyed under (controls.go: vLLM's
	// reset_cache); genKnown: learnt from (or set on) the server.
	gen      uint64
	genKnown bool
	genAsked time.Time                 // the last time the generation was asked for (learnGeneration)
	opts     map[string]RequestOptions // settings of requests not keyed yet (options.go)
	// loading: requests whose planned load vLLM has not seen finish, and
	// its chunks (controls.go: an abort meanwhile is a cancel).
	loading        map[string]int
	cancelledLoads uint64
	ev             *evState // KV events (events.go); nil until asked for
	// hits since the last TakeStepStats: what vLLM was told to load
	hitTokens, hitRequests uint64
}

type lookupState uint8

const (
	lookupNone    lookupState = iota // nothing to look up (no full chunk) or no server
	lookupPending                    // registered, answer not read yet
	lookupFinal                      // answer read (and cached here)
)

// groupReq is one KV-cache group's part of a request.
type groupReq struct {
	lookupID   uint64
	state      lookupState
	hits       int     // final answer: this group's chunks present on all ranks, held for us
	holdsFreed bool    // our holds were released (or never taken)
	saved      int     // chunks that need no save (stored, dispatched, or no longer savable)
	blocks     []int64 // block ids of the request, token order; -1: none (a null block)
	// win is a windowed group's second lookup: only the chunks its window
	// needs at the boundary the full-attention groups reached (foldHits);
	// useWin: the load reads it, not the first one.
	win    *winLookup
	useWin bool
}

// winLookup is a lookup of chunks [base, ...) of a request.
type winLookup struct {
	id    uint64
	state lookupState
	hits  int // chunks present from base on
	base  int
	freed bool
}

type schedReq struct {
	id        string
	prompt    int       // prompt length in tokens
	hashes    []kv.Hash // the prompt's full chunks
	extras    Extras    // what keyed hashes besides the tokens (extends them at the finish)
	state     lookupState
	submitted time.Time
	hits      int             // final answer, folded over the groups
	local     int             // vLLM's own prefix-cache hit, as last given to Match
	gen       uint64          // the generation its hashes were keyed under
	opt       RequestOptions  // its settings (and the role's)
	sources   []ipc.SourceRun // group 0's answer: the tier of each chunk

	g           []groupReq // one per KV-cache group
	winTried    bool       // windowed groups' second lookups were considered
	computed    int        // tokens vLLM has computed, as of the last step
	loadPlanned bool       // a load was planned (holds now belong to the workers)
	savesOut    bool       // saves were dispatched: the workers may still read its blocks
}

// NewScheduler checks cfg and computes the namespaces.
func NewScheduler(cfg SchedulerConfig) (*Scheduler, error) {
	groups, specs, err := cfg.Namespace.GroupNamespaces()
	if err != nil {
		return nil, err
	}
	gns := make([]kv.Namespace, len(specs))
	for i, sp := range specs {
		if gns[i], err = sp.Namespace(); err != nil {
			return nil, err
		}
	}
	chunk := cfg.Namespace.ChunkSize
	if cfg.BlockSize <= 0 || chunk%cfg.BlockSize != 0 {
		return nil, fmt.Errorf("%w: chunk size %d is not a multiple of the block size %d", ErrBadChunkSize, chunk, cfg.BlockSize)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	return &Scheduler{
		cfg: cfg, ns: gns[0], groups: groups, gns: gns, chunk: chunk,
		link: newLink(cfg.Socket, ipc.RoleScheduler, cfg.Instance, cfg.Timeout).directUnless(cfg.RingOnly),
		reqs: map[string]*schedReq{}, fence: map[int64]string{}, answers: map[uint64]*ipc.LookupResultResp{},
	}, nil
}

// ChunkSize is the namespace's chunk size in tokens.
func (s *Scheduler) ChunkSize() int { return s.chunk }

// Groups are the KV-cache groups the scheduler was configured with.
func (s *Scheduler) Groups() []GroupSpec { return slices.Clone(s.groups) }

// Close drops the server session; the server releases everything it held for us.
func (s *Scheduler) Close() error { return s.link.close() }

// Keyed reports whether Match has keyed req (and not forgotten it since:
// finished or preempted): a Match of a keyed request reads no tokens.
func (s *Scheduler) Keyed(req string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reqs[req] != nil
}

// Match answers get_num_new_matched_tokens: the number of tokens beyond
// numComputed that can be loaded, or pending (ask again next step). The
// first call computes the chunk keys and registers the lookups (one per
// KV-cache group); later calls read the answers once and cache them, so
// repeated calls are side-effect free and read no tokens (see Keyed).
func (s *Scheduler) Match(req string, tokens []uint32, ex Extras, numComputed int) (n int, pending bool, err error) {
	return s.match(req, ex, numComputed, func(opt RequestOptions) (*schedReq, error) {
		hashes, err := ChunkHashes(s.rootNS(), tokens, s.chunk, ex)
		if err != nil {
			return nil, err
		}
		return s.submit(req, len(tokens), hashes, ex, opt), nil
	})
}

// ErrStaleRoot: MatchHashes was given chunk keys chained from a root of a
// generation no longer in force (a reset came between KeyRoot and it).
var ErrStaleRoot = errors.New("shim: chunk keys of an earlier generation")

// KeyRoot returns the root that the chunk keys of a new request with
// extras ex chain from (RootHash of this scheduler's namespace and
// generation), and that generation: for a caller that hashes the prompt's
// chunks itself (PlainChunkMessage) and asks MatchHashes. It asks the
// server nothing (its caller may hold the GIL): the generation it knows
// may be one that MatchHashes, which asks, finds stale.
func (s *Scheduler) KeyRoot(ex Extras) (root kv.Hash, gen uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	root, err = RootHash(s.rootNS(), ex)
	return root, s.gen, err
}

// MatchHashes is Match for a prompt of prompt tokens whose full chunks'
// keys the caller computed, chained from KeyRoot's root of generation gen.
// A keyed request ignores them, as Match ignores its tokens. ErrStaleRoot
// when the generation moved since KeyRoot: ask KeyRoot again.
func (s *Scheduler) MatchHashes(req string, prompt int, hashes []kv.Hash, gen uint64, ex Extras, numComputed int) (n int, pending bool, err error) {
	return s.match(req, ex, numComputed, func(opt RequestOptions) (*schedReq, error) {
		if err := ex.Validate(); err != nil {
			return nil, err
		}
		if want := NumFullChunks(prompt, s.chunk); len(hashes) != want {
			return nil, fmt.Errorf("%w: %d chunk keys for %d tokens of chunk size %d, want %d", ErrBadPrefix, len(hashes), prompt, s.chunk, want)
		}
		if gen != s.gen {
			return nil, fmt.Errorf("%w: keyed under %d, generation %d in force", ErrStaleRoot, gen, s.gen)
		}
		return s.submit(req, prompt, hashes, ex, opt), nil
	})
}

// match is the body of Match and MatchHashes: key sets up a request not
// keyed yet (s.mu held; the generation learnt for opt).
func (s *Scheduler) match(req string, ex Extras, numComputed int, key func(opt RequestOptions) (*schedReq, error)) (n int, pending bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil {
		opt := s.options(req)
		s.learnGeneration(!opt.SkipLoad)
		if r, err = key(opt); err != nil {
			return 0, false, err
		}
	}
	r.local = numComputed
	if r.loadPlanned {
		// vLLM asks again only after our load failed and it dropped the
		// request's blocks to recompute them (kv_load_failure_policy
		// "recompute"): the workers released the holds, so answer a final
		// miss (never retry a load that just failed: it could fail forever)
		// and save the recomputed chunks again.
		r.loadPlanned, r.hits = false, 0
		for i := range r.g {
			r.g[i].hits, r.g[i].saved = 0, 0
		}
	}
	if r.state == lookupPending {
		s.poll(r)
	}
	switch r.state {
	case lookupPending:
		return 0, true, nil
	case lookupNone:
		return 0, false, nil
	}
	// vLLM must compute at least the last prompt token itself.
	usable := min(r.hits*s.chunk, r.prompt-1)
	return max(0, usable-numComputed), false, nil
}

// submit keys req (a prompt of prompt tokens, the keys of its full chunks
// hashes under generation s.gen) and sends its lookups. s.mu held.
func (s *Scheduler) submit(req string, prompt int, hashes []kv.Hash, ex Extras, opt RequestOptions) *schedReq {
	r := &schedReq{id: req, prompt: prompt, hashes: hashes, extras: ex, g: make([]groupReq, len(s.groups)), gen: s.gen,
		opt: opt} // s.opts[req] is kept until the finish: a preempted request is keyed again
	for i := range r.g {
		s.nextLookup++
		r.g[i] = groupReq{lookupID: s.nextLookup, holdsFreed: true}
	}
	s.reqs[req] = r
	if len(hashes) == 0 || r.opt.SkipLoad {
		return r // nothing to look up: a miss (its chunks are still keyed for saves)
	}
	for i := range r.g {
		lk := &ipc.LookupReq{LookupID: r.g[i].lookupID, Namespace: s.gns[i], WorldSize: uint32(s.cfg.Namespace.KVWorldSize()),
			MLA: s.cfg.Namespace.SharedMLA(), Hashes: hashes}
		if lk.MLA {
			// MLA objects are stored once and read by every rank.
			lk.WorldSize = uint32(s.cfg.Namespace.WorldSize)
		}
		if err := s.lookup(lk); err != nil {
			s.free(r, 0) // no server: a miss (and no lookup of another group is used)
			r.state = lookupNone
			return r
		}
		r.g[i].state, r.g[i].holdsFreed = lookupPending, false
		r.state = lookupPending
		s.traceSubmitted(r, r.g[i].lookupID, s.gns[i])
	}
	r.submitted = time.Now()
	return r
}

// poll reads the pending lookups' answers; a server that is gone or too
// slow turns the request into a miss. Once every group's answer is final,
// windowed groups that fall short of the full-attention groups' boundary
// get a second lookup of just their window there (submitWindows), and the
// request's hit is the fold of all answers (foldHits).
func (s *Scheduler) poll(r *schedReq) {
	stale := false
	read := func(id uint64) (lookupState, int) {
		res, err := s.lookupResult(id)
		switch {
		case err != nil || res.Status == ipc.StatusUnknown:
			return lookupNone, 0
		case res.Status == ipc.StatusPending:
			return lookupPending, 0
		}
		if !s.checkGeneration(r, res.Generation) {
			stale = true // keyed before a reset: its holds are released below
		}
		if id == r.g[0].lookupID {
			r.sources = res.Sources
		}
		return lookupFinal, int(res.Chunks)
	}
	pending, none := false, false
	for i := range r.g {
		g := &r.g[i]
		if g.state == lookupPending {
			g.state, g.hits = read(g.lookupID)
			g.holdsFreed = g.state == lookupNone || g.state == lookupFinal && g.hits == 0
		}
		if w := g.win; w != nil && w.state == lookupPending {
			w.state, w.hits = read(w.id)
			w.freed = w.state == lookupNone || w.state == lookupFinal && w.hits == 0
		}
		pending = pending || g.state == lookupPending || g.win != nil && g.win.state == lookupPending
		none = none || g.state == lookupNone
	}
	switch {
	case none || stale:
		s.free(r, 0)
		r.state = lookupNone
	case pending:
		if time.Since(r.submitted) > s.cfg.Timeout {
			s.free(r, 0)
			r.state = lookupNone
		}
	case !r.winTried && s.submitWindows(r):
		// asked; answered in a later poll
	default:
		r.state, r.hits = lookupFinal, s.foldHits(r)
		for i := range r.g {
			r.g[i].saved = r.hits
		}
		if r.hits == 0 {
			s.free(r, 0)
		}
	}
}

// fullBoundary is the boundary (in chunks) every full-attention group of r
// can restore: the smallest of their answers, and, with a Mamba group, a
// boundary short of the prompt's end (vLLM computes the last prompt token
// itself, and no state is kept one token short of a boundary).
func (s *Scheduler) fullBoundary(r *schedReq) int {
	k := len(r.hashes)
	if slices.ContainsFunc(s.groups, GroupSpec.BoundaryOnly) {
		k = min(k, max(0, r.prompt-1)/s.chunk)
	}
	for i, gs := range s.groups {
		if !gs.Windowed() {
			k = min(k, r.g[i].hits)
		}
	}
	return k
}

// windowChunk is the first chunk a windowed group needs for a hit of k
// chunks (ending where Match's answer ends it: one token short of the
// prompt when every prompt chunk hits).
func (s *Scheduler) windowChunk(r *schedReq, gs GroupSpec, k int) int {
	end := min(k*s.chunk, r.prompt-1)
	return gs.Skipped(end) / s.cfg.BlockSize / (s.chunk / s.cfg.BlockSize)
}

// submitWindows registers, for every windowed group whose answer (the
// contiguous prefix of its chunks) is shorter than the full-attention
// groups' boundary k, a lookup of the chunks its window needs at k. Such a
// group does not need its earlier chunks: a request that finished after a
// long answer stored only the windows its blocks still held. It reports
// whether any lookup was submitted.
func (s *Scheduler) submitWindows(r *schedReq) bool {
	r.winTried = true
	k := s.fullBoundary(r)
	if k == 0 {
		return false
	}
	submitted := false
	for i, gs := range s.groups {
		g := &r.g[i]
		if !gs.Windowed() || g.hits >= k {
			continue
		}
		base := s.windowChunk(r, gs, k)
		s.nextLookup++
		w := &winLookup{id: s.nextLookup, base: base, freed: true}
		lk := &ipc.LookupReq{LookupID: w.id, Namespace: s.gns[i], WorldSize: uint32(s.cfg.Namespace.KVWorldSize()),
			MLA: s.cfg.Namespace.MLA, Hashes: r.hashes[base:k]}
		if s.cfg.Namespace.MLA {
			lk.WorldSize = uint32(s.cfg.Namespace.WorldSize)
		}
		if err := s.lookup(lk); err != nil {
			continue // that group stays at its first answer
		}
		w.state, w.freed = lookupPending, false
		g.win = w
		submitted = true
		s.traceSubmitted(r, w.id, s.gns[i])
	}
	return submitted
}

// foldHits is the request's hit in chunks from its groups' answers: the
// largest chunk boundary every group can restore, each by its own
// protocol. A full-attention group restores a boundary k when chunks
// [0, k) are there (the server's contiguous prefix). A windowed group
// needs only the objects of the chunks that hold blocks inside its window
// at k (ObjectFirstBlock): there when its first answer reaches k, or when
// its window lookup (submitWindows) found all of them. If a windowed group
// cannot restore the full groups' boundary, the hit is the smallest first
// answer. The lookups not used are released.
func (s *Scheduler) foldHits(r *schedReq) int {
	k := s.fullBoundary(r)
	ok := true
	for i, gs := range s.groups {
		g := &r.g[i]
		if gs.Windowed() && g.hits < k && (g.win == nil || g.win.state != lookupFinal || g.win.base+g.win.hits < k) {
			ok = false
		}
	}
	if !ok {
		for i := range r.g {
			k = min(k, r.g[i].hits)
		}
	}
	for i := range r.g {
		g := &r.g[i]
		g.useWin = ok && g.win != nil && g.hits < k
		if g.useWin {
			s.freeGroup(r, i, 0)
		} else {
			s.freeWin(g)
		}
	}
	return k
}

// free releases our holds on chunks [from, end) of every group's lookup
// (and, from 0, every window lookup).
func (s *Scheduler) free(r *schedReq, from uint32) {
	for i := range r.g {
		s.freeGroup(r, i, from)
		if from == 0 {
			s.freeWin(&r.g[i])
		}
	}
}

// freeWin releases a group's window lookup, if any.
func (s *Scheduler) freeWin(g *groupReq) {
	w := g.win
	if w == nil || w.freed {
		return
	}
	_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
		return c.Free(ctx, &ipc.FreeReq{LookupID: w.id, Start: 0, End: ^uint32(0)})
	})
	w.freed = true
	if w.state == lookupPending {
		s.orphans = append(s.orphans, w.id)
	}
}

func (s *Scheduler) freeGroup(r *schedReq, i int, from uint32) {
	g := &r.g[i]
	if g.holdsFreed {
		return
	}
	_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
		return c.Free(ctx, &ipc.FreeReq{LookupID: g.lookupID, Start: from, End: ^uint32(0)})
	})
	if from == 0 {
		g.holdsFreed = true
		if g.state == lookupPending {
			// The server forgets a lookup only once its answer is read:
			// read it when the fill ends (reapOrphans).
			s.orphans = append(s.orphans, g.lookupID)
		}
	}
}

// lookup registers lk, asking for its answer in the ack: a lookup final at
// registration (everything it finds is in L1) is then answered without a
// second round trip, kept in s.answers until lookupResult reads it. s.mu
// held.
func (s *Scheduler) lookup(lk *ipc.LookupReq) error {
	lk.AnswerFinal = true
	var res *ipc.LookupResultResp
	err := s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		res, err = c.LookupAnswer(ctx, lk)
		return err
	})
	if err == nil && res != nil {
		s.answers[lk.LookupID] = res
	}
	return err
}

// lookupResult reads lookup id's answer: the one its ack carried, or the
// server's. s.mu held.
func (s *Scheduler) lookupResult(id uint64) (res *ipc.LookupResultResp, err error) {
	if res, ok := s.answers[id]; ok {
		delete(s.answers, id)
		return res, nil
	}
	err = s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		res, err = c.LookupResult(ctx, &ipc.LookupResultReq{LookupID: id})
		return err
	})
	return res, err
}

// reapOrphans reads the answers of lookups given up while pending (request
// aborted, or pending past the timeout) once they are final, and frees what
// they hold, so the server forgets them. Called once per step.
func (s *Scheduler) reapOrphans() {
	keep := s.orphans[:0]
	for _, id := range s.orphans {
		res, err := s.lookupResult(id)
		switch {
		case err != nil || res.Status == ipc.StatusUnknown:
			// server gone (its session with us too) or already forgotten
		case res.Status == ipc.StatusPending:
			keep = append(keep, id)
		case res.Chunks > 0:
			_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
				return c.Free(ctx, &ipc.FreeReq{LookupID: id, Start: 0, End: ^uint32(0)})
			})
		}
	}
	s.orphans = keep
}

// setBlocks records the request's block tables from one array of all
// groups (splitGroups).
func (s *Scheduler) setBlocks(r *schedReq, blocks []int64, groups int) error {
	parts, err := splitGroups(blocks, groups, s.groups)
	if err != nil {
		return err
	}
	for i := range r.g {
		r.g[i].blocks = append(r.g[i].blocks[:0], parts[i]...)
	}
	return nil
}

// AfterAlloc answers update_state_after_alloc: blocks are all the request's
// block ids so far (vLLM's own prefix-cache hits first; every KV-cache
// group's in one array, groups of them: splitGroups), numComputed
// the tokens vLLM has itself (negative: the value given to Match),
// numExternal the tokens to load. It plans, per group, the load of the
// chunks that cover [numComputed, numComputed+numExternal) and hold blocks
// the group needs there (a windowed group: from its window's first block
// on), skipping the blocks vLLM already has, and releases every other hold.
// A second call (more blocks after the load) only records the blocks.
func (s *Scheduler) AfterAlloc(req string, blocks []int64, groups, numComputed, numExternal int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if numExternal > 0 {
		s.hitTokens += uint64(numExternal)
		s.hitRequests++
	}
	r := s.reqs[req]
	if r == nil {
		return nil // never looked up (no full chunk): nothing to do
	}
	if numComputed < 0 {
		numComputed = r.local
	}
	if err := s.setBlocks(r, blocks, groups); err != nil {
		return err
	}
	r.computed = numComputed
	if r.loadPlanned {
		return nil
	}
	if numExternal <= 0 || r.state != lookupFinal {
		s.free(r, 0)
		return nil
	}
	bs := s.cfg.BlockSize
	cb := s.chunk / bs
	end := numComputed + numExternal
	first, last := numComputed/s.chunk, (end+s.chunk-1)/s.chunk
	if last > r.hits || (last*s.chunk)/bs > len(r.g[0].blocks)+cb && !s.groups[0].Windowed() {
		return fmt.Errorf("%w: load of %q: tokens [%d, %d) but %d chunks held and %d blocks", ErrBadMeta, req, numComputed, end, r.hits, len(r.g[0].blocks))
	}
	for i, gs := range s.groups {
		g := &r.g[i]
		// The first block vLLM allocated for this group (below: null
		// blocks of a window that moved on), and the chunk that holds it.
		firstBlock := gs.Skipped(end) / bs
		gFirst := max(first, firstBlock/cb)
		ids := make([]int64, 0, (last-gFirst)*cb)
		for b := gFirst * cb; b < last*cb; b++ {
			switch {
			case b < numComputed/bs:
				ids = append(ids, -1) // vLLM has it: never overwrite a shared block
			case b < firstBlock:
				ids = append(ids, -1) // outside the window: a null block
			case b < len(g.blocks):
				ids = append(ids, g.blocks[b]) // -1 when vLLM gave a null block
			default:
				// The full-hit case: vLLM allocated blocks for one token less
				// than the last chunk, so the tail of that chunk has no block.
				ids = append(ids, -1)
			}
		}
		// The lookup the load reads: the group's, or its window lookup,
		// whose chunk 0 is chunk base of the request.
		id, base, hits := g.lookupID, 0, g.hits
		if g.useWin {
			id, base, hits = g.win.id, g.win.base, g.win.base+g.win.hits
			g.win.freed = true
		}
		// The chunk hashes go with the load: the workers check each object's
		// header names its key before a byte of it reaches the KV cache.
		hs := make([]kv.Hash, 0, last-gFirst)
		for _, h := range r.hashes[gFirst:last] {
			hs = append(hs, kv.Hash(h))
		}
		lo, hi := gFirst-base, last-base
		if gFirst < base || gs.BoundaryOnly() && end%s.chunk != 0 {
			// vLLM loads fewer tokens than Match offered and the window
			// starts before the chunks held (or a Mamba group's load ends
			// off a chunk boundary, where no object holds the state): a
			// load without hashes, so every block of it is a load error
			// (no object is checked or copied) and vLLM recomputes them.
			hs, lo, hi = nil, 0, last-gFirst
		}
		// Holds outside the chunks we load are not needed; the workers
		// release the rest after their copies.
		if lo > 0 {
			_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
				return c.Free(ctx, &ipc.FreeReq{LookupID: id, Start: 0, End: uint32(lo)})
			})
		}
		if last < hits {
			_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
				return c.Free(ctx, &ipc.FreeReq{LookupID: id, Start: uint32(last - base), End: ^uint32(0)})
			})
		}
		s.loads = append(s.loads, LoadSpec{Req: req, Group: uint32(i), Owner: kv.Tag(s.cfg.Instance), Lookup: id,
			Start: uint32(lo), End: uint32(hi), Hashes: hs, Blocks: ids})
		g.holdsFreed = true
	}
	// vLLM itself keeps the blocks of a request whose load is in flight
	// (WAITING_FOR_REMOTE_KVS) until the workers report it received.
	r.loadPlanned = true
	if s.loading == nil {
		s.loading = map[string]int{}
	}
	s.loading[req] = last - first
	return nil
}

// groupSave is the save of group i's chunks [g.saved, full) of r from its
// block table blocks (none when nothing is to save); hashes are r's chunk
// hashes (at least full of them). A full-attention group saves every block
// of a chunk and stops at the first chunk with a missing block (not
// allocated yet). A windowed group's object of chunk c holds the blocks
// from ObjectFirstBlock on (the rest are -1, left out): a chunk whose
// window has a null block (freed by vLLM) can no longer be saved and is
// passed over. A sliding window passes over leading chunks only; a Mamba
// group may pass over any chunk (no step ended on its boundary), so the
// chunks saved are one SaveSpec per run of consecutive chunks. The blocks
// a windowed save reads are fenced (see fence).
func (s *Scheduler) groupSave(r *schedReq, i int, full int, hashes []kv.Hash, blocks []int64) []SaveSpec {
	if r.opt.SkipSave {
		return nil
	}
	g, gs := &r.g[i], s.groups[i]
	bs := s.cfg.BlockSize
	cb := s.chunk / bs
	if !gs.Windowed() {
		full = min(full, len(blocks)/cb)
	}
	if full <= g.saved {
		return nil
	}
	var out []SaveSpec
	var sv *SaveSpec
	c := g.saved
	for ; c < full; c++ {
		lo, hi := gs.ObjectFirstBlock(c, s.chunk, bs), (c+1)*cb
		if hi > len(blocks) {
			break // not allocated yet
		}
		if slices.ContainsFunc(blocks[lo:hi], func(id int64) bool { return id < 0 }) {
			sv = nil // the window moved on (or no state there): gone; a later chunk starts a new run
			continue
		}
		if sv == nil {
			out = append(out, SaveSpec{Req: r.id, Group: uint32(i), First: uint32(c), Blocks: make([]int64, 0, (full-c)*cb)})
			sv = &out[len(out)-1]
		}
		sv.Hashes = append(sv.Hashes, kv.Hash(hashes[c]))
		for b := c * cb; b < hi; b++ {
			if b < lo {
				sv.Blocks = append(sv.Blocks, -1)
				continue
			}
			sv.Blocks = append(sv.Blocks, blocks[b])
			if gs.Windowed() {
				s.fence[blocks[b]] = r.id
			}
		}
	}
	g.saved = c
	return out
}

// StepRequest is one scheduled request of an engine step, as Python
// flattens vLLM's SchedulerOutput. Blocks and NewBlocks hold every
// KV-cache group's ids, Groups of them, as AfterAlloc's do (splitGroups:
// vLLM's null block, id 0, means no block).
type StepRequest struct {
	Req       string  `json:"req"`
	Blocks    []int64 `json:"blocks"`           // new requests and resumed ones: all block ids
	NewBlocks []int64 `json:"new_blocks"`       // running requests: blocks added this step
	Groups    int     `json:"groups,omitempty"` // the KV-cache groups Blocks and NewBlocks hold (0: 1)
	Computed  int     `json:"computed"`         // num_computed_tokens before this step
	Scheduled int     `json:"scheduled"`        // tokens scheduled this step
	// Tokens (from token TokensFrom on, a chunk boundary at most the
	// request's keyed chunks) are a running request's token ids up to the
	// last chunk boundary its KV has reached: positions whose KV was
	// computed in earlier steps, accepted and processed (vLLM's
	// num_computed_tokens less the tokens in flight: never a draft or
	// rejected token, never the last sampled one). Python sends them only
	// when the decode crosses a chunk boundary; BuildMeta keys the new
	// chunks (chained on, as the finish does) and saves them.
	Tokens     []uint32 `json:"tokens,omitempty"`
	TokensFrom int      `json:"tokens_from,omitempty"`
}

// Step is one engine step: the scheduled requests, those that finished
// and those that were preempted.
type Step struct {
	Requests  []StepRequest `json:"requests"`
	Preempted []string      `json:"preempted"`
}

// BuildMeta answers build_connector_meta: the loads planned since the last
// step, the full prompt chunks this step completes (to save, per KV-cache
// group), the delay-freed requests and the preempted ones (and the
// requests whose saves still read a block this step hands out again: see
// fence). It resets the pending lists.
func (s *Scheduler) BuildMeta(step *Step) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Every request's block ids read first: a malformed step changes nothing.
	tables := make([][2][][]int64, len(step.Requests))
	for i, sr := range step.Requests {
		for _, f := range [...]struct {
			name string
			v    int
		}{{"computed", sr.Computed}, {"scheduled", sr.Scheduled}, {"tokens_from", sr.TokensFrom}} {
			if f.v < 0 {
				return nil, fmt.Errorf("%w: request %q: %s %d is negative", ErrBadMeta, sr.Req, f.name, f.v)
			}
		}
		var err error
		if sr.Blocks != nil {
			if tables[i][0], err = splitGroups(sr.Blocks, sr.Groups, s.groups); err != nil {
				return nil, fmt.Errorf("request %q: %w", sr.Req, err)
			}
		}
		if tables[i][1], err = splitGroups(sr.NewBlocks, sr.Groups, s.groups); err != nil {
			return nil, fmt.Errorf("request %q: %w", sr.Req, err)
		}
	}
	m := &StepMeta{Loads: s.loads, Saves: s.saves, Finished: s.finished, Preempted: step.Preempted}
	s.loads, s.saves, s.finished = nil, nil, nil
	s.reapOrphans()
	// A preempted request loses its blocks (the workers wait for its copies
	// before they are reused) and comes back through a new lookup.
	for _, id := range step.Preempted {
		if r := s.reqs[id]; r != nil {
			if !r.loadPlanned {
				s.free(r, 0)
			}
			delete(s.reqs, id)
			delete(s.loading, id)
		}
	}
	s.fenceStep(m, step)
	bs := s.cfg.BlockSize
	cb := s.chunk / bs
	for k, sr := range step.Requests {
		r := s.reqs[sr.Req]
		if r == nil {
			continue
		}
		for i := range r.g {
			g := &r.g[i]
			if all := tables[k][0]; all != nil {
				g.blocks = append(g.blocks[:0], all[i]...)
			}
			g.blocks = append(g.blocks, tables[k][1][i]...)
		}
		r.computed = sr.Computed + sr.Scheduled
		// Prompt chunks only: their keys are known from the lookup.
		full := min(min(r.computed, r.prompt)/s.chunk, len(r.hashes))
		if asBefore(s.groups) {
			full = min(full, len(r.g[0].blocks)/cb)
		}
		if sr.Tokens != nil {
			// Decode: the chunks completed by generated tokens.
			full = max(full, s.decodedChunks(r, &sr))
		}
		for i := range r.g {
			if svs := s.groupSave(r, i, full, r.hashes, r.g[i].blocks); len(svs) > 0 {
				m.Saves = append(m.Saves, svs...)
				s.announce(svs)
				r.savesOut = true
			}
		}
	}
	return m.Encode()
}

// decodedChunks keys the full chunks of a running request's tokens
// (sr.Tokens, token sr.TokensFrom on) past those r keyed already, chained
// on from its last key (the keys its finish and a lookup of its whole
// token list make), and returns how many chunks of r are keyed and
// computed: the boundary a decode-time save reaches. Tokens that do not
// fit r (from past its keyed chunks, or fewer than it keyed) add nothing.
func (s *Scheduler) decodedChunks(r *schedReq, sr *StepRequest) int {
	end := sr.TokensFrom + len(sr.Tokens)
	full := end / s.chunk
	if sr.TokensFrom < 0 || sr.TokensFrom > len(r.hashes)*s.chunk || end < r.prompt {
		return 0
	}
	if full > len(r.hashes) {
		// The tokens before TokensFrom are in r.hashes already.
		hashes, err := ExtendChunkHashesTail(genRoot(s.ns, r.gen), r.hashes, sr.Tokens, sr.TokensFrom, s.chunk, r.extras)
		if err != nil {
			return 0
		}
		r.hashes = hashes
	}
	return full
}

// fenceStep adds to m's preempted list the requests whose windowed saves
// (dispatched in earlier steps) read a block that this step allocates
// again: to a scheduled request, or to a load.
func (s *Scheduler) fenceStep(m *StepMeta, step *Step) {
	if len(s.fence) == 0 {
		return
	}
	waited := map[string]bool{}
	for _, id := range m.Preempted {
		waited[id] = true
	}
	check := func(ids []int64) {
		for _, id := range ids {
			if req, ok := s.fence[id]; ok {
				delete(s.fence, id)
				if !waited[req] {
					waited[req] = true
					m.Preempted = append(m.Preempted, req)
				}
			}
		}
	}
	for _, sr := range step.Requests {
		check(sr.Blocks)
		check(sr.NewBlocks)
	}
	for _, ld := range m.Loads {
		check(ld.Blocks)
	}
}

// Finished answers request_finished for a request whose computed chunks
// are not saved (an aborted one, or a caller that passes no tokens): see
// FinishedSaving.
func (s *Scheduler) Finished(req string) (delay bool) {
	delay, _ = s.FinishedSaving(req, nil)
	return delay
}

// FinishState is what request_finished knows of a request that finished
// normally (stopped or length-capped): its token ids, prompt and generated,
// from token First on (Tokens[i] is token First+i; First is at most the
// prompt's full chunks, whose keys are known from the lookup), Computed
// (how many of its tokens have KV in its blocks: vLLM's num_computed_tokens
// less the tokens still in flight; the last sampled token has none yet, and
// rejected draft tokens are not counted) and Blocks (its block ids, token
// order; every KV-cache group's, Groups of them, as splitGroups reads
// them).
type FinishState struct {
	Tokens   []uint32
	First    int
	Computed int
	Blocks   []int64
	Groups   int
}

// FinishedSaving answers request_finished: it releases what the request
// still holds, queues the save of every full chunk the request computed
// beyond those already saved or stored (with fin: the generated tokens'
// chunks too, under the same chained keys, so the next turn of a
// conversation hits its whole prefix; nil saves nothing new) for the next
// metadata, and reports whether vLLM must keep its blocks until the
// workers report the request in finished_sending (saves may still read
// them). A load in flight needs no delay here: vLLM keeps the blocks of a
// request waiting for remote KV until the workers report it received, and
// reporting it twice would free it twice. The request's state is dropped
// either way; an error (tokens that do not fit the request) saves nothing
// new and still answers delay.
func (s *Scheduler) FinishedSaving(req string, fin *FinishState) (delay bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.opts, req)
	defer s.eventFinished(req)
	r := s.reqs[req]
	if r == nil {
		return false, nil
	}
	delete(s.reqs, req)
	if !r.loadPlanned {
		s.free(r, 0)
	}
	if chunks, ok := s.loading[req]; ok {
		delete(s.loading, req)
		if fin == nil {
			s.loadCancelled(r, chunks)
		}
	}
	if fin != nil {
		var svs []SaveSpec
		if svs, err = s.finalSave(r, fin); len(svs) > 0 {
			s.saves = append(s.saves, svs...)
			s.announce(svs)
			r.savesOut = true
		}
	}
	if r.savesOut {
		s.finished = append(s.finished, req)
	}
	return r.savesOut, err
}

// finalSave is the save of r's full computed chunks [saved, n) at its
// finish, per group.
func (s *Scheduler) finalSave(r *schedReq, fin *FinishState) ([]SaveSpec, error) {
	known := len(r.hashes) * s.chunk
	if fin.First < 0 || fin.First > known {
		return nil, fmt.Errorf("%w: finish of %q: tokens from %d, but the lookup keyed only the first %d", ErrBadMeta, r.id, fin.First, known)
	}
	end := fin.First + len(fin.Tokens)
	if end < r.prompt {
		return nil, fmt.Errorf("%w: finish of %q: %d tokens, fewer than its %d-token prompt", ErrBadMeta, r.id, end, r.prompt)
	}
	blocks, err := splitGroups(fin.Blocks, fin.Groups, s.groups)
	if err != nil {
		return nil, err
	}
	full := min(fin.Computed, end) / s.chunk
	if asBefore(s.groups) {
		full = min(full, len(fin.Blocks)/(s.chunk/s.cfg.BlockSize))
	}
	need := false
	for i := range r.g {
		need = need || full > r.g[i].saved
	}
	if !need {
		return nil, nil
	}
	hashes := r.hashes
	if full > len(hashes) {
		// The chunks past the prompt's: chained on from its last key (the
		// tokens before First are in r.hashes already).
		tail := fin.Tokens[:full*s.chunk-fin.First]
		if hashes, err = ExtendChunkHashesTail(genRoot(s.ns, r.gen), slices.Clip(r.hashes), tail, fin.First, s.chunk, r.extras); err != nil {
			return nil, err
		}
	}
	var out []SaveSpec
	for i := range r.g {
		out = append(out, s.groupSave(r, i, full, hashes, blocks[i])...)
	}
	return out, nil
}

// Requests reports how many requests have state (a leak check for tests).
func (s *Scheduler) Requests() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.reqs)
}

// Stats asks the server for its counters.
func (s *Scheduler) Stats() (*ipc.StatsResp, error) {
	var st *ipc.StatsResp
	err := s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		st, err = c.Stats(ctx)
		return err
	})
	return st, err
}
