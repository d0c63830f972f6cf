package shim

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
)

// StepMeta is what the scheduler side hands to every worker for one engine
// step (vLLM pickles it inside the connector metadata). Go writes and reads
// it (Encode, DecodeStepMeta: the binary form below); Python only carries
// the bytes. The json tags give its text form, for people.
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
	Req    string    `json:"req"`
	Group  uint32    `json:"group,omitempty"` // KV-cache group (its namespace and layout)
	Owner  kv.Tag    `json:"owner"`
	Lookup uint64    `json:"lookup"`
	Start  uint32    `json:"start"`
	End    uint32    `json:"end"`
	Hashes []kv.Hash `json:"hashes,omitempty"`
	Blocks []int64   `json:"blocks"`
}

// SaveSpec stores the chunks with Hashes from Blocks (ChunkBlocks ids per
// chunk) of KV-cache group Group. First is the index of the first chunk in
// the request (for logs). -1 marks a block a windowed group's object leaves
// out (outside the window at the chunk's end): its bytes in the object are
// never written and never restored.
type SaveSpec struct {
	Req    string    `json:"req"`
	Group  uint32    `json:"group,omitempty"`
	First  uint32    `json:"first"`
	Hashes []kv.Hash `json:"hashes"`
	Blocks []int64   `json:"blocks"`
}

// ErrBadMeta marks step metadata that does not decode or does not fit the
// worker's layout.
var ErrBadMeta = errors.New("bad step metadata")

// MetaVersion is the first byte of the metadata's binary form:
//
//	meta  = version:u8 list(load) list(save) list(str) list(str)   (the last two: finished, preempted)
//	load  = str(req) uv(group) owner:[16]u8 uv(lookup) uv(start) uv(end) list(hash) list(block)
//	save  = str(req) uv(group) uv(first) list(hash) list(block)
//	list  = uv(count), then count items
//	str   = uv(length), then the bytes
//	hash  = [32]u8, raw
//	block = zigzag varint (a block id; -1 in a load: a block vLLM has)
//	uv    = unsigned LEB128 varint, at most 10 bytes (encoding/binary)
//
// Nothing follows the last list. A decoder checks every count against the
// bytes left before it allocates, and a number against its field's range.
// Other versions are refused; the scheduler and the workers run the same
// library, so a version only changes with it. Version 2 added the group.
const MetaVersion = 2

// Encode is the metadata's wire form: the binary form of MetaVersion.
func (m *StepMeta) Encode() ([]byte, error) {
	size := 5
	for i := range m.Loads {
		l := &m.Loads[i]
		size += 49 + len(l.Req) + HashSizeBytes*len(l.Hashes) + 3*len(l.Blocks)
	}
	for i := range m.Saves {
		s := &m.Saves[i]
		size += 17 + len(s.Req) + HashSizeBytes*len(s.Hashes) + 3*len(s.Blocks)
	}
	for _, r := range m.Finished {
		size += 2 + len(r)
	}
	for _, r := range m.Preempted {
		size += 2 + len(r)
	}
	b := make([]byte, 1, size)
	b[0] = MetaVersion
	b = binary.AppendUvarint(b, uint64(len(m.Loads)))
	for i := range m.Loads {
		l := &m.Loads[i]
		b = appendStr(b, l.Req)
		b = binary.AppendUvarint(b, uint64(l.Group))
		b = append(b, l.Owner[:]...)
		b = binary.AppendUvarint(b, l.Lookup)
		b = binary.AppendUvarint(b, uint64(l.Start))
		b = binary.AppendUvarint(b, uint64(l.End))
		b = appendHashes(b, l.Hashes)
		b = appendBlocks(b, l.Blocks)
	}
	b = binary.AppendUvarint(b, uint64(len(m.Saves)))
	for i := range m.Saves {
		s := &m.Saves[i]
		b = appendStr(b, s.Req)
		b = binary.AppendUvarint(b, uint64(s.Group))
		b = binary.AppendUvarint(b, uint64(s.First))
		b = appendHashes(b, s.Hashes)
		b = appendBlocks(b, s.Blocks)
	}
	b = appendStrs(b, m.Finished)
	b = appendStrs(b, m.Preempted)
	return b, nil
}

// HashSizeBytes is a chunk hash's size in the binary form.
const HashSizeBytes = len(kv.Hash{})

