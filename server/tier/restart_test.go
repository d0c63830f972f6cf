package tier_test

import (
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/mooncake/mctest"
	"github.com/kvshim/kvshim/server/l2/redis/redisserver"
	"github.com/kvshim/kvshim/server/tier"
)

func startRedis(t *testing.T) *redisserver.Server {
	t.Helper()
	s, err := redisserver.Start(t.TempDir())
	if errors.Is(err, redisserver.ErrNoBinary) {
		t.Skip(err.Error())
	}
	assert.NilError(t, err)
	t.Cleanup(s.Kill)
	return s
}

func redisConfig(s *redisserver.Server, extra string) string {
	return fmt.Sprintf(`{"type":"redis","addrs":[%q],"dial_timeout_ms":300,"read_timeout_ms":1000,"write_timeout_ms":1000,"max_retries":0,"op_timeout_ms":3000%s}`, s.Addr, extra)
}

// A server restarted with an empty L1 answers lookups from L2: objects
// were written after COMMIT (third done), loaded into L1 staging on lookup,
// served by RETRIEVE and freed after RELEASE.
func TestRestartHitsFromL2(t *testing.T) {
	cases := map[string]func(t *testing.T) string{
		"fs": func(t *testing.T) string { return fsConfig(t.TempDir()) },
		"redis": func(t *testing.T) string {
			return redisConfig(startRedis(t), "")
		},
	}
	for name, mk := range cases {
		t.Run(name, func(t *testing.T) {
			cfg := mk(t)
			const world = 2
			hs := hashes("restart "+name, 4)
			a := newEnv(t, 4, nil, server.Options{}, cfg)
			for r := range uint32(world) {
				a.put(t, r, hs)
			}
			a.flush(t)
			s := a.st.Writer().Stats()
			assert.Equal(t, s.Saved[0], int64(2*4))
			assert.Equal(t, s.SavedBytes[0], int64(2*4*objSize))
			assert.Equal(t, a.stat(t, "kvshim_l1_commits_total"), 8.0) // L1 readable
			assert.Equal(t, a.stat(t, "kvshim_l1_pinned"), 0.0)        // writes ended
			// The three dones are separate numbers: L1 commits above, L2 saves here.
			assert.Equal(t, a.stat(t, "kvshim_l2_store_saved_objects_total{adapter="+name+"}"), 8.0)
			assert.Equal(t, a.stat(t, "kvshim_l2_store_errors_total{adapter="+name+"}"), 0.0)
			mfs, err := a.st.Registry().Gather()
			assert.NilError(t, err)
			found := 0
			for _, mf := range mfs {
				switch mf.GetName() {
				case "kvshim_l2_store_saved_objects_total", "kvshim_l2_prefetch_budget_bytes", "kvshim_l2_tasks_total":
					found++
				}
			}
			assert.Equal(t, found, 3)
			a.close(t)

			b := newEnv(t, 4, nil, server.Options{}, cfg)
			assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), 0.0)
			id, n := b.lookup(t, world, false, hs)
			assert.Equal(t, n, uint32(4))
			assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=temporary}"), 8.0)
			b.check(t, id, world, false, hs, n)
			ps := b.st.PrefetchController().Stats()
			assert.Equal(t, ps.ChunksOK[0], int64(8))
			assert.Equal(t, b.stat(t, "kvshim_l2_prefetch_chunks_total{adapter="+name+",result=ok}"), 8.0)
			assert.Equal(t, ps.Loaded, int64(1))
			// Temporary objects go with the last release; nothing is pinned in L2.
			assert.Equal(t, b.stat(t, "kvshim_l1_used_bytes"), 0.0)
			assert.Equal(t, b.stat(t, "kvshim_l1_prefetch_bytes"), 0.0)
			assert.Equal(t, b.st.L2Adapters()[0].Held(tier.Key(ns1, 0, hs[0])), 0)
			// A prompt with an unknown suffix: the prefix L2 has.
			more := append(append([]kv.Hash{}, hs[:2]...), hashes("other", 2)...)
			_, n = b.lookup(t, world, false, more)
			assert.Equal(t, n, uint32(2))
		})
	}
}

// Retain mode: loaded objects become resident, so a second lookup hits L1.
func TestRetainMakesResident(t *testing.T) {
	cfg := fsConfig(t.TempDir())
	hs := hashes("retain", 3)
	a := newEnv(t, 4, nil, server.Options{}, cfg)
	a.put(t, 0, hs)
	a.flush(t)
	a.close(t)
	b := newEnv(t, 4, func(c *server.Config) { c.L2PrefetchRetain = true }, server.Options{}, cfg)
	id, n := b.lookup(t, 1, true, hs) // MLA, one reader
	assert.Equal(t, n, uint32(3))
	b.check(t, id, 1, true, hs, n)
	assert.Equal(t, b.stat(t, "kvshim_l1_objects{state=resident}"), 3.0)
	_, n = b.lookup(t, 1, true, hs)
	assert.Equal(t, n, uint32(3))
	assert.Equal(t, b.st.PrefetchController().Stats().Loaded, int64(1)) // the second was an L1 hit
}

