package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"bytes"
	"encoding/json"
	"fmt"
	"unsafe"

	"github.com/kvshim/kvshim/shim"
)

//export kvshim_vllm_namespace
func kvshim_vllm_namespace(specJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return callLib(func() error {
		if specJSON == nil {
			return fmt.Errorf("spec_json is NULL: %w", errInvalid)
		}
		dec := json.NewDecoder(bytes.NewReader([]byte(C.GoString(specJSON))))
		dec.DisallowUnknownFields()
		var s shim.VLLMSpec
		if err := dec.Decode(&s); err != nil {
			return fmt.Errorf("%w: vLLM spec: %w", shim.ErrBadNamespaceSpec, err)
		}
		l, err := shim.ResolveVLLM(s)
		if err != nil {
			return err
		}
		return outputLibJSON(l, buf, capacity, outLen)
	})
}

//export kvshim_vllm_tensors
func kvshim_vllm_tensors(inJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return callLib(func() error {
		if inJSON == nil {
			return fmt.Errorf("in_json is NULL: %w", errInvalid)
		}
		descs, err := shim.ParseVLLMTensors([]byte(C.GoString(inJSON)))
		if err != nil {
			return err
		}
		return outputLibJSON(descs, buf, capacity, outLen)
	})
}
