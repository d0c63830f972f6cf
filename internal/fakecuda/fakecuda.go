package fakecuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef int (*inject_fn)(const char *, int, int, int);
typedef void (*reset_fn)(unsigned);
typedef int (*adopt_fn)(uint64_t, uint64_t);
typedef void (*unadopt_fn)(uint64_t);
typedef void (*stats_fn)(uint64_t *, char *, size_t);
typedef int (*vllm_write_fn)(uint64_t, uint64_t, uint64_t, unsigned, uint64_t *);
typedef int (*event_destroy_fn)(void *);

static void *open_loaded(const char *path) { return dlopen(path, RTLD_NOW | RTLD_NOLOAD); }
static int call_inject(void *f, const char *fn, int nth, int code, int async) { return ((inject_fn)f)(fn, nth, code, async); }
static void call_reset(void *f, unsigned us) { ((reset_fn)f)(us); }
static int call_adopt(void *f, uint64_t p, uint64_t n) { return ((adopt_fn)f)(p, n); }
static void call_unadopt(void *f, uint64_t p) { ((unadopt_fn)f)(p); }
static void call_stats(void *f, uint64_t *out, char *msg, size_t n) { ((stats_fn)f)(out, msg, n); }
static int call_vllm_write(void *f, uint64_t dst, uint64_t src, uint64_t n, unsigned us, uint64_t *ev) { return ((vllm_write_fn)f)(dst, src, n, us, ev); }
static int call_event_destroy(void *f, uint64_t ev) { return ((event_destroy_fn)f)((void *)(uintptr_t)ev); }
*/
import "C"

import (
	_ "embed"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
	"unsafe"
)

//go:embed testdata/fakecuda.c
var source []byte

// LibraryEnv names the variable the cuda package reads the driver path from.
const LibraryEnv = "KVSHIM_LIBCUDA"

// Build compiles the fake into dir and returns the library's path. batch
// picks the driver it imitates: 2 = CUDA 13 (cuMemcpyBatchAsync_v2), 1 =
// CUDA 12.8 (cuMemcpyBatchAsync), 0 = older (per-span copies only).
func Build(dir string, batch int) (string, error) {
	src := filepath.Join(dir, "fakecuda.c")
	if err := os.WriteFile(src, source, 0o644); err != nil {
		return "", err
	}
	lib := filepath.Join(dir, fmt.Sprintf("libcuda-fake%d.so", batch))
	cc := compiler()
	out, err := exec.Command(cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-shared", "-fPIC",
		"-pthread", fmt.Sprintf("-DFAKECUDA_BATCH=%d", batch), "-o", lib, src).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("fakecuda: %s: %w\n%s", cc, err, out)
	}
	return lib, nil
}

func compiler() string {
	if cc := os.Getenv("CC"); cc != "" {
		return cc
	}
	return "cc"
}

// SkipWithoutCompiler skips t where no C compiler can build the fake (a
// GPU machine running build/gpu-check.sh may have none).
func SkipWithoutCompiler(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath(compiler()); err != nil {
		t.Skipf("no C compiler to build the fake CUDA driver: %v", err)
	}
}

// Driver is the fake as loaded in this process.
type Driver struct {
	inject, reset, adopt, unadopt, stats, vllmWrite, eventDestroy unsafe.Pointer
}

