package shim

import (
	"encoding/json"
	"fmt"
)

// KV-cache groups (vLLM's hybrid KV-cache manager, "HMA").
//
// vLLM gives every kind of attention its own KV-cache group with its own
// block table: full attention, sliding windows of W tokens, chunked local
// attention of A tokens (v1/kv_cache_interface.py FullAttentionSpec,
// SlidingWindowSpec, ChunkedLocalAttentionSpec). After N computed tokens a
// windowed group needs only the tokens from Skipped(N) on: vLLM frees the
// blocks below (v1/core/single_type_kv_cache_manager.py,
// remove_skipped_blocks) and gives a request that hits N tokens null blocks
// there (allocate_new_computed_blocks). kvshim follows the same rule:
//
//   - a full-attention group stores every block of every chunk and restores
//     the contiguous prefix, as a single-group model does;
//   - a windowed group's object for chunk j holds only the blocks inside the
//     group's window at that chunk's end (ObjectFirstBlock); the others are
//     left out of the copy. A hit at a chunk boundary restores, per group,
//     only the blocks vLLM allocated there.
//
// Each group has its own namespace (NamespaceSpec.KVGroup), so a group's
// objects can never be restored into another group; a model with one
// attention group keeps group 0's namespace, so its keys are those of kvshim
// before groups. A model's one group that frees blocks (a sliding window or
// chunked local attention on every layer, or the Mamba state of an
// attention-free model) is listed like a hybrid model's groups, so its rule
// applies and vLLM's null block is no block (asBefore).
//
// A Mamba/SSM group (MambaSpec with mamba_cache_mode "align") holds no KV
// per token but one recurrent state per block: block p holds the state after
// exactly (p+1)*block_size tokens once the request computed that far (vLLM
// v1/core/sched/scheduler.py:607-610, _mamba_block_aligned_split), or is the
// null block where no scheduler step ended at that boundary (the manager
// allocates only the block at a step's end: single_type_kv_cache_manager.py
// allocate_new_blocks, :1849-1859) or the state was retired
// (remove_skipped_blocks, 1629-1657). Its manager keeps only the state of the
// last computed token (get_num_skipped_tokens: n-1, :1971-1976), and a hit of
// n tokens needs exactly the one block ending at n (find_longest_cache_hit,
// :1470-1547). So kvshim's object of a Mamba group's chunk c holds only the
// chunk's last block; a chunk whose last block is null has no object; and a
// hit must end on a chunk boundary whose object is there (never one token
// short of the prompt: no state is kept there).

// GroupKind is the attention protocol of a KV-cache group.
type GroupKind string

const (
	GroupFull          GroupKind = "full"           // every token attends to all before it
	GroupSlidingWindow GroupKind = "sliding_window" // to the last Window tokens
	GroupChunkedLocal  GroupKind = "chunked_local"  // to the tokens of its Window-sized attention chunk
	GroupMamba         GroupKind = "mamba"          // one recurrent state per block, no window
)

// GroupSpec is one KV-cache group as the connector describes it.
type GroupSpec struct {
	Kind GroupKind `json:"kind"`
	// Window is the sliding window (tokens) or the attention chunk size.
	Window int `json:"window,omitempty"`
}

// Windowed says whether the group frees blocks behind a window (a Mamba
// group's "window" is its last state).
func (g GroupSpec) Windowed() bool { return g.Kind != GroupFull }

// BoundaryOnly says whether a hit of the group must end exactly on a chunk
// boundary whose object holds the state there (a Mamba group): the hit of a
// whole prompt cannot stop one token short of it.
func (g GroupSpec) BoundaryOnly() bool { return g.Kind == GroupMamba }

// Skipped is the number of leading tokens the group no longer needs once n
// tokens are computed: vLLM's get_num_skipped_tokens of
// SlidingWindowManager (max(0, n-W+1)), ChunkedLocalAttentionManager
// (n rounded down to the attention chunk) and MambaManager (n-1: the state
// of the last token only).
func (g GroupSpec) Skipped(n int) int {
	switch g.Kind {
	case GroupMamba:
		return max(0, n-1)
	case GroupSlidingWindow:
		return max(0, n-g.Window+1)
	case GroupChunkedLocal:
		return n / g.Window * g.Window
	}
	return 0
}

// ObjectFirstBlock is the first block (request block index) that chunk c's
// object of this group holds, for chunks of chunk tokens and blocks of bs:
// the first block inside the window of a hit that ends in the chunk's last
// token or right after it (the two ends a hit has: a chunk boundary, or one
// token less when the whole prompt hit). A window that moves on only frees
// more blocks, so the object of chunk c also holds what any later boundary
// needs from chunk c. The result is at least the chunk's first block and
// may be past its last one (nothing of the chunk is needed).
//
// A Mamba group's object holds the chunk's last block alone: the state at
// the chunk's end (a hit is never one token short there).
func (g GroupSpec) ObjectFirstBlock(c, chunk, bs int) int {
	first := c * chunk / bs
	switch {
	case !g.Windowed():
		return first
	case g.Kind == GroupMamba:
		return (c+1)*chunk/bs - 1
	}
	return max(first, g.Skipped((c+1)*chunk-1)/bs)
}

