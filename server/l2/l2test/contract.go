package l2test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
)

// Target is the backend under test.
type Target struct {
	// Open returns a new adapter on the storage under test and closes it
	// when t ends. Run calls it twice (one adapter for the rules, one to
	// close); the keys of each rule are its own, so the storage may be
	// shared with other tests.
	Open func(t testing.TB) *l2.Adapter

	// Lease is how long a lookup's server-side protection outlives
	// Release, 0 when Release ends every protection (fs, Redis). Mooncake
	// grants a read lease (default_kv_lease_ttl) on every hit of
	// batch_is_exist and refuses batch_remove until it ends
	// (OBJECT_HAS_LEASE): l2 documents it as the backend's own protection,
	// added to the adapter's hold. With Lease > 0 the suite deletes a key
	// that it looked up and released by retrying for at most
	// Lease + LeaseSlack; with 0 the first delete must succeed.
	Lease time.Duration

	// BreakStore, when set, makes the next stores of k through a fail (and
	// nothing else), to check a store batch with a partial failure.
	// Backends with no fault that one key can be given alone (Redis,
	// Mooncake: a key is a name on a server that accepts any) leave it nil:
	// the store case of that rule is skipped, the load and delete cases
	// still run.
	BreakStore func(t testing.TB, a *l2.Adapter, k kv.Key)

	// Corrupt, when set, damages k's stored object in place (its bytes,
	// not its presence), to check that a corrupt object is a miss that is
	// not served again. Backends that store the bytes without a checksum
	// (Redis, Mooncake) cannot tell a damaged object and leave it nil: the
	// rule is skipped.
	Corrupt func(t testing.TB, a *l2.Adapter, k kv.Key)
}

// LeaseSlack is the time allowed past Target.Lease for the backend to drop
// a lease (timers on a loaded machine).
const LeaseSlack = 10 * time.Second

// batchLen is the length of the batches that check per-key reporting: more
// keys than any test config has lane workers, so batches are cut in tiles.
const batchLen = 33

// Run checks the l2 contract against tg; each rule is a subtest.
func Run(t *testing.T, tg Target) {
	s := &suite{tg: tg, a: tg.Open(t), run: rand.Uint64()}
	for _, r := range []struct {
		name string
		fn   func(*testing.T)
	}{
		{"EachKeyReportedOnce", s.eachKeyReportedOnce},
		{"EmptyBatch", s.emptyBatch},
		{"MissIsNotFailure", s.missIsNotFailure},
		{"StoreExistingKeySucceeds", s.storeExistingKeySucceeds},
		{"LoadMovesTheBytes", s.loadMovesTheBytes},
		{"HeldKeyRefusesDelete", s.heldKeyRefusesDelete},
		{"PartialFailure", s.partialFailure},
		{"DeletedKeyIsMiss", s.deletedKeyIsMiss},
		{"CorruptObjectIsMiss", s.corruptObjectIsMiss},
		{"BadBatch", s.badBatch},
		{"Closed", s.closed},
	} {
		t.Run(r.name, r.fn)
	}
}

type suite struct {
	tg  Target
	a   *l2.Adapter
	run uint64 // this Run's keys differ from any other Run's on the same storage

	mu   sync.Mutex
	next uint32 // key spaces handed out
}

// keys returns n keys that no other call of this Run returns.
func (s *suite) keys(n int) []kv.Key {
	s.mu.Lock()
	s.next++
	space := s.next
	s.mu.Unlock()
	ks := make([]kv.Key, n)
	for i := range ks {
		k := kv.Key{Rank: uint32(i % 2)}
		k.Namespace[0] = 0xc7
		for b := range 8 {
			k.Namespace[8+b] = byte(s.run >> (8 * b))
		}
		k.Namespace[4], k.Namespace[5], k.Namespace[6] = byte(space), byte(space>>8), byte(space>>16)
		// a space per hash prefix: an fs shard directory is the space's
		// alone (Target.BreakStore may spoil one)
		k.Hash[0], k.Hash[1], k.Hash[2], k.Hash[31] = byte(space), byte(i), byte(i>>8), 0x11
		ks[i] = k
	}
	return ks
}

// payloads returns an object per key, of sizes that differ by key.
func payloads(n int) [][]byte {
	p := make([][]byte, n)
	for i := range p {
		p[i] = Payload(i, 1000+37*i)
	}
	return p
}

