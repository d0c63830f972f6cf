package fs

import (
	"bytes"
	"container/heap"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l2"
)

// Capacity ("max_bytes"): least-recently-used eviction kept in the file
// system itself, so that it survives restarts and works for several servers
// sharing base_path. doc.go ("Capacity") describes the design.

// Defaults of the capacity keys.
const (
	DefaultScanInterval  = 60 * time.Second // "scan_interval_s"
	DefaultTouchInterval = time.Second      // "touch_interval_ms"
)

const (
	// lowWater: a pass evicts down to this fraction of max_bytes, so that
	// the stores after it find room without a pass each.
	lowWater = 0.9
	// holdTTL bounds how long a lookup's hold keeps a key from this
	// server's eviction when its release never comes.
	holdTTL = 60 * time.Second
	// minRescan: under pressure a pass rescans base_path (to see other
	// servers' writes) at most this often, and at most once per four
	// durations of the last scan.
	minRescan = time.Second
	// evictPrefix names a file an evictor moved aside; one whose ctime is
	// older than staleEvict was left by an evictor that died and is removed
	// by the next scan.
	evictPrefix = ".evict."
	// warnEvery rate-limits the "nothing evictable" warning.
	warnEvery = 10 * time.Second
)

// staleEvict: see evictPrefix (a variable for tests).
var staleEvict = time.Minute

// testHookBeforeAside, when set (tests only), runs between an eviction's
// check of a candidate and its rename aside.
var testHookBeforeAside func(path string)

// ErrFull marks a store refused because it cannot fit under max_bytes: the
// object is larger than max_bytes, or nothing more could be evicted (every
// remaining object is held by a lookup of this server or was used since
// the last scan).
var ErrFull = fmt.Errorf("fs: max_bytes reached: %w", l2.ErrFull)

// EvictStats are the capacity counters of one backend.
type EvictStats struct {
	Max  int64 // max_bytes (0: no capacity)
	Used int64 // the estimate of the bytes of object files under base_path
	// Scans: scans of base_path. Evicted, EvictedBytes: objects this
	// backend evicted. Skipped: candidates not evicted because they were
	// replaced or used since the scan (or could not be moved). Full:
	// stores refused with ErrFull. TouchErrors: hits whose mtime could not
	// be updated (a group member without write permission on the file).
	Scans, Evicted, EvictedBytes, Skipped, Full, TouchErrors int64
}

// evictionKey reads the adapter-owned "eviction" value: absent, null or
// {"eviction_policy": "LRU"} (LMCache's form); anything else is refused,
// since LRU is the only policy the fs adapter implements.
func evictionKey(cfg *l2.Config, ex *l2.Extras) (set bool) {
	raw := bytes.TrimSpace(cfg.Eviction)
	if len(raw) == 0 || string(raw) == "null" {
		return false
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil || m == nil {
		ex.Fail("eviction", `want an object such as {"eviction_policy":"LRU"}, got %s`, raw)
		return true
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if k != "eviction_policy" {
			ex.Fail("eviction."+k, `unknown: the fs adapter reads only "eviction_policy" (the budget is "max_bytes")`)
			return true
		}
	}
	var pol string
	if err := json.Unmarshal(m["eviction_policy"], &pol); err != nil {
		ex.Fail("eviction.eviction_policy", "want a string, got %s", bytes.TrimSpace(m["eviction_policy"]))
		return true
	}
	if !strings.EqualFold(pol, "LRU") {
		ex.Fail("eviction.eviction_policy", `%q is not implemented by the fs adapter: only "LRU"`, pol)
	}
	return true
}

// cand is an object file found by a scan: an eviction candidate.
type cand struct {
	key      kv.Key
	size     int64
	mtime    int64 // ns
	dev, ino uint64
}

// is reports whether st is still the file the scan found, unchanged: same
// inode, size and mtime (a hit since the scan changed the mtime; a store
// that replaced the file changed the inode).
func (c *cand) is(st os.FileInfo) bool {
	s, ok := st.Sys().(*syscall.Stat_t)
	return ok && uint64(s.Dev) == c.dev && uint64(s.Ino) == c.ino && st.Size() == c.size && st.ModTime().UnixNano() == c.mtime
}

// newest is a max-heap on mtime: a scan keeps only the oldest files.
type newest []cand

func (h newest) Len() int           { return len(h) }
func (h newest) Less(i, j int) bool { return h[i].mtime > h[j].mtime }
func (h newest) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *newest) Push(x any)        { *h = append(*h, x.(cand)) }
func (h *newest) Pop() any {
	old := *h
	c := old[len(old)-1]
	*h = old[:len(old)-1]
	return c
}

