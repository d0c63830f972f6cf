package main

/*
#include <stdint.h>
#include <stddef.h>
*/
import "C"

import (
	"fmt"
	"runtime/debug"
	"syscall"
	"unsafe"

	"github.com/kvshim/kvshim/shim"
)

// The prologue and epilogue every export shares, written once.
//
//	//export kvshim_worker_start_loads
//	func kvshim_worker_start_loads(h C.int64_t) C.int {
//		return call(h, func(in *instance, ws *workerState) error { ... })
//	}

// call runs body for the open handle h whose state is a T (*shim.Scheduler,
// *workerState, *toolState, ...; *instance accepts a handle of any role):
// it recovers a panic as KVSHIM_EPANIC, answers KVSHIM_EBADH for a handle
// that is not open and KVSHIM_EINVAL for one of another role, and records
// body's error as h's last error, returning its code (codeOf).
func call[T any](h C.int64_t, body func(in *instance, s T) error) (rc C.int) {
	defer guard(int64(h), &rc)
	in, release, err := handles.acquire(int64(h))
	if err != nil {
		return C.int(fail(0, err))
	}
	defer release()
	s, ok := any(in).(T)
	if !ok {
		if s, ok = in.state.(T); !ok {
			return C.int(fail(in.id, fmt.Errorf("handle %d is a %s handle, not a %s one: %w",
				in.id, roleOf(in.state), roleOf(s), errInvalid)))
		}
	}
	if err := body(in, s); err != nil {
		return C.int(fail(in.id, err))
	}
	return codeOK
}

// callLib is call for the exports that take no handle: their failures are
// the library's last error (handle 0).
func callLib(body func() error) (rc C.int) {
	defer guard(0, &rc)
	if err := body(); err != nil {
		return C.int(fail(0, err))
	}
	return codeOK
}

// guard turns a panic into KVSHIM_EPANIC with the panic text as the last
// error of h (or of the library when h is not open). call and callLib
// defer it; the few exports that use neither defer it first themselves.
func guard(h int64, rc *C.int) {
	if r := recover(); r != nil {
		fail(h, fmt.Errorf("panic in libkvshim: %v\n%s", r, debug.Stack()))
		*rc = codePanic
	}
}

// roleOf names the role of a handle's state for error messages.
func roleOf(state any) string {
	switch state.(type) {
	case *shim.Scheduler:
		return "scheduler"
	case *workerState:
		return "worker"
	case *toolState:
		return "tool"
	}
	return fmt.Sprintf("%T", state)
}

// output hands bytes to the caller's buffer. When they do not fit it sets
// *out_len to the length needed, keeps them on the handle for the calling
// thread, and fails with errRange (KVSHIM_ERANGE); the same thread fetches
// them with kvshim_take_output. Keyed by thread, two threads sharing a
// handle never take each other's output.
func output(in *instance, data []byte, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) error {
	if outLen == nil {
		return fmt.Errorf("out_len is NULL: %w", errInvalid)
	}
	*outLen = C.size_t(len(data))
	if buf == nil || int(capacity) < len(data) {
		in.setPending(callerThread(), data)
		return fmt.Errorf("output of %d bytes does not fit a buffer of %d: fetch it with kvshim_take_output: %w",
			len(data), int(capacity), errRange)
	}
	copy(unsafe.Slice((*byte)(buf), len(data)), data)
	return nil
}

// callerThread is the OS thread of the C caller: an export runs on the
// thread that called it (cgo locks the callback's goroutine to it).
func callerThread() int { return syscall.Gettid() }

//export kvshim_take_output
func kvshim_take_output(h C.int64_t, buf unsafe.Pointer, capacity C.size_t, outLen *C.size_t) C.int {
	return call(h, func(in *instance, _ *instance) error {
		tid := callerThread()
		data, ok := in.takePending(tid)
		if !ok {
			return fmt.Errorf("no pending output on handle %d for this thread (output is kept for the thread that got KVSHIM_ERANGE): %w",
				in.id, errInvalid)
		}
		return output(in, data, buf, capacity, outLen) // does not fit again: kept again
	})
}

// cSlice views n elements of C memory at p; nil p with n > 0 is an error.
func cSlice[T any](p unsafe.Pointer, n uint64, what string) ([]T, error) {
	if n == 0 {
		return nil, nil
	}
	if p == nil {
		return nil, fmt.Errorf("%s is NULL with length %d: %w", what, n, errInvalid)
	}
	return unsafe.Slice((*T)(p), n), nil
}

func goString(p *C.char, what string) (string, error) {
	if p == nil {
		return "", fmt.Errorf("%s is NULL: %w", what, errInvalid)
	}
	return C.GoString(p), nil
}