// buffers returns a load destination per object, of its size, filled with
// a byte pattern that no payload has.
func buffers(src [][]byte) [][]byte {
	b := make([][]byte, len(src))
	for i := range b {
		b[i] = make([]byte, len(src[i]))
		for j := range b[i] {
			b[i][j] = 0xa5
		}
	}
	return b
}

func statuses(res []l2.Result) []l2.Status {
	st := make([]l2.Status, len(res))
	for i, r := range res {
		st[i] = r.Status
	}
	return st
}

// pick returns the elements of s at idx.
func pick[T any](idx []int, s []T) []T {
	out := make([]T, len(idx))
	for i, j := range idx {
		out[i] = s[j]
	}
	return out
}

// store writes keys and requires every key to succeed.
func (s *suite) store(t *testing.T, a *l2.Adapter, keys []kv.Key, src [][]byte) {
	t.Helper()
	for i, r := range Wait(t, a.Store(context.Background(), keys, src)) {
		eq(t, r.Status, l2.StatusOK, "store of key %d: %v", i, r.Err)
	}
}

// present looks keys up and releases them at once.
func (s *suite) present(t *testing.T, keys []kv.Key) []l2.Status {
	t.Helper()
	res := Wait(t, s.a.LookupAndHold(context.Background(), keys))
	s.a.Release(keys)
	return statuses(res)
}

// deleteReleased deletes a key that was looked up and released: at once
// without a lease, within the lease's time with one.
func (s *suite) deleteReleased(t *testing.T, k kv.Key) l2.Result {
	t.Helper()
	deadline := time.Now().Add(s.tg.Lease + LeaseSlack)
	for {
		r := Wait(t, s.a.Delete(context.Background(), []kv.Key{k}))[0]
		if r.Status != l2.StatusFailed || s.tg.Lease == 0 || time.Now().After(deadline) {
			return r
		}
		check(t, !errors.Is(r.Err, l2.ErrHeld), "released key still held: %v", r.Err)
		// The backend's lease has no event to wait for: poll it.
		time.Sleep(min(s.tg.Lease/4, 100*time.Millisecond) + time.Millisecond)
	}
}

// collect reads every event of task (bounded by WaitTimeout) and checks
// that each key is reported exactly once, under its own key, that Events
// closes after the last one, that Done closes and that Results agrees.
func collect(t *testing.T, task *l2.Task) []l2.Result {
	t.Helper()
	timeout := time.NewTimer(WaitTimeout)
	defer timeout.Stop()
	got := make([]l2.Result, task.Len())
	seen := make([]int, task.Len())
	for open := true; open; {
		select {
		case ev, ok := <-task.Events():
			if !ok {
				open = false
				break
			}
			check(t, ev.Index >= 0 && ev.Index < task.Len(), "event for index %d of %d", ev.Index, task.Len())
			seen[ev.Index]++
			eq(t, ev.Key, task.Keys()[ev.Index], "event %d", ev.Index)
			got[ev.Index] = ev.Result
		case <-timeout.C:
			t.Fatalf("%s task: Events not closed after %v; reports per key: %v", task.Op(), WaitTimeout, seen)
		}
	}
	for i, n := range seen {
		eq(t, n, 1, "%s: key %d reported %d times", task.Op(), i, n)
	}
	select {
	case <-task.Done():
	case <-timeout.C:
		t.Fatalf("%s task: Events closed but Done not after %v", task.Op(), WaitTimeout)
	}
	res := task.Results()
	eq(t, len(res), len(got))
	for i := range got {
		eq(t, res[i], got[i], "%s: key %d: Results and Events differ", task.Op(), i)
	}
	return got
}

