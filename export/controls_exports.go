package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"unsafe"

	"github.com/kvshim/kvshim/shim"
)

// vLLM's controls on the scheduler role (kvshim.h, "Scheduler role:
// vLLM's controls"): reset_cache, get_external_cache_hit_sources,
// per-request kv_transfer_params and the loads vLLM saw finish.

//export kvshim_sched_reset
func kvshim_sched_reset(h C.int64_t, generation *C.uint64_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		if generation == nil {
			return fmt.Errorf("generation is NULL: %w", errInvalid)
		}
		gen, err := s.Reset()
		*generation = C.uint64_t(gen)
		return err
	})
}

//export kvshim_sched_hit_sources
func kvshim_sched_hit_sources(h C.int64_t, reqID *C.char, numExternal C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		req, err := goString(reqID, "req_id")
		if err != nil {
			return err
		}
		if numExternal < 0 {
			return fmt.Errorf("num_external %d < 0: %w", int64(numExternal), errInvalid)
		}
		b, err := json.Marshal(s.HitSources(req, int(numExternal)))
		if err != nil {
			return err
		}
		return output(in, b, buf, capacity, outLen)
	})
}

//export kvshim_sched_request_options
func kvshim_sched_request_options(h C.int64_t, reqID, paramsJSON *C.char) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		req, err := goString(reqID, "req_id")
		if err != nil {
			return err
		}
		var raw []byte
		if paramsJSON != nil {
			raw = []byte(C.GoString(paramsJSON))
		}
		o, err := shim.DecodeRequestOptions(raw)
		s.SetRequestOptions(req, o) // on an error: neither loaded nor saved
		return err
	})
}

//export kvshim_sched_received
func kvshim_sched_received(h C.int64_t, idsJSON *C.char) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		raw, err := goString(idsJSON, "ids_json")
		if err != nil {
			return err
		}
		var ids []string
		if err := decodeStrict([]byte(raw), &ids, "ids_json"); err != nil {
			return err
		}
		s.Received(ids)
		return nil
	})
}

//export kvshim_worker_take_latencies
func kvshim_worker_take_latencies(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		b, err := json.Marshal(ws.w.TakeLatencies())
		if err != nil {
			return err
		}
		return output(in, b, buf, capacity, outLen)
	})
}

// KV events (kvshim.h, "KV events"): the worker's save reports, carried to
// the scheduler in vLLM's KVConnectorWorkerMetadata, and the events the
// scheduler makes of them (shim/events.go).

//export kvshim_worker_take_save_reports
func kvshim_worker_take_save_reports(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		b, err := json.Marshal(ws.w.TakeSaveReports())
		if err != nil {
			return err
		}
		return output(in, b, buf, capacity, outLen)
	})
}

//export kvshim_sched_save_reports
func kvshim_sched_save_reports(h C.int64_t, reportsJSON *C.char) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		raw, err := goString(reportsJSON, "reports_json")
		if err != nil {
			return err
		}
		var perRank [][]shim.SaveReport
		if err := decodeStrict([]byte(raw), &perRank, "reports_json"); err != nil {
			return err
		}
		var all []shim.SaveReport
		for _, r := range perRank {
			all = append(all, r...)
		}
		return s.SaveReports(all)
	})
}

//export kvshim_sched_take_events
func kvshim_sched_take_events(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, s *shim.Scheduler) error {
		b, err := json.Marshal(s.TakeEvents())
		if err != nil {
			return err
		}
		return output(in, b, buf, capacity, outLen)
	})
}
