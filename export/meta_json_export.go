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

// kvshim_meta_json is the test-only reader of step metadata: Go's decoder
// and Go's JSON form (json.Marshal of shim.StepMeta), so no caller writes a
// second decoder of the binary form (it had drifted once).
//
//export kvshim_meta_json
func kvshim_meta_json(meta unsafe.Pointer, n C.size_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return callLib(func() error {
		b, err := cSlice[byte](meta, uint64(n), "meta")
		if err != nil {
			return err
		}
		m, err := shim.ReadStepMeta(b)
		if err != nil {
			return err
		}
		return outputLibJSON(m, buf, capacity, outLen)
	})
}

// outputLibJSON is outputLib of v's JSON form.
func outputLibJSON(v any, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) error {
	out, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return outputLib(out, buf, capacity, outLen)
}

// outputLib is output for the exports that take no handle and compute the
// same bytes on every call: when they do not fit, *out_len says the size
// and the caller calls again with a buffer that large (nothing is kept).
func outputLib(data []byte, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) error {
	if outLen == nil {
		return fmt.Errorf("out_len is NULL: %w", errInvalid)
	}
	*outLen = C.size_t(len(data))
	if buf == nil || int(capacity) < len(data) {
		return fmt.Errorf("output of %d bytes does not fit a buffer of %d: call again with one that large: %w",
			len(data), int(capacity), errRange)
	}
	copy(unsafe.Slice((*byte)(buf), len(data)), data)
	return nil
}
