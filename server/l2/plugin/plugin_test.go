package plugin_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/l2test"
	"github.com/kvshim/kvshim/server/l2/plugin"
	"github.com/kvshim/kvshim/server/l2/plugin/plugintest"
)

// What is not tested here: a plugin that corrupts the window of another
// call in flight (it can; kvshim's own object check, objfmt.Verify on every
// L2 fill, is what stops those bytes: server/tier's tests), and a plugin
// that forks or leaks its own resources.

func TestMain(m *testing.M) {
	code := m.Run()
	plugintest.Remove()
	os.Exit(code)
}

func built(t testing.TB) plugintest.Built {
	t.Helper()
	b, err := plugintest.Build()
	if errors.Is(err, plugintest.ErrNoCompiler) {
		t.Skip(err.Error())
	}
	assert.NilError(t, err)
	return b
}

// sampled is a's number name{adapter=<its name>}, as STATS and /metrics
// show it (Adapter.Samples: the backend's own included); -1 when absent.
func sampled(a *l2.Adapter, name string) float64 {
	for _, s := range a.Samples() {
		if s.StatName() == name+"{adapter="+a.Name()+"}" {
			return s.Value
		}
	}
	return -1
}

func exampleConfig(b plugintest.Built, dir, extra string) string {
	return fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"dir":%q,"num_workers":2,"per_op_workers":{"lookup":1}%s}`,
		b.Example, b.Host, dir, extra)
}

// objPath is where example_files keeps k (examples/l2-plugin).
func objPath(dir string, k kv.Key) string {
	return filepath.Join(dir, fmt.Sprintf("%02x", k.Hash[0]), fmt.Sprintf("%02x", k.Hash[1]), k.String())
}

func TestContract(t *testing.T) {
	b := built(t)
	dir := t.TempDir()
	l2test.Run(t, l2test.Target{
		Open: func(t testing.TB) *l2.Adapter { return l2test.Open(t, exampleConfig(b, dir, "")) },
		// k's shard directory made a plain file: only k's store fails.
		BreakStore: func(t testing.TB, _ *l2.Adapter, k kv.Key) {
			shard := filepath.Dir(objPath(dir, k))
			assert.NilError(t, os.MkdirAll(filepath.Dir(shard), 0o700))
			assert.NilError(t, os.WriteFile(shard, []byte("not a dir"), 0o600))
		},
		Corrupt: func(t testing.TB, _ *l2.Adapter, k kv.Key) { flip(t, objPath(dir, k), 10) },
	})
}

func flip(t testing.TB, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	assert.NilError(t, err)
	defer f.Close()
	var c [1]byte
	_, err = f.ReadAt(c[:], off)
	assert.NilError(t, err)
	c[0] ^= 0x40
	_, err = f.WriteAt(c[:], off)
	assert.NilError(t, err)
}

// Another key's object copied over k's name is a miss, never its bytes
// (the example binds each object to its key), and is removed.
func TestOtherKeysBytesAreAMiss(t *testing.T) {
	b := built(t)
	dir := t.TempDir()
	a := l2test.Open(t, exampleConfig(b, dir, ""))
	ctx := context.Background()
	k1, k2 := l2test.Key(1), l2test.Key(1|1<<16) // same shard directory
	src := [][]byte{l2test.Payload(1, 4096), l2test.Payload(2, 4096)}
	for _, r := range l2test.Wait(t, a.Store(ctx, []kv.Key{k1, k2}, src)) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	obj, err := os.ReadFile(objPath(dir, k1))
	assert.NilError(t, err)
	assert.NilError(t, os.WriteFile(objPath(dir, k2), obj, 0o600))
	dst := make([]byte, 4096)
	r := l2test.Wait(t, a.Load(ctx, []kv.Key{k2}, [][]byte{dst}))[0]
	assert.Equal(t, r.Status, l2.StatusMiss, "%v", r.Err)
	assert.Assert(t, !bytes.Equal(dst, src[0]), "k1's bytes served as k2's")
	_, err = os.Stat(objPath(dir, k2))
	assert.Assert(t, errors.Is(err, os.ErrNotExist), "the misplaced object was kept")
}

func TestABIVersionMatchesHeader(t *testing.T) {
	h, err := os.ReadFile(filepath.Join(plugintest.Root(), "server", "l2", "plugin", "include", "kvshim_l2.h"))
	assert.NilError(t, err)
	m := regexp.MustCompile(`(?m)^#define KVSHIM_L2_ABI_VERSION (\d+)$`).FindSubmatch(h)
	assert.Assert(t, m != nil, "no KVSHIM_L2_ABI_VERSION in kvshim_l2.h")
	v, _ := strconv.Atoi(string(m[1]))
	assert.Equal(t, v, plugin.ABIVersion)
}

