package fs

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	iofs "io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
)

// Type is the adapter type name.
const Type = "fs"

const (
	trailerSize = 16
	magic       = 0x324c564b // "KVL2" little-endian
	suffix      = ".kv"
)

// Default permissions: the server's uid only, like its socket.
const (
	DefaultFileMode os.FileMode = 0o600
	DefaultDirMode  os.FileMode = 0o700
)

// The accepted "file_mode" and "dir_mode" values. No other-user bit is ever
// accepted; group bits are for a group of uids sharing base_path.
var (
	fileModes = []os.FileMode{0o600, 0o640}
	dirModes  = []os.FileMode{0o700, 0o750, 0o770}
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrCorrupt marks an object that failed verification (it is deleted and
// reported as a miss).
var ErrCorrupt = fmt.Errorf("fs: %w", l2.ErrCorrupt)

// errInvalid marks a file that cannot be a stored object (no trailer, bad
// magic, a length that disagrees with the file size, not a regular file).
var errInvalid = errors.New("not a valid object")

func init() { l2.Register(Type, New) }

// Backend is the fs backend.
type Backend struct {
	stop     context.CancelFunc
	swept    chan struct{}
	base     string
	fsync    bool
	dirMode  os.FileMode
	fileMode os.FileMode
	pid      string
	sweepAge time.Duration
	ev       *evictor // nil without max_bytes
}

// Config is the fs backend's own config.
type Config struct {
	BasePath string
	Fsync    bool
	// DirMode is the mode of every directory the adapter creates (base_path
	// and its missing parents included) and FileMode that of every object
	// file; both are set exactly, whatever the umask. Zero means the
	// defaults, 0700 and 0600. Accepted: DirMode 0700, 0750 or 0770,
	// FileMode 0600 or 0640, with group bits in both or in neither.
	DirMode  os.FileMode
	FileMode os.FileMode
	// SweepTmpAge > 0 removes, once in the background after Open,
	// temporary files of crashed writers older than this.
	SweepTmpAge time.Duration
	// MaxBytes > 0 bounds the bytes of the object files under BasePath,
	// with least-recently-used eviction (doc.go, "Capacity").
	MaxBytes int64
	// ScanInterval is the period of the scan of BasePath with MaxBytes
	// (0: DefaultScanInterval); TouchInterval the least age of an object
	// file's mtime before a hit updates it (0: DefaultTouchInterval; < 0:
	// every hit).
	ScanInterval  time.Duration
	TouchInterval time.Duration
	// Logger gets Open's warning about a base_path more open than DirMode
	// and the capacity's messages; nil means slog.Default().
	Logger *slog.Logger
}

// New is the l2 factory for type "fs".
func New(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
	c := Config{Logger: env.Logger}
	ex := cfg.Extras()
	ex.String("base_path", &c.BasePath)
	ex.Bool("fsync", &c.Fsync)
	modeKey(cfg, ex, "dir_mode", &c.DirMode)
	modeKey(cfg, ex, "file_mode", &c.FileMode)
	var sweep int
	if ex.Int("sweep_tmp_older_than_s", &sweep, 0, 1<<30) {
		c.SweepTmpAge = time.Duration(sweep) * time.Second
	}
	var maxBytes, scanS, touchMS int
	ex.Int("max_bytes", &maxBytes, 1, math.MaxInt)
	scanSet := ex.Int("scan_interval_s", &scanS, 1, 86400)
	touchSet := ex.Int("touch_interval_ms", &touchMS, 0, 86400000)
	evictionSet := evictionKey(cfg, ex)
	c.MaxBytes = int64(maxBytes)
	c.ScanInterval = time.Duration(scanS) * time.Second
	c.TouchInterval = time.Duration(touchMS) * time.Millisecond
	if touchSet && touchMS == 0 {
		c.TouchInterval = -1 // every hit
	}
	if maxBytes == 0 {
		for _, k := range []struct {
			key string
			set bool
		}{{"eviction", evictionSet}, {"scan_interval_s", scanSet}, {"touch_interval_ms", touchSet}} {
			if k.set {
				ex.Fail(k.key, `has no effect without "max_bytes" (the capacity that LRU eviction keeps the directory under)`)
			}
		}
	}
	if c.BasePath == "" {
		ex.Fail("base_path", "missing")
	}
	if err := ex.Done(); err != nil {
		return nil, err
	}
	return Open(c)
}

// modeKey reads a mode key: an octal string such as "0640" (a JSON number
// is refused: 640 would be read as decimal). The value is checked by the
// same rules as Open's.
func modeKey(cfg *l2.Config, ex *l2.Extras, key string, dst *os.FileMode) {
	const want = `want an octal string such as "0640"`
	if raw, ok := cfg.Extra[key]; ok {
		if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '"' {
			ex.Fail(key, "%s, got %s", want, t)
			return
		}
	}
	var s string
	if !ex.String(key, &s) {
		return
	}
	m, err := strconv.ParseUint(strings.TrimPrefix(s, "0"), 8, 12)
	if err != nil || len(s) < 3 || len(s) > 4 || (len(s) == 4 && s[0] != '0') {
		ex.Fail(key, "%q: %s", s, want)
		return
	}
	if why := modeProblem(key, os.FileMode(m)); why != "" {
		ex.Fail(key, "%s", why)
		return
	}
	*dst = os.FileMode(m)
}

// modeProblem says what is wrong with m as the value of "file_mode" or
// "dir_mode" ("" when nothing is).
func modeProblem(key string, m os.FileMode) string {
	ok := fileModes
	if key == "dir_mode" {
		ok = dirModes
	}
	switch {
	case slices.Contains(ok, m):
		return ""
	case m&0o007 != 0:
		return fmt.Sprintf("%04o gives every user of the host access to the KV data: other-user bits must be 0 (use %s)", uint32(m), modeList(ok))
	default:
		return fmt.Sprintf("%04o: want one of %s", uint32(m), modeList(ok))
	}
}

func modeList(ms []os.FileMode) string {
	var b strings.Builder
	for i, m := range ms {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%04o", uint32(m))
	}
	return b.String()
}

// check applies the mode rules (the Go API gets the same ones as the JSON
// keys).
func (c *Config) check() error {
	for _, m := range []struct {
		key  string
		mode os.FileMode
	}{{"file_mode", c.FileMode}, {"dir_mode", c.DirMode}} {
		if why := modeProblem(m.key, m.mode); why != "" {
			return fmt.Errorf("%w: key %q: %s", l2.ErrBadConfig, m.key, why)
		}
	}
	if c.MaxBytes < 0 {
		return fmt.Errorf("%w: key \"max_bytes\": %d, want > 0", l2.ErrBadConfig, c.MaxBytes)
	}
	if (c.FileMode&0o070 != 0) != (c.DirMode&0o070 != 0) {
		return fmt.Errorf("%w: key \"dir_mode\": file_mode %04o and dir_mode %04o disagree: give the group access in both (0640 with 0750 or 0770) or in neither",
			l2.ErrBadConfig, uint32(c.FileMode), uint32(c.DirMode))
	}
	return nil
}

// Open creates the base directory if needed and returns the backend.
// Directories it creates get c.DirMode exactly; an existing base_path is
// never chmod-ed, only warned about when it is more open than c.DirMode.
func Open(c Config) (*Backend, error) {
	if c.DirMode == 0 {
		c.DirMode = DefaultDirMode
	}
	if c.FileMode == 0 {
		c.FileMode = DefaultFileMode
	}
	if err := c.check(); err != nil {
		return nil, err
	}
	// kvshim creates base_path itself, never its parents: a missing parent
	// is far more often a typo than a wish (say so instead of creating it).
	created, err := mkdir1(c.BasePath, c.DirMode)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: fs: base_path %s: its parent directory %s does not exist (a typo?); kvshim creates only base_path itself",
			l2.ErrBadConfig, c.BasePath, filepath.Dir(c.BasePath))
	}
	if err != nil {
		return nil, fmt.Errorf("fs: base_path: %w", err)
	}
	if created {
		log := c.Logger
		if log == nil {
			log = slog.Default()
		}
		log.Info("fs L2: created base_path", "base_path", c.BasePath, "dir_mode", fmt.Sprintf("%04o", uint32(c.DirMode)))
	} else {
		if st, err := os.Stat(c.BasePath); err == nil && st.Mode().Perm()&^c.DirMode != 0 {
			log := c.Logger
			if log == nil {
				log = slog.Default()
			}
			log.Warn("fs L2: base_path is more open than dir_mode; kvshim leaves an existing directory's mode alone: chmod it (files written before 0600 was the default may be readable through it)",
				"base_path", c.BasePath, "mode", fmt.Sprintf("%04o", uint32(st.Mode().Perm())), "dir_mode", fmt.Sprintf("%04o", uint32(c.DirMode)))
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	b := &Backend{base: c.BasePath, fsync: c.Fsync, dirMode: c.DirMode, fileMode: c.FileMode,
		pid: strconv.Itoa(os.Getpid()), stop: cancel, swept: make(chan struct{}), sweepAge: c.SweepTmpAge}
	if c.MaxBytes > 0 {
		b.ev = newEvictor(b, c)
		go b.ev.run(ctx)
	}
	if c.SweepTmpAge > 0 {
		go func() {
			defer close(b.swept)
			_, _ = b.SweepTmp(ctx, c.SweepTmpAge)
		}()
	} else {
		close(b.swept)
	}
	return b, nil
}

// mkdirs creates dir and its missing parents, each with mode exactly
// (whatever the umask; a setgid bit inherited from the parent is kept), and
// leaves existing directories alone. created reports whether dir itself was
// made here.
func mkdirs(dir string, mode os.FileMode) (created bool, err error) {
	created, err = mkdir1(dir, mode)
	if !errors.Is(err, os.ErrNotExist) {
		return created, err
	}
	if parent := filepath.Dir(dir); parent != dir {
		if _, err := mkdirs(parent, mode); err != nil {
			return false, err
		}
	}
	return mkdir1(dir, mode)
}

func mkdir1(dir string, mode os.FileMode) (bool, error) {
	err := os.Mkdir(dir, mode)
	if errors.Is(err, os.ErrExist) {
		st, serr := os.Stat(dir)
		switch {
		case serr != nil:
			return false, serr
		case !st.IsDir():
			return false, &os.PathError{Op: "mkdir", Path: dir, Err: unix.ENOTDIR}
		}
		return false, nil
	}
	if err != nil {
		return false, err
	}
	// The umask may have taken bits away: set the mode. Until then the
	// directory is at most as open as mode.
	st, err := os.Lstat(dir)
	if err != nil {
		return true, err
	}
	want := mode | st.Mode()&os.ModeSetgid
	if st.Mode()&(os.ModePerm|os.ModeSetgid|os.ModeSetuid|os.ModeSticky) != want {
		err = os.Chmod(dir, want)
	}
	return true, err
}

// SweepTmp removes temporary files (".tmp.*") older than age, left by
// writers that died between create and publish. Safe to run while other
// hosts write: a live writer's file is younger than any sane age.
func (b *Backend) SweepTmp(ctx context.Context, age time.Duration) (int, error) {
	cutoff := time.Now().Add(-age)
	removed := 0
	err := filepath.WalkDir(b.base, func(path string, d iofs.DirEntry, err error) error {
		if err != nil {
			return nil // vanished or unreadable entries are skipped
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if d.IsDir() || !strings.HasPrefix(d.Name(), ".tmp.") {
			return nil
		}
		if info, err := d.Info(); err == nil && info.ModTime().Before(cutoff) {
			if os.Remove(path) == nil {
				removed++
			}
		}
		return nil
	})
	return removed, err
}

// Path is the object file of k.
func (b *Backend) Path(k kv.Key) string {
	h := hex.EncodeToString(k.Hash[:2])
	return filepath.Join(b.base, h[:2], h[2:4], k.String()+suffix)
}

// Store implements l2.Backend.
func (b *Backend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		if err := b.store(ctx, k, bufs[i]); err != nil {
			r.Fail(i, err)
			continue
		}
		r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(bufs[i])})
	}
}

