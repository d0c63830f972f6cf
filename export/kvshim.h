/*
 * kvshim.h - the stable C ABI of libkvshim.so.
 *
 * kvshim saves vLLM's paged KV cache to shared host memory (L1) and shared
 * storage (L2) and restores it into fresh pages. This header is handwritten
 * and versioned by KVSHIM_ABI_VERSION; cgo's generated header is a build
 * artefact. build/check-header.py fails the build when the two disagree.
 *
 * Conventions:
 *   - Objects are named by integer handles (kvshim_handle). 0 is never a
 *     valid handle; it names "the library" in kvshim_last_error.
 *   - Every function that can fail returns KVSHIM_OK (0) or a negative
 *     KVSHIM_E* code; kvshim_last_error copies the message of the last
 *     failure of a handle (or of the library, handle 0).
 *   - The caller owns every buffer; the library never keeps a pointer to
 *     caller memory after a call returns, except the KV cache memory it was
 *     registered with, which must outlive the handle.
 *   - Lengths are trusted: a (pointer, length) pair must describe memory
 *     the caller owns for the whole call. A length larger than the buffer
 *     (e.g. n = 2^30 tokens for a 16-token array) makes the library read
 *     past it, and a read of unmapped memory kills the process with the Go
 *     runtime's "fatal error: fault", which no recover() can catch: the
 *     same contract as memcpy's.
 *   - A panic inside the library is recovered and returned as
 *     KVSHIM_EPANIC; it never crashes the host process.
 *   - The Go runtime does not survive fork(): load the library after the
 *     process has forked (vLLM workers: in the connector's constructor).
 *
 * Threads:
 *   - Every function may be called from any thread, concurrently, on the
 *     same handle or on different ones.
 *   - The last error is per handle, not per thread: it is the message of
 *     the latest failure on that handle from any thread. Read it right after
 *     the failing call, or serialize calls on a handle whose messages you
 *     need.
 *   - Output kept after KVSHIM_ERANGE is per handle and OS thread: take it
 *     with kvshim_take_output on the thread that got KVSHIM_ERANGE.
 *   - kvshim_close(h) is safe against calls in flight on h: from the moment
 *     it starts, new calls on h return KVSHIM_EBADH; it waits for the calls
 *     already running on h to return (each is bounded by its own timeout),
 *     then frees h's resources.
 * *
 * Block ids (one form everywhere: kvshim_sched_after_alloc,
 * kvshim_sched_finished_tokens and step_json's "blocks" / "new_blocks"):
 * every KV-cache group's ids in one array of n_groups ("groups") equal
 * parts, group 0 first, each part padded with -1 to the longest. n_groups
 * is stated by the caller and must be the namespace's group count (1 for a
 * model without groups; 0 reads as 1); an array of no ids is no blocks in
 * any group.
 * With groups other than one full-attention group, block id 0 (vLLM's
 * null block) means "no block".
 */
#ifndef KVSHIM_H
#define KVSHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI's version, MAJOR.MINOR. A caller built for MAJOR.MINOR works with
 * any library of the same MAJOR and a MINOR at least its own: MINOR grows
 * when functions or codes are added (a caller that can do without a newer
 * function looks it up with dlsym), MAJOR when anything is removed or
 * changes meaning. kvshim_abi_version() returns MAJOR * 1000 + MINOR.
 * History: 2 dropped the walking-skeleton exports; 4 added
 * kvshim_sched_match_list; 5.0 is 4 made MAJOR.MINOR (kvshim_close waits
 * for calls in flight; kvshim_open refuses out-of-range fields); 5.1 adds
 * the scheduler's controls (kvshim_sched_reset, _hit_sources,
 * _request_options, _received), the scheduler's "kv_role" key and
 * kvshim_worker_take_latencies; 5.2 adds layer-wise loads
 * (kvshim_worker_start_loads_layered, _wait_layer, _wait_layers); 5.3 the KV
 * events (kvshim_worker_take_save_reports, kvshim_sched_save_reports,
 * kvshim_sched_take_events); 5.4 layer-wise saves (kvshim_worker_save_layer); 5.5
 * kvshim_vllm_namespace (and, for tests, kvshim_meta_json); 5.6
 * kvshim_vllm_config, kvshim_vllm_tensors and kvshim_worker_start_loads_wait;
 * 6.0 states the group count of block ids (n_groups of
 * kvshim_sched_after_alloc and kvshim_sched_finished_tokens, step_json's
 * "groups"), drops step_json's "group_blocks" / "new_group_blocks" and adds
 * kvshim_take_step_stats. */