// evictPass is one eviction pass; waiting stores wait for its end.
type evictPass struct {
	done chan struct{}
	full bool // at its end the largest waiting store still did not fit
}

type hold struct {
	n     int
	until time.Time
}

// evictor keeps one backend under max_bytes. Its state is this server's
// own: an estimate of the usage, the candidates of its last scan, the
// holds of its lookups; nothing is shared with other servers but the
// files and their mtimes.
type evictor struct {
	b          *Backend
	max, low   int64
	scanEvery  time.Duration
	touchEvery time.Duration // < 0: touch on every hit
	log        *slog.Logger

	kick      chan struct{}
	forceScan atomic.Bool
	stopped   chan struct{}

	acct    sync.Mutex
	used    int64 // estimate: the last scan's total + this server's changes since
	net     int64 // ledger of this server's changes (bytes added - removed)
	pending int64 // bytes reserved by stores not yet published (or failed)
	ready   bool  // the first scan is done

	need atomic.Int64 // largest store waiting for room

	passMu sync.Mutex
	next   *evictPass

	holdMu sync.Mutex
	holds  map[kv.Key]hold

	// The run goroutine's own.
	cands      []cand // oldest first
	pos        int
	scannedAt  time.Time
	scanTook   time.Duration
	lastWarn   time.Time
	suppressed int
	announced  bool

	scans, evicted, evictedBytes, skipped, full, touchErrs atomic.Int64

	onDrop atomic.Pointer[func(kv.Key)] // Backend.OnDrop
}

func newEvictor(b *Backend, c Config) *evictor {
	e := &evictor{b: b, max: c.MaxBytes, low: int64(float64(c.MaxBytes) * lowWater),
		scanEvery: c.ScanInterval, touchEvery: c.TouchInterval, log: c.Logger,
		kick: make(chan struct{}, 1), stopped: make(chan struct{}),
		next: &evictPass{done: make(chan struct{})}, holds: map[kv.Key]hold{}}
	if e.scanEvery <= 0 {
		e.scanEvery = DefaultScanInterval
	}
	if e.touchEvery == 0 {
		e.touchEvery = DefaultTouchInterval
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	return e
}

// run scans base_path at once (the usage and the recency order are
// rebuilt from the files: nothing is kept across restarts), then runs a
// pass when a store waits for room and a periodic one every scanEvery.
func (e *evictor) run(ctx context.Context) {
	defer close(e.stopped)
	e.pass(ctx, true)
	t := time.NewTicker(e.scanEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-e.kick:
			e.pass(ctx, false)
		case <-t.C:
			e.pass(ctx, true)
		}
	}
}

func (e *evictor) usage() int64 {
	e.acct.Lock()
	defer e.acct.Unlock()
	return e.used
}

// account records a change this server made (a file removed).
func (e *evictor) account(n int64) {
	e.acct.Lock()
	e.used += n
	e.net += n
	e.acct.Unlock()
}

// published ends a reservation of n bytes: the file is published, or the
// store failed and the bytes are given back.
func (e *evictor) published(n int64, ok bool) {
	e.acct.Lock()
	e.pending -= n
	if !ok {
		e.used -= n
		e.net -= n
	}
	e.acct.Unlock()
}

