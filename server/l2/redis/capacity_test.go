package redis_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/l2test"
	"github.com/kvshim/kvshim/server/l2/redis"
	"github.com/kvshim/kvshim/server/l2/redis/redisserver"
)

// Capacity: "ttl_s", and a Redis that is full (doc.go, "Capacity").

// pttl is the key's remaining life in ms (-1: no expiry, -2: absent).
func pttl(t *testing.T, s *redisserver.Server, k kv.Key) int {
	t.Helper()
	reply, err := s.Command("PTTL", k.String())
	assert.NilError(t, err)
	assert.Assert(t, strings.HasPrefix(reply, ":"), "PTTL: %q", reply)
	n, err := strconv.Atoi(reply[1:])
	assert.NilError(t, err)
	return n
}

func TestTTL(t *testing.T) {
	s := startRedis(t)
	ctx := context.Background()
	plain := l2test.Open(t, fmt.Sprintf(`{"type":"redis","addrs":[%q]}`, s.Addr))
	l2test.Wait(t, plain.Store(ctx, []kv.Key{l2test.Key(1)}, [][]byte{l2test.Payload(1, 1000)}))
	assert.Equal(t, pttl(t, s, l2test.Key(1)), -1, "without ttl_s objects do not expire")

	a := l2test.Open(t, fmt.Sprintf(`{"type":"redis","addrs":[%q],"ttl_s":2}`, s.Addr))
	keys := []kv.Key{l2test.Key(2), l2test.Key(3)}
	for _, r := range l2test.Wait(t, a.Store(ctx, keys, [][]byte{l2test.Payload(2, 1000), l2test.Payload(3, 1000)})) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	for _, k := range keys {
		ms := pttl(t, s, k)
		assert.Assert(t, ms > 0 && ms <= 2000, "PTTL %d", ms)
	}
	// A hit extends the life to ttl_s from now; a lookup does not.
	time.Sleep(1200 * time.Millisecond)
	l2test.Wait(t, a.LookupAndHold(ctx, keys))
	a.Release(keys)
	dst := make([]byte, 1000)
	res := l2test.Wait(t, a.Load(ctx, keys[:1], [][]byte{dst}))
	assert.Equal(t, res[0].Status, l2.StatusOK, "%v", res[0].Err)
	assert.Assert(t, bytes.Equal(dst, l2test.Payload(2, 1000)))
	assert.Assert(t, pttl(t, s, keys[0]) > 1500, "the hit did not extend the life")
	assert.Assert(t, pttl(t, s, keys[1]) < 900, "the lookup extended the life")
	// Expired: a miss, and the key can be stored again.
	time.Sleep(1000 * time.Millisecond)
	look := a.LookupAndHold(ctx, keys)
	l2test.Wait(t, look)
	assert.Equal(t, l2.BitmapOf(look.Results()).Count(), 1)
	assert.Equal(t, look.Results()[1].Status, l2.StatusMiss)
	res = l2test.Wait(t, a.Load(ctx, keys[1:], [][]byte{dst}))
	assert.Equal(t, res[0].Status, l2.StatusMiss)
	assert.Equal(t, l2test.Wait(t, a.Store(ctx, keys[1:], [][]byte{l2test.Payload(3, 1000)}))[0].Status, l2.StatusOK)
	assert.Equal(t, pttl(t, s, keys[1]) > 0, true)
}

// countingHandler counts WARN records.
type countingHandler struct {
	mu    sync.Mutex
	warns []string
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.mu.Lock()
		h.warns = append(h.warns, r.Message)
		h.mu.Unlock()
	}
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func (h *countingHandler) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.warns)
}

