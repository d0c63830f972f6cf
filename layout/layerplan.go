package layout

import "github.com/kvshim/kvshim/kv"

// AppendPlanTensor is AppendPlan for one registered tensor only (index ti,
// in registration order: one attention layer of vLLM's, or every layer of a
// cross-layer cache): the spans a layer-wise load copies for that layer.
// The object offsets are those of the whole chunk's plan, so the union over
// every ti is exactly AppendPlan's bytes.
func (l *Layout) AppendPlanTensor(dst []kv.Span, blockIDs []int64, objectBase uint64, dir kv.Direction, ti int) ([]kv.Span, error) {
	if err := l.checkPlan(blockIDs, objectBase, dir); err != nil {
		return dst, err
	}
	if ti < 0 || ti >= len(l.tensors) {
		return dst, geomErr("", "tensor", "index %d of %d tensors", ti, len(l.tensors))
	}
	obj := objectBase + HeaderSize
	for _, t := range l.tensors[:ti] {
		obj += t.blockBytes() * uint64(len(blockIDs))
	}
	var cur kv.Span
	dst = l.tensors[ti].appendSpans(dst, &cur, &obj, blockIDs, dir)
	if cur.Len != 0 {
		dst = append(dst, cur)
	}
	return dst, nil
}

// TensorIndex is the registration index of the tensor named name (vLLM's
// layer name), or -1.
func (l *Layout) TensorIndex(name string) int {
	for i, t := range l.tensors {
		if t.name == name {
			return i
		}
	}
	return -1
}