// reserve counts n bytes about to be written. Over max_bytes it waits
// (bounded by ctx) for a pass to make room; when a pass could not, or the
// object alone is larger than max_bytes, the store fails with ErrFull.
// Before the first scan ends the usage is unknown and stores are not held
// back (the scan then counts them).
func (e *evictor) reserve(ctx context.Context, n int64) error {
	if n > e.max {
		e.full.Add(1)
		return fmt.Errorf("%w: an object of %d bytes is larger than max_bytes (%d)", ErrFull, n, e.max)
	}
	full := false
	for {
		e.acct.Lock()
		if !e.ready || e.used+n <= e.max {
			e.used += n
			e.net += n
			e.pending += n
			e.acct.Unlock()
			return nil
		}
		used := e.used
		e.acct.Unlock()
		if full {
			e.full.Add(1)
			return fmt.Errorf("%w: %d of %d bytes used and nothing more could be evicted (objects held by lookups or used since the last scan)", ErrFull, used, e.max)
		}
		for {
			old := e.need.Load()
			if n <= old || e.need.CompareAndSwap(old, n) {
				break
			}
		}
		p, err := e.runPass(ctx)
		if err != nil {
			return err
		}
		full = p.full
	}
}

// rescan asks for a pass that scans base_path and waits for its end.
func (e *evictor) rescan(ctx context.Context) error {
	e.forceScan.Store(true)
	_, err := e.runPass(ctx)
	return err
}

// runPass kicks the evictor and waits for the end of the next pass.
func (e *evictor) runPass(ctx context.Context) (*evictPass, error) {
	e.passMu.Lock()
	p := e.next
	e.passMu.Unlock()
	select {
	case e.kick <- struct{}{}:
	default:
	}
	select {
	case <-p.done:
		return p, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-e.stopped:
		return nil, l2.ErrClosed
	}
}

// pass scans when due and, over max_bytes (or when a waiting store does
// not fit), evicts the least recently used objects down to the low
// watermark.
func (e *evictor) pass(ctx context.Context, periodic bool) {
	e.passMu.Lock()
	p := e.next
	e.next = &evictPass{done: make(chan struct{})}
	e.passMu.Unlock()
	defer close(p.done)
	e.pruneHolds()
	need := e.need.Swap(0)
	scanned := false
	if e.forceScan.Swap(false) || periodic || e.scannedAt.IsZero() || time.Since(e.scannedAt) >= e.scanEvery {
		if !e.scan(ctx) {
			return
		}
		scanned = true
	}
	over := func() bool { u := e.usage(); return u > e.max || (need > 0 && u+need > e.max) }
	if !over() {
		return
	}
	// Under pressure a stale scan misses what other servers wrote since:
	// rescan, at most once per max(minRescan, 4 scan durations).
	if !scanned && time.Since(e.scannedAt) >= max(minRescan, 4*e.scanTook) {
		if !e.scan(ctx) {
			return
		}
		if !over() {
			return
		}
	}
	if !e.announced {
		e.announced = true
		e.log.Info("fs L2: max_bytes reached; evicting the least recently used objects", "base_path", e.b.base, "max_bytes", e.max, "used", e.usage())
	}
	target := min(e.low, e.max-need)
	for round := 0; ; round++ {
		freed := e.evictTo(ctx, target)
		if e.usage() <= target || ctx.Err() != nil {
			break
		}
		// The candidates ran out. When a fresh scan's freed nothing, the
		// rest is held or in use; otherwise a new scan finds the next
		// oldest (a scan keeps at most half of max_bytes of candidates).
		if round > 0 && freed == 0 {
			break
		}
		if !e.scan(ctx) {
			return
		}
	}
	p.full = need > 0 && e.usage()+need > e.max
	if u := e.usage(); u > e.max || p.full {
		e.warnFull(u)
	}
}

