package mooncake_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/mooncake"
	"github.com/kvshim/kvshim/server/l2/mooncake/mctest"
)

// env starts a master; it skips (with the exact reason) when the wheel or
// the master is not installed.
func env(t *testing.T, leaseMS int) (string, *mctest.Master) {
	t.Helper()
	py, dir, err := mctest.Python()
	if err != nil {
		t.Skip(err.Error())
	}
	m, err := mctest.StartMaster(dir, t.TempDir(), leaseMS)
	if err != nil {
		t.Skip(err.Error())
	}
	t.Cleanup(m.Stop)
	return py, m
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
	k.Hash[0], k.Hash[1], k.Namespace[3] = byte(i), byte(i>>8), 0x77
	return k
}

func payload(i, n int) []byte {
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i*3 + j)
	}
	return b
}

func wait(t *testing.T, task *l2.Task) []l2.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := task.Wait(ctx)
	assert.NilError(t, err)
	return res
}

func TestRoundTripBounceAndSegment(t *testing.T) {
	py, m := env(t, 500)
	// a tiny bounce area forces the batch to be split into parts
	a := open(t, mctest.Config(py, m, 64<<20, 16<<20, `,"bounce_buffer_size":262144,
		"num_workers":2,"per_op_workers":{"lookup":1}`))
	ctx := context.Background()
	const n, size = 10, 100 << 10
	keys := make([]l2.Key, n)
	src := make([][]byte, n)
	for i := range keys {
		keys[i], src[i] = key(i), payload(i, size)
	}
	for _, r := range wait(t, a.Store(ctx, keys[:6], src[:6])) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	// immutable: put of an existing key is success
	assert.Equal(t, wait(t, a.Store(ctx, keys[:1], [][]byte{make([]byte, size)}))[0].Status, l2.StatusOK)

	look := a.LookupAndHold(ctx, keys)
	wait(t, look)
	assert.Equal(t, look.Bitmap().Prefix(), 6)
	assert.Equal(t, look.Bitmap().Count(), 6)
	a.Release(keys)

	// loads into a registered shared-memory segment (zero copy) ...
	seg := registerSegment(t, a, 4<<20)
	dst := make([][]byte, n)
	for i := range dst {
		dst[i] = seg[i*size : (i+1)*size]
	}
	res := wait(t, a.Load(ctx, keys, dst))
	for i, r := range res {
		if i < 6 {
			assert.Equal(t, r.Status, l2.StatusOK, "%d: %v", i, r.Err)
			assert.Assert(t, bytes.Equal(dst[i], src[i]), "key %d", i)
		} else {
			assert.Equal(t, r.Status, l2.StatusMiss, "%d: %v", i, r.Err)
		}
	}
	// ... and into plain Go memory (bounce copy)
	plain := [][]byte{make([]byte, size)}
	assert.Equal(t, wait(t, a.Load(ctx, keys[2:3], plain))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(plain[0], src[2]))

	// the lookup above granted a lease (500 ms): a remove right away fails
	// with OBJECT_HAS_LEASE, after it expires it succeeds
	wait(t, a.LookupAndHold(ctx, keys[:1]))
	a.Release(keys[:1])
	del := wait(t, a.Delete(ctx, keys[:1]))
	assert.Equal(t, del[0].Status, l2.StatusFailed)
	assert.Assert(t, is.Contains(del[0].Err.Error(), "OBJECT_HAS_LEASE"))
	time.Sleep(700 * time.Millisecond)
	del = wait(t, a.Delete(ctx, keys[:1]))
	assert.Equal(t, del[0].Status, l2.StatusOK, "%v", del[0].Err)
	assert.Equal(t, wait(t, a.Delete(ctx, keys[9:10]))[0].Status, l2.StatusMiss)
}

func registerSegment(t *testing.T, a *l2.Adapter, size int) []byte {
	t.Helper()
	fd, err := unix.MemfdCreate("l1-test", unix.MFD_CLOEXEC)
	assert.NilError(t, err)
	assert.NilError(t, unix.Ftruncate(fd, int64(size)))
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	assert.NilError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem); _ = unix.Close(fd) })
	assert.NilError(t, a.Backend().(*mooncake.Backend).RegisterL1Segment(fd, mem))
	return mem
}

// The helper dies: pending and immediate later keys fail (no hang); after
// the restart interval the helper is restarted and works again.
func TestHelperDeathFailsKeysThenRestarts(t *testing.T) {
	py, m := env(t, 500)
	a := open(t, mctest.Config(py, m, 32<<20, 16<<20, ""))
	b := a.Backend().(*mooncake.Backend)
	old := b.Pid()
	assert.NilError(t, unix.Kill(old, unix.SIGKILL))
	start := time.Now()
	res := wait(t, a.LookupAndHold(context.Background(), []l2.Key{key(1), key(2)}))
	for _, r := range res {
		assert.Equal(t, r.Status, l2.StatusFailed)
		assert.Assert(t, errors.Is(r.Err, l2.ErrUnavailable), "%v", r.Err)
	}
	assert.Assert(t, time.Since(start) < 5*time.Second)

	time.Sleep(2100 * time.Millisecond)
	ctx := context.Background()
	k := key(42)
	src := payload(42, 4096)
	// The master keeps the dead helper's segment until that client's
	// liveness TTL runs out (client_live_ttl_sec, 10 s by default); a put
	// it places there fails with TRANSFER_FAIL, per key, and a retry after
	// the master drops the segment succeeds.
	var st []l2.Result
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		st = wait(t, a.Store(ctx, []l2.Key{k}, [][]byte{src}))
		if st[0].Status == l2.StatusOK || time.Now().After(deadline) {
			break
		}
		assert.ErrorContains(t, st[0].Err, "TRANSFER_FAIL")
	}
	assert.Equal(t, st[0].Status, l2.StatusOK, "%v", st[0].Err)
	assert.Assert(t, b.Pid() != old && b.Pid() != 0)
	dst := make([]byte, len(src))
	ld := wait(t, a.Load(ctx, []l2.Key{k}, [][]byte{dst}))
	assert.Equal(t, ld[0].Status, l2.StatusOK, "%v", ld[0].Err)
	assert.Assert(t, bytes.Equal(dst, src))
}

func TestConfig(t *testing.T) {
	for _, tc := range []struct{ json, key string }{
		{`{"type":"mooncake_store","metadata_server":"P2PHANDSHAKE"}`, `"local_hostname"`},
		{`{"type":"mooncake_store","local_hostname":"h"}`, `"metadata_server"`},
		{`{"type":"mooncake_store","local_hostname":"h","metadata_server":"P2PHANDSHAKE",
			"master_server_address":"x:1"}`, `"master_server_address"`},
		{`{"type":"mooncake_store","local_hostname":"h","metadata_server":"P2PHANDSHAKE",
			"bounce_buffer_size":10}`, `"bounce_buffer_size"`},
	} {
		_, err := l2.OpenJSON(tc.json, l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", tc.json, err)
		assert.Assert(t, is.Contains(err.Error(), tc.key))
	}
}
