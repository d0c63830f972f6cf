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

// The walking skeleton (role "skeleton"): see shim.Skeleton. The connector
// roles replace it; it stays as the smallest end-to-end check of the ABI.

type skeletonConfig struct {
	Role        string `json:"role"`
	BlockBytes  int    `json:"block_bytes"`
	BlockTokens int    `json:"block_tokens"`
	ChunkTokens int    `json:"chunk_tokens"`
}

func init() {
	openers["skeleton"] = func(in *instance, raw []byte) error {
		var cfg skeletonConfig
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&cfg); err != nil {
			return fmt.Errorf("skeleton config: %v: %w", err, errInvalid)
		}
		s, err := shim.NewSkeleton(cfg.BlockBytes, cfg.BlockTokens, cfg.ChunkTokens)
		if err != nil {
			return fmt.Errorf("%v: %w", err, errInvalid)
		}
		in.state = s
		return nil
	}
}

func skeletonOf(h C.int64_t) (*shim.Skeleton, error) {
	in, err := handles.lookup(int64(h))
	if err != nil {
		return nil, err
	}
	s, ok := in.state.(*shim.Skeleton)
	if !ok {
		return nil, fmt.Errorf("handle %d is not a skeleton handle: %w", int64(h), errInvalid)
	}
	return s, nil
}

// cSlice views n elements of C memory at p; nil p with n > 0 is an error.
func cSlice[T any](p unsafe.Pointer, n uint64, what string) ([]T, error) {
	if n == 0 {
		return nil, nil
	}
	if p == nil {
		return nil, fmt.Errorf("%s is NULL with length %d: %w", what, n, errInvalid)
	}
	return unsafe.Slice((*T)(p), n), nil
}

type skeletonArgs struct {
	cache  []byte
	blocks []int64
	tokens []uint32
}

func skeletonInputs(cache unsafe.Pointer, cacheBytes C.uint64_t, ids *C.int64_t, nIDs C.size_t, toks *C.uint32_t, nToks C.size_t) (a skeletonArgs, err error) {
	if a.cache, err = cSlice[byte](cache, uint64(cacheBytes), "cache"); err != nil {
		return a, err
	}
	if a.blocks, err = cSlice[int64](unsafe.Pointer(ids), uint64(nIDs), "block_ids"); err != nil {
		return a, err
	}
	a.tokens, err = cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens")
	return a, err
}

//export kvshim_skeleton_save
func kvshim_skeleton_save(h C.int64_t, cache unsafe.Pointer, cacheBytes C.uint64_t, ids *C.int64_t, nIDs C.size_t, toks *C.uint32_t, nToks C.size_t, saved *C.uint64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	s, err := skeletonOf(h)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	a, err := skeletonInputs(cache, cacheBytes, ids, nIDs, toks, nToks)
	if err == nil && saved == nil {
		err = fmt.Errorf("saved is NULL: %w", errInvalid)
	}
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	n, err := s.Save(a.cache, a.blocks, a.tokens)
	*saved = C.uint64_t(n)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	return codeOK
}

//export kvshim_skeleton_lookup
func kvshim_skeleton_lookup(h C.int64_t, toks *C.uint32_t, nToks C.size_t, chunks *C.uint64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	s, err := skeletonOf(h)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	tokens, err := cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens")
	if err == nil && chunks == nil {
		err = fmt.Errorf("chunks is NULL: %w", errInvalid)
	}
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	*chunks = C.uint64_t(s.Lookup(tokens))
	return codeOK
}

//export kvshim_skeleton_load
func kvshim_skeleton_load(h C.int64_t, cache unsafe.Pointer, cacheBytes C.uint64_t, ids *C.int64_t, nIDs C.size_t, toks *C.uint32_t, nToks C.size_t, chunks C.uint64_t) (rc C.int) {
	defer guard(int64(h), &rc)
	s, err := skeletonOf(h)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	a, err := skeletonInputs(cache, cacheBytes, ids, nIDs, toks, nToks)
	if err != nil {
		return C.int(fail(int64(h), err))
	}
	if err := s.Load(a.cache, a.blocks, a.tokens, int(chunks)); err != nil {
		return C.int(fail(int64(h), err))
	}
	return codeOK
}
