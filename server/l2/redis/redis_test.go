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

	"github.com/kvshim/kvshim/server/l2"
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

func open(t *testing.T, cfg string) *l2.Adapter {
	t.Helper()
	a, err := l2.OpenJSON(cfg, l2.Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, a.Close()) })
	return a
}

func key(i int) l2.Key {
	k := l2.Key{Rank: uint32(i)}
	k.Hash[0], k.Hash[1], k.Hash[2] = byte(i), byte(i>>8), 0xee
	return k
}

// payload is binary: zeros, CR LF and every byte value.
func payload(i, n int) []byte {
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i + j)
	}
	copy(b, "\r\n\x00$-1\r\n")
	return b
}

func wait(t *testing.T, task *l2.Task) []l2.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := task.Wait(ctx)
	assert.NilError(t, err)
	return res
}

func roundTrip(t *testing.T, a *l2.Adapter, n, size int) {
	t.Helper()
	ctx := context.Background()
	keys := make([]l2.Key, n)
	src := make([][]byte, n)
	for i := range keys {
		keys[i], src[i] = key(i), payload(i, size)
	}
	half := n / 2
	for _, r := range wait(t, a.Store(ctx, keys[:half], src[:half])) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	// immutable: a second store of other bytes is success and changes nothing
	wait(t, a.Store(ctx, keys[:1], [][]byte{make([]byte, size)}))
	look := a.LookupAndHold(ctx, keys)
	wait(t, look)
	assert.Equal(t, look.Bitmap().Prefix(), half)
	assert.Equal(t, look.Bitmap().Count(), half)
	a.Release(keys)
	dst := make([][]byte, n)
	for i := range dst {
		dst[i] = make([]byte, size)
	}
	res := wait(t, a.Load(ctx, keys, dst))
	for i, r := range res {
		if i < half {
			assert.Equal(t, r.Status, l2.StatusOK, "%d: %v", i, r.Err)
			assert.Assert(t, bytes.Equal(dst[i], src[i]), "key %d", i)
		} else {
			assert.Equal(t, r.Status, l2.StatusMiss, "%d", i)
		}
	}
	short := wait(t, a.Load(ctx, keys[1:2], [][]byte{make([]byte, size-1)}))
	assert.Assert(t, errors.Is(short[0].Err, l2.ErrBufferSize))
	del := wait(t, a.Delete(ctx, keys[:half+1]))
	assert.Equal(t, del[0].Status, l2.StatusOK)
	assert.Equal(t, del[half].Status, l2.StatusMiss)
	assert.Equal(t, l2.BitmapOf(wait(t, a.LookupAndHold(ctx, keys))).Count(), 0)
}

func TestRoundTrip(t *testing.T) {
	s := startRedis(t)
	a := open(t, fmt.Sprintf(`{"type":"redis","addrs":[%q],"num_workers":2,
		"per_op_workers":{"lookup":1,"retrieve":2},"key_prefix":"t:"}`, s.Addr))
	roundTrip(t, a, 40, 70<<10)
}

func TestLMCacheHostPort(t *testing.T) {
	s := startRedis(t)
	a := open(t, fmt.Sprintf(`{"type":"redis","host":"127.0.0.1","port":%d}`, s.Port))
	roundTrip(t, a, 6, 1000)
}

func TestCluster(t *testing.T) {
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
	a := open(t, fmt.Sprintf(`{"type":"redis","addrs":[%s],"num_workers":3}`, strings.Join(addrs, ",")))
	roundTrip(t, a, 60, 4096)
}

// Redis dies while a load is in flight: every key of that load reports
// failed (not miss, not a hang), and later operations fail fast.
func TestKilledMidLoad(t *testing.T) {
	s := startRedis(t)
	a := open(t, fmt.Sprintf(`{"type":"redis","addrs":%q,"num_workers":4,"op_timeout_ms":5000,
		"read_timeout_ms":4000,"dial_timeout_ms":500}`, s.Addr))
	const n, size = 32, 256 << 10
	keys := make([]l2.Key, n)
	src := make([][]byte, n)
	dst := make([][]byte, n)
	for i := range keys {
		keys[i], src[i], dst[i] = key(i), payload(i, size), make([]byte, size)
	}
	for _, r := range wait(t, a.Store(context.Background(), keys, src)) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	s.Pause() // replies stop: the load below is in flight when the kill comes
	start := time.Now()
	ld := a.Load(context.Background(), keys, dst)
	time.Sleep(150 * time.Millisecond)
	s.Kill()
	res := wait(t, ld)
	elapsed := time.Since(start)
	for i, r := range res {
		assert.Equal(t, r.Status, l2.StatusFailed, "key %d", i)
		assert.Assert(t, errors.Is(r.Err, l2.ErrUnavailable), "%v", r.Err)
		assert.Assert(t, is.Contains(r.Err.Error(), keys[i].String()))
	}
	assert.Assert(t, elapsed < 3*time.Second, "load took %v after the kill", elapsed)

	start = time.Now()
	look := wait(t, a.LookupAndHold(context.Background(), keys[:4]))
	for _, r := range look {
		assert.Equal(t, r.Status, l2.StatusFailed)
	}
	assert.Assert(t, time.Since(start) < 3*time.Second)
}

// A hung (stopped) server: keys fail at the task deadline.
func TestHungServerTimesOut(t *testing.T) {
	s := startRedis(t)
	a := open(t, fmt.Sprintf(`{"type":"redis","addrs":%q,"op_timeout_ms":300}`, s.Addr))
	wait(t, a.Store(context.Background(), []l2.Key{key(1)}, [][]byte{payload(1, 10)}))
	s.Pause()
	start := time.Now()
	res := wait(t, a.LookupAndHold(context.Background(), []l2.Key{key(1), key(2)}))
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
