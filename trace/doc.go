// Package trace writes kvshim's lifecycle records: one record per stage of
// a request's life (lookup, load, save, cancel, eviction, L2 fill), so an
// operator can go from a symptom to the protocol layer and back.
//
// # Files
//
// A Writer (Open, off unless given a directory: `kvshim serve --trace-dir`,
// the connector's kvshim.trace_dir) writes Arrow IPC *files* (the random
// access format: pyarrow.ipc.open_file, arrow/go ipc.NewFileReader), one
// file series per record kind, named
//
//	SOURCE-PID-KIND-YYYYMMDDTHHMMSS-SEQ.arrow
//
// (SOURCE is "server" or "worker_rN"; SEQ counts the files of every writer
// of the process, so writers restarted in one process never collide). A
// file is written as NAME.arrow.part and renamed to NAME.arrow once closed
// (footer written); readers skip .part files. Rows are buffered per kind and written as a record batch
// every BatchRows rows or every Flush interval; a file is closed and a new
// one started once it holds MaxBytes (default 64 MiB) or is MaxAge old
// (default 5 min), and at Close.
//
// Memory is bounded: Emit puts the record on a queue of Buffer records
// (default 16384) and never blocks; when the queue is full the record is
// dropped and counted. The count is in Stats and in the "writer" kind's
// last record ("close": written, dropped).
//
// # Common columns (every kind)
//
//	mono_ns     int64   CLOCK_MONOTONIC ns (host-wide: orders server and worker records)
//	wall_ns     int64   unix ns
//	source      string  server | worker_rN
//	pid         int32
//	event       string  the stage (below)
//	request_id  string  vLLM's request id (workers; "" on the server, which never sees one)
//	lookup_id   uint64  the scheduler's lookup id
//	owner       string  hex session tag of the lookup's owner (the scheduler's instance)
//	namespace   string  hex namespace
//	rank        int32   KV rank (-1: every rank / not applicable)
//
// (owner, lookup_id) joins server records to the worker records of the
// same request; the worker's load records carry both and the request id.
//
// # Kinds
//
// lookup (server): chunks uint32, world uint32, l1_bitmap binary,
// missing_bitmap binary, matched uint32, chunk int32, stop_rank int32,
// result string, reason string. Events:
//   - registered: the ack. chunks asked, world (readers); l1_bitmap has bit i
//     (LSB first) set when chunk i is resident on every rank, missing_bitmap
//     when some rank lacks it (the per-chunk fold across ranks); matched is
//     the L1 prefix held now; chunk / stop_rank the first chunk some rank
//     lacks and the first rank lacking it (-1: none).
//   - pending: an L2 fill runs for chunks [matched, chunks).
//   - final: the answer: matched chunks held and why it stopped (result:
//     "full" | "missing"; reason names chunk and rank).
//   - consumed: the scheduler read the answer (matched).
//
// load (worker): start, end uint32 (lookup chunk range), chunks, blocks
// uint32, chunk int32, matched uint32, result, reason string, bytes uint64,
// retrieve_ns, check_ns, copy_ns int64. Events:
//   - planned: chunks and blocks to restore.
//   - chunk: one per chunk, written when the load ends (mono_ns is the
//     load's end, not the chunk's): result ok | not_loaded (after a failed chunk) |
//     missing | checksum | key_mismatch | copy_error | timeout |
//     unavailable | error, reason the error text.
//   - done: matched = chunks restored (a prefix), bytes copied, the phase
//     times (retrieve: RETRIEVE round trip; check: resolve + header/CRC
//     checks + planning, overlapped with the copies; copy: the wait for the
//     copies after the last check), result ok | partial | failed.
//
// save: chunks, matched, skipped, failed uint32, bytes uint64, result,
// reason string. A save is "done" three times, as three events:
//   - event (worker): the forward pass's CUDA event is enqueued for this
//     request's chunks (GPU data produced).
//   - commit (worker): COMMIT answered: matched chunks now readable in L1,
//     skipped (resident already or no space), failed (with reason).
//   - committed (server): the objects the server published.
//   - l2_saved (server, one per object and adapter): an L2 write ended;
//     matched 1 and bytes when saved, failed 1 when not; reason is the
//     adapter's name (and the error). Server save records carry namespace
//     and rank but no request id.
//
// cancel (server): start, end, chunks, matched uint32, result, reason.
// Events: free (FREE of chunks [start, end): matched holds released without
// a load; result is the lookup's state: pending | final | consumed),
// drop (the lookup was forgotten: session ended, hold TTL; chunks held
// still released). The worker writes preempted (vLLM preempted the
// request: its copies were waited for before vLLM reuses its blocks;
// result ok | timeout).
//
// evict (server): one record per object evicted from L1 (event evict):
// chunks (1), bytes, reason (lru watermark), rank, namespace.
//
// fill (server, L2 prefetch), event done, written with the lookup's final
// record when a pending lookup is answered: start, chunks (asked of L2:
// chunks [start, start+chunks)), matched (of those, now in the prefix),
// failed (the rest), result done | answered_early (prefetch timeout) |
// cancelled, reason. Event admission, once per fill, is the prefetch's
// admission decision: chunks = cells planned from L2 (chunk × rank, the
// longest prefix the byte budget allows), bytes = their worst case (what
// the budget counts), matched = cells that got L1 staging; result
// admitted | rejected (over the budget after waiting) | l1_full (no staging
// for the first chunk) | cancelled (the lookup was dropped) | no_l2
// (nothing to load); reason: the time waited for the budget. The reason a
// loaded chunk was rejected (corrupt, another key) is in the server log and
// the prefetch counters (kvshim stat), not in a record yet.
//
// hold (server): chunks, world, matched uint32, result, reason. Events:
// taken (with a lookup's final answer: matched = read holds the lookup
// owns, one per held chunk and reader rank), released (RELEASE by a
// worker after its copies: rank, matched = holds that rank dropped).
// Holds dropped by FREE or with a forgotten lookup are cancel records.
//
// writer: written, dropped uint64 (event "close").
//
// Every schema carries metadata kvshim.trace.kind and kvshim.trace.version.
package trace