func (b *Backend) store(ctx context.Context, k kv.Key, payload []byte) (err error) {
	final := b.Path(k)
	// An intact object of this size is the same object (content-addressed
	// keys): skip (a store of it is a use: with max_bytes its mtime is
	// touched like a hit's). A file that cannot be it (empty, truncated,
	// bad trailer, another size) is replaced, so the key heals. The
	// payload is not read here: loads verify it.
	replace := false
	if st, err := os.Stat(final); err == nil {
		if st.Mode().IsRegular() && st.Size() == int64(len(payload))+trailerSize {
			f, ost, _, _, err := openObject(final)
			if err == nil {
				if b.ev != nil {
					b.ev.touch(f, ost)
				}
				_ = f.Close()
				return nil
			}
			if !errors.Is(err, errInvalid) {
				return fmt.Errorf("fs: store %s: %w", k, err)
			}
		}
		replace = true
	}
	if b.ev != nil {
		// Room under max_bytes first (counted from now: the usage estimate
		// never lags a file this server writes).
		size := int64(len(payload)) + trailerSize
		if err := b.ev.reserve(ctx, size); err != nil {
			return fmt.Errorf("fs: store %s: %w", k, err)
		}
		defer func() { b.ev.published(size, err == nil) }()
	}
	dir := filepath.Dir(final)
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := filepath.Join(dir, ".tmp."+k.String()+"."+b.pid+"."+hex.EncodeToString(rnd[:]))
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, b.fileMode)
	if errors.Is(err, os.ErrNotExist) {
		if _, err = mkdirs(dir, b.dirMode); err == nil {
			f, err = os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, b.fileMode)
		}
	}
	if err != nil {
		return fmt.Errorf("fs: store %s: %w", k, err)
	}
	// The umask may have taken bits away at create: set the mode on the
	// open file (the file is never more open than fileMode meanwhile).
	err = f.Chmod(b.fileMode)
	var tr [trailerSize]byte
	binary.LittleEndian.PutUint32(tr[0:], magic)
	binary.LittleEndian.PutUint32(tr[4:], crc32.Checksum(payload, castagnoli))
	binary.LittleEndian.PutUint64(tr[8:], uint64(len(payload)))
	if err == nil {
		_, err = f.Write(payload)
	}
	if err == nil {
		_, err = f.Write(tr[:])
	}
	if err == nil && b.fsync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = publish(tmp, final, replace)
	}
	_ = os.Remove(tmp)
	if err != nil {
		return fmt.Errorf("fs: store %s: %w", k, err)
	}
	if b.fsync {
		syncDir(dir)
	}
	return nil
}

