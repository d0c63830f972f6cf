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
// objects can never be restored into another group; a model with one group
// keeps group 0's namespace, so its keys are those of kvshim before groups.

// GroupKind is the attention protocol of a KV-cache group.
type GroupKind string

const (
	GroupFull          GroupKind = "full"           // every token attends to all before it
	GroupSlidingWindow GroupKind = "sliding_window" // to the last Window tokens
	GroupChunkedLocal  GroupKind = "chunked_local"  // to the tokens of its Window-sized attention chunk
)

// GroupSpec is one KV-cache group as the connector describes it.
type GroupSpec struct {
	Kind GroupKind `json:"kind"`
	// Window is the sliding window (tokens) or the attention chunk size.
	Window int `json:"window,omitempty"`
}

// Windowed says whether the group frees blocks behind a window.
func (g GroupSpec) Windowed() bool { return g.Kind != GroupFull }

// Skipped is the number of leading tokens the group no longer needs once n
// tokens are computed: vLLM's get_num_skipped_tokens of
// SlidingWindowManager (max(0, n-W+1)) and ChunkedLocalAttentionManager
// (n rounded down to the attention chunk).
func (g GroupSpec) Skipped(n int) int {
	switch g.Kind {
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
func (g GroupSpec) ObjectFirstBlock(c, chunk, bs int) int {
	first := c * chunk / bs
	if !g.Windowed() {
		return first
	}
	return max(first, g.Skipped((c+1)*chunk-1)/bs)
}

// layoutGroups is the part of the namespace's layout string that lists
// groups (python/kvshim/vllm.py, _namespace: a JSON object; one group: no
// "groups" member, the layout string of kvshim before groups).
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
		case g.Kind == GroupSlidingWindow || g.Kind == GroupChunkedLocal:
			if g.Window <= 0 {
				return nil, fmt.Errorf("%w: group %d (%s): window %d", ErrBadNamespaceSpec, i, g.Kind, g.Window)
			}
		default:
			return nil, fmt.Errorf("%w: group %d: kind %q (want full, sliding_window or chunked_local)", ErrBadNamespaceSpec, i, g.Kind)
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

// splitGroups splits the block ids of n groups, passed as one array of n
// equal parts (group 0 first, each padded with -1 to the longest), into
// one list per group. With more than one group, id 0 (vLLM's null block,
// which windowed groups hold where their window has moved on) becomes -1:
// no block.
func splitGroups(ids []int64, n int) ([][]int64, error) {
	if n <= 1 {
		return [][]int64{ids}, nil
	}
	if len(ids)%n != 0 {
		return nil, fmt.Errorf("%w: %d block ids for %d groups", ErrBadMeta, len(ids), n)
	}
	per := len(ids) / n
	out := make([][]int64, n)
	for g := range out {
		part := make([]int64, per)
		for i, id := range ids[g*per : (g+1)*per] {
			if id == 0 {
				id = -1
			}
			part[i] = id
		}
		// trailing padding is not part of the table
		for len(part) > 0 && part[len(part)-1] < 0 {
			part = part[:len(part)-1]
		}
		out[g] = part
	}
	return out, nil
}
