package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"
	"unsafe"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/shim"
)

// parseExtras decodes a request's extras JSON (see shim.DecodeExtras: the
// LoRA is an object {name, path}, never a joined string); NULL is none.
// Malformed extras fail with shim.ErrBadExtras naming the field.
func parseExtras(p *C.char) (shim.Extras, error) {
	if p == nil {
		return shim.Extras{}, nil
	}
	return shim.DecodeExtras([]byte(C.GoString(p)))
}

//export kvshim_sched_match
func kvshim_sched_match(h C.int64_t, reqID *C.char, toks *C.uint32_t, nToks C.size_t, extras *C.char, numComputed C.int64_t, out *C.int64_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		return schedMatch(s, reqID, extras, numComputed, out, func(string, shim.Extras, bool) (prompt, error) {
			tokens, err := cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens")
			return prompt{tokens: tokens}, err
		}, nil)
	})
}

// kvshim_sched_match_list is kvshim_sched_match for a Python caller holding
// the GIL: the list is read (into a pooled buffer) only when the request is
// not keyed yet, and the GIL is released once the arguments are read, while
// the lookup waits for the server. Where the CPU has the SHA extensions
// and the request has no multimodal inputs, the chunk keys are hashed as
// the list is read (pyChainKeys), under the GIL; elsewhere after it.
//
//export kvshim_sched_match_list
func kvshim_sched_match_list(h C.int64_t, reqID *C.char, list unsafe.Pointer, extras *C.char, numComputed C.int64_t, out *C.int64_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		if list == nil {
			return fmt.Errorf("list is NULL: %w", errInvalid)
		}
		buf := tokenBufs.Get().(*[]uint32)
		defer tokenBufs.Put(buf)
		return schedMatch(s, reqID, extras, numComputed, out, func(req string, ex shim.Extras, chain bool) (prompt, error) {
			if s.Keyed(req) {
				return prompt{}, nil // asked again while pending: Match reads no tokens
			}
			if chain && len(ex.MM) == 0 {
				root, gen, err := s.KeyRoot(ex)
				if err != nil {
					return prompt{}, err
				}
				if n, keys, ok := pyChainKeys(list, root, s.ChunkSize()); ok {
					return prompt{hashed: true, n: n, keys: keys, gen: gen}, nil
				}
			}
			tokens, err := pyListTokens(list, (*buf)[:0])
			if cap(tokens) > cap(*buf) {
				*buf = tokens[:0]
			}
			return prompt{tokens: tokens}, err
		}, releaseGIL)
	})
}

// prompt is what a match export read of a request's prompt: its tokens, or
// (hashed) its length n and the keys of its full chunks, chained from the
// root of generation gen (shim.Scheduler.KeyRoot).
type prompt struct {
	tokens []uint32
	hashed bool
	n      int
	keys   []kv.Hash
	gen    uint64
}

// schedMatch is the body of both match exports: the arguments checked and
// read in order (req_id, extras, the prompt, out); then, the caller's
// memory read, release (if any) lets go of the caller's lock (the GIL)
// while Match hashes (unless read did) and waits for the server, and the
// lock is taken back on return. Keys read of a generation found stale (a
// reset, or the first request after a restart of a scheduler whose
// deployment was reset) are read again, and after a second time as
// tokens, which Match keys under the generation it learns.
func schedMatch(s *shim.Scheduler, reqID, extras *C.char, numComputed C.int64_t, out *C.int64_t,
	read func(req string, ex shim.Extras, chain bool) (prompt, error), release func() (reacquire func(), err error)) error {
	req, err := goString(reqID, "req_id")
	if err != nil {
		return err
	}
	ex, err := parseExtras(extras)
	if err != nil {
		return err
	}
	for try := 0; ; try++ {
		p, err := read(req, ex, try < 2)
		if err != nil {
			return err
		}
		if out == nil {
			return fmt.Errorf("out is NULL: %w", errInvalid)
		}
		n, pending, err := matchReleased(s, req, p, ex, int(numComputed), release)
		if p.hashed && errors.Is(err, shim.ErrStaleRoot) {
			continue
		}
		if err != nil {
			return err
		}
		*out = C.int64_t(n)
		if pending {
			*out = -1
		}
		return nil
	}
}

