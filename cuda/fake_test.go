package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/internal/fakecuda"
	"github.com/kvshim/kvshim/kv"
)

// The device tests (TestDevice*) need a CUDA driver. Without a GPU,
// TestFakeDriver runs them, and the TestFakeCUDA* tests of failure paths,
// in child processes whose driver is internal/fakecuda: host memory, one
// thread per stream, so the DeviceEngine's real code runs asynchronously.
// After the child's tests, TestMain fails it on any fake-driver violation
// (unpinned host memory, memory unmapped while registered, a destroyed
// handle used) or anything left retained, registered, allocated or alive.
// On a GPU machine (build/gpu-check.sh) the same TestDevice* tests use the
// real driver.

func TestMain(m *testing.M) { os.Exit(fakecuda.Main(m)) }

func TestFakeDriver(t *testing.T) {
	fakecuda.SkipWithoutCompiler(t)
	for _, v := range []struct {
		batch int
		api   string
	}{{2, "cuMemcpyBatchAsync_v2"}, {1, "cuMemcpyBatchAsync"}, {0, ""}} {
		t.Run(fmt.Sprintf("batch=%d", v.batch), func(t *testing.T) {
			lib, err := fakecuda.Build(t.TempDir(), v.batch)
			assert.NilError(t, err)
			out := fakecuda.Run(t, lib, "^(TestDevice|TestFakeCUDA)", "KVSHIM_WANT_BATCH_API="+v.api)
			for _, name := range []string{"TestDeviceRoundTrip", "TestDeviceWaitEvent", "TestDevicePlans", "TestFakeCUDACopyErrors"} {
				assert.Check(t, is.Contains(out, "--- PASS: "+name))
			}
		})
	}
}

func cmp(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// fakeDriver is the loaded fake, or skips outside a TestFakeDriver child.
func fakeDriver(t *testing.T) *fakecuda.Driver {
	t.Helper()
	skipIfNotSupported(t, Init())
	d, ok := fakecuda.Open()
	if !ok {
		t.Skip("needs the fake CUDA driver: TestFakeDriver runs this test")
	}
	t.Cleanup(func() { d.Reset(0) })
	return d
}

// scattered returns n spans of 4 KiB, every other page of src to dst.
func scattered(src, dst uint64, n int) []kv.Span {
	spans := make([]kv.Span, n)
	for i := range spans {
		spans[i] = kv.Span{Src: src + uint64(2*i)*4096, Dst: dst + uint64(2*i)*4096, Len: 4096}
	}
	return spans
}

// TestFakeCUDAAsynchronous: copies run after Submit returns, so the other
// device tests do exercise the engine's waiting.
func TestFakeCUDAAsynchronous(t *testing.T) {
	d := fakeDriver(t)
	e := newDeviceEngine(t)
	dev := deviceBuffer(t, e, 1<<20)
	src, sa := pinnedTB(t, e, 1<<20)
	fill(src, 9)
	d.Reset(20 * time.Millisecond)
	j, err := e.Submit([]kv.Span{{Src: sa, Dst: dev, Len: 1 << 20}}, kv.Load)
	assert.NilError(t, err)
	assert.Assert(t, !j.Done(), "a delayed copy finished inside Submit")
	assert.NilError(t, j.Wait(5*time.Second))
}

// TestFakeCUDABatch: many spans go in one batch call when the driver has
// one; a batch answered "not supported" switches the engine to per-span
// copies, and the copy still lands.
func TestFakeCUDABatch(t *testing.T) {
	d := fakeDriver(t)
	e := newDeviceEngine(t)
	if want, ok := os.LookupEnv("KVSHIM_WANT_BATCH_API"); ok {
		assert.Equal(t, e.BatchAPI(), want)
	}
	const n = 1 << 20
	dev := deviceBuffer(t, e, n)
	src, sa := pinnedTB(t, e, n)
	fill(src, 3)
	before := d.Stats()
	run(t, e, scattered(sa, dev, 64), kv.Load)
	after := d.Stats()
	if e.BatchAPI() == "" {
		assert.Equal(t, after.SpanCalls-before.SpanCalls, uint64(64))
		return
	}
	assert.Equal(t, after.BatchCalls-before.BatchCalls, uint64(1))
	d.Inject(e.BatchAPI(), 1, cudaErrorNotSupported, false)
	out, oa := pinnedTB(t, e, n)
	run(t, e, scattered(dev, oa, 64), kv.Save)
	assert.Equal(t, e.BatchAPI(), "")
	assert.Equal(t, d.Stats().SpanCalls-after.SpanCalls, uint64(64))
	for i := 0; i < 64*8192; i += 8192 {
		assert.Assert(t, bytes.Equal(out[i:i+4096], src[i:i+4096]), "page %d", i/4096)
	}
}

// TestFakeCUDACopyErrors: driver failures name the operation and the
// driver's error, and a job is never done while copies it queued may still
// touch its memory.
func TestFakeCUDACopyErrors(t *testing.T) {
	d := fakeDriver(t)
	copyFn := func(e *DeviceEngine) string { return cmp(e.BatchAPI(), "cuMemcpyDtoHAsync_v2") }
	tests := []struct {
		name   string
		inject func(e *DeviceEngine)
		// submitErr: Submit itself fails; else the job fails with jobErr.
		submitErr, jobErr string
	}{{
		name: "enqueue fails part-way",
		inject: func(e *DeviceEngine) {
			if e.BatchAPI() != "" {
				d.Inject(e.BatchAPI(), 1, 1, false) // one call for all spans
			} else {
				d.Inject("cuMemcpyDtoHAsync_v2", 3, 1, false)
			}
		},
		jobErr: "CUDA_ERROR_INVALID_VALUE (1)",
	}, {
		name:   "copy fails on the device",
		inject: func(e *DeviceEngine) { d.Inject(copyFn(e), 1, 700, true) },
		jobErr: "cuda: cuEventQuery: CUDA_ERROR_ILLEGAL_ADDRESS (700)",
	}, {
		name:      "completion event cannot be recorded",
		inject:    func(*DeviceEngine) { d.Inject("cuEventRecord", 1, 1, false) },
		submitErr: "cuda: cuEventRecord: CUDA_ERROR_INVALID_VALUE (1)",
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newDeviceEngine(t)
			const n = 1 << 20
			dev := deviceBuffer(t, e, n)
			src, sa := pinnedTB(t, e, n)
			fill(src, 11)
			run(t, e, []kv.Span{{Src: sa, Dst: dev, Len: n}}, kv.Load)
			dst, da := pinnedTB(t, e, n)
			spans := scattered(dev, da, 8)
			if e.BatchAPI() == "" {
				spans[2].Len = 4095 // the per-span message names this span
			}
			d.Reset(10 * time.Millisecond)
			tc.inject(e)
			j, err := e.Submit(spans, kv.Save)
			if tc.submitErr != "" {
				assert.ErrorContains(t, err, tc.submitErr)
				// Submit returned only after the queued copies ended.
				assert.Assert(t, bytes.Equal(dst[:4096], src[:4096]))
				return
			}
			assert.NilError(t, err)
			err = j.Wait(5 * time.Second)
			assert.ErrorContains(t, err, tc.jobErr)
			var de *DriverError
			assert.Assert(t, errors.As(err, &de))
			if tc.name == "enqueue fails part-way" {
				if e.BatchAPI() == "" {
					assert.ErrorContains(t, err, fmt.Sprintf("cuMemcpyDtoHAsync(span 2: src %#x dst %#x len 4095)", spans[2].Src, spans[2].Dst))
					// The two spans queued before the failure had run when the job ended.
					assert.Assert(t, bytes.Equal(dst[8192:12288], src[8192:12288]))
				} else {
					assert.ErrorContains(t, err, e.BatchAPI()+"(save, 8 spans)")
				}
			}
		})
	}
}