// A plugin built for another ABI is refused, with both versions named, and
// none of its functions is called.
func TestOtherABIRefused(t *testing.T) {
	b := built(t)
	_, err := l2.OpenJSON(fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q}`, b.WrongABI, b.Host), l2.Options{})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.Assert(t, is.Contains(err.Error(), "built for kvshim L2 plugin ABI 99; this kvshim speaks ABI 1"))
}

func TestConfigRefused(t *testing.T) {
	b := built(t)
	for _, tc := range []struct{ json, want string }{
		{`{"type":"plugin"}`, `key "library": missing`},
		{fmt.Sprintf(`{"type":"plugin","library":%q,"plugin":"x"}`, b.Example), `not both`},
		{`{"type":"plugin","plugin":"../etc"}`, `a name is [a-z0-9_-]`},
		{`{"type":"plugin","library":"/nonexistent/libx.so"}`, `is not a file`},
		{fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"window_bytes":10}`, b.Example, b.Host), `"window_bytes"`},
		// the plugin's own refusal, through open()
		{fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q}`, b.Example, b.Host), `key "dir": missing`},
		{fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"refuse":1}`, b.Faulty, b.Host), `refused by the faulty plugin`},
		// not a plugin at all
		{fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q}`, b.Host, b.Host), `dlopen`},
	} {
		_, err := l2.OpenJSON(tc.json, l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", tc.json, err)
		assert.Assert(t, is.Contains(err.Error(), tc.want), tc.json)
	}
}

// An installed plugin is found by name in the plugin directory.
func TestFindByName(t *testing.T) {
	b := built(t)
	pdir := t.TempDir()
	lib, err := os.ReadFile(b.Example)
	assert.NilError(t, err)
	assert.NilError(t, os.WriteFile(filepath.Join(pdir, "libkvshim-l2-example_files.so"), lib, 0o755))
	t.Setenv(plugin.PathEnv, t.TempDir()+":"+pdir)
	t.Setenv(plugin.HostEnv, b.Host)
	dir := t.TempDir()
	a := l2test.Open(t, fmt.Sprintf(`{"type":"plugin","plugin":"example_files","dir":%q}`, dir))
	k := l2test.Key(3)
	assert.Equal(t, l2test.Wait(t, a.Store(context.Background(), []kv.Key{k}, [][]byte{l2test.Payload(3, 100)}))[0].Status, l2.StatusOK)
	_, err = os.Stat(objPath(dir, k))
	assert.NilError(t, err)

	_, err = l2.OpenJSON(`{"type":"plugin","plugin":"nosuch"}`, l2.Options{})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.Assert(t, is.Contains(err.Error(), "libkvshim-l2-nosuch.so is in none of"))
	assert.Assert(t, is.Contains(err.Error(), pdir))
}

// faultKey is a key the faulty plugin crashes on (0xde) or hangs on (0xdf).
func faultKey(b byte) kv.Key {
	k := l2test.Key(99)
	k.Hash[0] = b
	return k
}

func pattern(n int) []byte { return bytes.Repeat([]byte{0xa5}, n) }

// A plugin that crashes kills its host only: the call's keys fail as L2
// errors, the caller's (L1) buffers keep their bytes although the plugin
// scribbled over its window first, and the next call runs on a new host.
func TestPluginCrash(t *testing.T) {
	b := built(t)
	a := l2test.Open(t, fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"num_workers":1}`, b.Faulty, b.Host))
	be := a.Backend().(*plugin.Backend)
	pid := be.Pid()
	ctx := context.Background()
	keys := []kv.Key{l2test.Key(1), faultKey(0xde), l2test.Key(2)}
	bufs := [][]byte{pattern(4096), pattern(100), pattern(70000)}
	for i, r := range l2test.Wait(t, a.Load(ctx, keys, bufs)) {
		assert.Equal(t, r.Status, l2.StatusFailed, "key %d", i)
		assert.Assert(t, errors.Is(r.Err, l2.ErrUnavailable), "key %d: %v", i, r.Err)
		assert.Assert(t, is.Contains(r.Err.Error(), "segmentation fault"))
		assert.Assert(t, bytes.Equal(bufs[i], pattern(len(bufs[i]))), "key %d: the caller's buffer was written", i)
	}
	// A new host, within the restart interval and a bit (bounded).
	var last error
	testkit.EventuallyShowing(t, 10*time.Second, "a working host after the crash", func() bool {
		r := l2test.Wait(t, a.Store(ctx, keys[:1], bufs[:1]))[0]
		last = r.Err
		return r.Status == l2.StatusOK
	}, func() string { return fmt.Sprint(last) })
	assert.Assert(t, be.Pid() != pid && be.Pid() != 0)
	assert.Equal(t, be.Stats().Restarts, int64(1))
	assert.Equal(t, sampled(a, "kvshim_l2_plugin_restarts_total"), 1.0)
	assert.Equal(t, sampled(a, "kvshim_l2_plugin_hang_kills_total"), 0.0)
	// A crash in store, as well.
	for _, r := range l2test.Wait(t, a.Store(ctx, keys[1:2], bufs[1:2])) {
		assert.Assert(t, errors.Is(r.Err, l2.ErrUnavailable), "%v", r.Err)
	}
}

