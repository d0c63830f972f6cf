// Package l2 is kvshim's L2 adapter layer: one batch interface with
// completions in front of the shared-storage backends (fs, redis,
// mooncake_store, s3, and third-party ones through plugin's C ABI),
// per-operation worker lanes, LMCache-style JSON config, a
// factory registry and Prometheus metrics.
//
// An Adapter wraps a Backend. Every operation takes a whole batch of keys and
// returns a *Task at once; the batch is cut into tiles that run on the
// operation's lane, and each key's Result is delivered exactly once, as soon
// as it is known, on Task.Events (buffered to the batch size, so workers
// never block). Task.Done closes when every key has a result.
//
//	caller ──Store/LookupAndHold/Load/Delete(keys)──► Adapter ──► *Task
//	                                                    │            ▲ Events(): per-key results
//	                 ┌──────────── lanes ──────────────┐│            │ Done():   all keys final
//	   lookup  ─────►│ dedicated queue + n workers     ││            │
//	   retrieve ────►│ dedicated queue + n workers     │┴─► Backend ─┘
//	   store   ─────►│ shared queue + num_workers      │   (fs | redis | mooncake_store)
//	   delete  ─────►│ (lanes not in per_op_workers)   │
//	                 └─────────────────────────────────┘
//
// Results are per key: StatusOK (written / present / loaded / deleted),
// StatusMiss (absent, or a corrupt object that was discarded) or
// StatusFailed (with the error). A partial failure of a batch names exactly
// the keys that failed; keys that succeeded stay succeeded (no rollback).
//
// Holds. LookupAndHold counts a client-side hold on every key it finds; a
// held key is refused by Delete (ErrHeld), which is how an L2 eviction pass
// must remove objects. Backends with a server-side protection add theirs
// (Mooncake: exists grants a lease of default_kv_lease_ttl, 10 s by default;
// it is not extended by the local count). Release drops the holds and never
// fails.
//
// Loads write into caller-provided destination buffers (L1 staging). A
// buffer may be partly written even when its key reports a miss or a
// failure: only StatusOK bytes may be consumed.
//
// Every adapter's tests run these rules as one suite, l2test.Run, against
// the real backend; a new rule here belongs there too.
//
// A prefetch controller uses it like this:
//
//	look := a.LookupAndHold(ctx, keys)          // whole key list, one task
//	res, err := look.Wait(ctx)                   // or read look.Events()
//	n := look.Bitmap().Prefix()                  // contiguous prefix present in L2
//	a.Release(keys[n:])                          // holds outside the plan
//	ld := a.Load(ctx, keys[:n], staging[:n])     // caller-owned staging buffers
//	for ev := range ld.Events() { admit or drop staging of ev.Index }
//	a.Release(keys[:n])
package l2
