package fs_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/l2/l2test"
)

// withUmask sets the process umask for the test (tests of this package do
// not run in parallel).
func withUmask(t *testing.T, mask int) {
	t.Helper()
	old := syscall.Umask(mask)
	t.Cleanup(func() { syscall.Umask(old) })
}

func modeOf(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	assert.NilError(t, err)
	return st.Mode() & (os.ModePerm | os.ModeSetgid)
}

func openAt(t *testing.T, base, extra string, logger *slog.Logger) *l2.Adapter {
	t.Helper()
	a, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q,"num_workers":1%s}`, base, extra),
		l2.Options{Registerer: prometheus.NewRegistry(), Logger: logger})
	assert.NilError(t, err)
	t.Cleanup(func() { assert.NilError(t, a.Close()) })
	return a
}

// Every directory the adapter creates (base_path, the shard directories)
// and every object file (linked into place, or renamed over a broken file) has the configured mode exactly, whatever
// the umask: a permissive one must not widen it, a strict one must not
// narrow the group setting.
func TestModesWhateverTheUmask(t *testing.T) {
	for _, mask := range []int{0, 0o077} {
		for _, tc := range []struct {
			name, extra   string
			dir, fileMode os.FileMode
		}{
			{"default", "", 0o700, 0o600},
			{"group-read", `,"dir_mode":"0750","file_mode":"0640"`, 0o750, 0o640},
			{"group-write", `,"dir_mode":"0770","file_mode":"0640"`, 0o770, 0o640},
		} {
			t.Run(fmt.Sprintf("umask%04o/%s", mask, tc.name), func(t *testing.T) {
				withUmask(t, mask)
				top := t.TempDir()
				base := filepath.Join(top, "kv", "base")
				assert.NilError(t, os.Mkdir(filepath.Join(top, "kv"), 0o755)) // the operator's; base is the adapter's
				a := openAt(t, base, tc.extra, nil)
				ctx := context.Background()
				be := a.Backend().(*fs.Backend)
				healed := l2test.Key(2)
				assert.NilError(t, os.MkdirAll(filepath.Dir(be.Path(healed)), 0o700))
				assert.NilError(t, os.WriteFile(be.Path(healed), nil, 0o600))
				for _, r := range l2test.Wait(t, a.Store(ctx, []kv.Key{l2test.Key(1), healed}, [][]byte{l2test.Payload(1, 64), l2test.Payload(2, 64)})) {
					assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
				}
				for _, d := range []string{base,
					filepath.Dir(filepath.Dir(be.Path(l2test.Key(1)))), filepath.Dir(be.Path(l2test.Key(1)))} {
					assert.Equal(t, modeOf(t, d), tc.dir, "directory %s", d)
				}
				for _, k := range []kv.Key{l2test.Key(1), healed} {
					assert.Equal(t, modeOf(t, be.Path(k)), tc.fileMode, "file of %s", k)
				}
			})
		}
	}
}

// A setgid bit inherited from a group-shared base_path survives the chmod
// of the shard directories (files then get the shared group).
func TestSetgidBaseIsInherited(t *testing.T) {
	withUmask(t, 0o077)
	base := t.TempDir()
	assert.NilError(t, os.Chmod(base, 0o770|os.ModeSetgid))
	a := openAt(t, base, `,"dir_mode":"0770","file_mode":"0640"`, nil)
	l2test.Wait(t, a.Store(context.Background(), []kv.Key{l2test.Key(1)}, [][]byte{l2test.Payload(1, 8)}))
	p := a.Backend().(*fs.Backend).Path(l2test.Key(1))
	assert.Equal(t, modeOf(t, filepath.Dir(p)), 0o770|os.ModeSetgid)
	assert.Equal(t, modeOf(t, p), os.FileMode(0o640))
}

func TestModeConfigRefused(t *testing.T) {
	for _, tc := range []struct{ name, extra, key, says string }{
		{"world-readable file", `,"file_mode":"0644"`, "file_mode", "other-user bits must be 0"},
		{"world-writable file", `,"dir_mode":"0750","file_mode":"0642"`, "file_mode", "other-user bits must be 0"},
		{"world-searchable dir", `,"dir_mode":"0701"`, "dir_mode", "other-user bits must be 0"},
		{"the old default dir", `,"dir_mode":"0755","file_mode":"0644"`, "dir_mode", "other-user bits must be 0"},
		{"executable file", `,"file_mode":"0700"`, "file_mode", "want one of 0600, 0640"},
		{"group-writable file", `,"dir_mode":"0770","file_mode":"0660"`, "file_mode", "want one of 0600, 0640"},
		{"owner cannot write", `,"file_mode":"0400"`, "file_mode", "want one of"},
		{"no access", `,"file_mode":"0000"`, "file_mode", "want one of"},
		{"special bits", `,"dir_mode":"2750","file_mode":"0640"`, "dir_mode", `want an octal string`},
		{"a JSON number", `,"file_mode":416`, "file_mode", `want an octal string such as "0640", got 416`},
		{"symbolic", `,"file_mode":"rw-r-----"`, "file_mode", "want an octal string"},
		{"0o prefix", `,"file_mode":"0o640"`, "file_mode", "want an octal string"},
		{"null", `,"file_mode":null`, "file_mode", "want an octal string"},
		{"group in files only", `,"file_mode":"0640"`, "dir_mode", "disagree"},
		{"group in dirs only", `,"dir_mode":"0750"`, "dir_mode", "disagree"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := filepath.Join(t.TempDir(), "kv")
			_, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q%s}`, base, tc.extra), l2.Options{})
			assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
			assert.Assert(t, is.Contains(err.Error(), `"`+tc.key+`"`))
			assert.Assert(t, is.Contains(err.Error(), tc.says))
			_, err = os.Stat(base)
			assert.Assert(t, errors.Is(err, os.ErrNotExist), "refused config created base_path")
		})
	}
	// The Go API applies the same rules.
	_, err := fs.Open(fs.Config{BasePath: t.TempDir(), FileMode: 0o644})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.Assert(t, is.Contains(err.Error(), "other-user bits must be 0"))
	// Three digits are the same mode as four.
	openAt(t, t.TempDir(), `,"dir_mode":"750","file_mode":"640"`, nil)
}

