// Package shim owns the connector's logic, independent of Python and of the
// C ABI (package export only marshals calls into it): the per-request state
// machines of both connector roles (scheduler and worker), chunk keys and
// namespaces, folding vLLM's per-block view into per-chunk objects, and save
// and load planning. It never touches GPU memory; copies are planned here and
// executed elsewhere.
//
// # Keys
//
// A stored object is named (namespace, kv rank, chunk hash), see
// kv.Key and ipc.AllocReq.
//
// The namespace (namespace.go) is the first 16 bytes of SHA-256 over a
// versioned, length-prefixed encoding of everything that makes KV bytes
// incompatible: model, KV dtype, layout fingerprint, object format version,
// the KV world (world size and TP size; for MLA with one pipeline stage and
// no decode context parallelism none, since every rank holds the same
// latent KV), the DCP size, chunk size and KV-cache group. Deployments that differ in any of these miss; they never read
// each other's bytes.
//
// Chunk hashes (keys.go) chain SHA-256 over full chunks of chunk_size tokens;
// the partial tail is never hashed. The root mixes in the namespace and the
// request's per-request identity (cache_salt, LoRA), so every hash of a
// salted or LoRA request differs from the unsalted one. A multimodal input is
// mixed into exactly the chunks its placeholder range overlaps:
//
//	root = H("kvshim.root.v2" ‖ ns ‖ lp(cache_salt) ‖ 0)                           no LoRA
//	root = H("kvshim.root.v2" ‖ ns ‖ lp(cache_salt) ‖ 1 ‖ lp(lora name) ‖ lp(lora path))
//
//	        chunk 0            chunk 1            chunk 2        tail
//	tokens [t0 … t255]        [t256 … t511]      [t512 … t767]  [t768 …]
//	                                   ├── image A ──┤            (dropped)
//	h0 = H(C ‖ root ‖ n ‖ tok0 ‖ 0)
//	h1 = H(C ‖ h0   ‖ n ‖ tok1 ‖ 1 ‖ mm(A))
//	h2 = H(C ‖ h1   ‖ n ‖ tok2 ‖ 1 ‖ mm(A))
//
//	C = "kvshim.chunk.v1", n = u32 token count, tokens = u32 little-endian,
//	lp(x) = u32 length ‖ x, mm(A) = lp(hash) ‖ u64 offset ‖ u64 length.
//
// Every field is fixed-size or length-prefixed and the LoRA's presence is a
// byte, so no two inputs hash the same bytes (FuzzExtrasInjective); an empty
// salt is no salt, as in vLLM. The encoding is pinned by golden vectors in testdata/: a change to any byte
// of it changes every key of every deployment and must bump the version tags.
//
// # A request's life in the scheduler
//
// Scheduler keeps one schedReq per request it has keyed; its state is
// lookupState plus two flags (loadPlanned, savesOut). vLLM's calls are the
// events:
//
//	               Match: full chunks           Match: none / no server / skip_load / producer
//	 (not keyed) ─────────────────► PENDING ──────────────────────────────► NONE (final 0)
//	                                  │ Match reads the answer (once)
//	                                  ▼
//	                               FINAL(h) ── AfterAlloc, external > 0 ──► LOADING (holds are the workers')
//	                                  │  AfterAlloc, external 0: holds freed  │  Match again after a failed load:
//	                                  │                                       │  FINAL(0), its chunks saved again
//	                                  ▼                                       ▼
//	      BuildMeta: new full chunks of a prefill or a decode ──► SAVING (savesOut: blocks may be read)
//	                                  │
//	        Finished / preempted ─────┴──► (not keyed): holds released; delay while SAVING
//
//	state \ event  Match             AfterAlloc            BuildMeta          Finished(Tokens)   preempted (step)
//	not keyed      key, LOOKUP:      nothing               nothing            nothing            nothing
//	               PENDING or NONE
//	NONE           0 (final)         nothing: no holds     saves (SAVING)     forget             forget
//	PENDING        poll; None        frees holds           -                  FREE, forget       FREE, forget
//	FINAL(h)       cached answer     plan load (LOADING)   saves (SAVING)     FREE, forget       FREE, forget
//	               (h chunks)        or free holds
//	LOADING        FINAL(0): the     record blocks only    load + saves       forget (vLLM       workers wait for
//	               load failed                                                keeps the blocks)  its copies; forget
//	SAVING         as FINAL          as FINAL              more saves         final saves,       forget (keyed again
//	                                                                          delay = true       on resume)
//
// Finished and FinishedTokens are one event: FinishedTokens (a request
// that ended normally) also saves the full chunks it computed that no
// BuildMeta saved (its answer's, the last prompt chunk's). A save happens
// in any state unless the request's role or options forbid it
// (kv_consumer, kvshim.skip_save).
//
// testdata/lifecycle holds these paths as data (TestLifecycle): vLLM's
// calls in order against a real server and worker, and what each answers.
//
// A reset (Reset, reset_cache) moves the namespace to a new generation
// (controls.go): every keyed request is forgotten, so the next Match keys it
// again under the new root. An abort of a LOADING request before the
// workers report it received is recorded as a cancel (Received).
package shim