// A plugin call that hangs fails its keys at the adapter's deadline like
// any backend's, leaves the caller's buffers alone, and its host is killed
// hang_grace_ms later, so the next calls run on a new one.
func TestPluginHang(t *testing.T) {
	b := built(t)
	a := l2test.Open(t, fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"num_workers":2,"op_timeout_ms":500,"hang_grace_ms":300}`, b.Faulty, b.Host))
	be := a.Backend().(*plugin.Backend)
	ctx := context.Background()
	keys := []kv.Key{faultKey(0xdf)}
	bufs := [][]byte{pattern(5000)}
	start := time.Now()
	r := l2test.Wait(t, a.Load(ctx, keys, bufs))[0]
	took := time.Since(start)
	assert.Equal(t, r.Status, l2.StatusFailed)
	assert.Assert(t, errors.Is(r.Err, context.DeadlineExceeded), "%v", r.Err)
	assert.Assert(t, took < 5*time.Second, "the deadline of 500 ms took %v", took)
	deadline := time.Now().Add(10 * time.Second) // bounds the kill and, below, the working host after it
	assert.Equal(t, sampled(a, "kvshim_l2_plugin_hang_kills_total"), 0.0)
	testkit.Eventually(t, 10*time.Second, "the hung host to be killed", func() bool { return be.Stats().HangKills > 0 })
	assert.Equal(t, sampled(a, "kvshim_l2_plugin_hang_kills_total"), 1.0)
	// The scribbled window was never copied out.
	assert.Assert(t, bytes.Equal(bufs[0], pattern(5000)))
	var last error
	testkit.EventuallyShowing(t, time.Until(deadline), "a working host after the kill", func() bool {
		r := l2test.Wait(t, a.LookupAndHold(ctx, []kv.Key{l2test.Key(5)}))[0]
		last = r.Err
		return r.Status == l2.StatusMiss
	}, func() string { return fmt.Sprint(last) })
	assert.Equal(t, sampled(a, "kvshim_l2_plugin_restarts_total"), 1.0)
}

// The host maps the window and nothing of L1: an L1 segment registered
// with the adapter (as the server registers each one) is not in the host's
// address space.
func TestHostMapsOnlyTheWindow(t *testing.T) {
	b := built(t)
	a := l2test.Open(t, exampleConfig(b, t.TempDir(), ""))
	fd, err := unix.MemfdCreate("kvshim-l1-test-segment", unix.MFD_CLOEXEC)
	assert.NilError(t, err)
	defer unix.Close(fd)
	assert.NilError(t, unix.Ftruncate(fd, 1<<20))
	mem, err := unix.Mmap(fd, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	assert.NilError(t, err)
	defer unix.Munmap(mem)
	assert.NilError(t, a.RegisterL1Segment(fd, mem))
	// a store and a load from buffers inside the segment
	k := l2test.Key(77)
	copy(mem, l2test.Payload(77, 4096))
	assert.Equal(t, l2test.Wait(t, a.Store(context.Background(), []kv.Key{k}, [][]byte{mem[:4096]}))[0].Status, l2.StatusOK)
	assert.Equal(t, l2test.Wait(t, a.Load(context.Background(), []kv.Key{k}, [][]byte{mem[8192 : 8192+4096]}))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(mem[:4096], mem[8192:8192+4096]))
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", a.Backend().(*plugin.Backend).Pid()))
	assert.NilError(t, err)
	assert.Assert(t, is.Contains(string(maps), "kvshim-l2-plugin-window"))
	assert.Assert(t, !strings.Contains(string(maps), "kvshim-l1-test-segment"), "the host maps L1:\n%s", maps)
}
