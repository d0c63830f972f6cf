package main

// Token lists from Python without a Python-level conversion: a C loop over
// the list's items, the Python C API resolved with dlsym(RTLD_DEFAULT) the
// first time (no Python headers or libpython at build time; a process that
// is not Python gets codeNotSup and converts on its own).

/*
#include <dlfcn.h>
#include <stdlib.h>
#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

static ssize_t (*kv_PyList_Size)(void *);
static void *(*kv_PyList_GetItem)(void *, ssize_t);
static unsigned long (*kv_PyLong_AsUnsignedLong)(void *);
static void *(*kv_PyLong_FromLongLong)(long long);
static void *(*kv_PyErr_Occurred)(void);
static void (*kv_PyErr_Clear)(void);
static void (*kv_Py_DecRef)(void *);
static void *(*kv_PyEval_SaveThread)(void);
static void (*kv_PyEval_RestoreThread)(void *);
static void *kv_PyList_Type;
static void *kv_PyLong_Type;
static int kv_py_state; // 0: not resolved yet, 1: resolved, -1: not a Python process
// How an exact int's digits are found (kv_long_layout), or 0: through
// PyLong_AsUnsignedLong only. Chosen once by kv_long_selftest.
static int kv_long_layout;

// The head of an int object in CPython builds with a GIL: PyObject (refcount,
// type), then one word, then 30-bit digits, least significant first. The word
// is ob_size up to 3.11 (the digit count, negative for a negative int) and
// lv_tag from 3.12 on (digit count << 3 | sign: 0 positive, 1 zero, 2
// negative; Include/cpython/longintrepr.h).
struct kv_pylong { intptr_t refcnt; void *type; intptr_t word; uint32_t digit[2]; };

enum { KV_LONG_OBSIZE = 1, KV_LONG_LVTAG = 2 };

// kv_long_u32 reads an exact int with the given layout: its value when it
// is in [0, 2^32), else -1.
static inline int64_t kv_long_u32(const struct kv_pylong *o, int layout) {
	intptr_t n;
	if (layout == KV_LONG_LVTAG) {
		uintptr_t tag = (uintptr_t)o->word;
		if ((tag & 3) == 1) return 0;
		if ((tag & 3) != 0) return -1;
		n = (intptr_t)(tag >> 3);
	} else {
		n = o->word;
		if (n < 0) return -1;
	}
	switch (n) {
	case 0: return 0;
	case 1: return o->digit[0];
	case 2: return o->digit[1] > 3 ? -1 : (int64_t)o->digit[0] | (int64_t)o->digit[1] << 30;
	}
	return -1;
}

// kv_long_selftest picks the layout that reads ints made by this very
// interpreter right (boundaries of one and two digits, the largest uint32,
// ints out of range), or none: another digit size, a free-threaded build or
// a future layout then take the C API path, never a wrong id.
static int kv_long_selftest(void) {
	static const long long vals[] = {0, 1, 7, 1073741823LL, 1073741824LL, 2147483655LL, 4294967295LL, 4294967296LL,
	                                 -1, -1073741824LL, 1LL << 40};
	int ok[3] = {0, 1, 1};
	for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
		void *o = kv_PyLong_FromLongLong(vals[i]);
		if (!o) { kv_PyErr_Clear(); return 0; }
		int64_t want = vals[i] >= 0 && vals[i] <= 0xFFFFFFFFLL ? vals[i] : -1;
		for (int l = KV_LONG_OBSIZE; l <= KV_LONG_LVTAG; l++)
			if (((struct kv_pylong *)o)->type != kv_PyLong_Type || kv_long_u32(o, l) != want) ok[l] = 0;
		kv_Py_DecRef(o);
	}
	return ok[KV_LONG_LVTAG] ? KV_LONG_LVTAG : ok[KV_LONG_OBSIZE] ? KV_LONG_OBSIZE : 0;
}

// Called with the GIL held: calls of one interpreter are serialized.
static int kv_py_resolve(void) {
	if (kv_py_state != 0) return kv_py_state;
	kv_PyList_Size = (ssize_t (*)(void *))dlsym(RTLD_DEFAULT, "PyList_Size");
	kv_PyList_GetItem = (void *(*)(void *, ssize_t))dlsym(RTLD_DEFAULT, "PyList_GetItem");
	kv_PyLong_AsUnsignedLong = (unsigned long (*)(void *))dlsym(RTLD_DEFAULT, "PyLong_AsUnsignedLong");
	kv_PyLong_FromLongLong = (void *(*)(long long))dlsym(RTLD_DEFAULT, "PyLong_FromLongLong");
	kv_PyErr_Occurred = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyErr_Occurred");
	kv_PyErr_Clear = (void (*)(void))dlsym(RTLD_DEFAULT, "PyErr_Clear");
	kv_Py_DecRef = (void (*)(void *))dlsym(RTLD_DEFAULT, "Py_DecRef");
	kv_PyEval_SaveThread = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
	kv_PyEval_RestoreThread = (void (*)(void *))dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
	kv_PyList_Type = dlsym(RTLD_DEFAULT, "PyList_Type");
	kv_PyLong_Type = dlsym(RTLD_DEFAULT, "PyLong_Type");
	int ok = kv_PyList_Size && kv_PyList_GetItem && kv_PyLong_AsUnsignedLong && kv_PyErr_Occurred &&
		kv_PyErr_Clear && kv_PyList_Type;
	if (ok && kv_PyLong_FromLongLong && kv_Py_DecRef && kv_PyLong_Type && !getenv("KVSHIM_PY_LONG_API"))
		kv_long_layout = kv_long_selftest();
	__atomic_store_n(&kv_py_state, ok ? 1 : -1, __ATOMIC_RELEASE);
	return kv_py_state;
}


// The head of a list object in CPython builds with a GIL (3.x):
// PyObject_VAR_HEAD (refcount, type, size), then the item array.
struct kv_pylist { intptr_t refcnt; void *type; ssize_t size; void **items; };

// How far ahead of the item being read the loop asks for the next ints'
// cache lines: a list made by the tokenizer holds ints scattered over the
// heap, and after the engine's own work most of them are out of cache.
#define KV_PREFETCH 16

// kv_py_u32 writes the ids of list into out[0:cap]. Returns the length
// (>= 0; more than cap: nothing written), -1 when list is no list or the
// C API is missing, or -2-i when item i is no int in [0, 2^32) (the
// exception is cleared: the caller's own conversion names it).
static int64_t kv_py_u32(void *list, uint32_t *out, size_t cap) {
	if (kv_py_resolve() < 0) return -1;
	ssize_t n = kv_PyList_Size(list);
	if (n < 0) { kv_PyErr_Clear(); return -1; }
	if ((size_t)n > cap) return n;
	struct kv_pylist *l = (struct kv_pylist *)list;
	// The items in place when the head is laid out as expected (an exact
	// list of a GIL build: its type where it should be, its size agreeing);
	// otherwise PyList_GetItem per item. No Python code runs in the loop
	// (PyLong_AsUnsignedLong calls no __index__), so the list cannot change.
	void **items = (l->type == kv_PyList_Type && l->size == n) ? l->items : NULL;
	int layout = items ? kv_long_layout : 0;
	for (ssize_t i = 0; i < n; i++) {
		void *o;
		int64_t v = -1;
		if (layout) {
			if (i + KV_PREFETCH < n) __builtin_prefetch(items[i + KV_PREFETCH]);
			o = items[i];
			// An exact int is read in place; a bool or a subclass of int
			// goes through the C API.
			if (((struct kv_pylong *)o)->type == kv_PyLong_Type) v = kv_long_u32(o, layout);
		} else {
			o = items ? items[i] : kv_PyList_GetItem(list, i);
		}
		if (v < 0) {
			unsigned long u = kv_PyLong_AsUnsignedLong(o);
			if (u > 0xFFFFFFFFul) {
				if (kv_PyErr_Occurred()) kv_PyErr_Clear();
				return -2 - (int64_t)i;
			}
			v = (int64_t)u;
		}
		out[i] = (uint32_t)v;
	}
	return n;
}

// kv_py_can_release reports whether the GIL can be released here
// (PyEval_SaveThread and PyEval_RestoreThread found). Called with the GIL.
static int kv_py_can_release(void) {
	return kv_py_resolve() > 0 && kv_PyEval_SaveThread && kv_PyEval_RestoreThread;
}

// kv_py_release releases the caller's GIL and returns its thread state for
// kv_py_reacquire. Only after kv_py_can_release said yes.
static void *kv_py_release(void) { return kv_PyEval_SaveThread(); }
static void kv_py_reacquire(void *ts) { kv_PyEval_RestoreThread(ts); }
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// pyListU32 is kv_py_u32: n >= 0 the list's length (written when <= cap),
// -1 no list or no Python, -2-i a bad item i.
func pyListU32(list unsafe.Pointer, out *C.uint32_t, capacity C.size_t) int64 {
	return int64(C.kv_py_u32(list, out, capacity))
}

// pyListTokens reads the Python list at list into buf (grown when the list
// is longer than its capacity) and returns the ids. Called with the GIL
// held. Errors: errors.ErrUnsupported (no list, or no Python C API in this
// process), errInvalid naming the first item that is no int in [0, 2^32).
func pyListTokens(list unsafe.Pointer, buf []uint32) ([]uint32, error) {
	for {
		n := pyListU32(list, (*C.uint32_t)(unsafe.SliceData(buf[:cap(buf)])), C.size_t(cap(buf)))
		switch {
		case n == -1:
			return nil, fmt.Errorf("tokens: no Python list, or no Python C API in this process: %w", errors.ErrUnsupported)
		case n < -1:
			return nil, fmt.Errorf("tokens: item %d is no int in [0, 2^32): %w", -2-n, errInvalid)
		case n > int64(cap(buf)):
			buf = make([]uint32, 0, n)
			continue
		}
		return buf[:n], nil
	}
}

// tokenBufs holds the buffers lists are read into: a lookup's tokens are
// hashed and dropped within the call (shim.Scheduler keeps only the hashes).
var tokenBufs = sync.Pool{New: func() any { return new([]uint32) }}

// releaseGIL releases the calling Python thread's GIL and returns the
// function that takes it back, or an error when this process has no such
// API (then nothing was released). Called with the GIL held.
func releaseGIL() (reacquire func(), err error) {
	if C.kv_py_can_release() == 0 {
		return nil, fmt.Errorf("no PyEval_SaveThread in this process: %w", errors.ErrUnsupported)
	}
	ts := C.kv_py_release()
	return func() { C.kv_py_reacquire(ts) }, nil
}
