package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import "unsafe"

//export kvshim_tokens_from_list
func kvshim_tokens_from_list(list unsafe.Pointer, out *C.uint32_t, capacity C.size_t, outLen *C.size_t) C.int {
	if list == nil || outLen == nil || (out == nil && capacity > 0) {
		return codeInval
	}
	n := pyListU32(list, out, capacity)
	switch {
	case n == -1:
		return codeNotSup
	case n < -1:
		*outLen = C.size_t(-2 - n) // the first bad item
		return codeInval
	}
	*outLen = C.size_t(n)
	if uint64(n) > uint64(capacity) {
		return codeRange
	}
	return codeOK
}