// Each key of a batch gets exactly one result, whatever the operation and
// its outcome, and the task ends.
func (s *suite) eachKeyReportedOnce(t *testing.T) {
	ctx := context.Background()
	src := payloads(batchLen)
	even := func(i int) bool { return i%2 == 0 }
	for _, tc := range []struct {
		name string
		run  func(keys []kv.Key) *l2.Task
		want func(i int) l2.Status // the even keys are stored beforehand
	}{
		{"store", func(k []kv.Key) *l2.Task { return s.a.Store(ctx, k, src) },
			func(int) l2.Status { return l2.StatusOK }},
		{"lookup", func(k []kv.Key) *l2.Task { return s.a.LookupAndHold(ctx, k) }, okIf(even)},
		{"load", func(k []kv.Key) *l2.Task { return s.a.Load(ctx, k, buffers(src)) }, okIf(even)},
		{"delete", func(k []kv.Key) *l2.Task { return s.a.Delete(ctx, k) }, okIf(even)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := s.keys(batchLen)
			var evens []int
			for i := 0; i < batchLen; i += 2 {
				evens = append(evens, i)
			}
			s.store(t, s.a, pick(evens, keys), pick(evens, src))
			task := tc.run(keys)
			eq(t, task.Len(), batchLen)
			got := collect(t, task)
			want := make([]l2.Status, batchLen)
			for i := range want {
				want[i] = tc.want(i)
			}
			eqs(t, statuses(got), want)
			s.a.Release(keys)
		})
	}
}

func okIf(f func(int) bool) func(int) l2.Status {
	return func(i int) l2.Status {
		if f(i) {
			return l2.StatusOK
		}
		return l2.StatusMiss
	}
}

// An empty batch is a task that is already done, with no events.
func (s *suite) emptyBatch(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		run  func() *l2.Task
	}{
		{"store", func() *l2.Task { return s.a.Store(ctx, nil, nil) }},
		{"lookup", func() *l2.Task { return s.a.LookupAndHold(ctx, nil) }},
		{"load", func() *l2.Task { return s.a.Load(ctx, nil, nil) }},
		{"delete", func() *l2.Task { return s.a.Delete(ctx, nil) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			task := tc.run()
			select {
			case <-task.Done():
			default:
				t.Fatal("empty batch: task not done on return")
			}
			_, open := <-task.Events()
			check(t, !open, "empty batch delivered an event")
			eq(t, len(task.Results()), 0)
		})
	}
}

// An absent key is a miss, for lookup, load and delete: not a failure, not
// a hole in the present prefix of the keys around it, and not held.
func (s *suite) missIsNotFailure(t *testing.T) {
	ctx := context.Background()
	src := payloads(4)
	want := []l2.Status{l2.StatusOK, l2.StatusMiss, l2.StatusOK, l2.StatusMiss}
	for _, tc := range []struct {
		name string
		run  func(keys []kv.Key) *l2.Task
	}{
		{"lookup", func(k []kv.Key) *l2.Task { return s.a.LookupAndHold(ctx, k) }},
		{"load", func(k []kv.Key) *l2.Task { return s.a.Load(ctx, k, buffers(src)) }},
		{"delete", func(k []kv.Key) *l2.Task { return s.a.Delete(ctx, k) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := s.keys(4)
			s.store(t, s.a, pick([]int{0, 2}, keys), pick([]int{0, 2}, src))
			task := tc.run(keys)
			res := Wait(t, task)
			eqs(t, statuses(res), want)
			eq(t, len(task.Failed()), 0, "a miss was listed as failed: %v", res)
			eq(t, task.Bitmap().Count(), 2)
			eq(t, task.Bitmap().Prefix(), 1)
			if task.Op() == l2.OpLookup {
				eq(t, s.a.Held(keys[0]), 1)
				eq(t, s.a.Held(keys[1]), 0, "a miss took a hold")
				s.a.Release(keys)
			}
		})
	}
}

// Writing a key that exists succeeds (objects are immutable: a key always
// names the same bytes), whoever wrote it first, and the bytes stay.
func (s *suite) storeExistingKeySucceeds(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		// write stores keys (with src) and returns every result
		write func(t *testing.T, keys []kv.Key, src [][]byte) []l2.Result
	}{
		{"again", func(t *testing.T, k []kv.Key, src [][]byte) []l2.Result {
			first := Wait(t, s.a.Store(ctx, k, src))
			return append(first, Wait(t, s.a.Store(ctx, k, src))...)
		}},
		{"twice in one batch", func(t *testing.T, k []kv.Key, src [][]byte) []l2.Result {
			return Wait(t, s.a.Store(ctx, append(k, k...), append(src, src...)))
		}},
		{"by concurrent writers", func(t *testing.T, k []kv.Key, src [][]byte) []l2.Result {
			const writers = 4
			res := make([][]l2.Result, writers)
			errs := make([]error, writers)
			var wg sync.WaitGroup
			for w := range writers {
				wg.Go(func() {
					wctx, cancel := context.WithTimeout(ctx, WaitTimeout)
					defer cancel()
					res[w], errs[w] = s.a.Store(wctx, k, src).Wait(wctx)
				})
			}
			wg.Wait()
			var all []l2.Result
			for w := range writers {
				noErr(t, errs[w])
				all = append(all, res[w]...)
			}
			return all
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := s.keys(3)
			src := payloads(3)
			res := tc.write(t, keys, src)
			for i, r := range res {
				eq(t, r.Status, l2.StatusOK, "result %d: %v", i, r.Err)
				eq(t, r.Bytes, len(src[i%len(src)]), "result %d", i)
			}
			dst := buffers(src)
			for i, r := range Wait(t, s.a.Load(ctx, keys, dst)) {
				eq(t, r.Status, l2.StatusOK, "load %d: %v", i, r.Err)
				check(t, bytes.Equal(dst[i], src[i]), "key %d: loaded bytes differ from the stored ones", i)
			}
		})
	}
}

