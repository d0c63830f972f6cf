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

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/l2test"
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

// leaseMS is the masters' default_kv_lease_ttl: short, so that the
// contract's delete after a lookup waits little.
const leaseMS = 500

func TestMooncakeContract(t *testing.T) {
	py, m := env(t, leaseMS)
	l2test.Run(t, l2test.Target{
		Open: func(t testing.TB) *l2.Adapter {
			// a small bounce area: batches are split into parts
			return l2test.Open(t, mctest.Config(py, m, 32<<20, 16<<20, `,"bounce_buffer_size":1048576,
				"num_workers":2,"per_op_workers":{"lookup":1}`))
		},
		// Mooncake's read lease: see l2test.Target.Lease.
		Lease: leaseMS * time.Millisecond,
		// A Mooncake key is a name on the master, which accepts any: no
		// per-key store fault, no BreakStore.
	})
}

func TestRoundTripBounceAndSegment(t *testing.T) {
	py, m := env(t, leaseMS)
	// a tiny bounce area forces the batch to be split into parts
	a := l2test.Open(t, mctest.Config(py, m, 64<<20, 16<<20, `,"bounce_buffer_size":262144,
		"num_workers":2,"per_op_workers":{"lookup":1}`))
	ctx := context.Background()
	const n, size = 10, 100 << 10
	keys := make([]kv.Key, n)
	src := make([][]byte, n)
	for i := range keys {
		keys[i], src[i] = l2test.Key(i), l2test.Payload(i, size)
	}
	for _, r := range l2test.Wait(t, a.Store(ctx, keys[:6], src[:6])) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	// loads into a registered shared-memory segment (zero copy) ...
	seg := registerSegment(t, a, 4<<20)
	dst := make([][]byte, n)
	for i := range dst {
		dst[i] = seg[i*size : (i+1)*size]
	}
	res := l2test.Wait(t, a.Load(ctx, keys, dst))
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
	assert.Equal(t, l2test.Wait(t, a.Load(ctx, keys[2:3], plain))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(plain[0], src[2]))

	// a lookup grants a lease (500 ms): a remove right away fails with
	// OBJECT_HAS_LEASE, and once it expires one succeeds (polled: the lease
	// has no event to wait for)
	l2test.Wait(t, a.LookupAndHold(ctx, keys[:1]))
	a.Release(keys[:1])
	del := l2test.Wait(t, a.Delete(ctx, keys[:1]))
	assert.Equal(t, del[0].Status, l2.StatusFailed)
	assert.Assert(t, is.Contains(del[0].Err.Error(), "OBJECT_HAS_LEASE"))
	for deadline := time.Now().Add(l2test.LeaseSlack); del[0].Status == l2.StatusFailed && time.Now().Before(deadline); {
		assert.Assert(t, is.Contains(del[0].Err.Error(), "OBJECT_HAS_LEASE"))
		time.Sleep(100 * time.Millisecond)
		del = l2test.Wait(t, a.Delete(ctx, keys[:1]))
	}
	assert.Equal(t, del[0].Status, l2.StatusOK, "%v", del[0].Err)
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
	py, m := env(t, leaseMS)
	a := l2test.Open(t, mctest.Config(py, m, 32<<20, 16<<20, ""))
	b := a.Backend().(*mooncake.Backend)
	old := b.Pid()
	assert.NilError(t, unix.Kill(old, unix.SIGKILL))
	start := time.Now()
	res := l2test.Wait(t, a.LookupAndHold(context.Background(), []kv.Key{l2test.Key(1), l2test.Key(2)}))
	for _, r := range res {
		assert.Equal(t, r.Status, l2.StatusFailed)
		assert.Assert(t, errors.Is(r.Err, l2.ErrUnavailable), "%v", r.Err)
	}
	assert.Assert(t, time.Since(start) < 5*time.Second)

	time.Sleep(2100 * time.Millisecond)
	ctx := context.Background()
	k := l2test.Key(42)
	src := l2test.Payload(42, 4096)
	// The master keeps the dead helper's segment until that client's
	// liveness TTL runs out (client_live_ttl_sec, 10 s by default); a put
	// it places there fails with TRANSFER_FAIL, per key, and a retry after
	// the master drops the segment succeeds.
	var st []l2.Result
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		st = l2test.Wait(t, a.Store(ctx, []kv.Key{k}, [][]byte{src}))
		if st[0].Status == l2.StatusOK || time.Now().After(deadline) {
			break
		}
		assert.ErrorContains(t, st[0].Err, "TRANSFER_FAIL")
	}
	assert.Equal(t, st[0].Status, l2.StatusOK, "%v", st[0].Err)
	assert.Assert(t, b.Pid() != old && b.Pid() != 0)
	restarts := -1.0
	for _, s := range a.Samples() {
		if s.StatName() == "kvshim_l2_mooncake_helper_restarts_total{adapter="+a.Name()+"}" {
			restarts = s.Value
		}
	}
	assert.Equal(t, restarts, 1.0, "the restart in /metrics and STATS")
	dst := make([]byte, len(src))
	ld := l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{dst}))
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
