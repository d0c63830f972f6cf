package shim

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/server"
)

// Chaos: the faults a fleet meets, against the real worker, server and
// rings, with other processes where the fault needs one (SIGSTOP, SIGKILL).
// The test binary re-runs itself in a role (chaosRoleEnv) for those
// processes. `make test` runs a few rounds; `make chaos` sets
// KVSHIM_CHAOS_ROUNDS for the counts (≥ 50 stalls, ≥ 100 kills).

const (
	chaosRoleEnv   = "KVSHIM_CHAOS_ROLE"
	chaosSockEnv   = "KVSHIM_CHAOS_SOCKET"
	chaosRoundsEnv = "KVSHIM_CHAOS_ROUNDS"

	// Geometry: 4 layers of FlashAttention NHD, blocks of 16 tokens, 4
	// heads of 64: a block is 64 KiB over all layers, a chunk (4 blocks)
	// a 256 KiB object, so copies and seals take long enough to be caught
	// in the middle.
	cLayers, cBlocks, cBS, cHeads, cHead = 4, 256, 16, 4, 64
	cChunk                               = 4 * cBS

	chaosBeatEvery  = 50 * time.Millisecond
	chaosBeatExpire = 400 * time.Millisecond
)

func chaosRounds(t *testing.T, def int) int {
	if v := os.Getenv(chaosRoundsEnv); v != "" {
		n, err := strconv.Atoi(v)
		assert.NilError(t, err, "%s", chaosRoundsEnv)
		return n
	}
	if testing.Short() {
		return 1
	}
	return def
}

func chaosNS() NamespaceSpec {
	return NamespaceSpec{Model: "chaos", DType: "bfloat16", LayoutFingerprint: "chaos", ObjectFormat: 1, WorldSize: 1, ChunkSize: cChunk}
}

// chaosCache is a CPU KV cache with the chaos geometry.
type chaosCache struct {
	mem   []byte
	descs []layout.TensorDesc
}

const cLayerBytes = 2 * cBlocks * cBS * cHeads * cHead * 2
const cBlockBytes = cBS * cHeads * cHead * 2 // K (or V) of one block in one layer

func newChaosCache() (*chaosCache, error) {
	mem, err := unix.Mmap(-1, 0, cLayerBytes*cLayers, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, err
	}
	c := &chaosCache{mem: mem}
	for i := range cLayers {
		c.descs = append(c.descs, layout.TensorDesc{
			Layer: fmt.Sprintf("layer%d", i), Backend: layout.FlashAttn, Device: layout.Device{Kind: layout.CPU},
			DataPtr: addrOf(mem) + uint64(i*cLayerBytes), DTypeSize: 2,
			Shape:   []int64{2, cBlocks, cBS, cHeads, cHead},
			Strides: []int64{cLayerBytes / 2, cBS * cHeads * cHead * 2, cHeads * cHead * 2, cHead * 2, 2},
		})
	}
	return c, nil
}

func (c *chaosCache) spans(b int) [][]byte {
	var out [][]byte
	for i := range cLayers {
		for _, off := range []int{i*cLayerBytes + b*cBlockBytes, i*cLayerBytes + cLayerBytes/2 + b*cBlockBytes} {
			out = append(out, c.mem[off:off+cBlockBytes])
		}
	}
	return out
}

// fill writes block b with bytes derived from seed (one stream per block).
func (c *chaosCache) fill(b int, seed uint64) {
	r := rand.New(rand.NewPCG(seed, uint64(b)))
	for _, s := range c.spans(b) {
		for k := 0; k < len(s); k += 8 {
			binary.LittleEndian.PutUint64(s[k:], r.Uint64())
		}
	}
}

func (c *chaosCache) block(b int) []byte { return bytes.Join(c.spans(b), nil) }

// chaosClient is one connector instance: a scheduler and one worker rank.
type chaosClient struct {
	sched *Scheduler
	w     *Worker
	cache *chaosCache
}

func newChaosClient(t testing.TB, sock string, timeout time.Duration) *chaosClient {
	s, err := NewScheduler(SchedulerConfig{Socket: sock, Namespace: chaosNS(), BlockSize: cBS, Timeout: timeout, Instance: uuid.New()})
	assert.NilError(t, err)
	w, err := NewWorker(WorkerConfig{Socket: sock, Namespace: chaosNS(), Timeout: timeout, Instance: uuid.New(), Workers: 2})
	assert.NilError(t, err)
	cache, err := newChaosCache()
	assert.NilError(t, err)
	c := &chaosClient{sched: s, w: w, cache: cache}
	assert.NilError(t, w.Register(c.cache.descs))
	t.Cleanup(func() { s.Close(); w.Close(); unix.Munmap(c.cache.mem) })
	return c
}