// Mooncake Store: no restart (its objects live in the client's segment,
// which goes with the adapter), so L1 is cleared instead.
func TestMooncakeClearedL1HitsFromL2(t *testing.T) {
	if os.Getenv(mctest.PythonEnv) == "" {
		t.Skip(mctest.PythonEnv + " is not set (a python with the Mooncake wheel, see server/l2/mooncake/doc.go)")
	}
	py, dir, err := mctest.Python()
	if err != nil {
		t.Skip(err.Error())
	}
	m, err := mctest.StartMaster(dir, t.TempDir(), 500)
	if err != nil {
		t.Skip(err.Error())
	}
	t.Cleanup(m.Stop)
	cfg := mctest.Config(py, m, 64<<20, 16<<20, "")
	hs := hashes("mooncake", 3)
	a := newEnv(t, 4, nil, server.Options{}, cfg)
	a.put(t, 0, hs)
	a.flush(t)
	assert.Equal(t, a.st.Writer().Stats().Saved[0], int64(3))
	_, err = a.st.Clear(a.sess)
	assert.NilError(t, err)
	assert.Equal(t, a.stat(t, "kvshim_l1_used_bytes"), 0.0)
	// mooncake's exists reports no size: the writer's hint is used
	id, n := a.lookup(t, 1, false, hs)
	assert.Equal(t, n, uint32(3))
	a.check(t, id, 1, false, hs, n)
}

// Config: each --l2-adapter is validated at start, naming the key.
func TestConfigValidation(t *testing.T) {
	base := server.DefaultConfig()
	cases := []struct {
		adapters []string
		policy   string
		want     string
	}{
		{[]string{`{"type":"fs"}`}, "", ""}, // base_path is checked when opened
		{[]string{`{"type":"fs","num_workers":"x"}`}, "", `key "num_workers"`},
		{[]string{`{"type":"nope"}`}, "", `key "type": "nope" is not a registered adapter type`},
		{[]string{`{"num_workers":1}`}, "", `key "type": missing`},
		{[]string{`{"type":"fs","base_path":"/a"}`, `{"type":"fs","base_path":"/b"}`}, "", `key "name": "fs" is already adapter #1's name`},
		{nil, "sometimes", `--l2-store-policy`},
	}
	for _, c := range cases {
		cfg := base
		cfg.L2Adapters, cfg.L2StorePolicy = c.adapters, c.policy
		err := cfg.Validate()
		if c.want == "" {
			assert.NilError(t, err)
			continue
		}
		assert.ErrorContains(t, err, c.want)
		assert.Assert(t, errors.Is(err, server.ErrConfig))
	}
	// Opening checks the backend's own keys.
	cfg := base
	cfg.L1SizeGB = 1.0 / 1024
	cfg.L2Adapters = []string{`{"type":"fs","bogus":1,"base_path":"/tmp/x"}`}
	_, err := server.NewCore(cfg, server.Options{})
	assert.ErrorContains(t, err, `key "bogus": unknown for type "fs"`)
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig))
	// L1 only: policy none installs no commit hook and pins nothing.
	e := newEnv(t, 1, func(c *server.Config) { c.L2StorePolicy = tier.PolicyNone }, server.Options{}, fsConfig(t.TempDir()))
	e.put(t, 0, hashes("none", 2))
	assert.Equal(t, e.stat(t, "kvshim_l1_pinned"), 0.0)
	assert.Equal(t, e.st.Writer().Stats().Pending, int64(0))
}

// server.Start registers every L1 segment with the adapters (fd + mapping).
func TestStartRegistersSegments(t *testing.T) {
	dir := t.TempDir()
	cfg := server.DefaultConfig()
	cfg.L1SizeGB = 2.0 / 1024
	cfg.SegmentSize = 1 << 20
	cfg.SlabSize = 256 << 10
	cfg.Socket = dir + "/s/kvshim.sock"
	cfg.L2Adapters = []string{faultConfig(t.TempDir())}
	srv, err := server.Start(cfg, nil, server.Options{})
	assert.NilError(t, err)
	defer func() { assert.NilError(t, srv.Close()) }()
	sess, err := srv.Core.OpenSession([16]byte{9})
	assert.NilError(t, err)
	_, err = srv.Core.Alloc(sess, allocReq(hashes("seg", 20)))
	assert.NilError(t, err)
	fb := srv.Core.L2Adapters()[0].Backend().(*faultBackend)
	testkit.Eventually(t, 20*time.Second, "2 segment registrations", func() bool {
		fb.mu.Lock()
		defer fb.mu.Unlock()
		return len(fb.segFDs) == 2
	})
}
