package l2_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/server/l2"
)

func TestParseAdapterConfig(t *testing.T) {
	c, err := l2.ParseAdapterConfig(`{"type":"mooncake_store","num_workers":4,
		"per_op_workers":{"lookup":1,"retrieve":1,"store":2},"op_timeout_ms":2500,
		"eviction":{"eviction_policy":"LRU"},"local_hostname":"node01","global_segment_size":3221225472}`)
	assert.NilError(t, err)
	assert.Equal(t, c.Type, "mooncake_store")
	assert.Equal(t, c.Name, "mooncake_store")
	assert.Equal(t, c.OpTimeout, 2500*time.Millisecond)
	assert.Equal(t, c.Lanes.String(), "shared=4 lookup=1 retrieve=1 store=2")
	assert.Equal(t, c.Lanes.Workers(l2.OpDelete), 4)
	assert.Equal(t, c.Lanes.Total(), 8)
	rest := c.Extras().Rest()
	assert.DeepEqual(t, rest, map[string]string{"local_hostname": "node01", "global_segment_size": "3221225472"})
}

func TestParseAdapterConfigRefuses(t *testing.T) {
	for _, tc := range []struct{ name, json, key string }{
		{"not object", `[1]`, "not a JSON object"},
		{"trailing", `{"type":"fs"} {}`, "trailing"},
		{"no type", `{"num_workers":2}`, `"type"`},
		{"type not string", `{"type":3}`, `"type"`},
		{"unknown lane", `{"type":"fs","per_op_workers":{"lookupp":1}}`, `"per_op_workers.lookupp"`},
		{"zero lane", `{"type":"fs","per_op_workers":{"store":0}}`, `"per_op_workers.store"`},
		{"negative lane", `{"type":"fs","per_op_workers":{"delete":-1}}`, `"per_op_workers.delete"`},
		{"fractional lane", `{"type":"fs","per_op_workers":{"lookup":1.5}}`, `"per_op_workers.lookup"`},
		{"zero shared", `{"type":"fs","num_workers":0,"per_op_workers":{"lookup":1}}`, "num_workers"},
		{"bad workers", `{"type":"fs","num_workers":"4"}`, `"num_workers"`},
		{"bad timeout", `{"type":"fs","op_timeout_ms":0}`, `"op_timeout_ms"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := l2.ParseAdapterConfig(tc.json)
			assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
			assert.Assert(t, is.Contains(err.Error(), tc.key))
		})
	}
}

func TestAllLanesDedicatedNeedsNoSharedPool(t *testing.T) {
	c, err := l2.ParseAdapterConfig(`{"type":"fs","num_workers":0,
		"per_op_workers":{"lookup":1,"retrieve":2,"store":3,"delete":1}}`)
	assert.NilError(t, err)
	assert.Equal(t, c.Lanes.Total(), 7)
}

func TestOpenUnknownType(t *testing.T) {
	_, err := l2.OpenJSON(`{"type":"nope"}`, l2.Options{})
	assert.Assert(t, errors.Is(err, l2.ErrUnknownType))
	assert.Assert(t, strings.Contains(err.Error(), `"nope"`))
}

func TestExtrasRefusesUnknownKey(t *testing.T) {
	c, err := l2.ParseAdapterConfig(`{"type":"x","base_path":"/tmp","bogus":1,"another":2}`)
	assert.NilError(t, err)
	ex := c.Extras()
	var p string
	ex.String("base_path", &p)
	err = ex.Done()
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig))
	assert.Assert(t, is.Contains(err.Error(), `key "another"`))
}

func FuzzParseAdapterConfig(f *testing.F) {
	f.Add(`{"type":"fs","base_path":"/x","num_workers":2,"per_op_workers":{"lookup":1}}`)
	f.Add(`{"type":"redis","per_op_workers":{"store":-1}}`)
	f.Add(`{}`)
	f.Add(`null`)
	f.Fuzz(func(t *testing.T, s string) {
		c, err := l2.ParseAdapterConfig(s)
		if err != nil {
			if !errors.Is(err, l2.ErrBadConfig) {
				t.Fatalf("error not wrapping ErrBadConfig: %v", err)
			}
			return
		}
		if c.Type == "" || c.Lanes.Validate() != nil {
			t.Fatalf("accepted invalid config %q", s)
		}
	})
}
