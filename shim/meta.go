package shim

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
)

// StepMeta is what the scheduler side hands to every worker for one engine
// step (vLLM pickles it inside the connector metadata). Go writes and reads
// it; Python only carries the bytes.
type StepMeta struct {
	// Loads to start: chunks [Start, End) of a lookup, into Blocks.
	Loads []LoadSpec `json:"loads,omitempty"`
	// Saves to start after this step's forward pass.
	Saves []SaveSpec `json:"saves,omitempty"`
	// Finished lists requests whose blocks vLLM keeps until every worker
	// reports them in finished_sending (delay-free): each worker reports a
	// request once its copies for it have ended.
	Finished []string `json:"finished,omitempty"`
	// Preempted requests: workers wait for their in-flight copies before
	// vLLM reuses the blocks (handle_preemptions).
	Preempted []string `json:"preempted,omitempty"`
}

// LoadSpec restores chunks [Start, End) of lookup (Owner, Lookup) into
// Blocks: ChunkBlocks ids per chunk, in token order; -1 marks a block the
// request already has (vLLM's own prefix cache), which is not written.
// Hashes are the chunk hashes of chunks [Start, End): every retrieved
// object's header must name (namespace, rank, hash) before a byte of it
// reaches the KV cache. A load without them loads nothing (every chunk is a
// load error).
type LoadSpec struct {
	Req    string  `json:"req"`
	Owner  Tag     `json:"owner"`
	Lookup uint64  `json:"lookup"`
	Start  uint32  `json:"start"`
	End    uint32  `json:"end"`
	Hashes []Hash  `json:"hashes,omitempty"`
	Blocks []int64 `json:"blocks"`
}

// SaveSpec stores the chunks with Hashes from Blocks (ChunkBlocks ids per
// chunk). First is the index of the first chunk in the request (for logs).
type SaveSpec struct {
	Req    string  `json:"req"`
	First  uint32  `json:"first"`
	Hashes []Hash  `json:"hashes"`
	Blocks []int64 `json:"blocks"`
}

// Hash and Tag are ipc's types with a hex text form for the metadata.
type (
	Hash ipc.Hash
	Tag  ipc.Tag
)

func (h Hash) MarshalText() ([]byte, error) { return hexText(h[:]), nil }
func (t Tag) MarshalText() ([]byte, error)  { return hexText(t[:]), nil }
func (h *Hash) UnmarshalText(b []byte) error {
	return unhex(h[:], b, "hash")
}
func (t *Tag) UnmarshalText(b []byte) error { return unhex(t[:], b, "tag") }

func hexText(b []byte) []byte { return []byte(hex.EncodeToString(b)) }

func unhex(dst, src []byte, what string) error {
	if hex.DecodedLen(len(src)) != len(dst) {
		return fmt.Errorf("%s: want %d hex digits, got %d", what, 2*len(dst), len(src))
	}
	_, err := hex.Decode(dst, src)
	return err
}

// ErrBadMeta marks step metadata that does not decode or does not fit the
// worker's layout.
var ErrBadMeta = errors.New("bad step metadata")

// Encode is the metadata's wire form.
func (m *StepMeta) Encode() ([]byte, error) { return json.Marshal(m) }

// DecodeStepMeta parses and checks metadata against chunkBlocks (blocks per
// chunk) and the number of blocks of the worker's cache.
func DecodeStepMeta(b []byte, chunkBlocks int, numBlocks int64) (*StepMeta, error) {
	var m StepMeta
	if len(b) == 0 {
		return &m, nil
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadMeta, err)
	}
	checkBlocks := func(what, req string, ids []int64, chunks int, allowSkip bool) error {
		if chunks < 0 || len(ids) != chunks*chunkBlocks {
			return fmt.Errorf("%w: %s of %q: %d block ids for %d chunks of %d blocks", ErrBadMeta, what, req, len(ids), chunks, chunkBlocks)
		}
		for _, id := range ids {
			if id >= numBlocks || id < 0 && !(allowSkip && id == -1) {
				return fmt.Errorf("%w: %s of %q: block id %d outside a cache of %d blocks", ErrBadMeta, what, req, id, numBlocks)
			}
		}
		return nil
	}
	for _, l := range m.Loads {
		if l.End < l.Start {
			return nil, fmt.Errorf("%w: load of %q: chunk range [%d, %d)", ErrBadMeta, l.Req, l.Start, l.End)
		}
		if err := checkBlocks("load", l.Req, l.Blocks, int(l.End-l.Start), true); err != nil {
			return nil, err
		}
		if len(l.Hashes) != 0 && len(l.Hashes) != int(l.End-l.Start) {
			return nil, fmt.Errorf("%w: load of %q: %d chunk hashes for chunks [%d, %d)", ErrBadMeta, l.Req, len(l.Hashes), l.Start, l.End)
		}
	}
	for _, s := range m.Saves {
		if err := checkBlocks("save", s.Req, s.Blocks, len(s.Hashes), false); err != nil {
			return nil, err
		}
	}
	return &m, nil
}

// ErrNoChunkHash: a load names no chunk hash for a chunk, so the object's
// key cannot be checked; the chunk is not loaded.
var ErrNoChunkHash = errors.New("no chunk hash to check the object's key against")

// objectKey is the key of chunk hash h of this worker's rank: what its
// objects' headers name.
func (w *Worker) objectKey(h Hash) layout.ObjectKey {
	return layout.ObjectKey{Namespace: w.ns, Rank: w.kvRank, Hash: h}
}

// verifyLoaded checks retrieved object obj, chunk i of a load's hashes,
// against the layout and the key it was asked for: the header (128 bytes:
// header CRC, key, fingerprint, sizes), and under kvshim.verify=always the
// payload CRC too, which must be set (objfmt: payloads are checked where
// they enter L2, not on every L1 restore). A header that names another key
// is counted (KeyMismatches) and logged: bytes stored under the wrong name.
func (w *Worker) verifyLoaded(l *layout.Layout, obj []byte, hashes []Hash, i int) error {
	if i >= len(hashes) {
		return ErrNoChunkHash
	}
	check := l.CheckHeader
	if w.cfg.Verify == objfmt.VerifyAlways {
		check = l.VerifyObject
	}
	err := check(obj, w.objectKey(hashes[i]))
	if errors.Is(err, layout.ErrKeyMismatch) {
		w.count(func(s *WorkerStats) { s.KeyMismatches++ })
		slog.Error("kvshim: retrieved object names another key; not loaded", "rank", w.kvRank, "chunk_hash", hex.EncodeToString(hashes[i][:]), "err", err)
	}
	return err
}