// matchReleased asks s for p with the caller's lock released (release,
// when not nil) and taken back before it returns. Errors of the match are
// errInvalid.
func matchReleased(s *shim.Scheduler, req string, p prompt, ex shim.Extras, numComputed int,
	release func() (reacquire func(), err error)) (n int, pending bool, err error) {
	if release != nil {
		reacquire, err := release()
		if err != nil {
			return 0, false, err
		}
		defer reacquire()
	}
	if p.hashed {
		n, pending, err = s.MatchHashes(req, p.n, p.keys, p.gen, ex, numComputed)
	} else {
		n, pending, err = s.Match(req, p.tokens, ex, numComputed)
	}
	if err != nil {
		err = fmt.Errorf("%w: %w", err, errInvalid)
	}
	return n, pending, err
}

//export kvshim_sched_after_alloc
func kvshim_sched_after_alloc(h C.int64_t, reqID *C.char, blocks *C.int64_t, nBlocks, nGroups C.size_t, numComputed, numExternal C.int64_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		req, err := goString(reqID, "req_id")
		if err != nil {
			return err
		}
		ids, err := cSlice[int64](unsafe.Pointer(blocks), uint64(nBlocks), "blocks")
		if err != nil {
			return err
		}
		return s.AfterAlloc(req, ids, groupCount(nGroups), int(numComputed), int(numExternal))
	})
}

// groupCount is n_groups as shim reads it: a count past any namespace's
// stays one (a mismatch the scheduler names), never wraps.
func groupCount(n C.size_t) int { return int(min(uint64(n), math.MaxInt32)) }

//export kvshim_sched_build_meta
func kvshim_sched_build_meta(h C.int64_t, stepJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		raw, err := goString(stepJSON, "step_json")
		if err != nil {
			return err
		}
		var step shim.Step
		if err := decodeStrict([]byte(raw), &step, "step_json"); err != nil {
			return err
		}
		meta, err := s.BuildMeta(&step)
		if err != nil {
			return err
		}
		return output(in, meta, buf, capacity, outLen)
	})
}

//export kvshim_sched_finished
func kvshim_sched_finished(h C.int64_t, reqID *C.char, delay *C.int) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		req, err := goString(reqID, "req_id")
		if err != nil {
			return err
		}
		if delay == nil {
			return fmt.Errorf("delay is NULL: %w", errInvalid)
		}
		*delay = 0
		if s.Finished(req) {
			*delay = 1
		}
		return nil
	})
}

//export kvshim_sched_finished_tokens
func kvshim_sched_finished_tokens(h C.int64_t, reqID *C.char, toks *C.uint32_t, nToks C.size_t, first, numComputed C.int64_t, blocks *C.int64_t, nBlocks, nGroups C.size_t, delay *C.int) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		req, err := goString(reqID, "req_id")
		if err != nil {
			return err
		}
		var fin shim.FinishState
		if fin.Tokens, err = cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens"); err != nil {
			return err
		}
		if fin.Blocks, err = cSlice[int64](unsafe.Pointer(blocks), uint64(nBlocks), "blocks"); err != nil {
			return err
		}
		if delay == nil {
			return fmt.Errorf("delay is NULL: %w", errInvalid)
		}
		fin.First, fin.Computed, fin.Groups = int(first), int(numComputed), groupCount(nGroups)
		// The request is finished either way: delay is set even when the
		// tokens do not fit it (then nothing new is saved and the error says why).
		d, err := s.FinishedSaving(req, &fin)
		*delay = 0
		if d {
			*delay = 1
		}
		if err != nil {
			return fmt.Errorf("%w: %w", err, errInvalid)
		}
		return nil
	})
}

//export kvshim_stats
func kvshim_stats(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, _ *instance) error {
		var out map[string]any
		switch st := in.state.(type) {
		case *shim.Scheduler:
			srv, err := st.Stats()
			out = schedStatsDoc(st.Requests(), srv, err)
		case *workerState:
			out = workerStatsDoc(st.w.Stats(), st.w.Jobs())
		default:
			return fmt.Errorf("handle %d (%s) has no stats: %w", in.id, roleOf(in.state), errInvalid)
		}
		b, _ := json.Marshal(out)
		return output(in, b, buf, capacity, outLen)
	})
}

