// Package cuda runs copy plans: the CUDA driver engine for GPU KV caches and
// the host engine for CPU KV caches, behind one Engine interface.
//
// The CUDA driver is opened at run time with dlopen (loader.c: "just enough"
// typedefs, a {name, &pointer, required} table filled with dlsym from
// libcuda.so.1, and C trampolines Go calls). The package builds, loads and
// tests with no CUDA installed; Init, Info and NewDeviceEngine then return an
// error wrapping ErrNotSupported ("cuda: not supported: load libcuda.so.1:
// ..."), and HostEngine keeps working. Driver failures are *DriverError
// values carrying the operation and the driver's error name.
//
//	connector goroutines                 DeviceEngine driver thread
//	─────────────────────                (runtime.LockOSThread, primary
//	WaitEvent(dir, ev) ─────request──►   context of cuda:N current)
//	                                     cuStreamWaitEvent(stream[dir], ev)
//	Submit(spans, dir) ─────request──►   cuMemcpyBatchAsync[_v2] (or one
//	                                       cuMemcpy{DtoH,HtoD}Async per span)
//	                                     cuEventRecord(done, stream[dir])
//	Job.Done() / Wait(t) ───request──►   cuEventQuery(done)
//
//	stream[Save]: D2H, device KV blocks -> pinned L1 objects
//	stream[Load]: H2D, pinned L1 objects -> device KV blocks
//
// Host memory that the GPU copies to or from must be registered once
// (RegisterHost: cuMemHostRegister, PORTABLE) so the copies are DMA from
// pinned memory; pageable copies are synchronous and ~10x slower.
//
// Spans are raw addresses of memory Go does not manage (see mem.go); both
// engines consume the span slice before Submit returns. A job is done only
// when no copy it queued can still touch its memory, failed jobs included:
// only then may the caller hand the memory back.
//
// Tests run the device engine against internal/fakecuda, a driver emulated
// in host memory, when no GPU is present (fake_test.go).
package cuda
