// Package server is kvshim's MP server core: sessions, lookups and their
// read holds, the L1 cache behind them, the L2 wiring and metrics. It is
// transport independent: every operation is a Core method taking the
// calling *Session and the ipc request type, and returning the ipc
// response type (or an error that StatusOf maps to a frame status). The
// session loop (rings, codec; serve.go) calls these methods.
//
// Names. Each word below has one meaning across server, server/l1 and
// server/tier:
//
//	Core         the server core (sessions, lookups, one mutex); a Server
//	             is a Core behind an ipc listener
//	l1.Cache     L1: segments, allocator, object table, LRU, object states
//	store        only the L2 write of one object: l2.Adapter.Store, the
//	             store policy (--l2-store-policy), kvshim_l2_store_*
//	tier.Writer  stores committed L1 objects to L2 (write-through)
//	fill         the L1<->L2 seam, L2 -> L1 for one lookup: tier.Filler
//	             (L2 side, Fill(req, f); the PrefetchController),
//	             tier.Fill (L1 side: one lookup's fill; *FillTask here),
//	             tier.FillRequest (what to fill)
//	prefetch     the policy behind the L2 side of a fill: the
//	             PrefetchController, its byte budget, --l2-prefetch-*,
//	             kvshim_l2_prefetch_*
//	save         a client's ALLOC + COMMIT into L1 (test helpers)
//
// L1 (package l1): the shared segments, the slab allocator, the object
// table, the LRU list and the object state machine, as pure bookkeeping
// that the Core guards with its one mutex. Its doc has the segment layout.
//
// Objects. Key = (namespace, rank, chunk hash). States:
//
//	ALLOC (key, writer tag) ──► staging ──COMMIT──► resident ──evict/CLEAR──► gone
//	                              │  (first publisher wins; a later copy
//	                              │   is discarded and its space freed)
//	                              └──ABORT / session close / staging TTL──► gone
//	FillTask.Reserve ──► staging ──Commit(temporary)──► temporary ──last hold──► gone
//	                              └──Commit (retained)──► resident (as COMMIT)
//
// Staging objects are invisible to lookups. Read holds are counters on the
// object, owned by a (session, lookup) pair per reader rank; held objects
// and staging objects are never evicted. Eviction is LRU over resident
// objects, from the high watermark down to the low one, and on demand when
// an allocation finds no space. A lookup hit moves its objects to the LRU
// front in chunk order (a prefix's head is the most recent, its tail goes
// first); releasing holds does not touch the LRU.
//
// Lookups. LOOKUP checks each chunk on every rank 0..WorldSize-1 (MLA: the
// rank-0 object, read by WorldSize readers, one hold each), holds the
// longest prefix present on all ranks, and is final at once, or pending
// while a tier.Filler fills the missing suffix (FillTask); then the prefix
// is recomputed over resident + filled objects and the rest released.
// LOOKUP_RESULT returns Pending, the final count once, then Unknown. FREE,
// RELEASE, session close and the hold TTL release holds; a lookup whose
// answer was read and that holds nothing is forgotten.
//
// Lookup limits. A session may have --max-lookups-per-session live lookups
// (default 4096) whose hold tables total --max-lookup-cells-per-session
// cells, chunks × readers (default 1Mi); a LOOKUP past either is refused
// with ErrLookupLimit (StatusBadRequest naming the limit: the client's
// miss) and counted in kvshim_lookups_rejected_total{limit}. A live lookup
// holds its 32-byte hash per chunk, a 4-byte hold slot per cell, a FREE
// mark per chunk (1 byte, once FREEd while pending), 24 bytes per reader
// and under 512 bytes of struct, map entry and fill task: at most 61 bytes
// a cell plus 512 a lookup, so one session's lookups hold at most 64 MiB
// with the defaults (measured: 36 bytes a chunk at one reader, 2.25 MiB
// for a 65,536-chunk lookup, 36 MiB at the cell limit). Session close
// frees all of it. Not counted: an L2 prefetch holds about 350 bytes per
// missing cell while it runs, up to --l2-prefetch-timeout, even after its
// lookup is gone; and the Go runtime returns freed heap to the OS lazily.
//
// L2. With Config.L2Adapters (--l2-adapter JSON, repeatable) the core
// opens the adapters (package l2, types fs, redis, mooncake_store, s3, plugin) and
// wires package tier's controllers (l2tier.go):
//
//	COMMIT ──publish──► resident ──pin (hold owned by the writer)──►
//	    Writer.Committed (after the lock) ──► adapter.Store ──► Unpin
//	LOOKUP ──miss──► FillTask ──tier.Filler.Fill──► PrefetchController (L2
//	    lookup, plan, byte-aware admission, Reserve, Load, Commit per key,
//	    Done/Answer through the FillTask)
//
// Pins (Pin/Unpin) are holds that no lookup owns: a pinned object is never
// evicted or cleared. PrefetchBytes (fill staging + temporary objects) is
// what the prefetch admission budget counts; FillTask.Answer finalizes a
// lookup at the prefetch deadline while loads still own their staging. New
// L1 segments are registered with every adapter (RegisterL1Segment) in the
// background. Close stops the controllers and closes the adapters before
// the segments go.
//
// Fencing. A client writes L1 through its own mapping, from copy and seal
// goroutines that can outlive its session: a process frozen past its
// heartbeat (SIGSTOP, a frozen cgroup, a debugger, swapping) or a call that
// timed out. Freeing its staging slots when the session ends would let a
// thawed writer overwrite the objects another writer commits there later.
// So a session opened with SessionOptions.Fence (every ipc session) parks
// its staging slots, at close and when the staging TTL takes them, in
// state "fenced": out of the table (others may stage the same keys) and out
// of the allocator, until the writer is known to be done:
//
//	staging ──session end / staging TTL──► fenced ──writer exited (pidfd)──────────► free
//	                                          └──same instance says HelloDrained──► free
//
// The writer's exit is watched with a pidfd opened when the fence is set (a
// recycled pid can only delay the release). A writer that lives on (or the
// embedded server's in-process worker, whose pid is ours) lifts its fence
// itself: its link redials with ipc.HelloDrained only once every earlier
// client has ended and its mappings are gone (ipc.Client.Use counts the
// jobs using them). Its late COMMIT cannot publish anything: COMMIT goes to
// the session that staged, and staging is owned by a session. Readers need
// no fence: the server marks the shared ring shut down before it releases a
// session's holds, and a load that finds its session ended after its copy
// (ipc.Client.Live) is a load error. The bound: a stalled writer keeps at
// most what it had staged (kvshim_l1_objects{state="fenced"}).
//
// # KV events (events.go, OpEvents)
//
// Each scheduler session that turned events on owns: the set of chunk keys
// (namespace, hash, medium) it announced (at most 65,536; one more reports
// the oldest removed and forgets it), a queue of events for it (at most
// 65,536; more are counted in the next answer's Lost) and an entry in the
// index key → announcing sessions. An L1 eviction (any rank's object of
// the chunk) or an L2 drop (the fs adapter's own eviction) queues
// "removed" for every session in the index entry, whichever instance
// caused it, and forgets the entry; an L2 write of an announced chunk
// queues "stored" (medium L2), and one that ended before the announce is
// found in a record of the last 65,536 L2 writes (kept only while some
// session has events on). A chunk already gone from L1 when announced is
// reported removed at once. Everything goes with the session
// (closeSessionLocked → eventsClosed).
package server
