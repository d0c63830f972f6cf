package shim

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
)

// SchedulerConfig configures the scheduler side of the connector.
type SchedulerConfig struct {
	Socket    string        // the server's socket
	Namespace NamespaceSpec // what makes KV bytes compatible
	BlockSize int           // vLLM's block size in tokens; divides ChunkSize
	Timeout   time.Duration // per server call, and the longest a lookup stays pending
	Instance  uuid.UUID     // this connector's id: the Owner workers retrieve with
}

// Scheduler is the scheduler-side state machine: it turns vLLM's questions
// (how many tokens can be loaded? which blocks to load into? which chunks
// to save?) into server lookups and per-step metadata for the workers.
// Every method is one Python call; none blocks longer than the call timeout.
type Scheduler struct {
	cfg   SchedulerConfig
	ns    ipc.Namespace
	chunk int
	link  *link

	mu         sync.Mutex
	reqs       map[string]*schedReq
	nextLookup uint64
	loads      []LoadSpec // dispatched with the next metadata
	finished   []string   // delay-freed requests, told to workers with the next metadata
	saves      []SaveSpec // saves of finished requests, dispatched with the next metadata
	orphans    []uint64   // lookups given up while pending: read once final so the server forgets them
	trace      schedTrace // lifecycle records (schedtrace.go)
}

type lookupState uint8

const (
	lookupNone    lookupState = iota // nothing to look up (no full chunk) or no server
	lookupPending                    // registered, answer not read yet
	lookupFinal                      // answer read (and cached here)
)

type schedReq struct {
	id        string
	prompt    int        // prompt length in tokens
	hashes    []ipc.Hash // the prompt's full chunks
	extras    Extras     // what keyed hashes besides the tokens (extends them at the finish)
	lookupID  uint64
	state     lookupState
	submitted time.Time
	hits      int // final answer: chunks present on all ranks, held for us
	local     int // vLLM's own prefix-cache hit, as last given to Match

	blocks      []int64 // block ids of the request, token order (group 0)
	computed    int     // tokens vLLM has computed, as of the last step
	loadPlanned bool    // a load was planned (holds now belong to the workers)
	holdsFreed  bool    // our holds were released (or never taken)
	saved       int     // chunks that need no save (stored, or dispatched)
	savesOut    bool    // saves were dispatched: the workers may still read its blocks
}

// NewScheduler checks cfg and computes the namespace.
func NewScheduler(cfg SchedulerConfig) (*Scheduler, error) {
	ns, err := cfg.Namespace.Namespace()
	if err != nil {
		return nil, err
	}
	chunk := cfg.Namespace.ChunkSize
	if cfg.BlockSize <= 0 || chunk%cfg.BlockSize != 0 {
		return nil, fmt.Errorf("%w: chunk size %d is not a multiple of the block size %d", ErrBadChunkSize, chunk, cfg.BlockSize)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	return &Scheduler{
		cfg: cfg, ns: ns, chunk: chunk,
		link: newLink(cfg.Socket, ipc.RoleScheduler, cfg.Instance, cfg.Timeout),
		reqs: map[string]*schedReq{},
	}, nil
}

// Close drops the server session; the server releases everything it held for us.
func (s *Scheduler) Close() error { return s.link.close() }

// Match answers get_num_new_matched_tokens: the number of tokens beyond
// numComputed that can be loaded, or pending (ask again next step). The
// first call computes the chunk keys and registers the lookup; later calls
// read the answer once and cache it, so repeated calls are side-effect free.
func (s *Scheduler) Match(req string, tokens []uint32, ex Extras, numComputed int) (n int, pending bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil {
		if r, err = s.submit(req, tokens, ex); err != nil {
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
		r.loadPlanned, r.hits, r.saved = false, 0, 0
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

func (s *Scheduler) submit(req string, tokens []uint32, ex Extras) (*schedReq, error) {
	hashes, err := ChunkHashes(s.ns, tokens, s.chunk, ex)
	if err != nil {
		return nil, err
	}
	s.nextLookup++
	r := &schedReq{id: req, prompt: len(tokens), hashes: hashes, extras: ex, lookupID: s.nextLookup, holdsFreed: true}
	s.reqs[req] = r
	if len(hashes) == 0 {
		return r, nil
	}
	lk := &ipc.LookupReq{LookupID: r.lookupID, Namespace: s.ns, WorldSize: uint32(s.cfg.Namespace.KVWorldSize()),
		MLA: s.cfg.Namespace.SharedMLA(), Hashes: hashes}
	if lk.MLA {
		// MLA objects are stored once and read by every rank.
		lk.WorldSize = uint32(s.cfg.Namespace.WorldSize)
	}
	err = s.link.call(func(ctx context.Context, c *ipc.Client) error { return c.Lookup(ctx, lk) })
	if err != nil {
		return r, nil // no server: a miss
	}
	r.state, r.submitted, r.holdsFreed = lookupPending, time.Now(), false
	s.traceSubmitted(r)
	return r, nil
}

// poll reads a pending lookup's answer; a server that is gone or too slow
// turns it into a miss.
func (s *Scheduler) poll(r *schedReq) {
	var res *ipc.LookupResultResp
	err := s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		res, err = c.LookupResult(ctx, &ipc.LookupResultReq{LookupID: r.lookupID})
		return err
	})
	switch {
	case err != nil || res.Status == ipc.StatusUnknown:
		r.state, r.holdsFreed = lookupNone, true
	case res.Status == ipc.StatusPending:
		if time.Since(r.submitted) > s.cfg.Timeout {
			s.free(r, 0)
			r.state = lookupNone
		}
	default:
		r.state, r.hits, r.saved = lookupFinal, int(res.Chunks), int(res.Chunks)
		if r.hits == 0 {
			r.holdsFreed = true
		}
	}
}

// free releases our holds on chunks [from, end) of the lookup.
func (s *Scheduler) free(r *schedReq, from uint32) {
	if r.holdsFreed {
		return
	}
	_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
		return c.Free(ctx, &ipc.FreeReq{LookupID: r.lookupID, Start: from, End: ^uint32(0)})
	})
	if from == 0 {
		r.holdsFreed = true
		if r.state == lookupPending {
			// The server forgets a lookup only once its answer is read:
			// read it when the fill ends (reapOrphans).
			s.orphans = append(s.orphans, r.lookupID)
		}
	}
}

