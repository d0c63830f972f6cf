package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"time"
	"unsafe"

	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/shim"
)

func stateOf[T any](h C.int64_t, role string) (*instance, T, error) {
	var zero T
	in, err := handles.lookup(int64(h))
	if err != nil {
		return nil, zero, err
	}
	s, ok := in.state.(T)
	if !ok {
		return in, zero, fmt.Errorf("handle %d is not a %s handle: %w", int64(h), role, errInvalid)
	}
	return in, s, nil
}

// output hands bytes to the caller's buffer; when they do not fit it keeps
// them on the handle, stores the needed length and returns KVSHIM_ERANGE,
// and the caller fetches them with kvshim_take_output.
func output(in *instance, data []byte, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	if outLen == nil {
		return C.int(fail(in.id, fmt.Errorf("out_len is NULL: %w", errInvalid)))
	}
	*outLen = C.size_t(len(data))
	if buf == nil || int(capacity) < len(data) {
		in.mu.Lock()
		in.pending = data
		in.mu.Unlock()
		return codeRange
	}
	copy(unsafe.Slice((*byte)(buf), len(data)), data)
	return codeOK
}

//export kvshim_take_output
func kvshim_take_output(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, err := handles.lookup(int64(h))
	if err != nil {
		return C.int(fail(0, err))
	}
	in.mu.Lock()
	data := in.pending
	in.mu.Unlock()
	if data == nil {
		return C.int(fail(in.id, fmt.Errorf("no pending output: %w", errInvalid)))
	}
	if rc := output(in, data, buf, capacity, outLen); rc != codeOK {
		return rc
	}
	in.mu.Lock()
	in.pending = nil
	in.mu.Unlock()
	return codeOK
}

