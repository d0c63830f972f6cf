package server

import (
	"errors"
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/server/l1"
)

type failingSource struct{ l1.HeapSource }

func (failingSource) NewSegment(uint32, uint64) ([]byte, error) { return nil, errors.New("no memfd") }

// TestSegmentSourceErrorIsNoSpace: a segment source failure is an ALLOC's
// NoSpace, counted, and kept for LastSegmentError.
func TestSegmentSourceErrorIsNoSpace(t *testing.T) {
	st := newCore(t, 1, Options{Source: failingSource{}})
	s := open(t, st, 0)
	r := save(t, st, s, 1, 0, hashes("x", 1))
	assert.Equal(t, int(r[0]), 2) // StatusNoSpace
	assert.Equal(t, stat(t, st, "kvshim_l1_objects{state=staging}"), 0.0)
	assert.Equal(t, stat(t, st, "kvshim_l1_segment_errors_total"), 1.0)
	assert.ErrorContains(t, st.LastSegmentError(), "no memfd")
}