// reapOrphans reads the answers of lookups given up while pending (request
// aborted, or pending past the timeout) once they are final, and frees what
// they hold, so the server forgets them. Called once per step.
func (s *Scheduler) reapOrphans() {
	keep := s.orphans[:0]
	for _, id := range s.orphans {
		var res *ipc.LookupResultResp
		err := s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
			res, err = c.LookupResult(ctx, &ipc.LookupResultReq{LookupID: id})
			return err
		})
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

// AfterAlloc answers update_state_after_alloc: blocks are all the request's
// block ids so far (vLLM's own prefix-cache hits first), numComputed the
// tokens vLLM has itself (negative: the value given to Match), numExternal
// the tokens to load. It plans the load
// of the chunks that cover [numComputed, numComputed+numExternal), skipping
// the blocks vLLM already has, and releases every other hold. A second call
// (more blocks after the load) only records the blocks.
func (s *Scheduler) AfterAlloc(req string, blocks []int64, numComputed, numExternal int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil {
		return nil // never looked up (no full chunk): nothing to do
	}
	if numComputed < 0 {
		numComputed = r.local
	}
	r.blocks = append(r.blocks[:0], blocks...)
	r.computed = numComputed
	if r.loadPlanned {
		return nil
	}
	if numExternal <= 0 || r.state != lookupFinal {
		s.free(r, 0)
		return nil
	}
	bs := s.cfg.BlockSize
	end := numComputed + numExternal
	first, last := numComputed/s.chunk, (end+s.chunk-1)/s.chunk
	if last > r.hits || (last*s.chunk)/bs > len(blocks)+(s.chunk/bs) {
		return fmt.Errorf("%w: load of %q: tokens [%d, %d) but %d chunks held and %d blocks", ErrBadMeta, req, numComputed, end, r.hits, len(blocks))
	}
	ids := make([]int64, 0, (last-first)*s.chunk/bs)
	for b := first * s.chunk / bs; b < last*s.chunk/bs; b++ {
		switch {
		case b < numComputed/bs:
			ids = append(ids, -1) // vLLM has it: never overwrite a shared block
		case b < len(blocks):
			ids = append(ids, blocks[b])
		default:
			// The full-hit case: vLLM allocated blocks for one token less
			// than the last chunk, so the tail of that chunk has no block.
			ids = append(ids, -1)
		}
	}
	// Holds below the first chunk we load are not needed; the workers
	// release the rest after their copies.
	if first > 0 {
		_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
			return c.Free(ctx, &ipc.FreeReq{LookupID: r.lookupID, Start: 0, End: uint32(first)})
		})
	}
	if last < r.hits {
		_ = s.link.call(func(ctx context.Context, c *ipc.Client) error {
			return c.Free(ctx, &ipc.FreeReq{LookupID: r.lookupID, Start: uint32(last), End: ^uint32(0)})
		})
	}
	// The chunk hashes go with the load: the workers check each object's
	// header names its key before a byte of it reaches the KV cache.
	hs := make([]Hash, 0, last-first)
	for _, h := range r.hashes[first:last] {
		hs = append(hs, Hash(h))
	}
	s.loads = append(s.loads, LoadSpec{Req: req, Owner: Tag(s.cfg.Instance), Lookup: r.lookupID,
		Start: uint32(first), End: uint32(last), Hashes: hs, Blocks: ids})
	// vLLM itself keeps the blocks of a request whose load is in flight
	// (WAITING_FOR_REMOTE_KVS) until the workers report it received.
	r.loadPlanned, r.holdsFreed = true, true
	return nil
}

