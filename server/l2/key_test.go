package l2_test

import (
	"testing"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/server/l2"
)

func TestBitmapPrefix(t *testing.T) {
	for _, tc := range []struct {
		n      int
		set    []int
		prefix int
		count  int
	}{
		{0, nil, 0, 0},
		{4, []int{0, 1, 3}, 2, 3},
		{70, seq(70), 70, 70},
		{130, seq(65), 65, 65},
		{64, seq(64), 64, 64},
	} {
		b := l2.NewBitmap(tc.n)
		for _, i := range tc.set {
			b.Set(i)
		}
		assert.Equal(t, b.Prefix(), tc.prefix)
		assert.Equal(t, b.Count(), tc.count)
	}
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}
