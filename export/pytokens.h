// The C half of pytokens.go: Python token lists read in place (no Python
// headers or libpython at build time; the C API is found with dlsym).
#ifndef KVSHIM_PYTOKENS_H
#define KVSHIM_PYTOKENS_H

#include <stddef.h>
#include <stdint.h>

// kv_py_u32 writes the ids of list into out[0:cap]. Returns the length
// (>= 0; more than cap: nothing written), -1 when list is no list or the
// C API is missing, or -2-i when item i is no int in [0, 2^32) (the
// exception is cleared: the caller's own conversion names it).
int64_t kv_py_u32(void *list, uint32_t *out, size_t cap);

// kv_py_chain reads the ids of list as kv_py_u32 does and, as it reads,
// hashes its full chunks of chunk ids with SHA-256: msg is the padded
// message of a chunk (nblocks blocks of 64 bytes) with the hash before
// chunk 0 at prev_off and room for the chunk's ids (u32le) at ids_off; the
// hash of chunk c is written to hashes[32c:] and becomes the next chunk's
// prev. Returns the list's length (more than max_hashes full chunks:
// nothing hashed), or -1 where it does not apply: no Python, no exact list,
// ints not readable in place, an item that is no exact int in [0, 2^32), a
// CPU without the SHA extensions (kv_py_u32 then reads the list, and names
// a bad item). Overwrites msg.
int64_t kv_py_chain(void *list, uint8_t *msg, size_t nblocks, size_t prev_off, size_t ids_off, size_t chunk,
                    uint8_t *hashes, size_t max_hashes);

// kv_chain_fake_ints is kv_py_chain over n ints made here in the int layout
// layout (1: ob_size, 2: lv_tag) from ids, where ids[i] == UINT32_MAX
// makes item i an int of three digits (out of range): for export's Go
// tests, which cannot call C themselves (cgo is not allowed in _test.go).
int64_t kv_chain_fake_ints(const uint32_t *ids, size_t n, int layout, uint8_t *msg, size_t nblocks, size_t prev_off,
                           size_t ids_off, size_t chunk, uint8_t *hashes, size_t max_hashes);

// kv_chain_sha_ni reports whether kv_py_chain can hash here: built for
// x86-64 and a CPU with SSSE3, SSE4.1 and the SHA extensions (CPUID).
int kv_chain_sha_ni(void);

// Called with the GIL held. kv_py_can_release: PyEval_SaveThread and
// PyEval_RestoreThread were found; kv_py_release releases the caller's
// GIL and returns its thread state for kv_py_reacquire.
int kv_py_can_release(void);
void *kv_py_release(void);
void kv_py_reacquire(void *ts);

#endif
