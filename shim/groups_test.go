package shim

import (
	"bytes"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// A layout string without groups (every model before KV-cache groups, and
// every single-group model now) is one full-attention group whose
// namespace is the spec's own: stored objects keep their keys.
func TestSingleGroupKeepsItsNamespace(t *testing.T) {
	spec := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: `{"block_size": 16, "spec": "FullAttentionSpec"}`,
		ObjectFormat: 1, WorldSize: 1, ChunkSize: 256}
	gs, specs, err := spec.GroupNamespaces()
	assert.NilError(t, err)
	assert.DeepEqual(t, gs, []GroupSpec{{Kind: GroupFull}})
	assert.Equal(t, specs[0], spec)
	want, err := spec.Namespace()
	assert.NilError(t, err)
	got, err := specs[0].Namespace()
	assert.NilError(t, err)
	assert.Equal(t, got, want)
}

// Every group of a hybrid model has its own namespace: a group's objects
// are never found under another group's key.
func TestGroupsHaveTheirOwnNamespaces(t *testing.T) {
	spec := NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: 8,
		LayoutFingerprint: `{"groups": [{"kind": "full"}, {"kind": "sliding_window", "window": 3}, {"kind": "chunked_local", "window": 16}]}`}
	gs, specs, err := spec.GroupNamespaces()
	assert.NilError(t, err)
	assert.DeepEqual(t, gs, []GroupSpec{{Kind: GroupFull}, {Kind: GroupSlidingWindow, Window: 3}, {Kind: GroupChunkedLocal, Window: 16}})
	seen := map[[16]byte]int{}
	for i, sp := range specs {
		assert.Equal(t, sp.KVGroup, i)
		ns, err := sp.Namespace()
		assert.NilError(t, err)
		_, dup := seen[ns]
		assert.Check(t, !dup, "group %d shares a namespace", i)
		seen[ns] = i
	}
	for _, bad := range []string{`{"groups": [{"kind": "ssm"}]}`, `{"groups": [{"kind": "sliding_window"}]}`, `{"groups": [{"kind": "mamba", "window": 4}]}`} {
		spec.LayoutFingerprint = bad
		_, _, err := spec.GroupNamespaces()
		assert.Check(t, is.ErrorIs(err, ErrBadNamespaceSpec), bad)
	}
}

// The window rule is vLLM's get_num_skipped_tokens; an object holds the
// blocks inside the window of a hit that ends at its chunk's end or one
// token before it.
func TestObjectFirstBlock(t *testing.T) {
	sw := GroupSpec{Kind: GroupSlidingWindow, Window: 40}
	assert.Equal(t, sw.Skipped(7), 0)
	assert.Equal(t, sw.Skipped(192), 153)
	cl := GroupSpec{Kind: GroupChunkedLocal, Window: 128}
	assert.Equal(t, cl.Skipped(127), 0)
	assert.Equal(t, cl.Skipped(192), 128)
	full := GroupSpec{Kind: GroupFull}
	for c := range 4 {
		assert.Equal(t, full.ObjectFirstBlock(c, 64, 16), 4*c)
	}
	// W=40, chunk 64, blocks of 16: a hit at 64(c+1)-1 skips 64c+23 tokens:
	// block 4c+1 on.
	for c := range 4 {
		assert.Equal(t, sw.ObjectFirstBlock(c, 64, 16), 4*c+1)
	}
	// A window wider than a chunk keeps every block of it.
	assert.Equal(t, GroupSpec{Kind: GroupSlidingWindow, Window: 1024}.ObjectFirstBlock(5, 64, 16), 20)
	// Chunked local attention: chunk 2 (tokens 128..191) is in the
	// attention chunk that starts at 128; chunk 1 ends one token before it.
	assert.Equal(t, cl.ObjectFirstBlock(1, 64, 16), 4)
	assert.Equal(t, cl.ObjectFirstBlock(2, 64, 16), 8)
}

