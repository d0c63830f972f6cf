/*
 * kvshim_l2.h - the C ABI of kvshim L2 backend plugins.
 *
 * A storage vendor ships an L2 backend for kvshim as a shared library that
 * exports one function, kvshim_l2_plugin(), returning a table of the
 * functions below. kvshim loads it with
 *
 *     kvshim serve --l2-adapter '{"type":"plugin","library":"/path/libx.so", ...}'
 *     kvshim serve --l2-adapter '{"type":"plugin","plugin":"x", ...}'   (installed)
 *
 * and calls it with batches of keys, with the same per-key semantics as
 * every built-in backend (server/l2/doc.go). docs/l2-plugins.md is the
 * guide; examples/l2-plugin/ is a complete plugin that passes kvshim's L2
 * contract suite.
 *
 * Where it runs. kvshim never loads a plugin into its own process: a small
 * host program, kvshim-l2-host, dlopens it and serves kvshim over a pipe.
 * A plugin that crashes kills only its host (kvshim fails that host's
 * pending keys as L2 errors and starts a new host for the next batch); one
 * that hangs past the adapter's deadline fails its keys like any backend
 * and is killed after a grace period. The plugin never sees kvshim's L1
 * memory: the buffers of a call are a shared-memory window that kvshim
 * copies into (store) or out of (load, only for keys the plugin reports
 * KVSHIM_L2_OK) around that call.
 *
 * Versioning. KVSHIM_L2_ABI_VERSION names this header's ABI. The host
 * calls kvshim_l2_plugin() and reads abi_version before anything else; a
 * plugin built for another version is refused ("built for ABI X; this
 * kvshim speaks ABI Y") and none of its other functions is called. A new
 * version may only append members to struct kvshim_l2_ops; struct_size
 * says how many the plugin filled in.
 *
 * Threads. open() is called once, before anything else; close() once, last,
 * after every other call has returned. lookup, store, load and remove are
 * called concurrently from several host threads (one per batch kvshim has
 * in flight: at most the adapter's lane workers), on the same state, and
 * must be thread-safe. A batch function should return within the adapter's
 * op_timeout_ms (default 10 s): past it kvshim reports the batch's keys
 * failed, and the host is killed if the call has not returned
 * hang_grace_ms later.
 *
 * Memory. Every pointer a call receives (keys, bufs, lens, status, sizes,
 * err) is owned by the host and valid only until the call returns; the
 * plugin keeps none of them. store's bufs are read-only for the plugin.
 * load writes exactly lens[i] bytes into bufs[i] for a key it reports
 * KVSHIM_L2_OK; it may have written part of bufs[i] for any other status
 * (kvshim discards those bytes). The plugin owns its state and everything
 * it allocates; close() frees them.
 *
 * Semantics (per key; the status array has one entry per key, which the
 * host sets to KVSHIM_L2_EIO before the call, so an entry the plugin leaves
 * alone is a failure):
 *   - Objects are immutable: store of a key that exists is KVSHIM_L2_OK.
 *     A batch may name a key twice (both entries get a status).
 *   - A miss is not a failure: an absent key is KVSHIM_L2_MISS for lookup,
 *     load and remove.
 *   - A corrupt object (a checksum that does not match, a truncated file)
 *     is KVSHIM_L2_MISS for load and lookup, and should be removed so it is
 *     not found again; the next store of the key replaces it.
 *   - load of an intact object whose size is not lens[i] is
 *     KVSHIM_L2_ESIZE (kvshim's buffer is the object's size), and the
 *     object is kept.
 *   - Partial failure: each key's status stands alone; keys that
 *     succeeded stay succeeded (no rollback).
 *   - Holds: kvshim counts a hold on every key a lookup finds and refuses
 *     to call remove for a held key, so a plugin needs no lock of its own
 *     for it; a backend with its own protection (a lease) answers
 *     KVSHIM_L2_EBUSY.
 *   - Keys are content-addressed, but bind the bytes to the key anyway
 *     (name objects by key->name and verify what you read): kvshim also
 *     checks every loaded object's header against the key it asked for.
 */
