package server

import (
	"errors"
	"strings"
	"testing"
	"time"

	"gotest.tools/v3/assert"
)

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		name  string
		tweak func(*Config)
		want  string // substring of the error; "" = valid
	}{
		{"defaults", func(*Config) {}, ""},
		{"lru any case", func(c *Config) { c.EvictionPolicy = "lru" }, ""},
		{"policy", func(c *Config) { c.EvictionPolicy = "S3FIFO" }, `--eviction-policy "S3FIFO" is not supported (only LRU)`},
		{"size zero", func(c *Config) { c.L1SizeGB = 0 }, "--l1-size-gb must be > 0"},
		{"size negative", func(c *Config) { c.L1SizeGB = -1 }, "--l1-size-gb must be > 0"},
		{"size tiny", func(c *Config) { c.L1SizeGB = 1e-9 }, "smaller than one 4 KiB page"},
		{"high > 1", func(c *Config) { c.HighWatermark = 1.5 }, "--l1-high-watermark must be in (0, 1]"},
		{"low >= high", func(c *Config) { c.HighWatermark, c.LowWatermark = 0.5, 0.5 }, "must be below --l1-high-watermark"},
		{"low negative", func(c *Config) { c.LowWatermark = -0.1 }, "--l1-low-watermark must be in [0, 1)"},
		{"ttl", func(c *Config) { c.HoldTTL = 0 }, "--hold-ttl must be > 0"},
		{"port", func(c *Config) { c.MetricsPort = 70000 }, "--metrics-port must be in [0, 65535]"},
		{"segment", func(c *Config) { c.SegmentSize = 1000 }, "segment size 1000 is not a multiple of 4 KiB"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.tweak(&c)
			err := c.Validate()
			if tc.want == "" {
				assert.NilError(t, err)
				return
			}
			assert.Assert(t, errors.Is(err, ErrConfig))
			assert.ErrorContains(t, err, tc.want)
			_, err = NewCore(c, Options{})
			assert.Assert(t, errors.Is(err, ErrConfig))
		})
	}
	// Several problems are reported together.
	c := Config{EvictionPolicy: "ARC"}
	err := c.Validate()
	assert.Assert(t, strings.Count(err.Error(), ";") >= 3, err.Error())
}

func TestConfigDefaults(t *testing.T) {
	c := DefaultConfig()
	c.L1SizeGB = 0.5
	d := c.withDefaults()
	assert.Equal(t, d.SegmentSize, uint64(GiB/2)) // capped by L1
	assert.Equal(t, d.SlabSize, uint64(DefaultSlabSize))
	assert.Equal(t, d.StagingTTL, DefaultHoldTTL)
	assert.Equal(t, d.ReapInterval, time.Minute)
}