func TestSplitGroups(t *testing.T) {
	full, mamba := GroupSpec{Kind: GroupFull}, GroupSpec{Kind: GroupMamba}
	for _, tc := range []struct {
		name   string
		ids    []int64
		n      int
		groups []GroupSpec
		want   [][]int64
		err    string
	}{
		{"one attention group: as it is", []int64{0, 1, 2}, 1, []GroupSpec{full}, [][]int64{{0, 1, 2}}, ""},
		{"a count of 0 reads as 1", []int64{0, 1, 2}, 0, []GroupSpec{full}, [][]int64{{0, 1, 2}}, ""},
		{"one Mamba group: null blocks are no state", []int64{0, 1, 0, 2}, 1, []GroupSpec{mamba}, [][]int64{{-1, 1, -1, 2}}, ""},
		{"padding dropped, a trailing null block kept", []int64{5, 6, 7, 0, 9, 0, 8, -1, -1}, 3, []GroupSpec{full, mamba, full},
			[][]int64{{5, 6, 7}, {-1, 9, -1}, {8}}, ""},
		{"no ids: no blocks in any group", nil, 0, []GroupSpec{full, mamba}, [][]int64{nil, nil}, ""},
		{"ids not in equal parts", []int64{1, 2, 3}, 2, []GroupSpec{full, full}, nil, "3 block ids for 2 groups"},
		{"a count that is not the namespace's", []int64{1, 2}, 1, []GroupSpec{full, mamba}, nil, "block ids of 1 KV-cache groups, the namespace has 2"},
	} {
		got, err := splitGroups(tc.ids, tc.n, tc.groups)
		if tc.err != "" {
			assert.Check(t, is.ErrorIs(err, ErrBadMeta), tc.name)
			assert.Check(t, is.ErrorContains(err, tc.err), tc.name)
			continue
		}
		assert.NilError(t, err, tc.name)
		assert.DeepEqual(t, got, tc.want)
	}
}

// A malformed step is refused whole: the loads and saves it would have
// carried stay pending for the next one.
func TestBuildMetaRefusesBadBlockIDsAndKeepsThePending(t *testing.T) {
	spec := NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk,
		LayoutFingerprint: `{"groups": [{"kind": "full"}, {"kind": "sliding_window", "window": 3}]}`}
	s, err := NewScheduler(SchedulerConfig{Socket: filepath.Join(t.TempDir(), "none.sock"), Namespace: spec, BlockSize: tBS,
		Timeout: 200 * time.Millisecond, Instance: uuid.New()})
	assert.NilError(t, err)
	defer s.Close()
	prompt := conversation(2*tChunk+1, 100)
	_, _, err = s.Match("A", prompt, Extras{}, 0)
	assert.NilError(t, err)
	full, window := []int64{10, 11, 12, 13, 14}, []int64{20, 21, 22, 23, 24}
	assert.NilError(t, s.AfterAlloc("A", flatGroups(full, window), 2, 0, 0))
	err = s.AfterAlloc("A", full, 1, 0, 0)
	assert.Check(t, is.ErrorContains(err, "block ids of 1 KV-cache groups, the namespace has 2"))
	bad := []StepRequest{{Req: "A", Blocks: flatGroups(full, window)[1:], Groups: 2, Scheduled: len(prompt)}}
	_, err = s.BuildMeta(&Step{Requests: bad})
	assert.Check(t, is.ErrorIs(err, ErrBadMeta))
	assert.Check(t, is.ErrorContains(err, `request "A"`))
	for _, neg := range []StepRequest{{Req: "A", Computed: -1}, {Req: "A", Scheduled: -5}, {Req: "A", TokensFrom: -256}} {
		_, err = s.BuildMeta(&Step{Requests: []StepRequest{neg}})
		assert.Check(t, is.ErrorIs(err, ErrBadMeta))
		assert.Check(t, is.ErrorContains(err, "is negative"))
	}
	raw, err := s.BuildMeta(&Step{Requests: []StepRequest{{Req: "A", Blocks: flatGroups(full, window), Groups: 2, Scheduled: len(prompt)}}})
	assert.NilError(t, err)
	m, err := DecodeStepMeta(raw, tChunk/tBS, tBlocks)
	assert.NilError(t, err)
	assert.Equal(t, len(m.Saves), 2) // both groups' chunk, as if the bad step had not come
}