func (c *chaosClient) match(t testing.TB, req string, tokens []uint32) int {
	var n int
	testkit.Eventually(t, 5*time.Second, "the lookup of "+req+" to be answered", func() bool {
		var pending bool
		var err error
		n, pending, err = c.sched.Match(req, tokens, Extras{}, 0)
		assert.NilError(t, err)
		return !pending
	})
	return n
}

// matchHit looks tokens up under fresh request ids until one hits: after a
// failed dial the scheduler's link redials at most once a second, and
// later requests are what finds the new server.
func (c *chaosClient) matchHit(t testing.TB, prefix string, tokens []uint32) (req string, n int) {
	for try := 0; n == 0; try++ {
		assert.Assert(t, try < 30, "%s: no hit", prefix)
		if try > 0 {
			time.Sleep(100 * time.Millisecond)
		}
		req = fmt.Sprint(prefix, "-", try)
		n = c.match(t, req, tokens)
	}
	return req, n
}

// step hands one step's metadata to the worker and starts its copies.
func (c *chaosClient) step(t testing.TB, st *Step) {
	b, err := c.sched.BuildMeta(st)
	assert.NilError(t, err)
	m, err := DecodeStepMeta(b, c.w.Layout().ChunkBlocks(), c.w.Layout().NumBlocks())
	assert.NilError(t, err)
	c.w.Finishing(m.Finished)
	c.w.StartLoads(m)
	c.w.StartSaves(m, 0)
}

// settle waits for the worker's copies (bounded: a hang fails the test).
func (c *chaosClient) settle(t testing.TB, within time.Duration) (recving []string, errBlocks []int64) {
	done := make(chan struct{})
	go func() { c.w.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(within):
		t.Fatalf("worker copies still running after %v", within)
	}
	_, recving, errBlocks = c.w.Poll()
	return recving, errBlocks
}

// save stores the full chunks of tokens from blocks (filled from seed)
// and returns how many chunks the worker saved.
func (c *chaosClient) save(t testing.TB, req string, tokens []uint32, blocks []int64, seed uint64) int {
	for _, b := range blocks {
		c.cache.fill(int(b), seed)
	}
	c.match(t, req, tokens)
	assert.NilError(t, c.sched.AfterAlloc(req, blocks, 1, 0, 0))
	before := c.w.Stats().SavedChunks
	c.step(t, &Step{Requests: []StepRequest{{Req: req, Blocks: blocks, Scheduled: len(tokens)}}})
	c.settle(t, 10*time.Second)
	c.sched.Finished(req)
	return int(c.w.Stats().SavedChunks - before)
}

// checkRestore checks that every block of dst[:n tokens] that is not a
// load error holds src's bytes, and that the load errors are a suffix; it
// returns how many blocks were restored.
func (c *chaosClient) checkRestore(t testing.TB, n int, src, dst []int64, errBlocks []int64) int {
	t.Helper()
	bad := map[int64]bool{}
	for _, b := range errBlocks {
		bad[b] = true
	}
	ok := 0
	for k := range n / cBS {
		if bad[dst[k]] {
			for _, later := range dst[k : n/cBS] {
				assert.Assert(t, bad[later], "load errors are not a suffix: block %d ok after a failed one", later)
			}
			break
		}
		assert.Assert(t, bytes.Equal(c.cache.block(int(dst[k])), c.cache.block(int(src[k]))),
			"block %d of %d restored WRONG bytes with no load error", k, n/cBS)
		ok++
	}
	return ok
}

func chaosTokens(round int, salt uint32, chunks int) []uint32 {
	tokens := make([]uint32, chunks*cChunk)
	for i := range tokens {
		tokens[i] = uint32(round)*1_000_003 + salt*7919 + uint32(i)
	}
	return tokens
}

// chaosProc is a child process in a chaos role; closing stdin ends it.
type chaosProc struct {
	*exec.Cmd
	stdin io.WriteCloser
}

// startChild runs this test binary in role, with env, and returns it once
// it printed "ready".
func startChild(t *testing.T, role string, env ...string) chaosProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append(env, chaosRoleEnv+"="+role)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	assert.NilError(t, err)
	stdin, err := cmd.StdinPipe()
	assert.NilError(t, err)
	assert.NilError(t, cmd.Start())
	t.Cleanup(func() { stdin.Close(); cmd.Process.Kill(); cmd.Wait() })
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(out).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("child said %q", line)
		}
		ready <- err
		io.Copy(io.Discard, out)
	}()
	select {
	case err := <-ready:
		assert.NilError(t, err, "%s child", role)
	case <-time.After(20 * time.Second):
		t.Fatalf("%s child not ready", role)
	}
	return chaosProc{cmd, stdin}
}

