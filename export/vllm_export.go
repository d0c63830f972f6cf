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

	"github.com/kvshim/kvshim/export/connector"
	"github.com/kvshim/kvshim/shim"
)

// The vLLM exports need no handle: each reads one JSON document of vLLM's
// configuration as plain data and answers one (outputLibJSON).

// vllmAnswer is such an export: in (named name) decoded strictly into T
// (a decoding error wraps bad), answered by resolve.
func vllmAnswer[T any](in *C.char, name string, bad error, resolve func(*T) (any, error),
	buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return callLib(func() error {
		if in == nil {
			return fmt.Errorf("%s is NULL: %w", name, errInvalid)
		}
		dec := json.NewDecoder(bytes.NewReader([]byte(C.GoString(in))))
		dec.DisallowUnknownFields()
		var v T
		if err := dec.Decode(&v); err != nil {
			return fmt.Errorf("%w: %s: %w", bad, name, err)
		}
		out, err := resolve(&v)
		if err != nil {
			return err
		}
		return outputLibJSON(out, buf, capacity, outLen)
	})
}

//export kvshim_vllm_namespace
func kvshim_vllm_namespace(specJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return vllmAnswer(specJSON, "spec_json", shim.ErrBadNamespaceSpec,
		func(s *shim.VLLMSpec) (any, error) { return shim.ResolveVLLM(*s) }, buf, capacity, outLen)
}

//export kvshim_vllm_config
func kvshim_vllm_config(inJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return vllmAnswer(inJSON, "in_json", connector.ErrConfig,
		func(in *connector.VLLMIn) (any, error) { return connector.ResolveVLLM(*in) }, buf, capacity, outLen)
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
