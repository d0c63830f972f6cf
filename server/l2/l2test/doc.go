// Package l2test is the L2 adapter contract, for the tests of the adapters
// under server/l2 (in the manner of net/http/httptest and testing/fstest).
//
// Run checks, against a real backend, the rules that package l2 states for
// every adapter (server/l2/doc.go and the Backend interface):
//
//   - each key of a batch gets exactly one result, on Events and in
//     Results, and the task ends (Events closed, Done closed), also for an
//     empty batch;
//   - a miss is not a failure: an absent key is StatusMiss for lookup, load
//     and delete, is not listed by Failed and takes no hold;
//   - writing an existing key succeeds (again, twice in one batch, from
//     several writers at once), and the key keeps its bytes;
//   - a load moves exactly the stored bytes into the caller's buffer, and
//     Result.Bytes is the payload size (a lookup's is 0 or the size);
//   - a held key refuses Delete with ErrHeld; holds count per lookup,
//     Release drops one and ignores keys that are not held;
//   - a batch with a partial failure fails exactly the failing keys, each
//     error names its key, and the other keys' results stand (no rollback);
//   - a deleted key is a miss and can be written again; so is a corrupt
//     object, which is not served again;
//   - keys and buffers of different lengths fail the whole batch with
//     ErrBadBatch, and a closed adapter fails every key with ErrClosed.
//
// Where a backend cannot honour a rule as written, Target says so with an
// explicit field, documented next to it (Target.Lease, Target.BreakStore, Target.Corrupt).
//
// The package also holds the few helpers the adapters' own tests share:
// Key, Payload, Wait and Open.
package l2test