//export kvshim_take_step_stats
func kvshim_take_step_stats(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, _ *instance) error {
		var out map[string]any
		switch st := in.state.(type) {
		case *shim.Scheduler:
			out = st.TakeStepStats()
		case *workerState:
			st.mu.Lock()
			out, st.reported = st.w.StepStats(st.reported)
			st.mu.Unlock()
		default:
			return fmt.Errorf("handle %d (%s) has no step stats: %w", in.id, roleOf(in.state), errInvalid)
		}
		b, _ := json.Marshal(out)
		return output(in, b, buf, capacity, outLen)
	})
}

// schedStatsDoc is kvshim_stats' document for a scheduler handle
// (export/schema/stats.json): the server's STATS, or why there are none.
func schedStatsDoc(requests int, srv *ipc.StatsResp, err error) map[string]any {
	out := map[string]any{"requests": requests}
	if err != nil {
		out["server_error"] = err.Error()
		return out
	}
	m := map[string]float64{}
	for _, x := range srv.Stats {
		m[x.Name] = x.Value
	}
	out["server"] = m
	return out
}

// workerStatsDoc is kvshim_stats' document for a worker handle.
func workerStatsDoc(st shim.WorkerStats, jobs int64) map[string]any {
	return map[string]any{"worker": st, "jobs": jobs}
}

//export kvshim_worker_register
func kvshim_worker_register(h C.int64_t, tensorsJSON *C.char) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		raw, err := goString(tensorsJSON, "tensors_json")
		if err != nil {
			return err
		}
		var descs []layout.TensorDesc
		if err := decodeStrict([]byte(raw), &descs, "tensors_json"); err != nil {
			return err
		}
		return ws.w.Register(descs)
	})
}

//export kvshim_worker_bind
func kvshim_worker_bind(h C.int64_t, meta unsafe.Pointer, n C.size_t, timeoutMS C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		l := ws.w.Layout()
		if l == nil {
			return fmt.Errorf("bind before register_kv_caches: %w", errInvalid)
		}
		raw, err := cSlice[byte](meta, uint64(n), "meta")
		if err != nil {
			return err
		}
		m, err := shim.DecodeStepMeta(raw, l.ChunkBlocks(), l.NumBlocks())
		if err != nil {
			return err
		}
		ws.mu.Lock()
		ws.bound = m
		ws.mu.Unlock()
		ws.w.Finishing(m.Finished)
		return ws.w.WaitFor(m.Preempted, time.Duration(timeoutMS)*time.Millisecond)
	})
}

// bound is the metadata bound by the last kvshim_worker_bind.
func (ws *workerState) boundMeta() (*shim.StepMeta, error) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.bound == nil {
		return nil, fmt.Errorf("no metadata bound: %w", errInvalid)
	}
	return ws.bound, nil
}

//export kvshim_worker_start_loads
func kvshim_worker_start_loads(h C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		m, err := ws.boundMeta()
		if err != nil {
			return err
		}
		ws.w.StartLoads(m)
		return nil
	})
}

//export kvshim_worker_start_saves
func kvshim_worker_start_saves(h C.int64_t, streamEvent C.uint64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		m, err := ws.boundMeta()
		if err != nil {
			return err
		}
		ws.w.StartSaves(m, uint64(streamEvent))
		return nil
	})
}

type pollJSON struct {
	Sending     []string `json:"sending"`
	Recving     []string `json:"recving"`
	ErrorBlocks []int64  `json:"error_blocks"`
	Failed      []string `json:"failed"` // requests whose loads failed
}

// encodePoll is kvshim_worker_poll's document (export/schema/poll.json):
// every list present, [] when empty (never null).
func encodePoll(sending, recving []string, errBlocks []int64, failed []string) []byte {
	p := pollJSON{Sending: orEmpty(sending), Recving: orEmpty(recving), ErrorBlocks: orEmpty(errBlocks), Failed: orEmpty(failed)}
	b, _ := json.Marshal(p)
	return b
}

func orEmpty[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

//export kvshim_worker_poll
func kvshim_worker_poll(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		return output(in, encodePoll(ws.w.PollFailed()), buf, capacity, outLen)
	})
}
