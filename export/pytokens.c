// The C half of pytokens.go (declarations and contracts in pytokens.h).

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

#include "pytokens.h"

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

// How far ahead of the item being read the loops ask for the next ints'
// cache lines: after the engine's own work most of a list's ints are out of
// cache. The ints of a list made at once lie one after another (32 bytes
// each), so this mostly streams memory; 64 ahead read a cold 16K-id list
// in 69 µs against 80 at 16 and 95 with none, 75 for a plain read of its
// 640 KB (2-vCPU Xeon VM, docs/datapath.md).
#define KV_PREFETCH 64

int64_t kv_py_u32(void *list, uint32_t *out, size_t cap) {
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

int kv_py_can_release(void) {
	return kv_py_resolve() > 0 && kv_PyEval_SaveThread && kv_PyEval_RestoreThread;
}

void *kv_py_release(void) { return kv_PyEval_SaveThread(); }
void kv_py_reacquire(void *ts) { kv_PyEval_RestoreThread(ts); }

// ---- Chunk keys hashed as the ids are read (kv_py_chain)
//
// A 64-chunk lookup reads 16K ints that are mostly out of cache (memory
// bound) and hashes 68 KB (compute bound, the SHA extensions). One after the
// other they add up (a cold 16K-id list: 70 µs to read, 133 µs read and
// then hashed); here each SHA-256 block is compressed as soon as its ids
// are in place, so the CPU hashes while the next ints' cache lines are on
// their way (81 µs; warm 52 against 72). The message layout is the caller's (shim.PlainChunkMessage,
// padded by pytokens.go): this file knows only where the ids and the
// previous hash go.

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

#define KV_SHA __attribute__((target("sha,sse4.1,ssse3")))

static const uint32_t kv_sha_k[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
	0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
	0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
	0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
	0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
	0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
	0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
	0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

// The state lives in two registers as the SHA instructions want it: ABEF
// and CDGH (Intel's SHA extensions guide, 2013).
KV_SHA static inline void kv_sha_init(__m128i *abef, __m128i *cdgh) {
	const __m128i abcd = _mm_set_epi32((int)0xa54ff53a, (int)0x3c6ef372, (int)0xbb67ae85, (int)0x6a09e667);
	const __m128i efgh = _mm_set_epi32((int)0x5be0cd19, (int)0x1f83d9ab, (int)0x9b05688c, (int)0x510e527f);
	__m128i t = _mm_shuffle_epi32(abcd, 0xB1), u = _mm_shuffle_epi32(efgh, 0x1B);
	*abef = _mm_alignr_epi8(t, u, 8);
	*cdgh = _mm_blend_epi16(u, t, 0xF0);
}

KV_SHA static inline void kv_sha_block(__m128i *abef, __m128i *cdgh, const uint8_t *p) {
	const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
	__m128i s0 = *abef, s1 = *cdgh, w[4];
	// Unrolled (cgo builds with -O2, which keeps these loops): w[] then
	// lives in registers; 64 warm chunks read and hashed in 52 µs instead
	// of 75.
#pragma GCC unroll 4
	for (int i = 0; i < 4; i++) w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
#pragma GCC unroll 16
	for (int i = 0; i < 16; i++) {
		__m128i g = w[i & 3];
		if (i >= 4) { // W[t] = σ1(W[t-2]) + W[t-7] + σ0(W[t-15]) + W[t-16], four at a time
			g = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]),
			                                       _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4)),
			                         w[(i + 3) & 3]);
			w[i & 3] = g;
		}
		__m128i m = _mm_add_epi32(g, _mm_loadu_si128((const __m128i *)&kv_sha_k[4 * i]));
		s1 = _mm_sha256rnds2_epu32(s1, s0, m);
		s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(m, 0x0E));
	}
	*abef = _mm_add_epi32(s0, *abef);
	*cdgh = _mm_add_epi32(s1, *cdgh);
}

KV_SHA static inline void kv_sha_digest(__m128i abef, __m128i cdgh, uint8_t out[32]) {
	const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
	__m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
	_mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(_mm_blend_epi16(feba, dchg, 0xF0), bswap));
	_mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(_mm_alignr_epi8(dchg, feba, 8), bswap));
}