// Open finds the fake among the libraries this process loaded (the cuda
// package dlopens KVSHIM_LIBCUDA on first use). It returns false when the
// loaded driver is not the fake, e.g. a real libcuda on a GPU machine.
func Open() (*Driver, bool) {
	path := os.Getenv(LibraryEnv)
	if path == "" {
		return nil, false
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	h := C.open_loaded(cpath)
	if h == nil {
		return nil, false
	}
	d := &Driver{}
	for name, p := range map[string]*unsafe.Pointer{
		"fakecuda_inject": &d.inject, "fakecuda_reset": &d.reset, "fakecuda_adopt": &d.adopt,
		"fakecuda_unadopt": &d.unadopt, "fakecuda_stats": &d.stats,
		"fakecuda_vllm_write": &d.vllmWrite, "cuEventDestroy_v2": &d.eventDestroy,
	} {
		cname := C.CString(name)
		*p = C.dlsym(h, cname)
		C.free(unsafe.Pointer(cname))
		if *p == nil {
			return nil, false
		}
	}
	return d, true
}

// Inject makes the nth call from now of the CUDA function fn (its exported
// name, e.g. "cuMemcpyBatchAsync_v2") return code. With async, the nth
// copy fn queues fails when it executes instead: the failure is sticky on
// that stream and surfaces through cuEventQuery, like a real asynchronous
// error.
func (d *Driver) Inject(fn string, nth, code int, async bool) {
	cfn := C.CString(fn)
	defer C.free(unsafe.Pointer(cfn))
	a := C.int(0)
	if async {
		a = 1
	}
	if C.call_inject(d.inject, cfn, C.int(nth), C.int(code), a) != 0 {
		panic("fakecuda: bad injection " + fn)
	}
}

// Reset drops pending injections and sets how long each queued copy waits
// before it runs (a wider window for ordering bugs).
func (d *Driver) Reset(copyDelay time.Duration) {
	C.call_reset(d.reset, C.unsigned(copyDelay.Microseconds()))
}

// Adopt declares [addr, addr+n) device memory: a test's stand-in for a KV
// tensor on cuda:0. Unadopt undoes it.
func (d *Driver) Adopt(addr, n uint64) {
	if C.call_adopt(d.adopt, C.uint64_t(addr), C.uint64_t(n)) != 0 {
		panic("fakecuda: adopt")
	}
}

// Unadopt forgets an adopted range by its start.
func (d *Driver) Unadopt(addr uint64) { C.call_unadopt(d.unadopt, C.uint64_t(addr)) }

// VLLMWrite plays vLLM's forward pass: on a stream of its own the driver
// copies n bytes src -> dst (device memory) after delay and then records
// an event, whose handle it returns. Destroy it with DestroyEvent, at once
// if you like.
func (d *Driver) VLLMWrite(dst, src, n uint64, delay time.Duration) uint64 {
	var ev C.uint64_t
	if C.call_vllm_write(d.vllmWrite, C.uint64_t(dst), C.uint64_t(src), C.uint64_t(n), C.unsigned(delay.Microseconds()), &ev) != 0 {
		panic("fakecuda: vllm write")
	}
	return uint64(ev)
}

// DestroyEvent is cuEventDestroy_v2 (pending events are freed when done).
func (d *Driver) DestroyEvent(ev uint64) {
	if r := C.call_event_destroy(d.eventDestroy, C.uint64_t(ev)); r != 0 {
		panic(fmt.Sprintf("fakecuda: cuEventDestroy_v2: %d", r))
	}
}

// Stats is what the fake counted and what is still live.
type Stats struct {
	Copies, Bytes, BatchCalls, SpanCalls uint64
	Violations                           uint64
	LastViolation                        string
	ContextRefs, Streams, Events         uint64
	Registrations, Allocations           uint64
}

// Stats reads the fake's counters.
func (d *Driver) Stats() Stats {
	var v [10]C.uint64_t
	var msg [512]C.char
	C.call_stats(d.stats, &v[0], &msg[0], C.size_t(len(msg)))
	return Stats{
		Copies: uint64(v[0]), Bytes: uint64(v[1]), BatchCalls: uint64(v[2]), SpanCalls: uint64(v[3]),
		Violations: uint64(v[4]), LastViolation: C.GoString(&msg[0]),
		ContextRefs: uint64(v[5]), Streams: uint64(v[6]), Events: uint64(v[7]),
		Registrations: uint64(v[8]), Allocations: uint64(v[9]),
	}
}

// CheckClean reports violations and anything still retained, registered,
// allocated or alive: call it when every engine is closed.
func (d *Driver) CheckClean() error {
	s := d.Stats()
	var errs []error
	if s.Violations != 0 {
		errs = append(errs, fmt.Errorf("fakecuda: %d violations, the last: %s", s.Violations, s.LastViolation))
	}
	if s.ContextRefs+s.Streams+s.Events+s.Registrations+s.Allocations != 0 {
		errs = append(errs, fmt.Errorf("fakecuda: left behind: %d context references, %d streams, %d events, %d host registrations, %d allocations",
			s.ContextRefs, s.Streams, s.Events, s.Registrations, s.Allocations))
	}
	return errors.Join(errs...)
}
