package shim

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/trace"
)

// Reset and hit sources: the scheduler's side of vLLM's reset_cache and
// get_external_cache_hit_sources (the server's side: server/reset.go).

// genRoot is the namespace that roots the chunk-hash chain of generation
// gen: ns itself for generation 0 (the keys kvshim has always made), a
// digest of (ns, gen) after a reset, so every chunk key changes.
func genRoot(ns kv.Namespace, gen uint64) kv.Namespace {
	if gen == 0 {
		return ns
	}
	h := sha256.New()
	h.Write([]byte("kvshim generation\x00"))
	h.Write(ns[:])
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], gen)
	h.Write(b[:])
	var out kv.Namespace
	copy(out[:], h.Sum(nil))
	return out
}

// rootNS is the namespace chunk hashes are chained from now.
func (s *Scheduler) rootNS() kv.Namespace { return genRoot(s.ns, s.gen) }

// Generation is the generation this scheduler keys new requests with.
func (s *Scheduler) Generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen
}

// resetCall sends OpReset for every namespace of this deployment (one per
// KV-cache group). s.mu held.
func (s *Scheduler) resetCall(bump bool) (*ipc.ResetResp, error) {
	req := &ipc.ResetReq{Bump: bump, AtLeast: s.gen, Namespaces: s.gns}
	var resp *ipc.ResetResp
	err := s.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		resp, err = c.Reset(ctx, req)
		return err
	})
	return resp, err
}

// Reset answers vLLM's reset_cache: the server moves this deployment's
// namespaces to a new generation (every instance of the deployment learns
// it from its next lookup answer), and from now on this scheduler keys
// requests under it, so nothing stored before is found in any tier.
// Requests keyed before the reset and not loading yet are forgotten (their
// holds released): when vLLM asks again they are keyed anew. A load already
// planned goes on (vLLM allocated its blocks; reset_prefix_cache refuses
// while requests hold blocks). An error (the server unreachable) means the
// reset did not happen.
func (s *Scheduler) Reset() (gen uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp, err := s.resetCall(true)
	if err != nil {
		return s.gen, fmt.Errorf("reset: %w", err)
	}
	if resp.Generation <= s.gen {
		return s.gen, fmt.Errorf("%w: reset: the server answered generation %d, not past %d", ErrUnavailable, resp.Generation, s.gen)
	}
	s.gen, s.genKnown = resp.Generation, true
	s.forgetKeyed()
	s.eventsCleared()
	return s.gen, nil
}

// forgetKeyed drops every request keyed under an older generation that has
// no load in flight. s.mu held.
func (s *Scheduler) forgetKeyed() {
	for id, r := range s.reqs {
		if r.loadPlanned || r.savesOut {
			continue // its blocks are being read or written by the workers
		}
		s.free(r, 0)
		delete(s.reqs, id)
	}
}

// learnGeneration asks the server for this deployment's generation before
// the first request is keyed (a scheduler that starts after a reset must
// not key with generation 0). A server that cannot be reached leaves it
// unknown: the request is a miss anyway. s.mu held.
//
// A scheduler that never looks up (a kv_producer, or a request that skips
// loads) gets no lookup answers to learn a reset from: it asks again when
// its last answer is older than genRefresh, so its saves move to the new
// generation within that time.
func (s *Scheduler) learnGeneration(lookups bool) {
	if s.genKnown && (lookups || time.Since(s.genAsked) < genRefresh) {
		return
	}
	s.genAsked = time.Now()
	resp, err := s.resetCall(false)
	if err != nil {
		return
	}
	s.gen, s.genKnown = max(s.gen, resp.Generation), true
}

// genRefresh is how often a scheduler that does not look up asks the
// server for the generation (one round trip, only while requests arrive).
const genRefresh = time.Second

// checkGeneration compares a lookup answer's generation with the one r was
// keyed under: a newer one means another instance reset the deployment
// (r's keys are stale: a miss, and this scheduler keys later requests
// under it); an older one means the server forgot (it restarted): it is
// told the generation in force. It reports whether the answer stands.
// s.mu held.
func (s *Scheduler) checkGeneration(r *schedReq, gen uint64) bool {
	switch {
	case gen > r.gen:
		if gen > s.gen {
			s.gen = gen
		}
		return false
	case gen < s.gen:
		_, _ = s.resetCall(false)
	}
	return true
}

// HitSource is a tier a hit came from, as vLLM's CacheHitSource names it.
type HitSource string

// The tiers of vLLM's CacheHitSource (v1/metrics/cache_hit_source.py).
// Redis and Mooncake are networked stores, which vLLM counts as
// "external_unspecified" (it has no remote-store member).
const (
	SourceHost        HitSource = "host"
	SourceDisk        HitSource = "disk"
	SourceUnspecified HitSource = "external_unspecified"
)

func hitSource(t ipc.Tier) HitSource {
	switch t {
	case ipc.TierL1:
		return SourceHost
	case ipc.TierDisk:
		return SourceDisk
	}
	return SourceUnspecified
}

// HitSources answers get_external_cache_hit_sources: the numExternal
// tokens of req's load (from the tokens vLLM had at update_state_after_alloc
// on) split by the tier each chunk came from (KV-cache group 0's answer:
// every group is loaded from the same tier of the same server). Only
// non-zero counts are in the map; they sum to numExternal.
func (s *Scheduler) HitSources(req string, numExternal int) map[HitSource]int {
	out := map[HitSource]int{}
	if numExternal <= 0 {
		return out
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil {
		out[SourceUnspecified] = numExternal
		return out
	}
	from, end := r.computed, r.computed+numExternal
	c0 := 0 // first chunk of the run
	for _, run := range r.sources {
		lo, hi := c0*s.chunk, (c0+int(run.Chunks))*s.chunk
		c0 += int(run.Chunks)
		if n := min(hi, end) - max(lo, from); n > 0 {
			out[hitSource(run.Tier)] += n
		}
	}
	if left := numExternal - sum(out); left > 0 {
		out[SourceUnspecified] += left
	}
	return out
}

func sum(m map[HitSource]int) (n int) {
	for _, v := range m {
		n += v
	}
	return n
}

// Received tells the scheduler which requests' loads vLLM saw finish
// (finished_recving): a request finished after that is no cancel.
func (s *Scheduler) Received(reqs []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range reqs {
		delete(s.loading, id)
	}
}

// CancelledLoads is how many requests were aborted while their load was in
// flight (vLLM's WAITING_FOR_REMOTE_KVS).
func (s *Scheduler) CancelledLoads() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cancelledLoads
}

// loadCancelled records that r finished (aborted) while its planned load
// of chunks chunks was in flight: the workers run the load to its end (the
// blocks are vLLM's until they report it) and vLLM then drops what was
// loaded. The trace's cancel record names the request, so `kvshim trace`
// shows the load's chunks beside it. s.mu held.
func (s *Scheduler) loadCancelled(r *schedReq, chunks int) {
	s.cancelledLoads++
	w := s.trace.w.Load()
	if w == nil {
		return
	}
	w.Emit(trace.Record{Kind: trace.KindCancel, Event: "load_dropped", RequestID: r.id, LookupID: r.g[0].lookupID,
		Owner: hex.EncodeToString(s.cfg.Instance[:]), Chunks: uint32(chunks), Rank: -1, Chunk: -1, StopRank: -1,
		Result: "dropped", Reason: "aborted while its load was in flight: the workers finish the load, vLLM drops it"})
}
