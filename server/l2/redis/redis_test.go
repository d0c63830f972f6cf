package redis_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/l2test"
	_ "github.com/kvshim/kvshim/server/l2/redis"
	"github.com/kvshim/kvshim/server/l2/redis/redisserver"
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

func TestContract(t *testing.T) {
	for _, tc := range []struct {
		name  string
		start func(t *testing.T) string // a Redis config for a fresh server
	}{
		{"one server", func(t *testing.T) string {
			s := startRedis(t)
			return fmt.Sprintf(`{"type":"redis","addrs":[%q],"num_workers":2,
				"per_op_workers":{"lookup":1,"retrieve":2},"key_prefix":"t:"}`, s.Addr)
		}},
		{"LMCache host and port", func(t *testing.T) string {
			s := startRedis(t)
			return fmt.Sprintf(`{"type":"redis","host":"127.0.0.1","port":%d}`, s.Port)
		}},
		{"cluster", func(t *testing.T) string {
			if _, err := redisserver.Binary(); err != nil {
				t.Skip(err.Error())
			}
			srvs, err := redisserver.Cluster(t.TempDir(), 3)
			assert.NilError(t, err)
			addrs := make([]string, len(srvs))
			for i, s := range srvs {
				addrs[i] = fmt.Sprintf("%q", s.Addr)
				t.Cleanup(s.Kill)
			}
			return fmt.Sprintf(`{"type":"redis","addrs":[%s],"num_workers":3}`, strings.Join(addrs, ","))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.start(t)
			// Redis has no per-key store fault (any key name is accepted):
			// no BreakStore.
			l2test.Run(t, l2test.Target{Open: func(t testing.TB) *l2.Adapter { return l2test.Open(t, cfg) }})
		})
	}
}

// SET NX: a second store of other bytes is success and changes nothing
// (the contract requires only that a key always names the same bytes).
func TestStoreKeepsTheFirstBytes(t *testing.T) {
	s := startRedis(t)
	a := l2test.Open(t, fmt.Sprintf(`{"type":"redis","addrs":[%q]}`, s.Addr))
	ctx := context.Background()
	k := []kv.Key{l2test.Key(1)}
	src := l2test.Payload(1, 1000)
	assert.Equal(t, l2test.Wait(t, a.Store(ctx, k, [][]byte{src}))[0].Status, l2.StatusOK)
	assert.Equal(t, l2test.Wait(t, a.Store(ctx, k, [][]byte{make([]byte, len(src))}))[0].Status, l2.StatusOK)
	dst := make([]byte, len(src))
	assert.Equal(t, l2test.Wait(t, a.Load(ctx, k, [][]byte{dst}))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(dst, src))
}

// Redis dies while a load is in flight: every key of that load reports
// failed (not miss, not a hang), and later operations fail fast.
func TestKilledMidLoad(t *testing.T) {
	s := startRedis(t)
	a := l2test.Open(t, fmt.Sprintf(`{"type":"redis","addrs":%q,"num_workers":4,"op_timeout_ms":5000,
		"read_timeout_ms":4000,"dial_timeout_ms":500}`, s.Addr))
	const n, size = 32, 256 << 10
	keys := make([]kv.Key, n)
	src := make([][]byte, n)
	dst := make([][]byte, n)
	for i := range keys {
		keys[i], src[i], dst[i] = l2test.Key(i), l2test.Payload(i, size), make([]byte, size)
	}
	for _, r := range l2test.Wait(t, a.Store(context.Background(), keys, src)) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	s.Pause() // replies stop: the load below is in flight when the kill comes
	start := time.Now()
	ld := a.Load(context.Background(), keys, dst)
	time.Sleep(150 * time.Millisecond)
	s.Kill()
	res := l2test.Wait(t, ld)
	elapsed := time.Since(start)
	for i, r := range res {
		assert.Equal(t, r.Status, l2.StatusFailed, "key %d", i)
		assert.Assert(t, errors.Is(r.Err, l2.ErrUnavailable), "%v", r.Err)
		assert.Assert(t, is.Contains(r.Err.Error(), keys[i].String()))
	}
	assert.Assert(t, elapsed < 3*time.Second, "load took %v after the kill", elapsed)

	start = time.Now()
	look := l2test.Wait(t, a.LookupAndHold(context.Background(), keys[:4]))
	for _, r := range look {
		assert.Equal(t, r.Status, l2.StatusFailed)
	}
	assert.Assert(t, time.Since(start) < 3*time.Second)
}

// A hung (stopped) server: keys fail at the task deadline.
func TestHungServerTimesOut(t *testing.T) {
	s := startRedis(t)
	a := l2test.Open(t, fmt.Sprintf(`{"type":"redis","addrs":%q,"op_timeout_ms":300}`, s.Addr))
	l2test.Wait(t, a.Store(context.Background(), []kv.Key{l2test.Key(1)}, [][]byte{l2test.Payload(1, 10)}))
	s.Pause()
	start := time.Now()
	res := l2test.Wait(t, a.LookupAndHold(context.Background(), []kv.Key{l2test.Key(1), l2test.Key(2)}))
	assert.Equal(t, res[0].Status, l2.StatusFailed)
	assert.Equal(t, res[1].Status, l2.StatusFailed)
	assert.Assert(t, time.Since(start) < 3*time.Second, "took %v", time.Since(start))
}

func TestConfigRefused(t *testing.T) {
	for _, tc := range []struct{ json, key string }{
		{`{"type":"redis"}`, `"addrs"`},
		{`{"type":"redis","addrs":["a:1"],"host":"b"}`, `"host"`},
		{`{"type":"redis","host":"b","port":70000}`, `"port"`},
		{`{"type":"redis","addrs":["a:1"],"pasword":"x"}`, `"pasword"`},
	} {
		_, err := l2.OpenJSON(tc.json, l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", tc.json, err)
		assert.Assert(t, is.Contains(err.Error(), tc.key))
	}
}