// TestFakeCUDAUnregisterWaitsForCopies: UnregisterHost (called before L1
// memory is unmapped) returns only after the copies that may use it.
func TestFakeCUDAUnregisterWaitsForCopies(t *testing.T) {
	d := fakeDriver(t)
	e := newDeviceEngine(t)
	const n = 1 << 20
	dev := deviceBuffer(t, e, n)
	_, ha := mmapTB(t, n, rw())
	assert.NilError(t, e.RegisterHost(ha, n))
	d.Reset(30 * time.Millisecond)
	j, err := e.Submit([]kv.Span{{Src: dev, Dst: ha, Len: n}}, kv.Save)
	assert.NilError(t, err)
	assert.NilError(t, e.UnregisterHost(ha))
	assert.Assert(t, j.Done(), "host memory unregistered while a copy into it ran")
	assert.ErrorIs(t, e.UnregisterHost(ha), ErrBadSpan)
}

// TestFakeCUDACloseWaitsForCopies: Close lets queued copies finish, and
// their jobs then report success.
func TestFakeCUDACloseWaitsForCopies(t *testing.T) {
	d := fakeDriver(t)
	e, err := NewDeviceEngine(0)
	assert.NilError(t, err)
	const n = 1 << 20
	dev, err := e.AllocDevice(n)
	assert.NilError(t, err)
	src, sa := mmapTB(t, n, rw())
	fill(src, 12)
	assert.NilError(t, e.RegisterHost(sa, n))
	d.Reset(30 * time.Millisecond)
	j, err := e.Submit(scattered(sa, dev, 4), kv.Load)
	assert.NilError(t, err)
	// FreeDevice is queued on the driver thread behind nothing: free only
	// after Close has drained the copies, as vLLM frees its cache last.
	assert.NilError(t, e.Close())
	assert.Assert(t, j.Done())
	assert.NilError(t, j.Err())
	assert.Equal(t, d.Stats().Registrations, uint64(0), "Close left host memory registered")
	// The engine is gone; release the allocation through a new one.
	e2 := newDeviceEngine(t)
	assert.NilError(t, e2.FreeDevice(dev))
	_, err = e.Submit(scattered(sa, dev, 1), kv.Load)
	assert.ErrorIs(t, err, ErrClosed)
}