// A load writes exactly the stored bytes into the caller's buffer;
// Result.Bytes is the payload size for a store and a load, and 0 (unknown)
// or the payload size for a lookup.
func (s *suite) loadMovesTheBytes(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		size int
	}{
		{"one byte", 1},
		{"odd size", 4096 + 3},
		{"256 KiB", 256 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := s.keys(3)
			src := make([][]byte, len(keys))
			for i := range src {
				src[i] = Payload(i+7, tc.size)
			}
			for i, r := range Wait(t, s.a.Store(ctx, keys, src)) {
				eq(t, r.Status, l2.StatusOK, "store %d: %v", i, r.Err)
				eq(t, r.Bytes, tc.size, "store %d", i)
			}
			for i, r := range Wait(t, s.a.LookupAndHold(ctx, keys)) {
				eq(t, r.Status, l2.StatusOK, "lookup %d: %v", i, r.Err)
				check(t, r.Bytes == 0 || r.Bytes == tc.size, "lookup %d: Bytes %d, object %d", i, r.Bytes, tc.size)
			}
			dst := buffers(src)
			for i, r := range Wait(t, s.a.Load(ctx, keys, dst)) {
				eq(t, r.Status, l2.StatusOK, "load %d: %v", i, r.Err)
				eq(t, r.Bytes, tc.size, "load %d", i)
				check(t, bytes.Equal(dst[i], src[i]), "key %d: loaded bytes differ from the stored ones", i)
			}
			s.a.Release(keys)
		})
	}
}

// A held key refuses Delete with ErrHeld. Each lookup that finds a key
// holds it once; Release drops one hold and ignores keys not held; once no
// hold (and no backend lease) is left, Delete removes the key.
func (s *suite) heldKeyRefusesDelete(t *testing.T) {
	ctx := context.Background()
	keys := s.keys(1)
	k := keys[0]
	src := payloads(1)
	s.store(t, s.a, keys, src)
	for range 2 {
		eq(t, Wait(t, s.a.LookupAndHold(ctx, keys))[0].Status, l2.StatusOK)
	}
	for _, step := range []struct {
		name    string
		release int // Release calls before this step
		held    int // hold count after them
	}{
		{"held twice", 0, 2},
		{"one release of two", 1, 1},
	} {
		for range step.release {
			s.a.Release(keys)
		}
		eq(t, s.a.Held(k), step.held, step.name)
		r := Wait(t, s.a.Delete(ctx, keys))[0]
		eq(t, r.Status, l2.StatusFailed, step.name)
		check(t, errors.Is(r.Err, l2.ErrHeld), "%s: %v", step.name, r.Err)
		contains(t, r.Err.Error(), k.String(), step.name)
		dst := buffers(src)
		eq(t, Wait(t, s.a.Load(ctx, keys, dst))[0].Status, l2.StatusOK, "%s: refused delete removed the key", step.name)
		check(t, bytes.Equal(dst[0], src[0]), "loaded bytes differ from the stored ones")
	}
	s.a.Release(keys)
	eq(t, s.a.Held(k), 0)
	s.a.Release(keys) // not held: ignored, no negative count
	eq(t, s.a.Held(k), 0)
	r := s.deleteReleased(t, k)
	eq(t, r.Status, l2.StatusOK, "%v", r.Err)
	eqs(t, s.present(t, keys), []l2.Status{l2.StatusMiss})
}

