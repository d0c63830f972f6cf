package cuda

import (
	"bytes"
	"errors"
	"math/rand"
	"os"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"gotest.tools/v3/assert"
)

// These tests use a real CUDA device and skip without one
// (build/gpu-check.sh runs them on a GPU machine).

func newDeviceEngine(t *testing.T, opts ...DeviceOption) *DeviceEngine {
	t.Helper()
	e, err := NewDeviceEngine(0, opts...)
	skipIfNotSupported(t, err)
	t.Cleanup(func() { assert.NilError(t, e.Close()) })
	return e
}

func deviceBuffer(t *testing.T, e *DeviceEngine, n uint64) uint64 {
	t.Helper()
	p, err := e.AllocDevice(n)
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, e.FreeDevice(p)) })
	return p
}

func pinnedTB(t *testing.T, e *DeviceEngine, n int) ([]byte, uint64) {
	t.Helper()
	b, a := mmapTB(t, n, rw())
	reg := uint64(n+4095) &^ 4095 // whole pages, as mmap maps them
	assert.NilError(t, e.RegisterHost(a, reg))
	assert.NilError(t, e.RegisterHost(a, reg)) // twice is fine
	t.Cleanup(func() { assert.NilError(t, e.UnregisterHost(a)) })
	return b, a
}

func run(t *testing.T, e Engine, spans []kv.Span, dir kv.Direction) {
	t.Helper()
	j, err := e.Submit(spans, dir)
	assert.NilError(t, err)
	assert.NilError(t, j.Wait(30*time.Second))
	assert.Assert(t, j.Done())
}

func TestDeviceInfo(t *testing.T) {
	info, err := Info()
	skipIfNotSupported(t, err)
	t.Logf("driver %s version %d, %d devices, batch API %q", info.Library, info.Version, info.Devices, info.BatchAPI)
	assert.Assert(t, info.Devices > 0)
	if info.Version >= 13000 {
		assert.Equal(t, info.BatchAPI, "cuMemcpyBatchAsync_v2")
	}
	if want, ok := os.LookupEnv("KVSHIM_WANT_BATCH_API"); ok {
		assert.Equal(t, info.BatchAPI, want)
	}
	_, err = NewDeviceEngine(info.Devices + 7)
	var de *DriverError
	assert.Assert(t, errors.As(err, &de), "%v", err)
	assert.Assert(t, len(de.Name) > len("CUDA_ERROR_"), de.Name)
}

func TestDeviceRoundTrip(t *testing.T) {
	for _, batch := range []bool{true, false} {
		name := "batch"
		var opts []DeviceOption
		if !batch {
			name, opts = "per-span", []DeviceOption{WithoutBatch()}
		}
		t.Run(name, func(t *testing.T) {
			e := newDeviceEngine(t, opts...)
			t.Logf("batch API %q", e.BatchAPI())
			const n = 32 << 20
			dev := deviceBuffer(t, e, n)
			src, sa := pinnedTB(t, e, n)
			dst, da := pinnedTB(t, e, n)
			fill(src, 4)
			run(t, e, []kv.Span{{Src: sa, Dst: dev, Len: n}}, kv.Load)
			// Scattered spans of odd sizes, out of order, device -> host.
			perm := rand.New(rand.NewSource(2)).Perm(n / 65536)
			var spans []kv.Span
			for i, p := range perm {
				l := uint64(4096 + 17*i%60000)
				spans = append(spans, kv.Span{Src: dev + uint64(p)*65536, Dst: da + uint64(p)*65536, Len: l})
			}
			run(t, e, spans, kv.Save)
			want := make([]byte, n)
			for _, s := range spans {
				copy(want[s.Dst-da:s.Dst-da+s.Len], src[s.Src-dev:s.Src-dev+s.Len])
			}
			assert.Assert(t, bytes.Equal(dst, want))
			sp, calls := e.Stats()
			t.Logf("spans %d, driver calls %d", sp, calls)
		})
	}
}