// chaosChild runs a role in a child process; its exit code is the result.
func chaosChild(role string) int {
	sock := os.Getenv(chaosSockEnv)
	switch role {
	case "server":
		cfg := server.DefaultConfig()
		cfg.Socket, cfg.L1SizeGB, cfg.SegmentSize = sock, 0.0625, 16<<20
		srv, err := server.Start(cfg, &ipc.ServerConfig{HeartbeatInterval: chaosBeatEvery, HeartbeatTimeout: chaosBeatExpire}, server.Options{})
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos server:", err)
			return 1
		}
		defer srv.Close()
		fmt.Println("ready")
		io.Copy(io.Discard, os.Stdin) // until the parent goes (or SIGKILL)
		return 0
	case "writer":
		return chaosWriter(sock)
	}
	fmt.Fprintln(os.Stderr, "unknown chaos role", role)
	return 2
}

// chaosWriter saves all its blocks under fresh keys, again and again,
// until its stdin closes: a writer that is always mid-copy or mid-seal.
func chaosWriter(sock string) int {
	w, err := NewWorker(WorkerConfig{Socket: sock, Namespace: chaosNS(), Timeout: time.Second, Instance: uuid.New(), Workers: 2})
	if err == nil {
		var c *chaosCache
		c, err = newChaosCache()
		if err == nil {
			for b := range cBlocks {
				c.fill(b, 0xa11ce)
			}
			err = w.Register(c.descs)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos writer:", err)
		return 1
	}
	stop := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
	fmt.Println("ready")
	blocks := make([]int64, cBlocks/2) // 8 MiB a save
	for i := range blocks {
		blocks[i] = int64(i)
	}
	for it := uint64(0); ; it++ {
		select {
		case <-stop:
			w.Close()
			return 0
		default:
		}
		sv := SaveSpec{Req: fmt.Sprint("w", it), Blocks: blocks}
		for k := range len(blocks) * cBS / cChunk {
			var h kv.Hash
			binary.LittleEndian.PutUint64(h[:], it)
			binary.LittleEndian.PutUint64(h[8:], uint64(k))
			h[31] = 0xa1
			sv.Hashes = append(sv.Hashes, h)
		}
		w.StartSaves(&StepMeta{Saves: []SaveSpec{sv}}, 0)
		w.wg.Wait()
	}
}

// TestChaosStalledWriter: writer A, in its own process, is frozen
// (SIGSTOP) in the middle of its saves, past its heartbeat, so the server
// ends its session; B saves a prompt into an L1 small enough that A's
// slots are the ones free; A is resumed and its copies and seals land.
// Then C restores B's prompt: every chunk B committed comes back, byte for
// byte, with no load error; A never crashes.
func TestChaosStalledWriter(t *testing.T) {
	rounds := chaosRounds(t, 4)
	sock := filepath.Join(t.TempDir(), "kvshim.sock")
	cfg := server.DefaultConfig()
	// L1 = 40 MiB: A stages 32 MiB a save, so when its session ends
	// unfenced, its slots are most of what B's 2 MiB can get.
	cfg.Socket, cfg.L1SizeGB, cfg.SegmentSize = sock, 40.0/1024, 8<<20
	srv, err := server.Start(cfg, &ipc.ServerConfig{HeartbeatInterval: chaosBeatEvery, HeartbeatTimeout: chaosBeatExpire}, server.Options{})
	assert.NilError(t, err)
	t.Cleanup(func() { srv.Close() })

	a := startChild(t, "writer", chaosSockEnv+"="+sock)
	b := newChaosClient(t, sock, 2*time.Second)
	c := newChaosClient(t, sock, 2*time.Second)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 11))
	src := seq(0, 32)
	dst := seq(64, 32)
	for round := range rounds {
		time.Sleep(time.Duration(rng.IntN(40)) * time.Millisecond)
		assert.NilError(t, a.Process.Signal(syscall.SIGSTOP))
		time.Sleep(chaosBeatExpire + 300*time.Millisecond) // A's session ends
		tokens := chaosTokens(round, 1, 8)
		saved := b.save(t, fmt.Sprint("B", round), tokens, src, uint64(round)+100)
		// C looks B's prompt up (read holds keep it from eviction by A's
		// next saves) before A resumes and its late copies and seals land.
		n := c.match(t, fmt.Sprint("C", round), tokens)
		assert.NilError(t, a.Process.Signal(syscall.SIGCONT))
		time.Sleep(150 * time.Millisecond)
		if n == 0 {
			assert.Equal(t, saved, 0, "round %d: B saved %d chunks, C found none", round, saved)
			continue
		}
		assert.NilError(t, c.sched.AfterAlloc(fmt.Sprint("C", round), dst, 1, -1, n))
		c.step(t, &Step{})
		// C's cache gets B's source bytes to compare with.
		for _, blk := range src {
			c.cache.fill(int(blk), uint64(round)+100)
		}
		recv, errs := c.settle(t, 10*time.Second)
		assert.DeepEqual(t, recv, []string{fmt.Sprint("C", round)})
		ok := c.checkRestore(t, n, src, dst, errs)
		assert.Equal(t, ok, n/cBS, "round %d: B's committed chunks were damaged (%d of %d blocks restored)", round, ok, n/cBS)
		t.Logf("round %d: B saved %d chunks, C restored %d blocks", round, saved, ok)
	}
	assert.NilError(t, a.Process.Signal(syscall.SIGCONT))
	// A exits 0 once its stdin closes: it never crashed.
	a.stdin.Close()
	waitExit(t, a.Cmd, 0)
}