// A batch with a partial failure fails exactly the failing keys, names each
// in its error, and leaves the other keys' results standing (no rollback).
func (s *suite) partialFailure(t *testing.T) {
	ctx := context.Background()
	const bad = 2
	// loadResized stores every key and loads them into buffers of their
	// size, except key bad's, resized by resize: the others load intact.
	loadResized := func(resize func([]byte) []byte) func(*testing.T, []kv.Key, [][]byte) *l2.Task {
		return func(t *testing.T, k []kv.Key, src [][]byte) *l2.Task {
			s.store(t, s.a, k, src)
			dst := buffers(src)
			dst[bad] = resize(dst[bad])
			task := s.a.Load(ctx, k, dst)
			Wait(t, task)
			for i := range k {
				if i != bad {
					check(t, bytes.Equal(dst[i], src[i]), "key %d: loaded bytes differ from the stored ones", i)
				}
			}
			return task
		}
	}
	for _, tc := range []struct {
		name string
		// run makes key bad fail in an operation on keys (src stored, except
		// where noted) and returns its task
		run     func(t *testing.T, keys []kv.Key, src [][]byte) *l2.Task
		wantErr error // nil: any error
		// after checks the state that the batch left
		after func(t *testing.T, keys []kv.Key, src [][]byte)
	}{
		{"load into a short buffer", loadResized(func(b []byte) []byte { return b[:len(b)-1] }), l2.ErrBufferSize, s.allLoad},
		{"load into a long buffer", loadResized(func(b []byte) []byte { return append(b, 0) }), l2.ErrBufferSize, s.allLoad},
		{"delete with a held key", func(t *testing.T, k []kv.Key, src [][]byte) *l2.Task {
			s.store(t, s.a, k, src)
			eq(t, Wait(t, s.a.LookupAndHold(ctx, k[bad:bad+1]))[0].Status, l2.StatusOK)
			return s.a.Delete(ctx, k)
		}, l2.ErrHeld, func(t *testing.T, k []kv.Key, src [][]byte) {
			want := make([]l2.Status, len(k))
			for i := range want {
				want[i] = l2.StatusMiss
			}
			want[bad] = l2.StatusOK
			s.a.Release(k[bad : bad+1])
			eqs(t, s.present(t, k), want)
		}},
		{"store of a broken key", func(t *testing.T, k []kv.Key, src [][]byte) *l2.Task {
			if s.tg.BreakStore == nil {
				t.Skip("the target has no store fault for one key (Target.BreakStore)")
			}
			s.tg.BreakStore(t, s.a, k[bad])
			task := s.a.Store(ctx, k, src)
			Wait(t, task)
			return task
		}, nil, func(t *testing.T, k []kv.Key, src [][]byte) {
			// the broken key's lookup may fail too: only the others count
			others := append(append([]kv.Key{}, k[:bad]...), k[bad+1:]...)
			want := make([]l2.Status, len(others))
			for i := range want {
				want[i] = l2.StatusOK
			}
			eqs(t, s.present(t, others), want)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := s.keys(5)
			src := payloads(5)
			task := tc.run(t, keys, src)
			res := Wait(t, task)
			eqs(t, task.Failed(), []int{bad})
			for i, r := range res {
				if i == bad {
					continue
				}
				eq(t, r.Status, l2.StatusOK, "key %d: %v", i, r.Err)
			}
			if tc.wantErr != nil {
				check(t, errors.Is(res[bad].Err, tc.wantErr), "%v", res[bad].Err)
			}
			contains(t, res[bad].Err.Error(), keys[bad].String())
			tc.after(t, keys, src)
		})
	}
}

// allLoad checks that every key still loads (a failed load removes
// nothing).
func (s *suite) allLoad(t *testing.T, keys []kv.Key, src [][]byte) {
	t.Helper()
	dst := buffers(src)
	for i, r := range Wait(t, s.a.Load(context.Background(), keys, dst)) {
		eq(t, r.Status, l2.StatusOK, "key %d after the failed load: %v", i, r.Err)
		check(t, bytes.Equal(dst[i], src[i]), "key %d: loaded bytes differ from the stored ones", i)
	}
}