func appendStr(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

func appendStrs(b []byte, ss []string) []byte {
	b = binary.AppendUvarint(b, uint64(len(ss)))
	for _, s := range ss {
		b = appendStr(b, s)
	}
	return b
}

func appendHashes(b []byte, hs []kv.Hash) []byte {
	b = binary.AppendUvarint(b, uint64(len(hs)))
	for i := range hs {
		b = append(b, hs[i][:]...)
	}
	return b
}

func appendBlocks(b []byte, ids []int64) []byte {
	b = binary.AppendUvarint(b, uint64(len(ids)))
	for _, id := range ids {
		b = binary.AppendVarint(b, id)
	}
	return b
}

// metaReader reads the binary form; the first error sticks and every later
// read returns zero values.
type metaReader struct {
	b   []byte
	n   int // total length, for offsets in errors
	err error
}

func (r *metaReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: byte %d: %s", ErrBadMeta, r.n-len(r.b), fmt.Sprintf(format, args...))
	}
}

func (r *metaReader) uvarint(what string) uint64 {
	if r.err != nil {
		return 0
	}
	v, k := binary.Uvarint(r.b)
	if k <= 0 {
		r.fail("%s: truncated or overlong varint", what)
		return 0
	}
	r.b = r.b[k:]
	return v
}

func (r *metaReader) u32(what string) uint32 {
	v := r.uvarint(what)
	if v > math.MaxUint32 {
		r.fail("%s %d does not fit 32 bits", what, v)
		return 0
	}
	return uint32(v)
}

// count reads a list length whose items take at least itemSize bytes each.
func (r *metaReader) count(what string, itemSize int) int {
	v := r.uvarint(what)
	if r.err == nil && v > uint64(len(r.b)/itemSize) {
		r.fail("%d %s in %d bytes", v, what, len(r.b))
		return 0
	}
	return int(v)
}

func (r *metaReader) bytes(what string, n int) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b) {
		r.fail("%s: %d bytes wanted, %d left", what, n, len(r.b))
		return nil
	}
	p := r.b[:n]
	r.b = r.b[n:]
	return p
}

func (r *metaReader) str(what string) string {
	return string(r.bytes(what, r.count(what+" bytes", 1)))
}

func (r *metaReader) strs(what string) []string {
	n := r.count(what, 1)
	if n == 0 {
		return nil
	}
	out := make([]string, n)
	for i := range out {
		out[i] = r.str(what)
	}
	return out
}

func (r *metaReader) hashes() []kv.Hash {
	n := r.count("chunk hashes", HashSizeBytes)
	if n == 0 {
		return nil
	}
	p := r.bytes("chunk hashes", n*HashSizeBytes)
	if p == nil {
		return nil
	}
	hs := make([]kv.Hash, n)
	for i := range hs {
		hs[i] = kv.Hash(p[i*HashSizeBytes:])
	}
	return hs
}

func (r *metaReader) blocks() []int64 {
	n := r.count("block ids", 1)
	if n == 0 {
		return nil
	}
	ids := make([]int64, n)
	p := r.b // a local: no write barrier per id
	for i := range ids {
		if len(p) > 0 && p[0] < 0x80 { // one byte: ids -64..63
			ids[i], p = int64(p[0]>>1)^-int64(p[0]&1), p[1:]
			continue
		}
		v, k := binary.Varint(p)
		if k <= 0 {
			r.b = p
			r.fail("block id %d of %d: truncated or overlong varint", i, n)
			return nil
		}
		ids[i], p = v, p[k:]
	}
	r.b = p
	return ids
}

// Smallest encodings, to bound counts: a load is a one-byte req length, a
// one-byte group, the owner, three one-byte numbers and two one-byte
// counts; a save a one-byte req length and group, three one-byte numbers
// or counts.
const minLoadBytes, minSaveBytes = 1 + 1 + len(kv.Tag{}) + 3 + 2, 1 + 1 + 3