// A windowed group's save leaves the blocks outside the window out, and a
// step that hands one of the blocks it reads to another request first
// makes the workers wait for the save's copies.
func TestWindowedSaveFencesItsBlocks(t *testing.T) {
	spec := NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk,
		LayoutFingerprint: `{"groups": [{"kind": "full"}, {"kind": "sliding_window", "window": 3}]}`}
	// No server: every lookup is a miss, saves are still planned.
	s, err := NewScheduler(SchedulerConfig{Socket: filepath.Join(t.TempDir(), "none.sock"), Namespace: spec, BlockSize: tBS,
		Timeout: 200 * time.Millisecond, Instance: uuid.New()})
	assert.NilError(t, err)
	defer s.Close()
	prompt := conversation(2*tChunk+1, 100)
	n, pending, err := s.Match("A", prompt, Extras{}, 0)
	assert.NilError(t, err)
	assert.Equal(t, n, 0)
	assert.Check(t, !pending)
	full, window := []int64{10, 11, 12, 13, 14}, []int64{20, 21, 22, 23, 24}
	assert.NilError(t, s.AfterAlloc("A", append(append([]int64{}, full...), window...), 2, 0, 0))
	meta := func(st *Step) *StepMeta {
		b, err := s.BuildMeta(st)
		assert.NilError(t, err)
		m, err := DecodeStepMeta(b, tChunk/tBS, tBlocks)
		assert.NilError(t, err)
		return m
	}
	m := meta(&Step{Requests: []StepRequest{{Req: "A", Blocks: flatGroups(full, window), Groups: 2, Scheduled: len(prompt)}}})
	assert.Equal(t, len(m.Saves), 2)
	assert.Equal(t, m.Saves[0].Group, uint32(0))
	assert.DeepEqual(t, m.Saves[0].Blocks, []int64{10, 11, 12, 13})
	// Window 3, blocks of 4, chunks of 8: a hit at 7 (15) needs tokens 5
	// (13) on: the second block of each chunk.
	assert.Equal(t, m.Saves[1].Group, uint32(1))
	assert.DeepEqual(t, m.Saves[1].Blocks, []int64{-1, 21, -1, 23})
	assert.DeepEqual(t, m.Saves[0].Hashes, m.Saves[1].Hashes) // one chain; the group is in the namespace

	// vLLM freed 20..23 (A's window moved on) and hands them out: 20 was
	// never read by a save, 23 still may be.
	m = meta(&Step{Requests: []StepRequest{{Req: "B", Blocks: []int64{30, 20}, Groups: 2, Scheduled: 1}}})
	assert.Equal(t, len(m.Preempted), 0)
	m = meta(&Step{Requests: []StepRequest{{Req: "B", NewBlocks: []int64{31, 23}, Groups: 2, Scheduled: 1}}})
	assert.DeepEqual(t, m.Preempted, []string{"A"})
	m = meta(&Step{Requests: []StepRequest{{Req: "B", NewBlocks: []int64{32, 23}, Groups: 2, Scheduled: 1}}})
	assert.Equal(t, len(m.Preempted), 0) // waited once
}

