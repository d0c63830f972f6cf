package main

/*
#include <stdint.h>
*/
import "C"

import (
	"fmt"
	"time"
)

// Layer-wise loads (kvshim.layerwise; shim/layerwise.go): the connector
// calls start_loads_layered instead of start_loads, wait_layer before each
// attention layer and wait_layers before the step's output.

//export kvshim_worker_start_loads_layered
func kvshim_worker_start_loads_layered(h C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		m, err := ws.boundMeta()
		if err != nil {
			return err
		}
		ws.w.StartLoadsLayered(m)
		return nil
	})
}

//export kvshim_worker_wait_layer
func kvshim_worker_wait_layer(h C.int64_t, layer *C.char, timeoutMS C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		if layer == nil {
			return fmt.Errorf("layer is NULL: %w", errInvalid)
		}
		if timeoutMS < 0 {
			return fmt.Errorf("timeout_ms %d is negative: %w", timeoutMS, errInvalid)
		}
		return ws.w.WaitLayer(C.GoString(layer), time.Duration(timeoutMS)*time.Millisecond) // shim.ErrLayerTimeout: ETIMEDOUT
	})
}

//export kvshim_worker_wait_layers
func kvshim_worker_wait_layers(h C.int64_t, timeoutMS C.int64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		if timeoutMS < 0 {
			return fmt.Errorf("timeout_ms %d is negative: %w", timeoutMS, errInvalid)
		}
		return ws.w.WaitLayers(time.Duration(timeoutMS) * time.Millisecond)
	})
}

// Layer-wise saves (shim/layersave.go): the connector calls save_layer in
// save_kv_layer; wait_for_save's start_saves then ends the step.

//export kvshim_worker_save_layer
func kvshim_worker_save_layer(h C.int64_t, layer *C.char, streamEvent C.uint64_t) C.int {
	return call(h, func(in *instance, ws *workerState) error {
		if layer == nil {
			return fmt.Errorf("layer is NULL: %w", errInvalid)
		}
		m, err := ws.boundMeta()
		if err != nil {
			return err
		}
		ws.w.SaveLayer(m, C.GoString(layer), uint64(streamEvent))
		return nil
	})
}
