package shim

import (
	"testing"

	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

// FuzzDecodeStepMeta: arbitrary bytes never panic or over-allocate; what
// decodes fits the layout, and its encoding decodes to the same metadata.
// The seeds (run by every go test) cover both forms.
//
//	go test ./shim -run '^$' -fuzz FuzzDecodeStepMeta -fuzztime 60s
func FuzzDecodeStepMeta(f *testing.F) {
	f.Add([]byte(`{"loads":[{"req":"a","start":0,"end":1,"blocks":[-1,3]}],"finished":["x"]}`))
	f.Add([]byte(`{"saves":[{"req":"a","hashes":["` + hex64 + `"],"blocks":[1,2]}]}`))
	f.Add([]byte(`null`))
	f.Add([]byte{})
	f.Add([]byte(`{"sAves":[]}`)) // the text form's empty list is the binary form's nil
	for _, m := range []*StepMeta{
		{},
		{Loads: []LoadSpec{{Req: "a", Owner: kv.Tag{7}, Lookup: 3, Start: 2, End: 4, Hashes: []kv.Hash{{1}, {2}}, Blocks: []int64{-1, 3, 4, 15}}}},
		{Saves: []SaveSpec{{Req: "b", First: 5, Hashes: []kv.Hash{{9}}, Blocks: []int64{0, 15}}}, Finished: []string{"c"}, Preempted: []string{"d", "e"}},
		metaSample(), // block ids past the fuzz layout: refused
	} {
		b, err := m.Encode()
		assert.NilError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeStepMeta(b, 2, 16)
		if err != nil {
			assert.ErrorIs(t, err, ErrBadMeta)
			return
		}
		for _, l := range m.Loads {
			assert.Equal(t, len(l.Blocks), 2*int(l.End-l.Start))
			assert.Assert(t, len(l.Hashes) == 0 || len(l.Hashes) == int(l.End-l.Start))
			for _, id := range l.Blocks {
				assert.Assert(t, id >= -1 && id < 16)
			}
		}
		for _, s := range m.Saves {
			assert.Equal(t, len(s.Blocks), 2*len(s.Hashes))
			for _, id := range s.Blocks {
				assert.Assert(t, id >= 0 && id < 16)
			}
		}
		enc, err := m.Encode()
		assert.NilError(t, err)
		again, err := DecodeStepMeta(enc, 2, 16)
		assert.NilError(t, err)
		assert.DeepEqual(t, again, m, cmpopts.EquateEmpty())
	})
}
