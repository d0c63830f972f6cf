package shim

import (
	"testing"

	"gotest.tools/v3/assert"
)

func TestStepMetaRoundTrip(t *testing.T) {
	m := &StepMeta{
		Loads:    []LoadSpec{{Req: "a", Owner: Tag{1, 2}, Lookup: 7, Start: 1, End: 3, Blocks: []int64{-1, 5, 6, 7}}},
		Saves:    []SaveSpec{{Req: "b", First: 2, Hashes: []Hash{{9}}, Blocks: []int64{1, 2}}},
		Finished: []string{"c"},
	}
	b, err := m.Encode()
	assert.NilError(t, err)
	got, err := DecodeStepMeta(b, 2, 8)
	assert.NilError(t, err)
	assert.DeepEqual(t, got, m)
}

func TestStepMetaRejects(t *testing.T) {
	for _, tc := range []struct{ name, meta, want string }{
		{"not json", `{`, "bad step metadata"},
		{"short blocks", `{"loads":[{"req":"a","start":0,"end":2,"blocks":[1,2,3]}]}`, "3 block ids for 2 chunks"},
		{"range", `{"loads":[{"req":"a","start":3,"end":2,"blocks":[]}]}`, "chunk range [3, 2)"},
		{"block out of range", `{"saves":[{"req":"a","hashes":["` + hex64 + `"],"blocks":[1,8]}]}`, "block id 8 outside"},
		{"skip in save", `{"saves":[{"req":"a","hashes":["` + hex64 + `"],"blocks":[-1,1]}]}`, "block id -1 outside"},
		{"short hash", `{"saves":[{"req":"a","hashes":["00"],"blocks":[1,1]}]}`, "want 64 hex digits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeStepMeta([]byte(tc.meta), 2, 8)
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

const hex64 = "0000000000000000000000000000000000000000000000000000000000000000"

func FuzzDecodeStepMeta(f *testing.F) {
	f.Add([]byte(`{"loads":[{"req":"a","start":0,"end":1,"blocks":[-1,3]}],"finished":["x"]}`))
	f.Add([]byte(`{"saves":[{"req":"a","hashes":["` + hex64 + `"],"blocks":[1,2]}]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeStepMeta(b, 2, 16)
		if err != nil {
			return
		}
		for _, l := range m.Loads {
			assert.Equal(t, len(l.Blocks), 2*int(l.End-l.Start))
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
	})
}