// TestDeviceWaitEvent: the copy must not start before the event that
// "vLLM" recorded on its own stream after writing the data.
func TestDeviceWaitEvent(t *testing.T) {
	e := newDeviceEngine(t)
	const n = 256 << 20
	dev := deviceBuffer(t, e, n)
	a, aa := pinnedTB(t, e, n)
	b, ba := pinnedTB(t, e, n)
	out, oa := pinnedTB(t, e, n)
	fill(a, 5)
	fill(b, 6)
	run(t, e, []kv.Span{{Src: aa, Dst: dev, Len: n}}, kv.Load) // device holds a
	ev, destroy, err := e.foreignEvent(dev, ba, n)             // "vLLM" writes b, records ev
	assert.NilError(t, err)
	assert.NilError(t, e.WaitEvent(kv.Save, ev))
	destroy() // as torch may, once WaitEvent returned
	run(t, e, []kv.Span{{Src: dev, Dst: oa, Len: n}}, kv.Save)
	assert.Assert(t, bytes.Equal(out, b), "save did not wait for the event")
}

// TestDevicePlans saves chunks of a device KV cache through layout plans,
// checks the objects against the host engine's objects made from a host
// copy of the same cache, restores them into a zeroed cache and compares.
func TestDevicePlans(t *testing.T) {
	e := newDeviceEngine(t)
	h := NewHostEngine(2)
	defer h.Close()
	for _, g := range geoms(layout.Device{Kind: layout.CUDA}) {
		t.Run(g.name, func(t *testing.T) {
			dev := deviceBuffer(t, e, uint64(g.bytes))
			host, ha := pinnedTB(t, e, g.bytes)
			fill(host, 7)
			run(t, e, []kv.Span{{Src: ha, Dst: dev, Len: uint64(g.bytes)}}, kv.Load)
			ld, err := layout.New(g.descs(dev), 4*gBS)
			assert.NilError(t, err)
			hostDescs := g.descs(ha)
			for i := range hostDescs {
				hostDescs[i].Device = layout.Device{Kind: layout.CPU}
			}
			lh, err := layout.New(hostDescs, 4*gBS)
			assert.NilError(t, err)
			size, _ := ld.ObjectSize(ld.ChunkTokens())
			objs, oa := pinnedTB(t, e, int(size)*2)
			ref, ra := mmapTB(t, int(size)*2, rw())
			chunks := [][]int64{{4, 5, 6, 7}, {9, 2, 15, 0}}
			for c, ids := range chunks {
				sd, err := ld.Plan(ids, oa+uint64(c)*size, kv.Save)
				assert.NilError(t, err)
				run(t, e, sd, kv.Save)
				sh, err := lh.Plan(ids, ra+uint64(c)*size, kv.Save)
				assert.NilError(t, err)
				run(t, h, sh, kv.Save)
				o := objs[uint64(c)*size : uint64(c+1)*size]
				assert.NilError(t, ld.SealObject(o, kv.Key{}))
				assert.NilError(t, ld.VerifyObject(o, kv.Key{}))
				assert.Assert(t, bytes.Equal(o[layout.HeaderSize:], ref[uint64(c)*size+layout.HeaderSize:uint64(c+1)*size]))
			}
			zero, za := pinnedTB(t, e, g.bytes)
			run(t, e, []kv.Span{{Src: za, Dst: dev, Len: uint64(g.bytes)}}, kv.Load)
			for c, ids := range chunks {
				sd, err := ld.Plan(ids, oa+uint64(c)*size, kv.Load)
				assert.NilError(t, err)
				run(t, e, sd, kv.Load)
			}
			run(t, e, []kv.Span{{Src: dev, Dst: za, Len: uint64(g.bytes)}}, kv.Save)
			want := make([]byte, g.bytes)
			blocks := map[int64]bool{}
			for _, c := range chunks {
				for _, b := range c {
					blocks[b] = true
				}
			}
			for _, d := range g.descs(dev) {
				markBlocks(want, host, dev, d, blocks)
			}
			assert.Assert(t, bytes.Equal(zero, want))
		})
	}
}