func (e *evictor) warnFull(used int64) {
	now := time.Now()
	if !e.lastWarn.IsZero() && now.Sub(e.lastWarn) < warnEvery {
		e.suppressed++
		return
	}
	e.log.Warn("fs L2: over max_bytes and nothing more to evict: the remaining objects are held by lookups or were used since the scan; stores fail until room is made",
		"base_path", e.b.base, "max_bytes", e.max, "used", used, "suppressed", e.suppressed)
	e.lastWarn, e.suppressed = now, 0
}

// evictTo evicts candidates, oldest first, until the usage is at most
// target or the candidates run out; it returns the bytes freed.
func (e *evictor) evictTo(ctx context.Context, target int64) int64 {
	var freed int64
	for e.pos < len(e.cands) && e.usage() > target && ctx.Err() == nil {
		c := e.cands[e.pos]
		e.pos++
		if e.held(c.key) {
			e.skipped.Add(1)
			continue
		}
		if n := e.remove(c); n > 0 {
			e.account(-n)
			freed += n
		}
	}
	return freed
}

// remove evicts c unless its file changed since the scan, and returns the
// bytes freed (c.size when the file is gone, by this call or another
// server's). The file is first renamed to a name only this call knows; the
// inode moved is then checked to be the one the scan found, unchanged, and
// only then unlinked. A file another server published or replaced under
// the name, or used (touched) since the scan, is never removed: when one
// slipped in between the check and the rename, it is linked back.
func (e *evictor) remove(c cand) int64 {
	path := e.b.Path(c.key)
	st, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return c.size
	}
	if err != nil || !c.is(st) {
		e.skipped.Add(1)
		return 0
	}
	if testHookBeforeAside != nil {
		testHookBeforeAside(path)
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	aside := filepath.Join(filepath.Dir(path), evictPrefix+c.key.String()+"."+e.b.pid+"."+hex.EncodeToString(rnd[:]))
	if err := os.Rename(path, aside); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return c.size
		}
		e.skipped.Add(1) // e.g. no write permission on the directory
		return 0
	}
	st, err = os.Lstat(aside)
	if err == nil && c.is(st) {
		if err := os.Remove(aside); err == nil {
			e.evicted.Add(1)
			e.evictedBytes.Add(c.size)
			if f := e.onDrop.Load(); f != nil {
				(*f)(c.key)
			}
			return c.size
		}
	}
	if err == nil {
		restore(aside, path)
	}
	e.skipped.Add(1)
	return 0
}

// restore puts a file moved aside back under path, unless path names a
// file again (the same object, published meanwhile): then the moved one
// is dropped.
func restore(aside, path string) {
	err := os.Link(aside, path)
	if err != nil && !errors.Is(err, os.ErrExist) {
		if unix.Renameat2(unix.AT_FDCWD, aside, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE) == nil {
			return
		}
	}
	_ = os.Remove(aside)
}

