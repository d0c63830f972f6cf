// Package mooncake is the "mooncake_store" L2 adapter: Mooncake Store
// (kvcache-ai/Mooncake) through the client in the PyPI wheel, run in a
// helper process. Registered as l2 type "mooncake_store".
//
// # What the wheel contains (investigated 2026-11-30)
//
// mooncake-transfer-engine 0.3.13.post1 (cp311 manylinux_2_28, 98 MB) and
// its -non-cuda twin ship, in site-packages/mooncake/:
//
//   - mooncake_master, mooncake_client, transfer_engine_bench: executables
//     (master needs libibverbs.so.1, libnuma.so.1, libcurl.so.4 from the
//     system: Debian libibverbs1 libnuma1 libcurl4; the rest is bundled in
//     mooncake_transfer_engine.libs/).
//   - store.so: the pybind11 module (MooncakeDistributedStore). Its only C
//     symbol is PyInit_store; `nm -D --defined-only` finds no mooncake_store_*
//     symbol in store.so, engine.so, libmooncake_pg.so or the executables.
//     The CUDA wheel's store.so also NEEDs libcuda.so.1 and libcudart.so.12,
//     so it does not even load on a machine without a GPU driver; the
//     -non-cuda wheel's does.
//   - engine.so (transfer engine bindings), libmooncake_pg.so, libetcd_wrapper,
//     Python modules (mooncake_store_service, http_metadata_server, ...).
//
// There is no libmooncake_store.so with the C API (store_c.h,
// WITH_STORE_C_SHARED) in the wheel, and no Debian package; building it
// needs a Mooncake source tree with yalantinglibs.
//
// # What works on this machine (no RDMA, TCP only)
//
// mooncake_master --rpc_port P --enable_http_metadata_server=true
// --http_metadata_server_port H starts in about a second. A client with
// setup({"local_hostname":"127.0.0.1","metadata_server":"http://127.0.0.1:H/metadata",
// "master_server_addr":"127.0.0.1:P","protocol":"tcp","global_segment_size":...})
// puts and gets; batch_put_from / batch_get_into work on a memfd mapping
// registered with register_buffer; batch_get_into returns the byte count
// per key, -704 (OBJECT_NOT_FOUND) for a miss; put of an existing key
// returns 0 (immutable keys); batch_is_exist returns 1/0; remove right
// after an exists returns -706 (OBJECT_HAS_LEASE): exists grants the
// default_kv_lease_ttl lease. setup(dict) takes string values. With
// metadata_server "P2PHANDSHAKE" a master started without the HTTP metadata
// server works as well.
//
// # Design: an out-of-process helper
//
// With no C API to dlopen, the adapter starts `helper_python -u
// helper.py` (embedded in this package) and talks to it over its
// stdin/stdout with length-prefixed JSON frames (see helper.py). Payloads
// never cross the pipe: both processes map the same shared memory.
//
//	Go (kvshim server)                         helper (python3 + wheel)
//	  L1 memfd segment ──RegisterL1Segment──►  mmap /proc/<pid>/fd/<fd>, register_buffer
//	  bounce memfd (segment 0) ─────────────►  mmap, register_buffer
//	  Store(keys, bufs) ── {"op":"put", keys, seg, off, len} ──► batch_put_from(keys, base+off, len)
//	  Load(keys, bufs)  ── {"op":"get", ...} ──────────────────► batch_get_into(...)
//	  LookupAndHold     ── {"op":"exists", keys} ──────────────► batch_is_exist
//	  Delete            ── {"op":"remove", keys} ──────────────► batch_remove(keys, force=False)
//	  ◄── {"id", "res": [code per key]} (requests run concurrently on a thread pool)
//
// A buffer inside a registered L1 segment is moved with no copy (Mooncake
// reads/writes the L1 bytes in place). Any other buffer goes through the
// bounce segment (one memcpy each way; a batch larger than the bounce area
// is sent in parts). Each batch is one request (Tiles = 1, Mooncake's batch
// calls parallelise internally); the lanes give concurrency across batches.
//
// Semantics: put of an existing key is success; exists = StatusOK and takes
// Mooncake's lease (plus the l2 layer's local hold count, which does not
// extend the lease); a get returning <= 0 or -704 is a miss; a size other
// than len(dst) is ErrBufferSize (Mooncake answers a smaller buffer with
// INVALID_PARAMS; the helper then answers the object's size); every other
// negative code fails that key
// only, with the code's name (LEASE_EXPIRED, TRANSFER_FAIL, ...). remove
// honours other readers' leases (OBJECT_HAS_LEASE fails the key).
//
// Failure: when the helper dies, every pending key fails with
// l2.ErrUnavailable; the next operation restarts it (at most once every
// 2 s, failing fast in between), re-running setup and re-registering every
// segment. Objects held in the dead helper's global segment are lost with
// it (Mooncake keeps data in the client's mounted segment). A task deadline fails the keys of a
// request still in the helper; its bounce pages are freed only when the
// helper answers. Caution: a timed-out load into a registered L1 buffer may
// still be written by Mooncake afterwards, so the caller must not reuse that
// staging buffer for another object before closing the adapter (or until
// the lease window, default 10 s, has passed).
//
// # Capacity
//
// Mooncake Store evicts by itself; the adapter adds nothing (no wheel
// setting exists for it: setup() takes none, the master's flags do). The
// pool is the sum of the global segments mounted on the master: every
// client's "global_segment_size" (each kvshim server's helper mounts one,
// and so does any other client of the same master), in the memory of the
// process that mounted it. What the master does when the pool fills
// (Mooncake's mooncake-store.md, "Eviction Policy" and "Lease", and
// mooncake_master --help of the 0.3.13.post1 wheel):
//
//   - Its eviction thread evicts when usage passes
//     --eviction_high_watermark_ratio (0.9 in this wheel; the docs say
//     0.95), and a put that finds no space fails with -200
//     NO_AVAILABLE_HANDLE and triggers an eviction. Each eviction removes
//     --eviction_ratio (0.05) of the objects. Evicted objects are only
//     marked deleted: no data moves.
//   - The order is approximately least recently used. Objects with an
//     active lease are never evicted: an exists or a get grants one for
//     --default_kv_lease_ttl (10 s in this wheel), so a kvshim lookup
//     protects what it found until its load is done (or the lease ends).
//     Objects whose put has not completed are never evicted either, and
//     soft-pinned ones go last (kvshim does not soft-pin;
//     --allow_evict_soft_pinned_objects, --default_kv_soft_pin_ttl).
//     Space of puts that never completed is reclaimed after
//     --put_start_release_timeout_sec (600).
//   - Here a put failing with NO_AVAILABLE_HANDLE is that key's failed
//     store: a lost save, not retried (the request is not affected), and
//     later puts succeed once the master has evicted.
//     TestMooncakeEvictsWhenFull (64 objects of 1 MiB into a 16 MiB
//     segment, default flags) saw 52 puts succeed and 12 fail, 13 objects
//     left, the newest, and the objects a lookup kept leased all along
//     survived.
//
// To size it: give each helper the global_segment_size its host can
// spare; to have fewer failed puts under a stream of saves, start the
// master with a lower --eviction_high_watermark_ratio (e.g. 0.8) and a
// larger --eviction_ratio, so that the eviction thread makes room before
// puts find none. The adapter-owned "eviction" key of --l2-adapter does
// not configure any of this (the master's flags do).
//
// Config: adapter-owned keys are "helper_python" (default python3),
// "bounce_buffer_size" (bytes, default 64 MiB), "setup_timeout_ms"
// (60000), "helper_log" (file for the helper's stderr) and LMCache's
// "preregister_l1_memory" (accepted; segments are always registered).
// Every other key goes to MooncakeDistributedStore.setup(dict) unchanged, as
// a string: local_hostname and metadata_server are required
// (P2PHANDSHAKE or http://host:port/metadata), master_server_addr,
// protocol, rdma_devices, global_segment_size, local_buffer_size, ... The
// misspelling master_server_address (ignored by Mooncake) is refused.
//
// Tests need the wheel and its master: they skip with the reason otherwise.
// Set KVSHIM_MOONCAKE_PYTHON to a python that imports mooncake.store, e.g.
//
//	python3 -m venv /opt/mc && /opt/mc/bin/pip install mooncake-transfer-engine-non-cuda
//	apt-get install -y libibverbs1 libnuma1 libcurl4
//	KVSHIM_MOONCAKE_PYTHON=/opt/mc/bin/python go test ./server/l2/mooncake/
//
// A future in-process variant can dlopen a libmooncake_store.so built with
// WITH_STORE_C_SHARED (mooncake_store_* C API) behind the same Backend.
package mooncake
