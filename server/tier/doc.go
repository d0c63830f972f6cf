// Package tier is the L2 tier's control plane: the Writer (L1 → L2 after
// COMMIT, the L1 source pinned until the write ends) and the
// PrefetchController (L2 → L1 for lookups, under a byte budget). It sits
// between package server (which implements L1 and Fill) and package l2
// (the adapters); it does not import server.
//
// The fill seam is the two interfaces of types.go: a Filler (the
// PrefetchController) is handed each lookup's FillRequest and its Fill (the
// server's FillTask), and reserves, commits and answers through the Fill.
//
// Write flow (the third "done"):
//
//	COMMIT ─► L1 resident ("L1 readable", kvshim_l1_commits_total)
//	   └─► server pins each published object (a hold owned by the
//	       controller) and calls Writer.Committed (no lock held)
//	          └─► policy → prepare, once per object: header verified under
//	              its key, payload CRC set in L1 (below)
//	                 └─► adapter.Store(keys, L1 bytes) on every target
//	                        └─► per key: result recorded ("L2 saved",
//	                            kvshim_l2_store_saved_objects_total{adapter}),
//	                            and when the last target finished: L1 unpinned.
//
// Fill flow (PrefetchController.Fill: one goroutine per lookup that misses L1):
//
//	LookupAndHold(missing cells) on every adapter ──► plan one contiguous
//	prefix over L1 ∪ L2 (first adapter holding a cell wins) ──► release the
//	holds outside the plan ──► admission (bytes) ──► Reserve L1 staging in
//	chunk order ──► Load per adapter ──► Commit each key as it arrives
//	──► Done (the lookup's answer = prefix present on all ranks) ──► release.
//
// Admission is byte-aware: a lookup's planned bytes (4 KiB slots) are
// admitted only while
//
//	L1 prefetch bytes (fill staging + temporary objects, from the core)
//	+ accepted bytes not yet reserved (admitted lookups)
//	+ this lookup's bytes  <=  budget
//
// A plan larger than the whole budget is trimmed to a prefix that fits.
// Over budget, a lookup waits (FIFO, at most AdmissionWait, re-checking on
// every release and every few milliseconds) or is answered with what L1
// already holds. Every phase runs under the prefetch deadline (Timeout):
// past it the lookup is answered with the chunks loaded so far (prefix
// semantics), and the staging buffers of loads still running are freed
// only when their keys report, never under a running load.
//
// Payload checksums (objfmt: the payload CRC slot; kvshim.verify). Bytes
// that a worker copied into L1 by DMA and another copies out by DMA are not
// re-read by any CPU; corruption enters where bytes cross a disk or a
// network, so that is where payloads are checked:
//
//   - Store. Workers (default kvshim.verify=l2) commit objects whose header
//     is sealed and whose payload CRC slot is empty: their saves make no
//     pass over the payload. Before the first adapter reads a committed
//     object, the writer verifies its header under the key it
//     was committed under (an object that does not verify is never written:
//     kvshim_l2_store_skipped_total{reason="corrupt"}) and sets its payload
//     CRC in L1 (objfmt.SetPayloadCRC: one atomic 8-byte store outside the
//     header CRC, so readers of the object see the slot empty or set, never
//     torn; kvshim_l2_store_checksummed_objects_total and _bytes_total).
//     Every L2 copy therefore carries its payload CRC. This is one CPU pass
//     over the payload on the controller's goroutine, while the object is
//     pinned, off every request's path; a slot already set (a worker under
//     kvshim.verify=always, which seals with the CRC) is kept.
//   - Fill. Bytes arriving from L2 are checked before they can be served.
//     Each loaded object's header (magic, format version, header checksum)
//     must name the key the fill asked for (namespace, rank, chunk hash),
//     its size must match, and its payload CRC must be set and match the
//     payload (objfmt.Verify): an L2 object without one (written by
//     anything but this writer) is rejected like a corrupt one. An object
//     that fails (a file copied over another key's, a stale writer's bytes,
//     an object of another format version, a corrupt payload or payload
//     CRC) is a failed load of that chunk, counted
//     (kvshim_l2_prefetch_chunks_total{result="rejected"}, and
//     kvshim_l2_prefetch_key_mismatches_total when it names another key),
//     logged, and deleted through the adapter once the fill's holds are
//     released, so the next store of that key writes the right bytes. The
//     layout fingerprint and chunk tokens are the worker's to check (the
//     server never knows the layout).
//   - L1 restores. Workers check every object's header, fingerprint,
//     sizes and key (128 bytes a chunk), not its payload, unless
//     kvshim.verify=always (then every load verifies the payload CRC too,
//     and an object without one is a load error).
//
// Partial failure: a load that fails or misses for chunk k frees its
// staging; the core's fill (Done) then answers at most k chunks even when
// later chunks loaded (they are dropped, or stay resident in retain mode
// without counting).
//
// Limits. L1 cells beyond the lookup's held prefix are probed, not held,
// while L2 loads run: if one is evicted meanwhile the answer is shorter
// (never wrong). Sizes come from the L2 lookup (fs, redis) or, for
// mooncake_store whose exists has none, from the lookup's own L1 objects or
// the last size seen for the (namespace, rank). A mooncake_store load that
// timed out may still be written by Mooncake after its key failed (see
// package mooncake); fs and redis never write a buffer after reporting its
// key. The writer does not retry failed writes (LMCache: best
// effort) and skips objects while MaxBytes are pinned ("busy").
package tier
