// Package l1 is the server's L1: host memory in shared segments, the
// allocator that cuts it into object slots, the object table, the LRU list
// and the object state machine. It is pure bookkeeping: no sockets, no
// sessions, no locks (its owner, server.Core, holds one mutex around every
// call), no I/O but the SegmentSource it is given, so it is tested alone.
//
// Layout. Segments are created lazily (SegmentSource) up to the L1 size,
// or made ready ahead of use by a ReadySource (a background grower keeps
// ReadyAhead bytes free). Each segment is cut into slabs; a slab holds
// equal slots of one size class (object size rounded up to 4 KiB), so many
// equal-sized KV chunk objects pack with no per-object headers in shared
// memory:
//
//	segment 1 (SegmentSize, e.g. 1 GiB, shared with every client)
//	┌──────────────────────────┬──────────────────────────┬───────────────┐
//	│ slab A: class 2 MiB      │ slab B: class 8 KiB      │ free extent   │
//	│ ┌──────┬──────┬──────┬─┐ │ ┌──┬──┬──┬──┬──┬──┬───┐  │ (coalesced;   │
//	│ │slot 0│slot 1│slot 2│…│ │ │0 │1 │2 │3 │… │  │   │  │  slabs come   │
//	│ └──────┴──────┴──────┴─┘ │ └──┴──┴──┴──┴──┴──┴───┘  │  back here    │
//	└──────────────────────────┴──────────────────────────┴───────────────┘
//	 Loc{Segment: 1, Offset: slab.off + slot*class, Size: object bytes}
//
// An empty slab returns to its segment's free extents. Fragmentation is
// exported: Stats.Used-Requested (slot padding) and Slab-Used (free slots).
//
// Objects. An object is named by its arena index (a uint32, Nil for none)
// and keyed by (namespace shard, rank, chunk hash). Its metadata lives in a
// chunked arena (indices, not pointers: the garbage collector never scans
// it). The state machine:
//
//	Reserve ──► Staging ──Publish──► Resident ──Free (evict, clear)──► Free
//	               │ │  (a key already resident: discarded, freed)
//	               │ └──MakeTemporary──► Temporary ──last Unhold──► Free
//	               ├──Fence──► Fenced ──Free (writer known done)──► Free
//	               └──Free (abort, TTL, failed fill)──► Free
//
// Staging, temporary and fenced objects are invisible to Find; only
// resident ones are in the table and on the LRU list. Any other change is
// ErrTransition and leaves the object as it was. Read holds are counters
// (Hold, Unhold); held objects are never evicted or cleared, and freeing
// one is its owner's bug. Eviction (MaybeEvict, and Reserve when no slot
// is free) takes unheld resident objects from the LRU tail; Touch moves a
// lookup's hits to the head in chunk order, so a prefix's tail goes first.
package l1
