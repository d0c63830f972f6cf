package cuda

/*
#include "loader.h"
*/
import "C"

// AllocDevice allocates size bytes of device memory (cuMemAlloc) in the
// engine's context. For tests and benchmarks; vLLM owns the real KV cache.
func (e *DeviceEngine) AllocDevice(size uint64) (uint64, error) {
	var p C.uint64_t
	err := e.do(func() error { return e.drv.check("cuMemAlloc", C.kvs_mem_alloc(e.drv.d, &p, C.uint64_t(size))) })
	return uint64(p), err
}

// FreeDevice frees memory from AllocDevice.
func (e *DeviceEngine) FreeDevice(p uint64) error {
	return e.do(func() error { return e.drv.check("cuMemFree", C.kvs_mem_free(e.drv.d, C.uint64_t(p))) })
}

// foreignEvent plays vLLM's side in tests: on a stream of its own it
// copies n bytes host src -> device dst and records an event after the
// copy. It returns the event's handle (what Python passes to WaitEvent)
// and a function that destroys the stream and event without waiting for
// them, as torch may.
func (e *DeviceEngine) foreignEvent(dst, src, n uint64) (ev uint64, destroy func(), err error) {
	var s, evh C.uint64_t
	d := e.drv.d
	err = e.do(func() error {
		if err := e.drv.check("cuStreamCreate", C.kvs_stream_create(d, &s)); err != nil {
			return err
		}
		if err := e.drv.check("cuEventCreate", C.kvs_event_create(d, &evh, C.KVS_CU_EVENT_DISABLE_TIMING)); err != nil {
			return err
		}
		var failed C.size_t
		dd, ss, ll := C.uint64_t(dst), C.uint64_t(src), C.uint64_t(n)
		if err := e.drv.check("cuMemcpyHtoDAsync", C.kvs_copy_spans(d, 1, &dd, &ss, &ll, 1, s, &failed)); err != nil {
			return err
		}
		return e.drv.check("cuEventRecord", C.kvs_event_record(d, evh, s))
	})
	destroy = func() {
		_ = e.do(func() error {
			if evh != 0 { // pending or not: CUDA frees it once complete
				C.kvs_event_destroy(d, evh)
			}
			if s != 0 {
				C.kvs_stream_destroy(d, s)
			}
			return nil
		})
	}
	return uint64(evh), destroy, err
}
