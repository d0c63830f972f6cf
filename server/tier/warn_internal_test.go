package tier

import (
	"testing"
	"time"

	"gotest.tools/v3/assert"
)

// A failing L2 (full, dead) is one line per warnEvery per adapter, with the
// count of what was held back, not a line per key.
func TestWarnLimiter(t *testing.T) {
	var w warnLimiter
	t0 := time.Unix(1000, 0)
	n, ok := w.allow(t0)
	assert.Assert(t, ok)
	assert.Equal(t, n, 0)
	for i := 1; i <= 148; i++ {
		_, ok := w.allow(t0.Add(time.Duration(i) * time.Millisecond))
		assert.Assert(t, !ok, "event %d logged", i)
	}
	n, ok = w.allow(t0.Add(warnEvery))
	assert.Assert(t, ok)
	assert.Equal(t, n, 148)
}