// kv_chain_items is kv_py_chain over items[0:n], exact ints of type ltype
// read in int layout layout.
KV_SHA static int64_t kv_chain_items(void *const *items, ssize_t n, const void *ltype, int layout, uint8_t *msg,
                                     size_t nblocks, size_t prev_off, size_t ids_off, size_t chunk, uint8_t *hashes,
                                     size_t max_hashes) {
	size_t nchunks = (size_t)n / chunk;
	if (nchunks > max_hashes) return n;
	ssize_t i = 0;
	for (size_t c = 0; c < nchunks; c++) {
		__m128i abef, cdgh;
		kv_sha_init(&abef, &cdgh);
		size_t j = 0;
		for (size_t b = 0; b <= nblocks; b++) {
			// The ids whose bytes fall before the end of block b, then
			// block b-1: its 16-byte loads come a block after the 4-byte
			// stores of its ids (a load right after the stores it spans
			// waits for them: 59 µs instead of 52 for 64 warm chunks).
			size_t end = 64 * (b + 1), upto = end <= ids_off ? 0 : (end - ids_off + 3) / 4;
			if (upto > chunk) upto = chunk;
			for (; j < upto; j++, i++) {
				if (i + KV_PREFETCH < n) __builtin_prefetch(items[i + KV_PREFETCH]);
				const struct kv_pylong *o = items[i];
				int64_t v = o->type == ltype ? kv_long_u32(o, layout) : -1;
				if (v < 0) return -1;
				uint32_t u = (uint32_t)v;
				memcpy(msg + ids_off + 4 * j, &u, 4);
			}
			if (b > 0) kv_sha_block(&abef, &cdgh, msg + 64 * (b - 1));
		}
		kv_sha_digest(abef, cdgh, msg + prev_off);
		memcpy(hashes + 32 * c, msg + prev_off, 32);
	}
	for (; i < n; i++) { // the partial last chunk: checked, not hashed
		if (i + KV_PREFETCH < n) __builtin_prefetch(items[i + KV_PREFETCH]);
		const struct kv_pylong *o = items[i];
		if (o->type != ltype || kv_long_u32(o, layout) < 0) return -1;
	}
	return n;
}

// CPUID is asked once (in a VM each CPUID exits to the hypervisor): 0 not
// yet, 1 yes, -1 no.
static int kv_sha_ni;

int kv_chain_sha_ni(void) {
	int v = __atomic_load_n(&kv_sha_ni, __ATOMIC_RELAXED);
	if (v == 0) {
		unsigned a, b, c, d;
		int ok = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSSE3) && (c & bit_SSE4_1) &&
		         __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA);
		v = ok ? 1 : -1;
		__atomic_store_n(&kv_sha_ni, v, __ATOMIC_RELAXED);
	}
	return v > 0;
}
#else
static int64_t kv_chain_items(void *const *items, ssize_t n, const void *ltype, int layout, uint8_t *msg,
                              size_t nblocks, size_t prev_off, size_t ids_off, size_t chunk, uint8_t *hashes,
                              size_t max_hashes) {
	return -1;
}

int kv_chain_sha_ni(void) { return 0; }
#endif

int64_t kv_py_chain(void *list, uint8_t *msg, size_t nblocks, size_t prev_off, size_t ids_off, size_t chunk,
                    uint8_t *hashes, size_t max_hashes) {
	if (!kv_chain_sha_ni() || kv_py_resolve() < 0 || !kv_long_layout || !chunk) return -1;
	ssize_t n = kv_PyList_Size(list);
	if (n < 0) { kv_PyErr_Clear(); return -1; }
	const struct kv_pylist *l = (const struct kv_pylist *)list;
	if (l->type != kv_PyList_Type || l->size != n) return -1;
	return kv_chain_items(l->items, n, kv_PyLong_Type, kv_long_layout, msg, nblocks, prev_off, ids_off, chunk, hashes,
	                      max_hashes);
}

int64_t kv_chain_fake_ints(const uint32_t *ids, size_t n, int layout, uint8_t *msg, size_t nblocks, size_t prev_off,
                           size_t ids_off, size_t chunk, uint8_t *hashes, size_t max_hashes) {
	static int fake_type;
	if (!kv_chain_sha_ni()) return -1;
	struct kv_pylong *ints = calloc(n ? n : 1, sizeof *ints);
	void **items = calloc(n ? n : 1, sizeof *items);
	if (!ints || !items) { free(ints); free(items); return -3; }
	for (size_t i = 0; i < n; i++) {
		uint32_t v = ids[i];
		intptr_t digits = v == UINT32_MAX ? 3 : v == 0 ? 0 : v < (1u << 30) ? 1 : 2;
		ints[i].type = &fake_type;
		ints[i].word = layout == KV_LONG_LVTAG ? (v == 0 ? 1 : digits << 3) : digits;
		ints[i].digit[0] = v & ((1u << 30) - 1);
		ints[i].digit[1] = v >> 30;
		items[i] = &ints[i];
	}
	int64_t r = chunk ? kv_chain_items(items, (ssize_t)n, &fake_type, layout, msg, nblocks, prev_off, ids_off, chunk,
	                                   hashes, max_hashes) : -1;
	free(items);
	free(ints);
	return r;
}