// A deleted key is a miss for lookup, load and delete, and can be written
// again.
func (s *suite) deletedKeyIsMiss(t *testing.T) {
	ctx := context.Background()
	keys := s.keys(3)
	src := payloads(3)
	s.store(t, s.a, keys[:2], src[:2])
	del := Wait(t, s.a.Delete(ctx, keys))
	eqs(t, statuses(del), []l2.Status{l2.StatusOK, l2.StatusOK, l2.StatusMiss})
	miss := []l2.Status{l2.StatusMiss, l2.StatusMiss, l2.StatusMiss}
	eqs(t, s.present(t, keys), miss)
	eqs(t, statuses(Wait(t, s.a.Load(ctx, keys, buffers(src)))), miss)
	eqs(t, statuses(Wait(t, s.a.Delete(ctx, keys))), miss)

	s.store(t, s.a, keys[:1], src[:1])
	dst := buffers(src[:1])
	eq(t, Wait(t, s.a.Load(ctx, keys[:1], dst))[0].Status, l2.StatusOK)
	check(t, bytes.Equal(dst[0], src[0]), "loaded bytes differ from the stored ones")
}

// A corrupt object is a miss (not a failure, not bytes), is discarded (not
// found or served again) and is healed by the next store of its key.
func (s *suite) corruptObjectIsMiss(t *testing.T) {
	if s.tg.Corrupt == nil {
		t.Skip("the target cannot damage an object (Target.Corrupt)")
	}
	ctx := context.Background()
	keys := s.keys(3)
	src := payloads(3)
	s.store(t, s.a, keys, src)
	s.tg.Corrupt(t, s.a, keys[1])
	want := []l2.Status{l2.StatusOK, l2.StatusMiss, l2.StatusOK}
	dst := buffers(src)
	task := s.a.Load(ctx, keys, dst)
	eqs(t, statuses(Wait(t, task)), want)
	eq(t, len(task.Failed()), 0)
	for _, i := range []int{0, 2} {
		check(t, bytes.Equal(dst[i], src[i]), "key %d: loaded bytes differ from the stored ones", i)
	}
	eqs(t, s.present(t, keys), want)
	eqs(t, statuses(Wait(t, s.a.Load(ctx, keys, buffers(src)))), want)

	s.store(t, s.a, keys[1:2], src[1:2])
	dst = buffers(src[1:2])
	eq(t, Wait(t, s.a.Load(ctx, keys[1:2], dst))[0].Status, l2.StatusOK)
	check(t, bytes.Equal(dst[0], src[1]), "healed key: loaded bytes differ from the stored ones")
}

// Keys and buffers of different lengths fail every key with ErrBadBatch.
func (s *suite) badBatch(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		run  func(keys []kv.Key, bufs [][]byte) *l2.Task
	}{
		{"store", func(k []kv.Key, b [][]byte) *l2.Task { return s.a.Store(ctx, k, b) }},
		{"load", func(k []kv.Key, b [][]byte) *l2.Task { return s.a.Load(ctx, k, b) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := s.keys(3)
			res := Wait(t, tc.run(keys, payloads(2)))
			eq(t, len(res), 3)
			for i, r := range res {
				eq(t, r.Status, l2.StatusFailed, "key %d", i)
				check(t, errors.Is(r.Err, l2.ErrBadBatch), "key %d: %v", i, r.Err)
			}
			eqs(t, s.present(t, keys), []l2.Status{l2.StatusMiss, l2.StatusMiss, l2.StatusMiss})
		})
	}
}

// A closed adapter fails every key of every operation with ErrClosed;
// Release and a second Close do nothing.
func (s *suite) closed(t *testing.T) {
	ctx := context.Background()
	a := s.tg.Open(t)
	keys := s.keys(2)
	src := payloads(2)
	s.store(t, a, keys, src)
	noErr(t, a.Close())
	for _, task := range []*l2.Task{
		a.Store(ctx, keys, src),
		a.LookupAndHold(ctx, keys),
		a.Load(ctx, keys, buffers(src)),
		a.Delete(ctx, keys),
	} {
		for i, r := range Wait(t, task) {
			eq(t, r.Status, l2.StatusFailed, "%s key %d", task.Op(), i)
			check(t, errors.Is(r.Err, l2.ErrClosed), "%s key %d: %v", task.Op(), i, r.Err)
		}
	}
	a.Release(keys)
	eq(t, a.Held(keys[0]), 0)
	noErr(t, a.Close())
}