// An existing base_path is left as the operator made it; one more open
// than dir_mode is warned about.
func TestWideBasePathWarnsAndIsLeftAlone(t *testing.T) {
	for _, tc := range []struct {
		name, extra string
		mode        os.FileMode
		warn        bool
	}{
		{"0755 default", "", 0o755, true},
		{"0750 default", "", 0o750, true},
		{"0700 default", "", 0o700, false},
		{"0750 group", `,"dir_mode":"0750","file_mode":"0640"`, 0o750, false},
		{"0775 group", `,"dir_mode":"0770","file_mode":"0640"`, 0o775, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			assert.NilError(t, os.Chmod(base, tc.mode))
			var log bytes.Buffer
			openAt(t, base, tc.extra, slog.New(slog.NewTextHandler(&log, nil)))
			assert.Equal(t, strings.Contains(log.String(), "level=WARN"), tc.warn, "log: %s", log.String())
			if tc.warn {
				assert.Assert(t, is.Contains(log.String(), fmt.Sprintf("mode=%04o", uint32(tc.mode))))
				assert.Assert(t, is.Contains(log.String(), "more open than dir_mode"))
			}
			assert.Equal(t, modeOf(t, base), tc.mode)
		})
	}
}

// The reproduction: another uid reads an L2 file. Run as root, a
// child process under uid 65534 ("nobody") tries to read an object file
// whose parent chain it can search up to base_path.
func TestOtherUidCannotReadL2Files(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a child under another uid")
	}
	cat, err := exec.LookPath("cat")
	if err != nil {
		t.Skip("no cat to run as another uid")
	}
	const nobody = 65534
	// t.TempDir's parents are 0700; this top directory is searchable by
	// every uid, as a deployment's /mnt/kv parent would be.
	top, err := os.MkdirTemp("", "kvshim-fs-uid-")
	assert.NilError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(top) })
	assert.NilError(t, os.Chmod(top, 0o755))
	readAs := func(path string, gid uint32) ([]byte, error) {
		cmd := exec.Command(cat, path)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: gid, Groups: []uint32{}}}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Skipf("cannot run a child as uid %d here: %v", nobody, err)
		}
		if err != nil {
			err = fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr.String()))
		}
		return out, err
	}
	// Control: the child does read what is open to it.
	open := filepath.Join(top, "open")
	assert.NilError(t, os.WriteFile(open, []byte("hi"), 0o644))
	assert.NilError(t, os.Chmod(open, 0o644))
	out, err := readAs(open, nobody)
	assert.NilError(t, err)
	assert.Equal(t, string(out), "hi")

	withUmask(t, 0o022) // the usual umask: the 0644/0755 of the issue
	src := l2test.Payload(7, 4096)
	for _, tc := range []struct {
		name, extra string
		gid         uint32 // the child's group
		reads       bool
	}{
		{"default, other group", "", nobody, false},
		{"default, the file's group", "", 0, false},
		{"group setting, other group", `,"dir_mode":"0750","file_mode":"0640"`, nobody, false},
		{"group setting, the file's group", `,"dir_mode":"0750","file_mode":"0640"`, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := filepath.Join(top, strings.ReplaceAll(tc.name, " ", "_"))
			a := openAt(t, base, tc.extra, nil)
			assert.Equal(t, l2test.Wait(t, a.Store(context.Background(), []kv.Key{l2test.Key(7)}, [][]byte{src}))[0].Status, l2.StatusOK)
			p := a.Backend().(*fs.Backend).Path(l2test.Key(7))
			st, err := os.Stat(p)
			assert.NilError(t, err)
			assert.Equal(t, st.Sys().(*syscall.Stat_t).Gid, uint32(0))
			out, err := readAs(p, tc.gid)
			if !tc.reads {
				assert.Assert(t, err != nil, "uid %d gid %d read %d bytes of %s", nobody, tc.gid, len(out), p)
				assert.Assert(t, is.Contains(err.Error(), "Permission denied"))
				return
			}
			assert.NilError(t, err)
			assert.Assert(t, bytes.Equal(out[:len(src)], src))
		})
	}
}