// publish links tmp to final; an existing final is success (same key, same
// bytes). Without hard-link support it renames. With replace (final holds
// a file that is not a valid object) it renames over final atomically.
func publish(tmp, final string, replace bool) error {
	if replace {
		return os.Rename(tmp, final)
	}
	err := os.Link(tmp, final)
	if err == nil || errors.Is(err, os.ErrExist) {
		return nil
	}
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) {
		return os.Rename(tmp, final)
	}
	return err
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
}

// openObject opens an object file and checks what every stored object
// has, without reading the payload: a regular file of at least trailerSize
// bytes whose trailer carries the magic and the length size-trailerSize.
// It returns the open file, its FileInfo, the payload length and the
// payload's crc32c from the trailer. A file that cannot be an object is an
// error wrapping errInvalid (st is then set); f is nil on any error.
func openObject(path string) (f *os.File, st os.FileInfo, n int64, crc uint32, err error) {
	if f, err = os.Open(path); err != nil {
		return nil, nil, 0, 0, err
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			f = nil
		}
	}()
	if st, err = f.Stat(); err != nil {
		return nil, nil, 0, 0, err
	}
	size := st.Size()
	if !st.Mode().IsRegular() {
		return nil, st, 0, 0, fmt.Errorf("%w: not a regular file (%v)", errInvalid, st.Mode().Type())
	}
	if size < trailerSize {
		return nil, st, 0, 0, fmt.Errorf("%w: file of %d bytes has no trailer", errInvalid, size)
	}
	var tr [trailerSize]byte
	if _, err := f.ReadAt(tr[:], size-trailerSize); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, st, 0, 0, fmt.Errorf("%w: read trailer: %v", errInvalid, err)
		}
		return nil, st, 0, 0, fmt.Errorf("read trailer: %w", err)
	}
	m, ln := binary.LittleEndian.Uint32(tr[0:]), binary.LittleEndian.Uint64(tr[8:])
	if m != magic || ln != uint64(size-trailerSize) {
		return nil, st, 0, 0, fmt.Errorf("%w: bad trailer (magic %#x, length %d, file %d)", errInvalid, m, ln, size)
	}
	return f, st, int64(ln), binary.LittleEndian.Uint32(tr[4:]), nil
}

