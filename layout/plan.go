package layout

import (
	"math/bits"

	"github.com/kvshim/kvshim/kv"
)

// Plan returns the copy spans that move one chunk between the KV tensors
// and the object at objectBase (the address of the object's header; the
// payload starts HeaderSize bytes later). blockIDs are the chunk's blocks in
// token order, exactly ChunkBlocks() of them, each in [0, NumBlocks()), no
// repeats; for loads an id of Skip (-1) leaves that block alone (the request
// already has it, e.g. from vLLM's own prefix cache, and the block may be
// shared). Spans that are contiguous on both sides are merged, so
// consecutive block ids become one span per run (one per chunk for
// cross-layer). Every span lies inside a tensor and inside the object.
func (l *Layout) Plan(blockIDs []int64, objectBase uint64, dir kv.Direction) ([]kv.Span, error) {
	return l.AppendPlan(nil, blockIDs, objectBase, dir)
}

// AppendPlan is Plan appending to dst, for callers that reuse a buffer.
func (l *Layout) AppendPlan(dst []kv.Span, blockIDs []int64, objectBase uint64, dir kv.Direction) ([]kv.Span, error) {
	if err := l.checkPlan(blockIDs, objectBase, dir); err != nil {
		return dst, err
	}
	obj := objectBase + HeaderSize
	var cur kv.Span // the span being extended; Len 0 = none yet
	for i := range l.tensors {
		dst = l.tensors[i].appendSpans(dst, &cur, &obj, blockIDs, dir)
	}
	if cur.Len != 0 {
		dst = append(dst, cur)
	}
	return dst, nil
}

// Skip in a plan's block ids marks a block not to copy: a load does not
// write it (vLLM has it), a save leaves its bytes in the object unwritten
// (a windowed KV-cache group's object holds only the blocks inside the
// window; shim/groups.go), and no load of that object ever reads them.
const Skip int64 = -1

func (l *Layout) checkPlan(ids []int64, objectBase uint64, dir kv.Direction) error {
	name := l.tensors[0].name
	if dir != kv.Save && dir != kv.Load {
		return geomErr(name, "direction", "unknown direction %d", dir)
	}
	if len(ids) != l.ChunkBlocks() {
		return geomErr(name, "block_ids", "partial chunk: %d block ids, chunk of %d tokens needs %d",
			len(ids), l.chunkTokens, l.ChunkBlocks())
	}
	var seen map[int64]bool
	if len(ids) > 64 {
		seen = make(map[int64]bool, len(ids))
	}
	for i, b := range ids {
		if b == Skip {
			continue
		}
		if b < 0 || b >= l.numBlocks {
			return geomErr(name, "block_ids", "block id %d out of range [0, %d)", b, l.numBlocks)
		}
		dup := seen[b]
		if seen != nil {
			seen[b] = true
		} else {
			for _, c := range ids[:i] {
				dup = dup || c == b
			}
		}
		if dup {
			return geomErr(name, "block_ids", "block id %d repeated", b)
		}
	}
	size, _ := l.ObjectSize(l.chunkTokens)
	if objectBase == 0 {
		return geomErr(name, "object_base", "null")
	}
	if _, carry := bits.Add64(objectBase, size, 0); carry != 0 {
		return geomErr(name, "object_base", "%#x + %d overflows", objectBase, size)
	}
	return nil
}

// appendSpans appends t's spans for blockIDs to dst, extending *cur while
// both sides stay contiguous (a span still open when it returns is left in
// *cur, so the next tensor may extend it) and advancing *obj, the object
// offset, past every block, skipped ones (Skip) included.
func (t *tensor) appendSpans(dst []kv.Span, cur *kv.Span, obj *uint64, blockIDs []int64, dir kv.Direction) []kv.Span {
	rl, bs := t.runLen, t.blockStride
	for _, roff := range t.runs {
		base := t.base + roff
		for _, b := range blockIDs {
			if b == Skip {
				if cur.Len != 0 {
					dst = append(dst, *cur)
					*cur = kv.Span{}
				}
				*obj += rl
				continue
			}
			src, dstA := base+uint64(b)*bs, *obj
			if dir == kv.Load {
				src, dstA = dstA, src
			}
			if cur.Len != 0 && cur.Src+cur.Len == src && cur.Dst+cur.Len == dstA {
				cur.Len += rl
			} else {
				if cur.Len != 0 {
					dst = append(dst, *cur)
				}
				*cur = kv.Span{Src: src, Dst: dstA, Len: rl}
			}
			*obj += rl
		}
	}
	return dst
}
