// Package fakecuda builds and steers a CUDA driver emulated in host memory
// (testdata/fakecuda.c), so tests on machines without a GPU run kvshim's
// real CUDA path: the dlopen loader, the DeviceEngine's locked driver
// thread, streams, events, batched and per-span copies, and the pinning of
// L1 segments. It is for tests only.
//
// The driver is a process-wide singleton (cuda loads it once, from
// KVSHIM_LIBCUDA), so a test that wants it re-runs its own test binary with
// the fake configured (Run) and the child finds it with Open.
//
//	parent test ── Build(dir, batch) ──► libcuda-fake.so
//	            ── Run(t, lib, "^TestDevice") ──► child: same test binary,
//	                                              KVSHIM_LIBCUDA=libcuda-fake.so
//	child tests ── Open() ──► Inject / Adopt / Stats on the loaded fake
//
// Besides CUDA's own rules the fake enforces kvshim's: copies touch only
// registered host memory, registered memory stays mapped until it is
// unregistered, no handle is used after destruction. A breach is a
// violation; Stats reports them and CheckClean fails on any, or on anything
// left allocated, registered or retained.
package fakecuda