#define KVSHIM_ABI_MAJOR 6
#define KVSHIM_ABI_MINOR 0
#define KVSHIM_ABI_VERSION (KVSHIM_ABI_MAJOR * 1000 + KVSHIM_ABI_MINOR)

typedef int64_t kvshim_handle;

#define KVSHIM_OK         0
#define KVSHIM_EINVAL    -1  /* bad argument: NULL pointer, malformed JSON, bad geometry */
#define KVSHIM_EBADH     -2  /* unknown or closed handle */
#define KVSHIM_EPANIC    -3  /* a panic inside the library, recovered */
#define KVSHIM_ERANGE    -4  /* caller's buffer too small; output truncated */
#define KVSHIM_ENOTSUP   -5  /* not supported here (e.g. no CUDA driver) */
#define KVSHIM_ETIMEDOUT -6  /* a wait ran past its timeout */
#define KVSHIM_EIO       -7  /* the server or a peer failed */
#define KVSHIM_ENOSPC    -8  /* no space: the kernel refused memory or disk, or an L2 backend is full */
#define KVSHIM_ECLOSED   -9  /* the handle or its connection is shutting down */
#define KVSHIM_EINTERNAL -10 /* anything else; see kvshim_last_error */
/* The codes are assigned in one place (export/errors.go: every sentinel
 * error of the library and its code). A save that finds the cache full is
 * skipped, as a cache may skip, and is never an error: KVSHIM_ENOSPC is
 * for space the library needs and cannot get. */

/* Returns KVSHIM_ABI_VERSION of the loaded library (MAJOR * 1000 + MINOR).
 * Never fails. */
int kvshim_abi_version(void);

/* Copies the library version string, NUL-terminated, into buf[0:len].
 * Returns KVSHIM_OK, KVSHIM_EINVAL (buf NULL or len 0) or KVSHIM_ERANGE
 * (truncated; buf still holds a NUL-terminated prefix). */
int kvshim_version(char *buf, size_t len);

/* Copies the last error message of handle h (h == 0: of calls that had no
 * valid handle, such as a failed kvshim_open or an unknown handle) into
 * buf[0:len], NUL-terminated. Reading does not clear the message.
 * Returns KVSHIM_OK, KVSHIM_EINVAL, KVSHIM_ERANGE (truncated) or
 * KVSHIM_EBADH (h is not open). */
int kvshim_last_error(kvshim_handle h, char *buf, size_t len);

/* Opens a handle described by a JSON object whose "role" selects what it is
 * (its keys and their ranges: export/schema/open.json). On success stores
 * the handle in *out and returns KVSHIM_OK. Errors: KVSHIM_EINVAL (NULL
 * argument, not JSON, unknown role or key), or the role's own failures;
 * read the message with kvshim_last_error(0, ...). */
int kvshim_open(const char *config_json, kvshim_handle *out);

/* Closes h and releases everything it owns (connections, holds, staging
 * space, copy streams), after the calls in flight on h have returned (see
 * Threads above). Returns KVSHIM_OK or KVSHIM_EBADH (unknown or already
 * closed; the message is on handle 0). */
int kvshim_close(kvshim_handle h);

/* Runs the kvshim command line (doctor, serve, stat, ...) with argv[0] the
 * program name; blocks until the command ends and returns its exit code
 * (0 success, 1 failure, 2 usage error). */
int kvshim_main(int argc, char **argv);

/* Returns output that did not fit: a call that writes variable-length
 * output into (buf, cap) sets *out_len to the length; when it does not fit
 * it returns KVSHIM_ERANGE and keeps the bytes on the handle for the
 * calling thread, and this call, made on the same thread, copies them into
 * a buffer of at least *out_len bytes. Threads sharing a handle never see
 * each other's pending output: each thread has at most one per handle (a
 * newer KVSHIM_ERANGE replaces it), taken once, or freed by kvshim_close.
 * KVSHIM_EINVAL when this thread has nothing pending on h. */
