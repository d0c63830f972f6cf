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
func kvshim_skeleton_save(h C.int64_t, cache unsafe.Pointer, cacheBytes C.uint64_t, ids *C.int64_t, nIDs C.size_t, toks *C.uint32_t, nToks C.size_t, saved *C.uint64_t) C.int {
	return call(h, func(in *instance, s *shim.Skeleton) error {
		a, err := skeletonInputs(cache, cacheBytes, ids, nIDs, toks, nToks)
		if err != nil {
			return err
		}
		if saved == nil {
			return fmt.Errorf("saved is NULL: %w", errInvalid)
		}
		n, err := s.Save(a.cache, a.blocks, a.tokens)
		*saved = C.uint64_t(n)
		return err
	})
}

//export kvshim_skeleton_lookup
func kvshim_skeleton_lookup(h C.int64_t, toks *C.uint32_t, nToks C.size_t, chunks *C.uint64_t) C.int {
	return call(h, func(in *instance, s *shim.Skeleton) error {
		tokens, err := cSlice[uint32](unsafe.Pointer(toks), uint64(nToks), "tokens")
		if err != nil {
			return err
		}
		if chunks == nil {
			return fmt.Errorf("chunks is NULL: %w", errInvalid)
		}
		*chunks = C.uint64_t(s.Lookup(tokens))
		return nil
	})
}

//export kvshim_skeleton_load
func kvshim_skeleton_load(h C.int64_t, cache unsafe.Pointer, cacheBytes C.uint64_t, ids *C.int64_t, nIDs C.size_t, toks *C.uint32_t, nToks C.size_t, chunks C.uint64_t) C.int {
	return call(h, func(in *instance, s *shim.Skeleton) error {
		a, err := skeletonInputs(cache, cacheBytes, ids, nIDs, toks, nToks)
		if err != nil {
			return err
		}
		return s.Load(a.cache, a.blocks, a.tokens, int(chunks))
	})
}