func goString(p *C.char, what string) (string, error) {
	if p == nil {
		return "", fmt.Errorf("%s is NULL: %w", what, errInvalid)
	}
	return C.GoString(p), nil
}

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
func kvshim_sched_match(h C.int64_t, reqID *C.char, toks *C.uint32_t, nToks C.size_t, extras *C.char, numComputed C.int64_t, out *C.int64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, s, err := stateOf[*shim.Scheduler](h, "scheduler")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	req, err := goString(reqID, "req_id")
	var tokens []uint32
	var ex shim.Extras
	if err == nil {
		tokens, err = cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens")
	}
	if err == nil {
		ex, err = parseExtras(extras)
	}
	if err == nil && out == nil {
		err = fmt.Errorf("out is NULL: %w", errInvalid)
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	n, pending, err := s.Match(req, tokens, ex, int(numComputed))
	if err != nil {
		return C.int(fail(in.id, fmt.Errorf("%v: %w", err, errInvalid)))
	}
	*out = C.int64_t(n)
	if pending {
		*out = -1
	}
	return codeOK
}

//export kvshim_sched_after_alloc
func kvshim_sched_after_alloc(h C.int64_t, reqID *C.char, blocks *C.int64_t, nBlocks C.size_t, numComputed, numExternal C.int64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, s, err := stateOf[*shim.Scheduler](h, "scheduler")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	req, err := goString(reqID, "req_id")
	var ids []int64
	if err == nil {
		ids, err = cSlice[int64](unsafe.Pointer(blocks), uint64(nBlocks), "blocks")
	}
	if err == nil {
		err = s.AfterAlloc(req, ids, int(numComputed), int(numExternal))
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	return codeOK
}

//export kvshim_sched_build_meta
func kvshim_sched_build_meta(h C.int64_t, stepJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, s, err := stateOf[*shim.Scheduler](h, "scheduler")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	raw, err := goString(stepJSON, "step_json")
	var step shim.Step
	if err == nil {
		err = decodeStrict([]byte(raw), &step)
	}
	var meta []byte
	if err == nil {
		meta, err = s.BuildMeta(&step)
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	return output(in, meta, buf, capacity, outLen)
}

//export kvshim_sched_finished
func kvshim_sched_finished(h C.int64_t, reqID *C.char, delay *C.int) (rc C.int) {
	defer guard(int64(h), &rc)
	in, s, err := stateOf[*shim.Scheduler](h, "scheduler")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	req, err := goString(reqID, "req_id")
	if err == nil && delay == nil {
		err = fmt.Errorf("delay is NULL: %w", errInvalid)
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	*delay = 0
	if s.Finished(req) {
		*delay = 1
	}
	return codeOK
}

//export kvshim_sched_finished_tokens
func kvshim_sched_finished_tokens(h C.int64_t, reqID *C.char, toks *C.uint32_t, nToks C.size_t, first, numComputed C.int64_t, blocks *C.int64_t, nBlocks C.size_t, delay *C.int) (rc C.int) {
	defer guard(int64(h), &rc)
	in, s, err := stateOf[*shim.Scheduler](h, "scheduler")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	req, err := goString(reqID, "req_id")
	var fin shim.FinishState
	if err == nil {
		fin.Tokens, err = cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens")
	}
	if err == nil {
		fin.Blocks, err = cSlice[int64](unsafe.Pointer(blocks), uint64(nBlocks), "blocks")
	}
	if err == nil && delay == nil {
		err = fmt.Errorf("delay is NULL: %w", errInvalid)
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	fin.First, fin.Computed = int(first), int(numComputed)
	// The request is finished either way: delay is set even when the
	// tokens do not fit it (then nothing new is saved and the error says why).
	d, err := s.FinishedSaving(req, &fin)
	*delay = 0
	if d {
		*delay = 1
	}
	if err != nil {
		return C.int(fail(in.id, fmt.Errorf("%v: %w", err, errInvalid)))
	}
	return codeOK
}

//export kvshim_stats
func kvshim_stats(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, err := handles.lookup(int64(h))
	if err != nil {
		return C.int(fail(0, err))
	}
	out := map[string]any{}
	switch st := in.state.(type) {
	case *shim.Scheduler:
		out["requests"] = st.Requests()
		if srv, err := st.Stats(); err == nil {
			m := map[string]float64{}
			for _, x := range srv.Stats {
				m[x.Name] = x.Value
			}
			out["server"] = m
		} else {
			out["server_error"] = err.Error()
		}
	case *workerState:
		out["worker"] = st.w.Stats()
		out["jobs"] = st.w.Jobs()
	default:
		return C.int(fail(in.id, fmt.Errorf("handle %d has no stats: %w", int64(h), errInvalid)))
	}
	b, _ := json.Marshal(out)
	return output(in, b, buf, capacity, outLen)
}

//export kvshim_worker_register
func kvshim_worker_register(h C.int64_t, tensorsJSON *C.char) (rc C.int) {
	defer guard(int64(h), &rc)
	in, ws, err := stateOf[*workerState](h, "worker")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	raw, err := goString(tensorsJSON, "tensors_json")
	var descs []layout.TensorDesc
	if err == nil {
		err = decodeStrict([]byte(raw), &descs)
	}
	if err == nil {
		err = ws.w.Register(descs)
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	return codeOK
}

//export kvshim_worker_bind
func kvshim_worker_bind(h C.int64_t, meta unsafe.Pointer, n C.size_t, timeoutMS C.int64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, ws, err := stateOf[*workerState](h, "worker")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	l := ws.w.Layout()
	if l == nil {
		return C.int(fail(in.id, fmt.Errorf("bind before register_kv_caches: %w", errInvalid)))
	}
	raw, err := cSlice[byte](meta, uint64(n), "meta")
	var m *shim.StepMeta
	if err == nil {
		m, err = shim.DecodeStepMeta(raw, l.ChunkBlocks(), l.NumBlocks())
	}
	if err != nil {
		return C.int(fail(in.id, err))
	}
	ws.mu.Lock()
	ws.bound = m
	ws.mu.Unlock()
	ws.w.Finishing(m.Finished)
	if err := ws.w.WaitFor(m.Preempted, time.Duration(timeoutMS)*time.Millisecond); err != nil {
		return C.int(fail(in.id, err))
	}
	return codeOK
}

func boundMeta(h C.int64_t) (*instance, *workerState, *shim.StepMeta, error) {
	in, ws, err := stateOf[*workerState](h, "worker")
	if err != nil {
		return in, nil, nil, err
	}
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.bound == nil {
		return in, ws, nil, fmt.Errorf("no metadata bound: %w", errInvalid)
	}
	return in, ws, ws.bound, nil
}

//export kvshim_worker_start_loads
func kvshim_worker_start_loads(h C.int64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	_, ws, m, err := boundMeta(h)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	ws.w.StartLoads(m)
	return codeOK
}

//export kvshim_worker_start_saves
func kvshim_worker_start_saves(h C.int64_t, streamEvent C.uint64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	_, ws, m, err := boundMeta(h)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	ws.w.StartSaves(m, uint64(streamEvent))
	return codeOK
}

type pollJSON struct {
	Sending     []string `json:"sending"`
	Recving     []string `json:"recving"`
	ErrorBlocks []int64  `json:"error_blocks"`
}

//export kvshim_worker_poll
func kvshim_worker_poll(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) (rc C.int) {
	defer guard(int64(h), &rc)
	in, ws, err := stateOf[*workerState](h, "worker")
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	var p pollJSON
	p.Sending, p.Recving, p.ErrorBlocks = ws.w.Poll()
	b, _ := json.Marshal(p)
	return output(in, b, buf, capacity, outLen)
}
