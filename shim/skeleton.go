package shim

import (
	"fmt"
	"sync"

	"github.com/kvshim/kvshim/ipc"
)

// Skeleton is the walking skeleton's store: chunk objects kept in Go memory
// of this process and copied with plain copy(). It proves the wiring from
// Python through the C ABI to chunk keys and copies; the connector roles
// replace each part with the full design (ipc/ rings, server/ L1 segments,
// layout/ plans, cuda/ engines).
type Skeleton struct {
	blockBytes  int
	chunkBlocks int
	blockTokens int
	ns          ipc.Namespace

	mu      sync.Mutex
	objects map[ipc.Hash][]byte
}

// ErrSkeleton marks bad input to the skeleton.
var ErrSkeleton = fmt.Errorf("skeleton")

// NewSkeleton makes a store for blocks of blockBytes bytes holding
// blockTokens tokens, grouped chunkTokens tokens to a chunk.
func NewSkeleton(blockBytes, blockTokens, chunkTokens int) (*Skeleton, error) {
	if blockBytes <= 0 || blockTokens <= 0 || chunkTokens <= 0 || chunkTokens%blockTokens != 0 {
		return nil, fmt.Errorf("%w: block_bytes %d, block_tokens %d, chunk_tokens %d: all must be positive and chunk_tokens a multiple of block_tokens",
			ErrSkeleton, blockBytes, blockTokens, chunkTokens)
	}
	ns, err := NamespaceSpec{Model: "kvshim-skeleton", DType: "bytes", LayoutFingerprint: "contiguous-blocks", ObjectFormat: 1, WorldSize: 1, ChunkSize: chunkTokens}.Namespace()
	if err != nil {
		return nil, err
	}
	return &Skeleton{
		blockBytes: blockBytes, chunkBlocks: chunkTokens / blockTokens, blockTokens: blockTokens,
		ns: ns, objects: map[ipc.Hash][]byte{},
	}, nil
}

func (s *Skeleton) block(cache []byte, id int64) ([]byte, error) {
	off := id * int64(s.blockBytes)
	if id < 0 || off+int64(s.blockBytes) > int64(len(cache)) {
		return nil, fmt.Errorf("%w: block id %d outside a cache of %d blocks", ErrSkeleton, id, len(cache)/s.blockBytes)
	}
	return cache[off : off+int64(s.blockBytes)], nil
}

func (s *Skeleton) hashes(tokens []uint32) []ipc.Hash {
	hs, err := ChunkHashes(s.ns, tokens, s.chunkBlocks*s.blockTokens, Extras{})
	if err != nil { // only for bad chunk sizes or extras, which NewSkeleton rules out
		panic(err)
	}
	return hs
}

// Save stores every full chunk not yet stored; it returns how many it wrote.
func (s *Skeleton) Save(cache []byte, blockIDs []int64, tokens []uint32) (int, error) {
	hs := s.hashes(tokens)
	if len(blockIDs) < len(hs)*s.chunkBlocks {
		return 0, fmt.Errorf("%w: %d block ids for %d chunks of %d blocks", ErrSkeleton, len(blockIDs), len(hs), s.chunkBlocks)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	saved := 0
	for c, h := range hs {
		if _, ok := s.objects[h]; ok {
			continue
		}
		obj := make([]byte, 0, s.chunkBlocks*s.blockBytes)
		for _, id := range blockIDs[c*s.chunkBlocks : (c+1)*s.chunkBlocks] {
			b, err := s.block(cache, id)
			if err != nil {
				return saved, err
			}
			obj = append(obj, b...)
		}
		s.objects[h] = obj
		saved++
	}
	return saved, nil
}

// Lookup counts the leading chunks of the prompt that are stored.
func (s *Skeleton) Lookup(tokens []uint32) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, h := range s.hashes(tokens) {
		if _, ok := s.objects[h]; !ok {
			break
		}
		n++
	}
	return n
}

// Load restores the first chunks chunks into blockIDs; it checks every
// chunk and block id before it writes anything.
func (s *Skeleton) Load(cache []byte, blockIDs []int64, tokens []uint32, chunks int) error {
	hs := s.hashes(tokens)
	if chunks < 0 || chunks > len(hs) || len(blockIDs) < chunks*s.chunkBlocks {
		return fmt.Errorf("%w: cannot load %d chunks with %d full chunks and %d block ids", ErrSkeleton, chunks, len(hs), len(blockIDs))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	objs := make([][]byte, chunks)
	for c := range objs {
		obj, ok := s.objects[hs[c]]
		if !ok {
			return fmt.Errorf("%w: chunk %d is not stored", ErrSkeleton, c)
		}
		objs[c] = obj
	}
	for _, id := range blockIDs[:chunks*s.chunkBlocks] {
		if _, err := s.block(cache, id); err != nil {
			return err
		}
	}
	for c, obj := range objs {
		for i, id := range blockIDs[c*s.chunkBlocks : (c+1)*s.chunkBlocks] {
			b, _ := s.block(cache, id)
			copy(b, obj[i*s.blockBytes:(i+1)*s.blockBytes])
		}
	}
	return nil
}
