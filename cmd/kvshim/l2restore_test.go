package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server/l2/plugin/plugintest"
	"github.com/kvshim/kvshim/server/l2/s3/s3test"
)

// A restore end to end through `kvshim serve` and an L2 plugin (the
// example in examples/l2-plugin, run by kvshim-l2-host): a server saves
// three chunks, is stopped, and a new server with an empty L1 serves the
// lookup and retrieve of them from the plugin.
func TestServeRestoresFromL2Plugin(t *testing.T) {
	b, err := plugintest.Build()
	if errors.Is(err, plugintest.ErrNoCompiler) {
		t.Skip(err.Error())
	}
	assert.NilError(t, err)
	dir := t.TempDir()
	l2 := fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"dir":%q}`, b.Example, b.Host, filepath.Join(dir, "objects"))
	ServeRestore(t, l2, "plugin")
	ents, err := os.ReadDir(filepath.Join(dir, "objects"))
	assert.NilError(t, err)
	assert.Assert(t, len(ents) > 0, "the plugin wrote no shard directory")
}

var restoreNS = kv.Namespace{0xB7}

const restoreObj = 64 << 10

func restoreHashes(seed string, n int) []kv.Hash {
	out := make([]kv.Hash, n)
	for i := range out {
		out[i][0] = byte(i + 1)
		copy(out[i][1:], seed)
		now := uint64(time.Now().UnixNano()) // new keys every run
		for j := range 8 {
			out[i][24+j] = byte(now >> (8 * j))
		}
	}
	return out
}

// restoreObject is chunk h's bytes: an object header naming its key (the
// server verifies it on an L2 fill) and a payload derived from the key.
func restoreObject(h kv.Hash) []byte {
	b := make([]byte, restoreObj)
	for i := range b {
		b[i] = h[i%32] ^ byte(i>>8) ^ byte(i*7)
	}
	if err := objfmt.Seal(b, objfmt.Header{ChunkTokens: 16, Key: kv.Key{Namespace: restoreNS, Hash: h}}); err != nil {
		panic(err)
	}
	return b
}

// servedProc is a running `kvshim serve`.
type servedProc struct {
	cmd    *exec.Cmd
	sock   string
	port   int
	stderr *strings.Builder
	lines  chan string
}

func startServe(t *testing.T, dir, l2json string) *servedProc {
	t.Helper()
	s := &servedProc{sock: filepath.Join(dir, "kvshim.sock"), port: freePort(t), stderr: &strings.Builder{}, lines: make(chan string, 64)}
	s.cmd = exec.Command(binary(t), "serve", "--socket", s.sock, "--l1-size-gb", "0.0625", "--l1-prefault-gb", "0",
		"--metrics-port", strconv.Itoa(s.port), "--l2-adapter", l2json)
	stdout, err := s.cmd.StdoutPipe()
	assert.NilError(t, err)
	s.cmd.Stderr = s.stderr
	assert.NilError(t, s.cmd.Start())
	t.Cleanup(func() { _ = s.cmd.Process.Kill(); _ = s.cmd.Wait() })
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		close(s.lines)
	}()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-s.lines:
			if !ok {
				t.Fatalf("serve exited; stderr: %s", s.stderr.String())
			}
			if strings.Contains(l, "listening on") {
				return s
			}
		case <-deadline:
			t.Fatalf("serve did not start in 30 s; stderr: %s", s.stderr.String())
		}
	}
}

func (s *servedProc) dial(t *testing.T, role ipc.Role) *ipc.Client {
	t.Helper()
	c, err := ipc.Dial(s.sock, ipc.Hello{Version: ipc.ProtocolVersion, Role: role, PID: uint32(os.Getpid()), Instance: uuid.New()}, 5*time.Second)
	assert.NilError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// metric polls /metrics until the sample line starting with name has
// value want (bounded).
func (s *servedProc) waitMetric(t *testing.T, name string, want float64) {
	t.Helper()
	s.waitMetricFn(t, name, func(f float64) bool { return f == want })
}

func (s *servedProc) waitMetricFn(t *testing.T, name string, want func(float64) bool) {
	t.Helper()
	last := ""
	testkit.EventuallyShowing(t, 30*time.Second, "metric "+name+" to get the wanted value", func() bool {
		_, body := httpGet(t, "http://127.0.0.1:"+strconv.Itoa(s.port)+"/metrics")
		for _, l := range strings.Split(body, "\n") {
			if v, ok := strings.CutPrefix(l, name+" "); ok {
				last = l
				if f, err := strconv.ParseFloat(v, 64); err == nil && want(f) {
					return true
				}
			}
		}
		return false
	}, func() string { return fmt.Sprintf("last: %q; stderr: %s", last, s.stderr.String()) })
}

func (s *servedProc) stop(t *testing.T) {
	t.Helper()
	assert.NilError(t, s.cmd.Process.Signal(syscall.SIGTERM))
	done := make(chan error, 1)
	go func() {
		for range s.lines {
		}
		done <- s.cmd.Wait()
	}()
	select {
	case err := <-done:
		assert.NilError(t, err, "stderr: %s", s.stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not stop on SIGTERM in 30 s")
	}
}

// ServeRestore saves three chunks through one `kvshim serve` with the L2
// adapter l2json (its metrics label adapter), stops it, and restores them
// through a second one with an empty L1: lookup finds all three (from L2)
// and retrieve returns their bytes.
func ServeRestore(t *testing.T, l2json, adapter string) {
	dir, err := os.MkdirTemp("", "kvl2") // short: sun_path holds 107 bytes
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	hs := restoreHashes(adapter, 3)
	binary(t) // built before the clock starts

	a := startServe(t, dir, l2json)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	worker := a.dial(t, ipc.RoleWorker)
	saveObjects(ctx, t, worker, kv.Tag{0x42}, hs)
	a.waitMetric(t, `kvshim_l2_store_saved_objects_total{adapter="`+adapter+`"}`, 3)
	worker.Close()
	a.stop(t)

	bsrv := startServe(t, dir, l2json)
	sched, worker := bsrv.dial(t, ipc.RoleScheduler), bsrv.dial(t, ipc.RoleWorker)
	lr := lookupFinal(ctx, t, sched, 9, hs)
	// Filled from the plugin: a networked-kind L2 as far as hit sources go.
	assert.DeepEqual(t, *lr, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 3,
		Sources: []ipc.SourceRun{{Tier: ipc.TierRemote, Chunks: 3}}})
	retrieveEqual(ctx, t, sched, worker, 9, hs)
	bsrv.waitMetric(t, `kvshim_l2_prefetch_chunks_total{adapter="`+adapter+`",result="ok"}`, 3)
	bsrv.stop(t)
}

// The same restore through the s3 adapter and a real SeaweedFS S3 gateway
// (server/l2/s3/s3test; skipped without a weed binary).
func TestServeRestoresFromS3(t *testing.T) {
	if _, err := s3test.Binary(); err != nil {
		t.Skip(err.Error())
	}
	wdir, err := os.MkdirTemp("", "kvshim-weed-")
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(wdir) })
	w, err := s3test.Start(wdir)
	assert.NilError(t, err)
	t.Cleanup(w.Kill)
	ServeRestore(t, fmt.Sprintf(`{"type":"s3","endpoint":%q,"bucket":"kvshim-e2e","create_bucket":true}`, w.Endpoint), "s3")
}

// A plugin that crashes under `kvshim serve` costs only its saves: the
// server keeps running, the chunks it was saving stay in L1 and are served
// intact, and the next saves go to a new host.
func TestServePluginCrashKeepsL1(t *testing.T) {
	b, err := plugintest.Build()
	if errors.Is(err, plugintest.ErrNoCompiler) {
		t.Skip(err.Error())
	}
	assert.NilError(t, err)
	binary(t)
	dir, err := os.MkdirTemp("", "kvl2c")
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	srv := startServe(t, dir, fmt.Sprintf(`{"type":"plugin","library":%q,"host":%q,"num_workers":1}`, b.Faulty, b.Host))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	worker, sched := srv.dial(t, ipc.RoleWorker), srv.dial(t, ipc.RoleScheduler)
	hs := restoreHashes("crash", 3)
	hs[1][0] = 0xde // the faulty plugin segfaults on it
	saveObjects(ctx, t, worker, kv.Tag{0x43}, hs)
	srv.waitMetricFn(t, `kvshim_l2_store_errors_total{adapter="plugin"}`, func(f float64) bool { return f >= 1 })

	lr := lookupFinal(ctx, t, sched, 5, hs)
	// Served from L1: the plugin's crash touched none of it.
	assert.DeepEqual(t, *lr, ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 3,
		Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 3}}})
	retrieveEqual(ctx, t, sched, worker, 5, hs)

	// Saves after the crash reach a new host (the faulty plugin accepts them).
	time.Sleep(1100 * time.Millisecond) // the restart interval
	saveObjects(ctx, t, worker, kv.Tag{0x43}, restoreHashes("after", 2))
	srv.waitMetricFn(t, `kvshim_l2_store_saved_objects_total{adapter="plugin"}`, func(f float64) bool { return f >= 2 })
	srv.stop(t)
}

// saveObjects stores restoreObject(h) for each of hs through worker, as a
// worker's save does: alloc, write into L1, commit.
func saveObjects(ctx context.Context, t *testing.T, worker *ipc.Client, tag kv.Tag, hs []kv.Hash) {
	t.Helper()
	sizes := make([]uint64, len(hs))
	for i := range sizes {
		sizes[i] = restoreObj
	}
	ar, err := worker.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: restoreNS, Hashes: hs, Sizes: sizes})
	assert.NilError(t, err)
	for i, l := range ar.Locs {
		assert.Equal(t, ar.Status[i], ipc.StatusOK)
		buf, err := worker.Segments().ResolveWait(l, 5*time.Second)
		assert.NilError(t, err)
		copy(buf, restoreObject(hs[i]))
	}
	_, err = worker.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: restoreNS, Hashes: hs})
	assert.NilError(t, err)
}

// retrieveEqual retrieves every chunk of sched's final lookup id through
// worker, checks each holds restoreObject(h), and releases the lookup.
func retrieveEqual(ctx context.Context, t *testing.T, sched, worker *ipc.Client, id uint64, hs []kv.Hash) {
	t.Helper()
	owner := kv.Tag(sched.Hello().Instance)
	rr, err := worker.Retrieve(ctx, &ipc.RetrieveReq{Owner: owner, LookupID: id, End: ^uint32(0)})
	assert.NilError(t, err)
	assert.Equal(t, len(rr.Locs), len(hs))
	for i, l := range rr.Locs {
		assert.Equal(t, rr.Status[i], ipc.StatusOK)
		got, err := worker.Resolve(l)
		assert.NilError(t, err)
		assert.Assert(t, string(got) == string(restoreObject(hs[i])), "chunk %d: retrieved bytes differ", i)
	}
	assert.NilError(t, worker.Release(ctx, &ipc.ReleaseReq{Owner: owner, LookupID: id}))
}

// lookupFinal registers lookup id for hs and polls its result until it is
// no longer pending, for at most 60 s (the callers' ctx, which bounds it
// too: LookupResult fails once it ends).
func lookupFinal(ctx context.Context, t *testing.T, sched *ipc.Client, id uint64, hs []kv.Hash) *ipc.LookupResultResp {
	t.Helper()
	assert.NilError(t, sched.Lookup(ctx, &ipc.LookupReq{LookupID: id, Namespace: restoreNS, WorldSize: 1, Hashes: hs}))
	var lr *ipc.LookupResultResp
	testkit.Eventually(t, 60*time.Second, fmt.Sprintf("lookup %d to be answered", id), func() bool {
		var err error
		lr, err = sched.LookupResult(ctx, &ipc.LookupResultReq{LookupID: id})
		assert.NilError(t, err)
		return lr.Status != ipc.StatusPending
	})
	return lr
}