// Two KV-cache groups through the real server and a worker: group 0 full
// attention (layer0), group 1 a sliding window of 3 tokens (layer1). A
// request saves both; another restores group 0's whole prefix and group
// 1's window only, each into its own blocks, and is reported received
// once.
func TestGroupsSaveAndRestoreByTheirProtocol(t *testing.T) {
	r, c := groupRig(t, `{"groups": [{"kind": "full"}, {"kind": "sliding_window", "window": 3}]}`, true)
	s, w, srv := r.sched, r.workers[0], r.srv

	tokens, a0, _ := saveTwoGroups(t, r, c)

	// B hits both chunks (16 tokens, one less than the prompt: 16 is a
	// chunk boundary). vLLM gives group 1 null blocks below its window:
	// Skipped(16) = 14, block 3 on.
	assert.Equal(t, r.match(t, "B", tokens, Extras{}, 0), 2*tChunk)
	b0, b1 := seq(30, 5), []int64{0, 0, 0, 43, 44}
	assert.NilError(t, s.AfterAlloc("B", append(slices.Clone(b0), b1...), 2, 0, 2*tChunk))
	recving, errBlocks := r.step(t, &Step{})
	assert.DeepEqual(t, recving, map[string]int{"B": 1})
	assert.Equal(t, len(errBlocks), 0)
	for i := range 4 { // group 0 (layer0): the whole prefix
		assert.Check(t, bytes.Equal(c.block(0, int(b0[i])), c.block(0, int(a0[i]))), "group 0 block %d", i)
	}
	// group 1 (layer1): its window's block only
	assert.Check(t, bytes.Equal(c.block(1, 43), c.block(1, 23)))
	assert.Equal(t, w.Stats().LoadedChunks, uint64(3)) // 2 of group 0, 1 of group 1
	assert.Equal(t, holds(t, srv), 0.0)                // group 1's hold on chunk 0 too

	// A group's objects never reach another group: group 1's load read as
	// group 0's names group 1's namespace in its header, a key mismatch,
	// so its blocks are load errors and nothing is copied.
	assert.Equal(t, r.match(t, "C", tokens, Extras{}, 0), 2*tChunk)
	c0, c1 := seq(50, 5), []int64{0, 0, 0, 53, 54}
	assert.NilError(t, s.AfterAlloc("C", append(slices.Clone(c0), c1...), 2, 0, 2*tChunk))
	b, err := s.BuildMeta(&Step{})
	assert.NilError(t, err)
	m, err := DecodeStepMeta(b, tChunk/tBS, tBlocks)
	assert.NilError(t, err)
	assert.Equal(t, len(m.Loads), 2)
	assert.Equal(t, m.Loads[1].Group, uint32(1))
	m.Loads = m.Loads[1:]
	m.Loads[0].Group = 0
	c.fill(53, 99)
	before := c.block(0, 53)
	w.StartLoads(m)
	w.wg.Wait()
	_, rv, eb := w.Poll()
	assert.DeepEqual(t, rv, []string{"C"})
	assert.DeepEqual(t, eb, []int64{53})
	assert.Equal(t, w.Stats().KeyMismatches, uint64(1))
	assert.Check(t, bytes.Equal(c.block(0, 53), before))
}

// groupRig is one worker on a real server for a namespace whose layout
// lists groups; with layer1, the rank cache's second layer is in group 1.
func groupRig(t *testing.T, layout string, layer1 bool) (*rig, *rankCache) {
	t.Helper()
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk, LayoutFingerprint: layout}
	r := newRigWith(t, ns, nil, func(c *rankCache) {
		if layer1 {
			c.descs[1].Group = 1
		}
	})
	return r, r.caches[0]
}

// saveTwoGroups has request A (two chunks and a token) save both chunks
// of both groups of r from blocks 10-14 (group 0) and 20-24 (group 1),
// filled with pattern 7; it returns A's tokens and blocks.
func saveTwoGroups(t *testing.T, r *rig, c *rankCache) (tokens []uint32, a0, a1 []int64) {
	t.Helper()
	tokens = conversation(2*tChunk+1, 100)
	assert.Equal(t, r.match(t, "A", tokens, Extras{}, 0), 0)
	a0, a1 = seq(10, 5), seq(20, 5)
	assert.NilError(t, r.sched.AfterAlloc("A", append(slices.Clone(a0), a1...), 2, 0, 0))
	for _, b := range append(slices.Clone(a0), a1...) {
		c.fill(int(b), 7)
	}
	r.step(t, &Step{Requests: []StepRequest{{Req: "A", Blocks: flatGroups(a0, a1), Groups: 2, Scheduled: len(tokens)}}})
	assert.Equal(t, r.workers[0].Stats().SavedChunks, uint64(4))
	return tokens, a0, a1
}

// flatGroups is block tables as they cross the C ABI (splitGroups): one
// after the other, each padded with -1 to the longest.
func flatGroups(tables ...[]int64) []int64 {
	n := 0
	for _, t := range tables {
		n = max(n, len(t))
	}
	var out []int64
	for _, t := range tables {
		out = append(out, t...)
		for range n - len(t) {
			out = append(out, -1)
		}
	}
	return out
}
