package fs

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/server/l2"
)

// Type is the adapter type name.
const Type = "fs"

const (
	trailerSize = 16
	magic       = 0x324c564b // "KVL2" little-endian
	suffix      = ".kv"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrCorrupt marks an object that failed verification (it is deleted and
// reported as a miss).
var ErrCorrupt = errors.New("fs: corrupt object")

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
}

// Config is the fs backend's own config.
type Config struct {
	BasePath string
	Fsync    bool
	DirMode  os.FileMode
	FileMode os.FileMode
	// SweepTmpAge > 0 removes, once in the background after Open,
	// temporary files of crashed writers older than this.
	SweepTmpAge time.Duration
}

// New is the l2 factory for type "fs".
func New(cfg *l2.Config, _ l2.Env) (l2.Backend, error) {
	c := Config{DirMode: 0o755, FileMode: 0o644}
	ex := cfg.Extras()
	ex.String("base_path", &c.BasePath)
	ex.Bool("fsync", &c.Fsync)
	var dm, fm int
	if ex.Int("dir_mode", &dm, 0o700, 0o777) {
		c.DirMode = os.FileMode(dm)
	}
	if ex.Int("file_mode", &fm, 0o400, 0o777) {
		c.FileMode = os.FileMode(fm)
	}
	var sweep int
	if ex.Int("sweep_tmp_older_than_s", &sweep, 0, 1<<30) {
		c.SweepTmpAge = time.Duration(sweep) * time.Second
	}
	if c.BasePath == "" {
		ex.Fail("base_path", "missing")
	}
	if err := ex.Done(); err != nil {
		return nil, err
	}
	return Open(c)
}

// Open creates the base directory if needed and returns the backend.
func Open(c Config) (*Backend, error) {
	if c.DirMode == 0 {
		c.DirMode = 0o755
	}
	if c.FileMode == 0 {
		c.FileMode = 0o644
	}
	if err := os.MkdirAll(c.BasePath, c.DirMode); err != nil {
		return nil, fmt.Errorf("fs: base_path: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b := &Backend{base: c.BasePath, fsync: c.Fsync, dirMode: c.DirMode, fileMode: c.FileMode,
		pid: strconv.Itoa(os.Getpid()), stop: cancel, swept: make(chan struct{})}
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
func (b *Backend) Path(k l2.Key) string {
	h := hex.EncodeToString(k.Hash[:2])
	return filepath.Join(b.base, h[:2], h[2:4], k.String()+suffix)
}

// Store implements l2.Backend.
func (b *Backend) Store(ctx context.Context, keys []l2.Key, bufs [][]byte, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		if err := b.store(k, bufs[i]); err != nil {
			r.Fail(i, err)
			continue
		}
		r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(bufs[i])})
	}
}

func (b *Backend) store(k l2.Key, payload []byte) error {
	final := b.Path(k)
	if _, err := os.Stat(final); err == nil {
		return nil
	}
	dir := filepath.Dir(final)
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := filepath.Join(dir, ".tmp."+k.String()+"."+b.pid+"."+hex.EncodeToString(rnd[:]))
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, b.fileMode)
	if errors.Is(err, os.ErrNotExist) {
		if err = os.MkdirAll(dir, b.dirMode); err == nil {
			f, err = os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, b.fileMode)
		}
	}
	if err != nil {
		return fmt.Errorf("fs: store %s: %w", k, err)
	}
	var tr [trailerSize]byte
	binary.LittleEndian.PutUint32(tr[0:], magic)
	binary.LittleEndian.PutUint32(tr[4:], crc32.Checksum(payload, castagnoli))
	binary.LittleEndian.PutUint64(tr[8:], uint64(len(payload)))
	_, err = f.Write(payload)
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
		err = publish(tmp, final)
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
// bytes). Without hard-link support it renames.
func publish(tmp, final string) error {
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

// Exists implements l2.Backend.
func (b *Backend) Exists(ctx context.Context, keys []l2.Key, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		st, err := os.Stat(b.Path(k))
		switch {
		case err == nil && st.Size() >= trailerSize:
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: int(st.Size() - trailerSize)})
		case err == nil || errors.Is(err, os.ErrNotExist):
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, fmt.Errorf("fs: exists %s: %w", k, err))
		}
	}
}

// Load implements l2.Backend.
func (b *Backend) Load(ctx context.Context, keys []l2.Key, bufs [][]byte, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		r.Report(i, b.load(k, bufs[i]))
	}
}

func (b *Backend) load(k l2.Key, dst []byte) l2.Result {
	path := b.Path(k)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return l2.Result{Status: l2.StatusMiss}
	}
	if err != nil {
		return l2.Result{Status: l2.StatusFailed, Err: fmt.Errorf("fs: load %s: %w", k, err)}
	}
	defer f.Close()
	corrupt := func(why string, args ...any) l2.Result {
		_ = os.Remove(path)
		return l2.Result{Status: l2.StatusMiss, Err: fmt.Errorf("%w: %s: %s", ErrCorrupt, k, fmt.Sprintf(why, args...))}
	}
	st, err := f.Stat()
	if err != nil {
		return l2.Result{Status: l2.StatusFailed, Err: fmt.Errorf("fs: load %s: %w", k, err)}
	}
	size := st.Size()
	if size < trailerSize {
		return corrupt("file of %d bytes has no trailer", size)
	}
	var tr [trailerSize]byte
	if _, err := f.ReadAt(tr[:], size-trailerSize); err != nil {
		return corrupt("read trailer: %v", err)
	}
	n := binary.LittleEndian.Uint64(tr[8:])
	if binary.LittleEndian.Uint32(tr[0:]) != magic || n != uint64(size-trailerSize) {
		return corrupt("bad trailer (magic %#x, length %d, file %d)", binary.LittleEndian.Uint32(tr[0:]), n, size)
	}
	if n != uint64(len(dst)) {
		return l2.Result{Status: l2.StatusFailed, Err: fmt.Errorf("fs: load %s: object %d bytes, buffer %d: %w", k, n, len(dst), l2.ErrBufferSize)}
	}
	if _, err := f.ReadAt(dst, 0); err != nil && !(err == io.EOF && n == 0) {
		return corrupt("read payload: %v", err)
	}
	if crc32.Checksum(dst, castagnoli) != binary.LittleEndian.Uint32(tr[4:]) {
		return corrupt("crc32c mismatch")
	}
	return l2.Result{Status: l2.StatusOK, Bytes: len(dst)}
}

// Delete implements l2.Backend.
func (b *Backend) Delete(ctx context.Context, keys []l2.Key, r l2.Reporter) {
	for i, k := range keys {
		if err := ctx.Err(); err != nil {
			r.FailAll(len(keys), err)
			return
		}
		err := os.Remove(b.Path(k))
		switch {
		case err == nil:
			r.Report(i, l2.Result{Status: l2.StatusOK})
		case errors.Is(err, os.ErrNotExist):
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, fmt.Errorf("fs: delete %s: %w", k, err))
		}
	}
}

// Close implements l2.Backend; it stops a running sweep.
func (b *Backend) Close() error {
	b.stop()
	select {
	case <-b.swept:
	case <-time.After(10 * time.Second):
	}
	return nil
}
