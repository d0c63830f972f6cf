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
)

//export kvshim_vllm_config
func kvshim_vllm_config(inJSON *C.char, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return callLib(func() error {
		if inJSON == nil {
			return fmt.Errorf("in_json is NULL: %w", errInvalid)
		}
		dec := json.NewDecoder(bytes.NewReader([]byte(C.GoString(inJSON))))
		dec.DisallowUnknownFields()
		var in connector.VLLMIn
		if err := dec.Decode(&in); err != nil {
			return fmt.Errorf("kvshim_vllm_config input: %v: %w", err, connector.ErrConfig)
		}
		out, err := connector.ResolveVLLM(in)
		if err != nil {
			return err
		}
		return outputLibJSON(out, buf, capacity, outLen)
	})
}