// A file at a key's path that cannot be an object is a miss for Exists
// and Load, and the next store replaces it (after which Load returns the
// stored bytes and a further store is a skip: the same inode stays).
func TestBrokenFileIsMissAndHealsOnStore(t *testing.T) {
	const n = 4096
	src := l2test.Payload(3, n)
	trailer := func(p []byte) []byte {
		var tr [16]byte
		binary.LittleEndian.PutUint32(tr[0:], 0x324c564b)
		binary.LittleEndian.PutUint32(tr[4:], crc32.Checksum(p, crc32.MakeTable(crc32.Castagnoli)))
		binary.LittleEndian.PutUint64(tr[8:], uint64(len(p)))
		return append(append([]byte(nil), p...), tr[:]...)
	}
	valid := trailer(src)
	badMagic := append([]byte(nil), valid...)
	badMagic[n] ^= 0xff
	for _, tc := range []struct {
		name string
		file []byte
	}{
		{"zero-length", nil},
		{"shorter than a trailer", valid[:10]},
		{"truncated in the payload", valid[:n/2]},
		{"truncated in the trailer", valid[:n+8]},
		{"zero-filled, full size", make([]byte, n+16)},
		{"bad magic", badMagic},
		{"a bigger object's tail", valid[n/2:]}, // trailer intact, length disagrees with the size
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b, _ := open(t, "")
			ctx := context.Background()
			k := l2test.Key(3)
			path := b.Path(k)
			plant := func() {
				assert.NilError(t, os.MkdirAll(filepath.Dir(path), 0o700))
				assert.NilError(t, os.WriteFile(path, tc.file, 0o600))
			}
			plant()
			look := l2test.Wait(t, a.LookupAndHold(ctx, []kv.Key{k}))
			a.Release([]kv.Key{k})
			assert.Equal(t, look[0].Status, l2.StatusMiss, "Exists: %v", look[0].Err)

			dst := make([]byte, n)
			res := l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{dst}))
			assert.Equal(t, res[0].Status, l2.StatusMiss, "Load: %v", res[0].Err)
			assert.Assert(t, errors.Is(res[0].Err, fs.ErrCorrupt), "%v", res[0].Err)

			plant() // Load discarded it; a store must heal it without that
			assert.Equal(t, l2test.Wait(t, a.Store(ctx, []kv.Key{k}, [][]byte{src}))[0].Status, l2.StatusOK)
			got, err := os.ReadFile(path)
			assert.NilError(t, err)
			assert.Assert(t, bytes.Equal(got, valid), "store did not replace the broken file (%d bytes)", len(got))
			ents, err := os.ReadDir(filepath.Dir(path))
			assert.NilError(t, err)
			assert.Equal(t, len(ents), 1, "temporary file left")

			look = l2test.Wait(t, a.LookupAndHold(ctx, []kv.Key{k}))
			a.Release([]kv.Key{k})
			assert.Equal(t, look[0].Status, l2.StatusOK)
			assert.Equal(t, look[0].Bytes, n)
			clear(dst)
			res = l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{dst}))
			assert.Equal(t, res[0].Status, l2.StatusOK, "%v", res[0].Err)
			assert.Assert(t, bytes.Equal(dst, src))

			before, err := os.Stat(path)
			assert.NilError(t, err)
			assert.Equal(t, l2test.Wait(t, a.Store(ctx, []kv.Key{k}, [][]byte{src}))[0].Status, l2.StatusOK)
			after, err := os.Stat(path)
			assert.NilError(t, err)
			assert.Assert(t, os.SameFile(before, after), "a valid object was rewritten")
		})
	}
}