// StepRequest is one scheduled request of an engine step, as Python
// flattens vLLM's SchedulerOutput.
type StepRequest struct {
	Req       string  `json:"req"`
	Blocks    []int64 `json:"blocks"`     // new requests and resumed ones: all block ids
	NewBlocks []int64 `json:"new_blocks"` // running requests: blocks added this step
	Computed  int     `json:"computed"`   // num_computed_tokens before this step
	Scheduled int     `json:"scheduled"`  // tokens scheduled this step
}

// Step is one engine step: the scheduled requests, those that finished
// and those that were preempted.
type Step struct {
	Requests  []StepRequest `json:"requests"`
	Preempted []string      `json:"preempted"`
}

// BuildMeta answers build_connector_meta: the loads planned since the last
// step, the full prompt chunks this step completes (to save), the
// delay-freed requests and the preempted ones. It resets the pending lists.
func (s *Scheduler) BuildMeta(step *Step) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
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
		}
	}
	bs := s.cfg.BlockSize
	cb := s.chunk / bs
	for _, sr := range step.Requests {
		r := s.reqs[sr.Req]
		if r == nil {
			continue
		}
		if sr.Blocks != nil {
			r.blocks = append(r.blocks[:0], sr.Blocks...)
		}
		r.blocks = append(r.blocks, sr.NewBlocks...)
		r.computed = sr.Computed + sr.Scheduled
		// Prompt chunks only: their keys are known from the lookup.
		full := min(min(r.computed, r.prompt)/s.chunk, len(r.hashes), len(r.blocks)/cb)
		if full <= r.saved {
			continue
		}
		sv := SaveSpec{Req: r.id, First: uint32(r.saved), Blocks: make([]int64, 0, (full-r.saved)*cb)}
		for c := r.saved; c < full; c++ {
			sv.Hashes = append(sv.Hashes, Hash(r.hashes[c]))
			sv.Blocks = append(sv.Blocks, r.blocks[c*cb:(c+1)*cb]...)
		}
		m.Saves = append(m.Saves, sv)
		r.saved, r.savesOut = full, true
	}
	return m.Encode()
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
// order, group 0).
type FinishState struct {
	Tokens   []uint32
	First    int
	Computed int
	Blocks   []int64
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
	r := s.reqs[req]
	if r == nil {
		return false, nil
	}
	delete(s.reqs, req)
	if !r.loadPlanned {
		s.free(r, 0)
	}
	if fin != nil {
		var sv *SaveSpec
		if sv, err = s.finalSave(r, fin); sv != nil {
			s.saves = append(s.saves, *sv)
			r.savesOut = true
		}
	}
	if r.savesOut {
		s.finished = append(s.finished, req)
	}
	return r.savesOut, err
}

// finalSave is the save of r's full computed chunks [r.saved, n) at its
// finish, or nil when there is none.
func (s *Scheduler) finalSave(r *schedReq, fin *FinishState) (*SaveSpec, error) {
	known := len(r.hashes) * s.chunk
	if fin.First < 0 || fin.First > known {
		return nil, fmt.Errorf("%w: finish of %q: tokens from %d, but the lookup keyed only the first %d", ErrBadMeta, r.id, fin.First, known)
	}
	end := fin.First + len(fin.Tokens)
	if end < r.prompt {
		return nil, fmt.Errorf("%w: finish of %q: %d tokens, fewer than its %d-token prompt", ErrBadMeta, r.id, end, r.prompt)
	}
	cb := s.chunk / s.cfg.BlockSize
	full := min(min(fin.Computed, end)/s.chunk, len(fin.Blocks)/cb)
	if full <= r.saved {
		return nil, nil
	}
	hashes := r.hashes
	if full > len(hashes) {
		// The chunks past the prompt's: chained on from its last key. The
		// tokens before First are never read (they are in r.hashes).
		toks := make([]uint32, full*s.chunk)
		copy(toks[fin.First:], fin.Tokens)
		var err error
		if hashes, err = ExtendChunkHashes(s.ns, slices.Clip(r.hashes), toks, s.chunk, r.extras); err != nil {
			return nil, err
		}
	}
	sv := &SaveSpec{Req: r.id, First: uint32(r.saved), Blocks: make([]int64, 0, (full-r.saved)*cb)}
	for c := r.saved; c < full; c++ {
		sv.Hashes = append(sv.Hashes, Hash(hashes[c]))
		sv.Blocks = append(sv.Blocks, fin.Blocks[c*cb:(c+1)*cb]...)
	}
	r.saved = full
	return sv, nil
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