// A Redis started with a small maxmemory and the noeviction policy
// answers OOM once full. Each such store is a failed key wrapping ErrOOM
// (not ErrUnavailable), counted; for a second after, stores fail without
// being sent; one WARN, not one per key; reads and deletes keep working,
// and once there is room stores succeed again.
func TestOOMIsAFailedStoreNotAStorm(t *testing.T) {
	s, err := redisserver.Start(t.TempDir(), "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
	if errors.Is(err, redisserver.ErrNoBinary) {
		t.Skip(err.Error())
	}
	assert.NilError(t, err)
	t.Cleanup(s.Kill)
	h := &countingHandler{}
	a, err := l2.OpenJSON(fmt.Sprintf(`{"type":"redis","addrs":[%q],"num_workers":2}`, s.Addr), l2.Options{Logger: slog.New(h)})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, a.Close()) })
	b := a.Backend().(*redis.Backend)
	ctx := context.Background()
	const size = 256 << 10
	var stored, failed []kv.Key
	for batch := range 12 { // 12 MiB into 4 MiB
		keys := make([]kv.Key, 4)
		bufs := make([][]byte, 4)
		for i := range keys {
			keys[i], bufs[i] = l2test.Key(batch*4+i), l2test.Payload(batch*4+i, size)
		}
		for i, r := range l2test.Wait(t, a.Store(ctx, keys, bufs)) {
			switch r.Status {
			case l2.StatusOK:
				stored = append(stored, keys[i])
			default:
				assert.Assert(t, errors.Is(r.Err, redis.ErrOOM), "%v", r.Err)
				assert.Assert(t, !errors.Is(r.Err, l2.ErrUnavailable), "%v", r.Err)
				failed = append(failed, keys[i])
			}
		}
	}
	st := b.Stats()
	t.Logf("stored %d, failed %d, %+v", len(stored), len(failed), st)
	assert.Assert(t, len(stored) >= 4 && len(failed) >= 16, "stored %d, failed %d", len(stored), len(failed))
	assert.Assert(t, st.OOM >= 1)
	assert.Equal(t, st.OOM+st.OOMSkipped, int64(len(failed)))
	assert.Assert(t, st.OOMSkipped > 0, "no store was held back after an OOM answer")
	// The adapter exports the same counters (STATS, /metrics).
	got := map[string]float64{}
	for _, s := range a.Samples() {
		got[s.StatName()] = s.Value
	}
	assert.Equal(t, got["kvshim_l2_redis_oom_total{adapter=redis}"], float64(st.OOM))
	assert.Equal(t, got["kvshim_l2_redis_oom_skipped_total{adapter=redis}"], float64(st.OOMSkipped))
	assert.Equal(t, h.count(), 1, "WARN lines: %v", h.warns)
	assert.Assert(t, is.Contains(h.warns[0], "Redis is full"))

	// Reads work while Redis is full.
	look := a.LookupAndHold(ctx, stored)
	l2test.Wait(t, look)
	assert.Equal(t, look.Bitmap().Count(), len(stored))
	a.Release(stored)
	dst := make([]byte, size)
	res := l2test.Wait(t, a.Load(ctx, stored[:1], [][]byte{dst}))
	assert.Equal(t, res[0].Status, l2.StatusOK, "%v", res[0].Err)
	assert.Assert(t, bytes.Equal(dst, l2test.Payload(int(stored[0].Hash[0])|int(stored[0].Hash[1])<<8, size)))
	// Room again (deletes work when full): after the backoff, stores succeed.
	for _, r := range l2test.Wait(t, a.Delete(ctx, stored)) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	time.Sleep(redis.OOMBackoff + 100*time.Millisecond)
	res = l2test.Wait(t, a.Store(ctx, failed[:2], [][]byte{l2test.Payload(1, size), l2test.Payload(2, size)}))
	for _, r := range res {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
}

func TestEvictionKeyRefused(t *testing.T) {
	_, err := l2.OpenJSON(`{"type":"redis","addrs":["127.0.0.1:1"],"eviction":{"eviction_policy":"LRU"}}`, l2.Options{})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.Assert(t, is.Contains(err.Error(), `"eviction"`))
	assert.Assert(t, is.Contains(err.Error(), "maxmemory-policy"))
	for _, bad := range []string{`-1`, `"60"`, `1.5`} {
		_, err := l2.OpenJSON(`{"type":"redis","addrs":["127.0.0.1:1"],"ttl_s":`+bad+`}`, l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", bad, err)
		assert.Assert(t, is.Contains(err.Error(), `"ttl_s"`))
	}
}

// An L2 Redis that cannot be reached is said in the log at open, once.
func TestUnreachableRedisIsLogged(t *testing.T) {
	h := &countingHandler{}
	a, err := l2.OpenJSON(`{"type":"redis","addrs":["127.0.0.1:1"],"num_workers":1}`, l2.Options{Logger: slog.New(h)})
	assert.NilError(t, err)
	defer a.Close()
	testkit.Eventually(t, 8*time.Second, "a warning for an unreachable Redis", func() bool { return h.count() > 0 })
	h.mu.Lock()
	defer h.mu.Unlock()
	assert.Equal(t, len(h.warns), 1)
	assert.Assert(t, strings.Contains(h.warns[0], "cannot reach Redis"), h.warns[0])
}