// Exists implements l2.Backend: a file that cannot be an object (see
// openObject) is a miss, as Load would find it.
func (b *Backend) Exists(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		f, _, n, _, err := openObject(b.Path(k))
		switch {
		case err == nil:
			_ = f.Close()
			if b.ev != nil {
				b.ev.hold(k)
			}
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: int(n)})
		case errors.Is(err, os.ErrNotExist) || errors.Is(err, errInvalid):
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, fmt.Errorf("fs: exists %s: %w", k, err))
		}
	}
}

// Load implements l2.Backend.
func (b *Backend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		r.Report(i, b.load(k, bufs[i]))
	}
}

func (b *Backend) load(k kv.Key, dst []byte) l2.Result {
	path := b.Path(k)
	f, st, n, crc, err := openObject(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return l2.Result{Status: l2.StatusMiss}
	case errors.Is(err, errInvalid):
		b.discard(path, st)
		return l2.Result{Status: l2.StatusMiss, Err: fmt.Errorf("%w: %s: %v", ErrCorrupt, k, err)}
	case err != nil:
		return l2.Result{Status: l2.StatusFailed, Err: fmt.Errorf("fs: load %s: %w", k, err)}
	}
	defer f.Close()
	corrupt := func(why string, args ...any) l2.Result {
		b.discard(path, st)
		return l2.Result{Status: l2.StatusMiss, Err: fmt.Errorf("%w: %s: %s", ErrCorrupt, k, fmt.Sprintf(why, args...))}
	}
	if n != int64(len(dst)) {
		return l2.Result{Status: l2.StatusFailed, Err: fmt.Errorf("fs: load %s: object %d bytes, buffer %d: %w", k, n, len(dst), l2.ErrBufferSize)}
	}
	if _, err := f.ReadAt(dst, 0); err != nil && !(err == io.EOF && n == 0) {
		return corrupt("read payload: %v", err)
	}
	if crc32.Checksum(dst, castagnoli) != crc {
		return corrupt("crc32c mismatch")
	}
	if b.ev != nil {
		b.ev.touch(f, st)
	}
	return l2.Result{Status: l2.StatusOK, Bytes: len(dst)}
}