// An intact object of another length under the key is an object (Exists
// says so, Load refuses the buffer and keeps it), but a store of this
// length replaces it: the key is not blocked either.
func TestOtherLengthObjectIsReplacedOnStore(t *testing.T) {
	a, b, _ := open(t, "")
	ctx := context.Background()
	k := l2test.Key(4)
	l2test.Wait(t, a.Store(ctx, []kv.Key{k}, [][]byte{l2test.Payload(4, 100)}))
	look := l2test.Wait(t, a.LookupAndHold(ctx, []kv.Key{k}))
	a.Release([]kv.Key{k})
	assert.Equal(t, look[0].Status, l2.StatusOK)
	assert.Equal(t, look[0].Bytes, 100)
	dst := make([]byte, 200)
	res := l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{dst}))
	assert.Assert(t, errors.Is(res[0].Err, l2.ErrBufferSize), "%v", res[0].Err)

	src := l2test.Payload(4, 200)
	assert.Equal(t, l2test.Wait(t, a.Store(ctx, []kv.Key{k}, [][]byte{src}))[0].Status, l2.StatusOK)
	res = l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{dst}))
	assert.Equal(t, res[0].Status, l2.StatusOK, "%v", res[0].Err)
	assert.Assert(t, bytes.Equal(dst, src))
	_, err := os.Stat(b.Path(k))
	assert.NilError(t, err)
}

// kvshim creates base_path, never its parents: a typo in the path is
// reported (naming the missing parent), not silently created.
func TestBasePathParentMustExist(t *testing.T) {
	top := t.TempDir()
	_, err := l2.OpenJSON(fmt.Sprintf(`{"type":"fs","base_path":%q}`, filepath.Join(top, "typo", "kv")),
		l2.Options{Registerer: prometheus.NewRegistry()})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.ErrorContains(t, err, filepath.Join(top, "typo")+" does not exist")
	_, statErr := os.Stat(filepath.Join(top, "typo"))
	assert.Assert(t, os.IsNotExist(statErr), "the parent was created")
	openAt(t, filepath.Join(top, "kv"), "", nil) // base_path itself is created
}