// scan walks base_path's shard directories: the usage is the total size of
// the object files found plus what this server changed during the walk,
// and the oldest files (by mtime, up to half of max_bytes of them) become
// the candidates. Temporary files of crashed writers are removed when
// sweep_tmp_older_than_s is set, files moved aside by an evictor that died
// always. It returns false when ctx ended the walk.
func (e *evictor) scan(ctx context.Context) bool {
	start := time.Now()
	e.acct.Lock()
	// Stores reserved before the walk and published after it passed their
	// directory would be missed: count what is pending now (a file the
	// walk saw as well is counted twice until the next scan: the estimate
	// errs on the safe side).
	mark, pending := e.net, e.pending
	e.acct.Unlock()
	keep := e.max / 2
	var h newest
	var kept, total int64
	var tmpCut time.Time
	if e.b.sweepAge > 0 {
		tmpCut = start.Add(-e.b.sweepAge)
	}
	base := filepath.Clean(e.b.base)
	err := filepath.WalkDir(base, func(path string, d iofs.DirEntry, err error) error {
		if err != nil {
			return nil // vanished or unreadable entries are skipped
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		name := d.Name()
		if d.IsDir() {
			if path == base {
				return nil
			}
			// Only the two levels of shard directories (two hex digits).
			rel := path[len(base)+1:]
			if strings.Count(rel, string(filepath.Separator)) > 1 || len(name) != 2 || !isHex(name) {
				return filepath.SkipDir
			}
			return nil
		}
		switch {
		case strings.HasSuffix(name, suffix) && len(name) == kv.KeyStringLen+len(suffix):
			k, err := kv.ParseKey(name[:kv.KeyStringLen])
			if err != nil || e.b.Path(k) != path {
				return nil
			}
			info, err := d.Info()
			if err != nil || !info.Mode().IsRegular() {
				return nil
			}
			s, ok := info.Sys().(*syscall.Stat_t)
			if !ok {
				return nil
			}
			c := cand{key: k, size: info.Size(), mtime: info.ModTime().UnixNano(), dev: uint64(s.Dev), ino: uint64(s.Ino)}
			total += c.size
			heap.Push(&h, c)
			kept += c.size
			for h.Len() > 1 && kept-h[0].size >= keep {
				kept -= heap.Pop(&h).(cand).size
			}
		case strings.HasPrefix(name, ".tmp."):
			if !tmpCut.IsZero() {
				if info, err := d.Info(); err == nil && info.ModTime().Before(tmpCut) {
					_ = os.Remove(path)
				}
			}
		case strings.HasPrefix(name, evictPrefix):
			if info, err := d.Info(); err == nil {
				if s, ok := info.Sys().(*syscall.Stat_t); ok && time.Since(time.Unix(s.Ctim.Unix())) > staleEvict {
					_ = os.Remove(path)
				}
			}
		}
		return nil
	})
	if err != nil && ctx.Err() != nil {
		return false
	}
	cands := []cand(h)
	slices.SortFunc(cands, func(a, b cand) int {
		switch {
		case a.mtime < b.mtime:
			return -1
		case a.mtime > b.mtime:
			return 1
		}
		return 0
	})
	e.acct.Lock()
	e.used = total + (e.net - mark) + pending
	e.ready = true
	e.acct.Unlock()
	e.cands, e.pos = cands, 0
	e.scannedAt, e.scanTook = time.Now(), time.Since(start)
	e.scans.Add(1)
	e.log.Debug("fs L2: scanned base_path", "base_path", e.b.base, "bytes", total, "candidates", len(cands), "took", e.scanTook)
	return true
}

func isHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// touch marks a hit: the object file's mtime is set to "now" (the file
// system's clock: on NFS the server's, so every host orders hits the same
// way), at most once per touchEvery per file, through the open file, so
// the inode read is the one touched even if the name changed meanwhile.
func (e *evictor) touch(f *os.File, st os.FileInfo) {
	if e.touchEvery > 0 && time.Since(st.ModTime()) < e.touchEvery {
		return
	}
	rc, err := f.SyscallConn()
	if err != nil {
		e.touchErrs.Add(1)
		return
	}
	ts := [2]unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_NOW}}
	var errno syscall.Errno
	_ = rc.Control(func(fd uintptr) {
		// utimensat(fd, NULL, ts, 0) is futimens(fd, ts).
		_, _, errno = unix.Syscall6(unix.SYS_UTIMENSAT, fd, 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	})
	if errno != 0 {
		e.touchErrs.Add(1)
	}
}

// hold protects k from this server's eviction until released (a lookup
// found it and a load may follow), at most holdTTL.
func (e *evictor) hold(k kv.Key) {
	e.holdMu.Lock()
	h := e.holds[k]
	h.n++
	h.until = time.Now().Add(holdTTL)
	e.holds[k] = h
	e.holdMu.Unlock()
}

