package main

// Token lists from Python without a Python-level conversion: a C loop over
// the list's items, the Python C API resolved with dlsym(RTLD_DEFAULT) the
// first time (no Python headers or libpython at build time; a process that
// is not Python gets codeNotSup and converts on its own).

/*
#include "pytokens.h"
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/shim"
)

// pyListU32 is kv_py_u32: n >= 0 the list's length (written when <= cap),
// -1 no list or no Python, -2-i a bad item i.
func pyListU32(list unsafe.Pointer, out *C.uint32_t, capacity C.size_t) int64 {
	return int64(C.kv_py_u32(list, out, capacity))
}

// pyListTokens reads the Python list at list into buf (grown when the list
// is longer than its capacity) and returns the ids. Called with the GIL
// held. Errors: errors.ErrUnsupported (no list, or no Python C API in this
// process), errInvalid naming the first item that is no int in [0, 2^32).
func pyListTokens(list unsafe.Pointer, buf []uint32) ([]uint32, error) {
	for {
		n := pyListU32(list, (*C.uint32_t)(unsafe.SliceData(buf[:cap(buf)])), C.size_t(cap(buf)))
		switch {
		case n == -1:
			return nil, fmt.Errorf("tokens: no Python list, or no Python C API in this process: %w", errors.ErrUnsupported)
		case n < -1:
			return nil, fmt.Errorf("tokens: item %d is no int in [0, 2^32): %w", -2-n, errInvalid)
		case n > int64(cap(buf)):
			buf = make([]uint32, 0, n)
			continue
		}
		return buf[:n], nil
	}
}

// LookupHashEnv set to "go" makes kvshim_sched_match_list read a list's
// ids first and hash them with Go's crypto/sha256 afterwards, as on a CPU
// without the SHA extensions (A/B measurements, docs/datapath.md).
const LookupHashEnv = "KVSHIM_LOOKUP_HASH"

// chainReads: kv_py_chain can hash here (x86-64 with the SHA extensions)
// and is not turned off.
var chainReads = sync.OnceValue(func() bool {
	return C.kv_chain_sha_ni() == 1 && os.Getenv(LookupHashEnv) != "go"
})

// chainMsg is the padded SHA-256 message of one chunk of chunkSize ids
// with no multimodal input (shim.PlainChunkMessage) chained from root,
// and where kv_py_chain writes the previous hash and the ids.
func chainMsg(root kv.Hash, chunkSize int) (msg []byte, prevOff, idsOff int) {
	pre, mid, suf := shim.PlainChunkMessage(chunkSize)
	prevOff, idsOff = len(pre), len(pre)+len(root)+len(mid)
	n := idsOff + 4*chunkSize + len(suf)
	msg = make([]byte, (n+9+63)/64*64) // SHA-256 padding: 0x80, zeros, the bit length (u64be)
	copy(msg, pre)
	copy(msg[prevOff:], root[:])
	copy(msg[prevOff+len(root):], mid)
	copy(msg[idsOff+4*chunkSize:], suf)
	msg[n] = 0x80
	binary.BigEndian.PutUint64(msg[len(msg)-8:], uint64(n)*8)
	return msg, prevOff, idsOff
}

// pyChainKeys reads the Python list at list and hashes its full chunks as
// it reads (kv_py_chain): the list's length and the chunk keys chained from
// root, or ok false where that path does not apply (then pyListTokens
// reads the list). Called with the GIL held.
func pyChainKeys(list unsafe.Pointer, root kv.Hash, chunkSize int) (n int, keys []kv.Hash, ok bool) {
	if !chainReads() || chunkSize <= 0 {
		return 0, nil, false
	}
	msg, prevOff, idsOff := chainMsg(root, chunkSize)
	return chainKeys(chunkSize, func(keys []kv.Hash) int64 {
		return int64(C.kv_py_chain(list, (*C.uint8_t)(unsafe.SliceData(msg)), C.size_t(len(msg)/64), C.size_t(prevOff),
			C.size_t(idsOff), C.size_t(chunkSize), (*C.uint8_t)(unsafe.Pointer(unsafe.SliceData(keys))), C.size_t(len(keys))))
	})
}

// chainKeys runs a kv_py_chain-like call with room for no keys first (it
// returns the length), then with room for all.
func chainKeys(chunkSize int, run func(keys []kv.Hash) int64) (n int, keys []kv.Hash, ok bool) {
	for {
		r := run(keys)
		if r < 0 {
			return 0, nil, false
		}
		if full := int(r) / chunkSize; full > len(keys) {
			keys = make([]kv.Hash, full)
			continue
		}
		return int(r), keys, true
	}
}

// fakeIntsChainKeys is pyChainKeys over ints made in C from ids in CPython's
// int layout layout (1: ob_size, 2: lv_tag; an id of 2^32-1 is made an int
// out of range): the chain reader without a Python, for tests.
func fakeIntsChainKeys(ids []uint32, layout int, root kv.Hash, chunkSize int) (n int, keys []kv.Hash, ok bool) {
	msg, prevOff, idsOff := chainMsg(root, chunkSize)
	return chainKeys(chunkSize, func(keys []kv.Hash) int64 {
		return int64(C.kv_chain_fake_ints((*C.uint32_t)(unsafe.SliceData(ids)), C.size_t(len(ids)), C.int(layout),
			(*C.uint8_t)(unsafe.SliceData(msg)), C.size_t(len(msg)/64), C.size_t(prevOff), C.size_t(idsOff),
			C.size_t(chunkSize), (*C.uint8_t)(unsafe.Pointer(unsafe.SliceData(keys))), C.size_t(len(keys))))
	})
}

// tokenBufs holds the buffers lists are read into: a lookup's tokens are
// hashed and dropped within the call (shim.Scheduler keeps only the hashes).
var tokenBufs = sync.Pool{New: func() any { return new([]uint32) }}

// releaseGIL releases the calling Python thread's GIL and returns the
// function that takes it back, or an error when this process has no such
// API (then nothing was released). Called with the GIL held.
func releaseGIL() (reacquire func(), err error) {
	if C.kv_py_can_release() == 0 {
		return nil, fmt.Errorf("no PyEval_SaveThread in this process: %w", errors.ErrUnsupported)
	}
	ts := C.kv_py_release()
	return func() { C.kv_py_reacquire(ts) }, nil
}