#ifndef KVSHIM_L2_H
#define KVSHIM_L2_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1: the first ABI. */
#define KVSHIM_L2_ABI_VERSION 1

/* Per-key status codes (int32_t). */
#define KVSHIM_L2_OK      0  /* stored / present / loaded / removed */
#define KVSHIM_L2_MISS    1  /* absent (or corrupt and discarded) */
#define KVSHIM_L2_EIO    -1  /* the operation failed for this key */
#define KVSHIM_L2_ESIZE  -2  /* load: the object's size is not lens[i] */
#define KVSHIM_L2_ENOSPC -3  /* store: the backend is full (a lost save, not retried) */
#define KVSHIM_L2_EBUSY  -4  /* remove: the backend protects the key (a lease) */
#define KVSHIM_L2_EINVAL -5  /* the plugin refuses the argument */
#define KVSHIM_L2_EUNAVAIL -6 /* the backend is unreachable (its server is down) */

/* open's return codes: KVSHIM_L2_OK or one of these (err says why). */
#define KVSHIM_L2_EBADCONFIG -100 /* the config is wrong: kvshim names it as a bad adapter config */

/* Length of a key's name, without the terminating NUL:
 * <namespace 32 hex>@<rank 8 hex>@<hash 64 hex>, kvshim's kv.Key.String(). */
#define KVSHIM_L2_KEY_NAME_LEN 106

/* One key: the binary fields and the same key as a printable name (a
 * NUL-terminated string of [0-9a-f@], usable as a file or object name). */
typedef struct kvshim_l2_key {
  uint8_t  ns[16];   /* namespace fingerprint */
  uint32_t rank;     /* KV rank, host byte order */
  uint8_t  hash[32]; /* chained chunk hash */
  char     name[KVSHIM_L2_KEY_NAME_LEN + 2]; /* NUL-terminated, padded with NULs */
} kvshim_l2_key;     /* 160 bytes */

/* err/err_len in every call: an optional message buffer (NUL-terminated,
 * truncated to err_len) for the first failure of the call; kvshim appends
 * it to the keys' errors. It may be left empty. */

typedef struct kvshim_l2_ops {
  uint32_t abi_version; /* KVSHIM_L2_ABI_VERSION the plugin was built with */
  uint32_t struct_size; /* sizeof(struct kvshim_l2_ops) at build time */
  const char *name;     /* short name for logs, e.g. "example_files" */

  /* Opens the backend. config is the adapter's pass-through config: a JSON
   * object (config_len bytes, NUL-terminated) of every --l2-adapter key
   * kvshim does not own. On KVSHIM_L2_OK *state is the plugin's handle for
   * the other calls. */
  int32_t (*open)(const char *config, size_t config_len, void **state, char *err, size_t err_len);

  /* status[i]: OK (present) or MISS; sizes[i]: the object's payload size
   * when known, else 0. */
  void (*lookup)(void *state, const kvshim_l2_key *keys, size_t n, int32_t *status, uint64_t *sizes,
                 char *err, size_t err_len);

  /* Writes bufs[i] (lens[i] bytes) under keys[i]. */
  void (*store)(void *state, const kvshim_l2_key *keys, const void *const *bufs, const uint64_t *lens,
                size_t n, int32_t *status, char *err, size_t err_len);

  /* Reads keys[i] into bufs[i] (exactly lens[i] bytes). */
  void (*load)(void *state, const kvshim_l2_key *keys, void *const *bufs, const uint64_t *lens, size_t n,
               int32_t *status, char *err, size_t err_len);

  /* Removes keys[i]: OK, MISS (absent), or a failure. */
  void (*remove)(void *state, const kvshim_l2_key *keys, size_t n, int32_t *status, char *err, size_t err_len);

  /* Releases everything open allocated. */
  void (*close)(void *state);
} kvshim_l2_ops;

/* The one symbol a plugin exports. It must return a pointer to a table
 * that lives as long as the library is loaded (a static const struct), and
 * must not fail or block. */
const kvshim_l2_ops *kvshim_l2_plugin(void);

#ifdef __cplusplus
}
#endif

#endif /* KVSHIM_L2_H */