int kvshim_take_output(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* Server and connector counters of h as one JSON object (variable-length
 * output, see kvshim_take_output; schema: export/schema/stats.json). */
int kvshim_stats(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* vLLM's get_kv_connector_stats (ABI 6.0): h's counters since the previous
 * call, by metric name, as one JSON object of numbers (variable-length
 * output). A scheduler handle: hit_tokens (tokens vLLM was told to load)
 * and hit_requests. A worker handle: every counter of kvshim_stats'
 * "worker" but the Populate* ones, snake_case (saved_chunks, ...), and
 * load_seconds / save_seconds, the job durations since the previous call
 * (lists, present when not empty; they are the samples
 * kvshim_worker_take_latencies would return). Schema:
 * export/schema/step_stats.json. */
int kvshim_take_step_stats(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* ---- Tool role ({"role": "tool", "server": SOCKET}): a plain session. ----
 *
 * kvshim_ping sends body[0:n] to the server, which echoes it; the answer is
 * variable-length output. A round-trip probe for health checks and the
 * IPC benchmark. */
int kvshim_ping(kvshim_handle h, const void *body, size_t n, void *buf, size_t cap, size_t *out_len);

/* ---- Scheduler role: the vLLM scheduler-side connector. ----
 *
 * kvshim_sched_match answers get_num_new_matched_tokens for request req_id
 * with prompt tokens[0:n_tokens] and extras_json ({"cache_salt": str,
 * "lora": {"name": str, "path": str}, "mm": [{"hash": str, "offset": int,
 * "length": int}]}, each optional, or NULL; malformed extras are
 * KVSHIM_EINVAL naming the field; schema: export/schema/extras.json).
 * *out is the number of
 * tokens beyond num_computed that can be loaded asynchronously, or -1 while
 * the lookup is pending (ask again next step). A dead or slow server is a
 * miss (0), never an error. */
int kvshim_sched_match(kvshim_handle h, const char *req_id, const uint32_t *tokens,
                       size_t n_tokens, const char *extras_json, int64_t num_computed,
                       int64_t *out);

/* Answers update_state_after_alloc: blocks[0:n_blocks] are all block ids
 * of the request in token order, n_groups groups of them (Block ids
 * above); num_computed the tokens vLLM has (negative: the value given to
 * the match); num_external the tokens to load. Plans the load; releases
 * other holds. KVSHIM_EINVAL when the ids are not n_groups equal parts or
 * n_groups is not the namespace's. */
int kvshim_sched_after_alloc(kvshim_handle h, const char *req_id, const int64_t *blocks,
                             size_t n_blocks, size_t n_groups, int64_t num_computed,
                             int64_t num_external);

/* Answers build_connector_meta for one step described by step_json
 * ({"requests": [{"req", "blocks" (new and resumed requests: all their
 * ids), "new_blocks" (running ones: the ids added this step), "groups"
 * (their group count, Block ids above; absent: 1), "computed",
 * "scheduled", "tokens", "tokens_from"}], "preempted": [...]}); writes the
 * workers' metadata (variable-length output). Resets the pending loads and
 * finished requests. A malformed step is KVSHIM_EINVAL naming the request,
 * and nothing pending is lost. Schema: export/schema/step.json. */
int kvshim_sched_build_meta(kvshim_handle h, const char *step_json, void *buf, size_t cap,
                            size_t *out_len);

/* Answers request_finished: releases the request's holds and sets *delay to
 * 1 when vLLM must keep its blocks until the workers report the request in
 * finished_sending, else 0. */
int kvshim_sched_finished(kvshim_handle h, const char *req_id, int *delay);

/* Answers request_finished for a request that finished normally (stopped
 * or length-capped), as kvshim_sched_finished, and also saves every full
 * chunk it computed, prompt and generated alike, beyond those already
 * saved, under the same chained keys (so the next turn of a conversation
 * hits them): tokens[0:n_tokens] are the request's token ids from token
 * first on (first at most the prompt's full chunks: 0 is always right),
 * num_computed the tokens whose KV its blocks hold (vLLM's
 * num_computed_tokens less those still in flight), blocks[0:n_blocks] its
 * block ids in token order, n_groups groups of them (Block ids above). The
 * saves go with the next step's metadata; *delay is 1 when there are any.
 * *delay is set even when the call fails (tokens or blocks that do not fit
 * the request: KVSHIM_EINVAL, nothing new saved). */
int kvshim_sched_finished_tokens(kvshim_handle h, const char *req_id, const uint32_t *tokens,
                                 size_t n_tokens, int64_t first, int64_t num_computed,
                                 const int64_t *blocks, size_t n_blocks, size_t n_groups,
                                 int *delay);

/* ---- Scheduler role: vLLM's controls. ----
 *
 * The scheduler role's open config may name vLLM's "kv_role":
 * "kv_producer" (saves, never looks up or loads), "kv_consumer" (looks up
 * and loads, never saves) or "kv_both" (the default); another value is
 * KVSHIM_EINVAL naming it. */

/* Answers reset_cache (vLLM's reset_prefix_cache with reset_connector): the
 * server moves this deployment's namespaces to a new generation, after
 * which no chunk stored before is found in any tier (L1 or L2), by this
 * instance or any other of the deployment; *generation is the generation
 * now in force. KVSHIM_EIO: the server was not reached and nothing was
 * reset (*generation is the old one). */
int kvshim_sched_reset(kvshim_handle h, uint64_t *generation);

/* Answers get_external_cache_hit_sources: the num_external tokens of
 * req_id's planned load split by the tier each chunk came from, as a JSON
 * object of vLLM's CacheHitSource values ("host": L1, "disk": an fs L2,
 * "external_unspecified": a networked L2 or unknown) to token counts, only
 * non-zero ones, summing to num_external (variable-length output; schema:
 * export/schema/hit_sources.json). */
int kvshim_sched_hit_sources(kvshim_handle h, const char *req_id, int64_t num_external, void *buf,
                             size_t cap, size_t *out_len);

/* Sets req_id's kvshim settings from its kv_transfer_params (params_json,
 * a JSON object or NULL) before its first kvshim_sched_match: keys
 * "kvshim.skip_load" and "kvshim.skip_save" (booleans); keys without the
 * "kvshim." prefix are other connectors' and are passed over. An unknown
 * kvshim key or a value that is no boolean is KVSHIM_EINVAL naming it, and
 * the request is then neither loaded nor saved. Schema:
 * export/schema/request_options.json. */
int kvshim_sched_request_options(kvshim_handle h, const char *req_id, const char *params_json);

/* Tells the scheduler the requests whose loads vLLM saw finish
 * (finished_recving), a JSON array of request ids: a request finished
 * (aborted) after its load was planned and before this is recorded as a
 * cancelled load (trace record kind cancel, event load_dropped). Schema:
 * export/schema/received.json. */
int kvshim_sched_received(kvshim_handle h, const char *ids_json);

/* Worker role, for vLLM's /metrics: the durations in seconds of the load
 * and save jobs that ended since the last call, as JSON {"load": [...],
 * "save": [...], "dropped": n} (a list is null when no job of its kind
 * ended; at most 4096 of each kept between calls; dropped counts the rest)
 * (variable-length output; schema: export/schema/latencies.json). */
int kvshim_worker_take_latencies(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* KV events (vLLM's take_events; ABI 5.2). Nothing is recorded until the
 * first call of kvshim_worker_take_save_reports (worker) or
 * kvshim_sched_take_events (scheduler).
 *
 * Worker role: how each chunk of each save job ended since the last call,
 * a JSON array of {"r": request id, "g": KV-cache group, "k": KV rank,
 * "h": chunk hash (64 hex digits), "ok": committed} (at most 65536 kept
 * between calls) (variable-length output; schema:
 * export/schema/save_reports.json). */
int kvshim_worker_take_save_reports(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* Scheduler role: one engine step's save reports, a JSON array of every
 * rank's kvshim_worker_take_save_reports array. A chunk every KV rank
 * committed becomes a "stored" event; one a rank did not commit is
 * forgotten (never announced). A hash that is no chunk hash is
 * KVSHIM_EINVAL (the other reports are still taken). Schema:
 * export/schema/save_reports.json, its $defs.step. */
int kvshim_sched_save_reports(kvshim_handle h, const char *reports_json);

/* Scheduler role: the events since the last call, as JSON {"events":
 * [{"kind": "stored", "req", "group", "first_block", "blocks", "medium":
 * "CPU", "chunks"} | {"kind": "cleared"} | {"kind": "removed" or
 * "stored_chunk", "medium", "chunk"}], "done": [request ids finished with
 * nothing left to announce], "dropped": chunks never announced (their
 * reports did not come within 2 minutes, or the table of 65536 pending
 * chunks was full), "pending": chunks waiting for reports, "reported":
 * reports matched} (variable-length output). kvshim_sched_reset adds a
 * "cleared" event. Schema: export/schema/events.json. */
int kvshim_sched_take_events(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* ---- Worker role: the vLLM worker-side connector (one per rank). ---- */

/* Registers the KV cache tensors: a JSON array of tensor descriptions
 * (layer, group, backend, device, data_ptr, dtype_size, shape,
 * stride_bytes, dims; schema: export/schema/tensors.json). Errors:
 * KVSHIM_EINVAL for unsupported or
 * inconsistent geometry (the message names the layer and the field) and
 * for a second registration on the same handle; KVSHIM_ENOTSUP for a GPU
 * cache where no CUDA driver can be loaded. */
int kvshim_worker_register(kvshim_handle h, const char *tensors_json);

/* Binds one step's metadata (meta[0:n] from kvshim_sched_build_meta) and
 * waits at most timeout_ms for the copies of requests it lists as
 * preempted: KVSHIM_ETIMEDOUT when they still run then (the metadata is
 * bound regardless). */
int kvshim_worker_bind(kvshim_handle h, const void *meta, size_t n, int64_t timeout_ms);

/* Starts the bound step's loads (asynchronous; see kvshim_worker_poll). */
int kvshim_worker_start_loads(kvshim_handle h);

/* kvshim_worker_start_loads, then, when the bound step has loads, waits at
 * most wait_ms for kvshim_worker_poll to have something to report (ABI
 * 5.6). For a step without a forward pass (vLLM's no-forward step): its
 * output then reports the loads and vLLM computes the request in the next
 * step instead of after one more empty step. KVSHIM_OK whether or not a
 * load ended in time. */
int kvshim_worker_start_loads_wait(kvshim_handle h, int64_t wait_ms);

/* Starts the bound step's saves after the forward pass; stream_event is a
 * CUevent recorded on vLLM's stream (0 for CPU caches). */
int kvshim_worker_start_saves(kvshim_handle h, uint64_t stream_event);

/* Reports, as JSON {"sending": [...], "recving": [...], "error_blocks": [...],
 * "failed": [...]}, the delay-freed requests whose copies ended, the
 * requests whose loads ended, the blocks whose loads failed and the
 * requests with a failed load (each once, no later than its "recving"),
 * since the last call (variable-length output; schema:
 * export/schema/poll.json). */
int kvshim_worker_poll(kvshim_handle h, void *buf, size_t cap, size_t *out_len);

/* Blocks until kvshim_worker_poll has something to report (a load ended, a
 * delay-freed request's copies ended) or timeout_ms passes
 * (KVSHIM_ETIMEDOUT): a caller waiting for completion blocks here instead
 * of calling kvshim_worker_poll in a loop. Reports nothing itself. */
int kvshim_worker_wait(kvshim_handle h, int64_t timeout_ms);

/* Layer-wise loads (kvshim.layerwise; docs/datapath.md). Starts the bound
 * step's loads layer by layer: one copy per layer in registration order
 * (the forward pass's), each once every chunk is checked. Loads started so
 * are not reported in "recving" (vLLM loads them synchronously); their
 * failed blocks are in "error_blocks" once kvshim_worker_wait_layers
 * returned. */
int kvshim_worker_start_loads_layered(kvshim_handle h);

/* Blocks until the bound step's copies of the layer named layer (vLLM's
 * layer name, as registered) have ended, or timeout_ms (KVSHIM_ETIMEDOUT);
 * a name not registered on its own (a cross-layer cache) waits for every
 * layer. Returns at once when the step has no layer-wise load. */
int kvshim_worker_wait_layer(kvshim_handle h, const char *layer, int64_t timeout_ms);

/* Blocks until every layer-wise load of the bound step has ended and its
 * failures are reported to kvshim_worker_poll, or timeout_ms. */
int kvshim_worker_wait_layers(kvshim_handle h, int64_t timeout_ms);

/* Layer-wise saves (save_kv_layer; docs/datapath.md). The forward pass has
 * written the layer named layer (vLLM's layer name, as registered) of the
 * bound step; stream_event is a CUevent recorded on vLLM's stream after it
 * (0 for CPU caches; it may be destroyed once this returns). The step's
 * first call starts its saves; each layer is copied once marked. A name not
 * registered on its own (a cross-layer cache) is saved at the step's end:
 * kvshim_worker_start_saves of the same bound step (wait_for_save) marks
 * every layer not marked yet, and a chunk is committed only once all its
 * layers are copied. Returns at once; failures are failed saves. */
int kvshim_worker_save_layer(kvshim_handle h, const char *layer, uint64_t stream_event);

/* ---- vLLM's objects as plain data: no handle. ----
 * What the connector hands over from vLLM, decided in Go: the settings,
 * the namespace, each role's open config, the KV tensors' layout. Pure
 * functions of their JSON (no handle, no server, callable before
 * kvshim_open); the answer goes into buf[0:cap]. */

/* vLLM's configuration as plain data (spec_json: shim.VLLMSpec, written
 * by python/kvshim/vllm/config.py from vLLM's objects: model, cache,
 * parallel config fields and each KV-cache group's spec class and fields)
 * -> the namespace kvshim_open takes (JSON: model, dtype, layout,
 * world_size, tp_size, chunk_size, kv_group, mla, dcp_size) plus
 * sched_block_size (the scheduler's block_size) and groups (true: the
 * layout names the KV-cache groups; failed loads are then reported by
 * request). Go decides compatibility, the groups and the refusals (Mamba
 * state it cannot restore, unknown group kinds, mixed block sizes).
 * Needs no handle; KVSHIM_ERANGE with *out_len the size needed when the
 * answer does not fit buf[0:cap] (call again). KVSHIM_EINVAL naming the
 * field, or the refusal. Schema: export/schema/vllm_namespace.json (the
 * answer: its $defs.out). */
int kvshim_vllm_namespace(const char *spec_json, void *buf, size_t cap, size_t *out_len);

/* The whole vLLM connector configuration, decided in Go (ABI 5.6). in_json
 * (connector.VLLMIn): {"extra": kv_connector_extra_config, "kv_cache_layouts":
 * vLLM's KVCacheLayout names, "role": "scheduler" | "worker", "vllm":
 * shim.VLLMSpec less chunk_size and kvshim_model, "engine_id", "kv_role",
 * "rank"}. The answer (connector.VLLMOut): {"settings": every kvshim.* key
 * with its default, "open": the role's kvshim_open config, "layerwise",
 * "by_request" (failed loads are reported by request), "warnings" (for
 * vLLM's log), "summary"}. With "extra" alone only "settings" is answered.
 * The kvshim.* keys, their defaults and their checks live here only: a key
 * that is unknown, given twice (flat and nested, vLLM's dotted CLI form)
 * or out of range is KVSHIM_EINVAL naming it. Buffer as
 * kvshim_vllm_namespace. Schema: export/schema/vllm_config.json (the answer:
 * its $defs.out; "vllm": export/schema/vllm_namespace.json). */
int kvshim_vllm_config(const char *in_json, void *buf, size_t cap, size_t *out_len);

/* ABI 5.6. vLLM's KV tensors as raw facts -> how each lies in memory
 * (in_json: shim.VLLMTensorsIn, export/schema/vllm_tensors.json, written
 * by python/kvshim/vllm/worker.py's register_kv_caches: the scheduler's
 * block_size, kv_cache_config's groups as kvshim_vllm_namespace takes them
 * (classes, layers, block_size read) and, for each tensor of
 * register_kv_caches in the dict's order, layer, device, data_ptr,
 * dtype_size, shape, strides in elements, storage_ptr, storage_bytes).
 * Writes the JSON array kvshim_worker_register takes
 * (export/schema/tensors.json). Go decides each layer's KV-cache group,
 * which layers sharing one tensor are registered, the backend from the
 * shape, the whole-block view of kernel blocks and Mamba state pages
 * (shim/vllmtensors.go). Needs no handle; KVSHIM_ERANGE with *out_len the
 * size needed when the answer does not fit buf[0:cap] (call again).
 * KVSHIM_EINVAL naming the field (tensors[3].shape) and why. */
int kvshim_vllm_tensors(const char *in_json, void *buf, size_t cap, size_t *out_len);

/* ---- CPython callers only: these read Python objects in place. ----
 * They must be called through ctypes.PyDLL (with the GIL held; the Python C
 * API is found with dlsym(RTLD_DEFAULT) on first use). Another engine uses
 * kvshim_sched_match with a uint32 array. */

/* kvshim_sched_match for a Python caller only (ctypes.PyDLL: called with
 * the GIL held, list a py_object): the prompt is the Python list of ints
 * `list`, read in one C loop as kvshim_tokens_from_list reads it, and only
 * when req_id is not keyed yet (asked again while its lookup is pending,
 * the list is not read). On x86-64 with the SHA extensions, and for a
 * request with no "mm" extras, the chunk keys are hashed as the list is
 * read (KVSHIM_LOOKUP_HASH=go: after it, as elsewhere). The GIL is
 * released once the list is read, while the lookup (hashes, where they are
 * not made yet, and) waits for the server, and held again before the call
 * returns. Besides kvshim_sched_match's errors: KVSHIM_ENOTSUP,
 * list is no list or the process has no Python C API (nothing was asked);
 * KVSHIM_EINVAL naming the first item that is no int in [0, 2^32) (convert
 * with Python for the id itself). */
int kvshim_sched_match_list(kvshim_handle h, const char *req_id, void *list, const char *extras_json,
                            int64_t num_computed, int64_t *out);

/* For a Python caller only (ctypes.PyDLL: called with the GIL held, list a
 * py_object): writes the ids of the Python list of ints `list` into
 * out[0:cap] as uint32 in one C loop (the Python C API is found with
 * dlsym(RTLD_DEFAULT) on first use) and the list's length into *out_len.
 * KVSHIM_ERANGE: *out_len > cap, nothing written; KVSHIM_EINVAL: item
 * *out_len is no int in [0, 2^32) (no exception is left set: convert with
 * Python to get the error); KVSHIM_ENOTSUP: list is no list, or the process
 * has no Python C API. Never records a last error. */
int kvshim_tokens_from_list(void *list, uint32_t *out, size_t cap, size_t *out_len);

/* ---- Tests and benchmarks: not part of what a connector needs. ---- */

/* Test-only: step metadata (kvshim_sched_build_meta's output, n bytes) as
 * its JSON text form (json.Marshal of shim.StepMeta: hashes and owner in
 * hex, empty lists and group 0 left out), decoded by the workers' own
 * decoder. Needs no handle; when the text does not fit buf[0:cap],
 * KVSHIM_ERANGE with *out_len the size needed (call again: nothing is
 * kept). KVSHIM_EINVAL: bad metadata (version, truncated, bytes after).
 * Schema: export/schema/meta.json. */
int kvshim_meta_json(const void *meta, size_t n, void *buf, size_t cap, size_t *out_len);

/* Returns how many handles are open (a leak check for tests). */
int kvshim_handle_count(void);

/* Test hook: panics inside the library and returns KVSHIM_EPANIC with the
 * panic text as the last error of h (or of the library when h is not open).
 * It exists so tests can prove a panic never crashes the host. */
int kvshim_debug_panic(kvshim_handle h);

/* The copy engine alone, for benchmarks and the demo: copies the chunks of
 * block_ids[0:n_blocks] (token order, a positive multiple of a chunk's
 * blocks; loads accept -1 to skip a block) between h's registered KV cache
 * and caller memory holding one object per chunk, chunk i at
 * objects + i * object_stride (object_stride at least the object size:
 * header and one chunk's payload). direction 1 saves (KV cache to
 * objects), 2 loads (objects to KV cache). The plans are the ones the
 * worker copies; the engine is of the worker's kind and size (host engine
 * for CPU caches, a CUDA engine for GPU caches: give it pinned memory),
 * created on first use and closed with h. No server, no lookup, no header
 * or checksum: the objects' bytes are copied as they are. Blocks until
 * the copy ends and sets *elapsed_ns to the time from planning to the
 * end of the copy. Errors: KVSHIM_EINVAL (no KV caches registered, bad
 * direction, count, stride or block id, NULL pointer), KVSHIM_ENOTSUP (no
 * CUDA driver for a GPU cache), KVSHIM_ETIMEDOUT (the copy ran past
 * timeout_ms; the call returns once it stopped, or a minute later with
 * the memory possibly still in use). */
int kvshim_worker_engine_copy(kvshim_handle h, int direction, void *objects, uint64_t object_stride,
                              const int64_t *block_ids, size_t n_blocks, int64_t timeout_ms,
                              uint64_t *elapsed_ns);

#ifdef __cplusplus
}
#endif

#endif /* KVSHIM_H */