func decodeBinaryMeta(b []byte) (*StepMeta, error) {
	var m StepMeta
	if b[0] != MetaVersion {
		return nil, fmt.Errorf("%w: version %d (this library reads version %d)", ErrBadMeta, b[0], MetaVersion)
	}
	r := &metaReader{b: b[1:], n: len(b)}
	if n := r.count("loads", minLoadBytes); n > 0 {
		m.Loads = make([]LoadSpec, n)
		for i := range m.Loads {
			l := &m.Loads[i]
			l.Req = r.str("req")
			l.Group = r.u32("group")
			if p := r.bytes("owner", len(kv.Tag{})); p != nil {
				l.Owner = kv.Tag(p)
			}
			l.Lookup = r.uvarint("lookup")
			l.Start = r.u32("start")
			l.End = r.u32("end")
			l.Hashes = r.hashes()
			l.Blocks = r.blocks()
			if r.err != nil {
				return nil, r.err
			}
		}
	}
	if n := r.count("saves", minSaveBytes); n > 0 {
		m.Saves = make([]SaveSpec, n)
		for i := range m.Saves {
			s := &m.Saves[i]
			s.Req = r.str("req")
			s.Group = r.u32("group")
			s.First = r.u32("first")
			s.Hashes = r.hashes()
			s.Blocks = r.blocks()
			if r.err != nil {
				return nil, r.err
			}
		}
	}
	m.Finished = r.strs("finished")
	m.Preempted = r.strs("preempted")
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d bytes after the metadata", len(r.b))
	}
	if r.err != nil {
		return nil, r.err
	}
	return &m, nil
}

// ReadStepMeta decodes the binary form alone, unchecked against a cache
// (kvshim_meta_json: tests and debugging read a step's metadata with Go's
// decoder instead of a copy of it).
func ReadStepMeta(b []byte) (*StepMeta, error) {
	if len(b) == 0 {
		return &StepMeta{}, nil
	}
	return decodeBinaryMeta(b)
}

// DecodeStepMeta parses and checks metadata against chunkBlocks (blocks per
// chunk) and the number of blocks of the worker's cache. It reads the
// binary form (Encode); metadata that starts with '{' is read as the JSON
// text form instead (hex hashes: hand-written metadata in tests and
// debugging; the scheduler never writes it). Empty metadata is an empty step.
func DecodeStepMeta(b []byte, chunkBlocks int, numBlocks int64) (*StepMeta, error) {
	if len(b) == 0 {
		return &StepMeta{}, nil
	}
	var m *StepMeta
	if b[0] == '{' {
		m = new(StepMeta)
		if err := json.Unmarshal(b, m); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrBadMeta, err)
		}
	} else {
		var err error
		if m, err = decodeBinaryMeta(b); err != nil {
			return nil, err
		}
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
		if err := checkBlocks("save", s.Req, s.Blocks, len(s.Hashes), true); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// ErrNoChunkHash: a load names no chunk hash for a chunk, so the object's
// key cannot be checked; the chunk is not loaded.
var ErrNoChunkHash = errors.New("no chunk hash to check the object's key against")

// objectKey is the key of chunk hash h of this worker's rank in namespace
// ns (a KV-cache group's): what its objects' headers name.
func (w *Worker) objectKey(ns kv.Namespace, h kv.Hash) kv.Key {
	return kv.Key{Namespace: ns, Rank: w.kvRank, Hash: h}
}

// verifyLoaded checks retrieved object obj, chunk i of a load's hashes,
// against the layout and the key it was asked for: the header (128 bytes:
// header CRC, key, fingerprint, sizes), and under kvshim.verify=always the
// payload CRC too, which must be set (objfmt: payloads are checked where
// they enter L2, not on every L1 restore). A header that names another key
// is counted (KeyMismatches) and logged: bytes stored under the wrong name.
func (w *Worker) verifyLoaded(l *layout.Layout, ns kv.Namespace, obj []byte, hashes []kv.Hash, i int) error {
	if i >= len(hashes) {
		return ErrNoChunkHash
	}
	check := l.CheckHeader
	if w.cfg.Verify == objfmt.VerifyAlways {
		check = l.VerifyObject
	}
	err := check(obj, w.objectKey(ns, hashes[i]))
	if errors.Is(err, layout.ErrKeyMismatch) {
		w.count(func(s *WorkerStats) { s.KeyMismatches++ })
		slog.Error("kvshim: retrieved object names another key; not loaded", "rank", w.kvRank, "chunk_hash", hex.EncodeToString(hashes[i][:]), "err", err)
	}
	return err
}