func waitExit(t *testing.T, cmd *exec.Cmd, want int) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else {
			assert.NilError(t, err)
		}
		assert.Equal(t, code, want, "child exit")
	case <-time.After(10 * time.Second):
		t.Fatal("child did not exit")
	}
}

// TestChaosServerKilled: the server process is SIGKILLed at a random
// moment while the worker loads or saves. The worker's process survives
// every round, answers with restored blocks or load errors (never wrong
// bytes) within its timeout, and hits again once a server is back.
func TestChaosServerKilled(t *testing.T) {
	rounds := chaosRounds(t, 20)
	sock := filepath.Join(t.TempDir(), "kvshim.sock")
	env := chaosSockEnv + "=" + sock
	srv := startChild(t, "server", env)
	const timeout = time.Second
	cl := newChaosClient(t, sock, timeout)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 13))
	src, dst, other := seq(0, 96), seq(128, 96), seq(96, 32) // a 6 MiB prompt
	var loadsHit, loadErrs int
	for round := range rounds {
		tokens := chaosTokens(round, 2, 24)
		saved := 0
		for try := 0; saved == 0; try++ { // the links redial the new server
			assert.Assert(t, try < 30, "round %d: nothing saved after a restart", round)
			saved = cl.save(t, fmt.Sprint("S", round, "-", try), tokens, src, uint64(round))
			if saved == 0 {
				time.Sleep(100 * time.Millisecond)
			}
		}
		// The kill lands while the step's copies run: 0-4 ms after they start.
		killed := make(chan struct{})
		killer := func() {
			defer close(killed)
			time.Sleep(time.Duration(rng.IntN(4000)) * time.Microsecond)
			assert.Check(t, srv.Process.Kill())
		}
		if round%2 == 0 { // kill during a load
			req, n := cl.matchHit(t, fmt.Sprint("L", round), tokens)
			assert.NilError(t, cl.sched.AfterAlloc(req, dst, 1, -1, n))
			go killer()
			start := time.Now()
			cl.step(t, &Step{})
			recv, errs := cl.settle(t, 3*timeout)
			assert.DeepEqual(t, recv, []string{req})
			<-killed
			t.Logf("round %d: load of %d blocks answered in %v with %d load errors", round, n/cBS, time.Since(start).Round(time.Millisecond), len(errs))
			if ok := cl.checkRestore(t, n, src, dst, errs); ok == n/cBS {
				loadsHit++
			} else {
				loadErrs++
			}
		} else { // kill during a save of new chunks
			req := fmt.Sprint("M", round)
			more := chaosTokens(round, 3, 8)
			for _, b := range other {
				cl.cache.fill(int(b), uint64(round)+7)
			}
			cl.match(t, req, more)
			assert.NilError(t, cl.sched.AfterAlloc(req, other, 1, 0, 0))
			go killer()
			cl.step(t, &Step{Requests: []StepRequest{{Req: req, Blocks: other, Scheduled: len(more)}}})
			cl.settle(t, 3*timeout)
			<-killed
			cl.sched.Finished(req)
		}
		srv.Wait()
		srv = startChild(t, "server", env)
	}
	t.Logf("%d rounds: %d loads complete, %d with load errors", rounds, loadsHit, loadErrs)
	// Back to normal: a save and a full hit on the last server.
	tokens := chaosTokens(rounds, 4, 24)
	for try := 0; cl.save(t, fmt.Sprint("F", try), tokens, src, 99) == 0; try++ {
		assert.Assert(t, try < 30, "no save after the last restart")
		time.Sleep(100 * time.Millisecond)
	}
	req, n := cl.matchHit(t, "G", tokens)
	assert.Equal(t, n, len(tokens)-1) // a full hit reports one token less
	assert.NilError(t, cl.sched.AfterAlloc(req, dst, 1, -1, n))
	cl.step(t, &Step{})
	_, errs := cl.settle(t, 10*time.Second)
	assert.Equal(t, cl.checkRestore(t, n, src, dst, errs), n/cBS)
}