func (e *evictor) release(keys []kv.Key) {
	e.holdMu.Lock()
	for _, k := range keys {
		if h, ok := e.holds[k]; ok {
			if h.n <= 1 {
				delete(e.holds, k)
			} else {
				h.n--
				e.holds[k] = h
			}
		}
	}
	e.holdMu.Unlock()
}

func (e *evictor) held(k kv.Key) bool {
	e.holdMu.Lock()
	defer e.holdMu.Unlock()
	h, ok := e.holds[k]
	return ok && time.Now().Before(h.until)
}

func (e *evictor) pruneHolds() {
	now := time.Now()
	e.holdMu.Lock()
	for k, h := range e.holds {
		if !now.Before(h.until) {
			delete(e.holds, k)
		}
	}
	e.holdMu.Unlock()
}

func (e *evictor) stats() EvictStats {
	return EvictStats{Max: e.max, Used: e.usage(), Scans: e.scans.Load(), Evicted: e.evicted.Load(),
		EvictedBytes: e.evictedBytes.Load(), Skipped: e.skipped.Load(), Full: e.full.Load(), TouchErrors: e.touchErrs.Load()}
}

// EvictStats returns the capacity counters (all zero without max_bytes).
func (b *Backend) EvictStats() EvictStats {
	if b.ev == nil {
		return EvictStats{}
	}
	return b.ev.stats()
}

// Samples are the capacity numbers of EvictStats as the adapter exports
// them (l2.Sampler: /metrics and STATS, label adapter=<name>); none
// without max_bytes.
func (b *Backend) Samples() []metric.Sample {
	if b.ev == nil {
		return nil
	}
	st := b.ev.stats()
	c := func(name, help string, v int64) metric.Sample {
		return metric.Sample{Name: name, Help: help, Counter: true, Value: float64(v)}
	}
	return []metric.Sample{
		{Name: "kvshim_l2_fs_max_bytes", Help: "max_bytes: the cap on the bytes of object files under base_path.", Value: float64(st.Max)},
		{Name: "kvshim_l2_fs_used_bytes", Help: "This server's estimate of the bytes of object files under base_path: its last scan plus its own writes and removals since.",
			Value: float64(st.Used)},
		c("kvshim_l2_fs_scans_total", "Scans of base_path (the walk that rebuilds the usage estimate and the eviction order).", st.Scans),
		c("kvshim_l2_fs_evicted_objects_total", "Objects this server evicted to stay under max_bytes (least recently used first).", st.Evicted),
		c("kvshim_l2_fs_evicted_bytes_total", "Bytes of the object files this server evicted.", st.EvictedBytes),
		c("kvshim_l2_fs_evict_skipped_total", "Eviction candidates kept: held by a lookup, replaced or used since the scan, or not movable (no write permission on the directory).",
			st.Skipped),
		c("kvshim_l2_fs_full_stores_total", "Stores refused with ErrFull: the object is larger than max_bytes, or nothing more could be evicted.", st.Full),
		c("kvshim_l2_fs_touch_errors_total", "Hits whose file mtime (the recency eviction orders by) could not be set, e.g. another uid's file in a shared base_path.",
			st.TouchErrors),
	}
}

// OnDrop makes f hear of every object this server's eviction removes
// (l2.DropNotifier); without max_bytes nothing is evicted and f is never
// called. Another server's eviction of a shared base_path is not seen.
func (b *Backend) OnDrop(f func(kv.Key)) {
	if b.ev != nil {
		b.ev.onDrop.Store(&f)
	}
}

// Rescan scans base_path now and evicts when it is over max_bytes (what
// the periodic scan does every scan_interval_s); it returns when that pass
// ended. Without max_bytes it does nothing.
func (b *Backend) Rescan(ctx context.Context) error {
	if b.ev == nil {
		return nil
	}
	return b.ev.rescan(ctx)
}

// Release implements l2.Releaser: it drops the holds of a lookup.
func (b *Backend) Release(keys []kv.Key) {
	if b.ev != nil {
		b.ev.release(keys)
	}
}
