package main

// Token lists from Python without a Python-level conversion: a C loop over
// the list's items, the Python C API resolved with dlsym(RTLD_DEFAULT) the
// first time (no Python headers or libpython at build time; a process that
// is not Python gets codeNotSup and converts on its own).

/*
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

static ssize_t (*kv_PyList_Size)(void *);
static void *(*kv_PyList_GetItem)(void *, ssize_t);
static unsigned long (*kv_PyLong_AsUnsignedLong)(void *);
static void *(*kv_PyErr_Occurred)(void);
static void (*kv_PyErr_Clear)(void);
static void *kv_PyList_Type;
static int kv_py_state; // 0: not resolved yet, 1: resolved, -1: not a Python process

// Called with the GIL held: calls of one interpreter are serialized.
static int kv_py_resolve(void) {
	if (kv_py_state != 0) return kv_py_state;
	kv_PyList_Size = (ssize_t (*)(void *))dlsym(RTLD_DEFAULT, "PyList_Size");
	kv_PyList_GetItem = (void *(*)(void *, ssize_t))dlsym(RTLD_DEFAULT, "PyList_GetItem");
	kv_PyLong_AsUnsignedLong = (unsigned long (*)(void *))dlsym(RTLD_DEFAULT, "PyLong_AsUnsignedLong");
	kv_PyErr_Occurred = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyErr_Occurred");
	kv_PyErr_Clear = (void (*)(void))dlsym(RTLD_DEFAULT, "PyErr_Clear");
	kv_PyList_Type = dlsym(RTLD_DEFAULT, "PyList_Type");
	int ok = kv_PyList_Size && kv_PyList_GetItem && kv_PyLong_AsUnsignedLong && kv_PyErr_Occurred &&
		kv_PyErr_Clear && kv_PyList_Type;
	__atomic_store_n(&kv_py_state, ok ? 1 : -1, __ATOMIC_RELEASE);
	return kv_py_state;
}

// The head of a list object in CPython builds with a GIL (3.x):
// PyObject_VAR_HEAD (refcount, type, size), then the item array.
struct kv_pylist { intptr_t refcnt; void *type; ssize_t size; void **items; };

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
	for (ssize_t i = 0; i < n; i++) {
		unsigned long v = kv_PyLong_AsUnsignedLong(items ? items[i] : kv_PyList_GetItem(list, i));
		if (v > 0xFFFFFFFFul) {
			if (kv_PyErr_Occurred()) kv_PyErr_Clear();
			return -2 - (int64_t)i;
		}
		out[i] = (uint32_t)v;
	}
	return n;
}
*/
import "C"

import "unsafe"

// pyListU32 is kv_py_u32: n >= 0 the list's length (written when <= cap),
// -1 no list or no Python, -2-i a bad item i.
func pyListU32(list unsafe.Pointer, out *C.uint32_t, capacity C.size_t) int64 {
	return int64(C.kv_py_u32(list, out, capacity))
}