// layoutGroups is the part of the namespace's layout string that lists
// groups (shim/vllmspec.go, ResolveVLLM: a JSON object; one
// full-attention group: no "groups" member, the layout string of kvshim
// before groups; one group that frees blocks: a list of one).
type layoutGroups struct {
	Groups []GroupSpec `json:"groups"`
}

// Groups are the KV-cache groups of the namespace, in vLLM's group order:
// those the layout string lists, or one full-attention group. A group
// kvshim cannot use is ErrBadNamespaceSpec (the groups are part of it).
func (s NamespaceSpec) Groups() ([]GroupSpec, error) {
	var lg layoutGroups
	if err := json.Unmarshal([]byte(s.LayoutFingerprint), &lg); err != nil || len(lg.Groups) == 0 {
		return []GroupSpec{{Kind: GroupFull}}, nil
	}
	for i, g := range lg.Groups {
		switch {
		case g.Kind == GroupFull:
		case g.Kind == GroupMamba:
			if g.Window != 0 {
				return nil, fmt.Errorf("%w: group %d (%s): window %d (a state has none)", ErrBadNamespaceSpec, i, g.Kind, g.Window)
			}
		case g.Kind == GroupSlidingWindow || g.Kind == GroupChunkedLocal:
			if g.Window <= 0 {
				return nil, fmt.Errorf("%w: group %d (%s): window %d", ErrBadNamespaceSpec, i, g.Kind, g.Window)
			}
		default:
			return nil, fmt.Errorf("%w: group %d: kind %q (want full, sliding_window, chunked_local or mamba)", ErrBadNamespaceSpec, i, g.Kind)
		}
	}
	if len(lg.Groups) >= maxKVGroup {
		return nil, fmt.Errorf("%w: %d groups", ErrBadNamespaceSpec, len(lg.Groups))
	}
	return lg.Groups, nil
}

// GroupNamespaces are the namespace specs of the groups: s with KVGroup set
// to the group's index (group 0 of a single-group model is s itself).
func (s NamespaceSpec) GroupNamespaces() ([]GroupSpec, []NamespaceSpec, error) {
	gs, err := s.Groups()
	if err != nil {
		return nil, nil, err
	}
	specs := make([]NamespaceSpec, len(gs))
	for i := range gs {
		specs[i] = s
		specs[i].KVGroup = s.KVGroup + i
	}
	return gs, specs, nil
}

// asBefore says whether gs is one full-attention group: the model kvshim
// served before groups, whose block ids are read as they are. Any other
// model's block id 0 is vLLM's null block, no block: where a window moved
// on, and, in a Mamba group, where no state is kept (an attention-free
// model's one Mamba group as much as a hybrid model's).
func asBefore(gs []GroupSpec) bool { return len(gs) == 1 && gs[0].Kind == GroupFull }

// splitGroups reads block ids in the one form they cross the C ABI in:
// n equal parts of ids, one per KV-cache group in vLLM's order, each
// padded with -1 to the longest (vLLM's ids are never negative). n is the
// group count the caller states (0 reads as 1): it must be the
// namespace's. It returns one table per group, the padding dropped; unless
// the groups are asBefore, vLLM's null block (id 0) becomes -1: no block.
// No ids are no blocks in any group, whatever the count.
func splitGroups(ids []int64, n int, gs []GroupSpec) ([][]int64, error) {
	if len(ids) == 0 {
		return make([][]int64, len(gs)), nil
	}
	n = max(n, 1)
	if n != len(gs) {
		return nil, fmt.Errorf("%w: block ids of %d KV-cache groups, the namespace has %d", ErrBadMeta, n, len(gs))
	}
	if asBefore(gs) {
		return [][]int64{ids}, nil
	}
	if len(ids)%n != 0 {
		return nil, fmt.Errorf("%w: %d block ids for %d groups", ErrBadMeta, len(ids), n)
	}
	per := len(ids) / n
	out := make([][]int64, n)
	for g := range out {
		part := ids[g*per : (g+1)*per]
		for len(part) > 0 && part[len(part)-1] == -1 {
			part = part[:len(part)-1]
		}
		out[g] = make([]int64, len(part))
		for i, id := range part {
			if id == 0 {
				id = -1
			}
			out[g][i] = id
		}
	}
	return out, nil
}