// discard removes a file found not to be a valid object, unless path names
// another file by now (a store replaced it meanwhile).
func (b *Backend) discard(path string, st os.FileInfo) {
	if cur, err := os.Stat(path); err == nil && st != nil && os.SameFile(st, cur) {
		if os.Remove(path) == nil && b.ev != nil {
			b.ev.account(-cur.Size())
		}
	}
}

// Delete implements l2.Backend.
func (b *Backend) Delete(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		path := b.Path(k)
		var size int64 = -1
		if b.ev != nil {
			if st, err := os.Lstat(path); err == nil {
				size = st.Size()
			}
		}
		err := os.Remove(path)
		switch {
		case err == nil:
			if size >= 0 {
				b.ev.account(-size)
			}
			r.Report(i, l2.Result{Status: l2.StatusOK})
		case errors.Is(err, os.ErrNotExist):
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, fmt.Errorf("fs: delete %s: %w", k, err))
		}
	}
}

// Close implements l2.Backend; it stops a running sweep and the eviction.
func (b *Backend) Close() error {
	b.stop()
	timeout := time.After(10 * time.Second)
	select {
	case <-b.swept:
	case <-timeout:
	}
	if b.ev != nil {
		select {
		case <-b.ev.stopped:
		case <-timeout:
		}
	}
	return nil
}
