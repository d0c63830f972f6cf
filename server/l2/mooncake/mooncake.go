package mooncake

import (
	"bufio"
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
)

// Type is the adapter type name (LMCache's).
const Type = "mooncake_store"

//go:embed helper.py
var helperPy []byte

// Mooncake error codes (mooncake-store types.h) the adapter distinguishes.
const (
	codeNotFound      = -704
	codeAlreadyExists = -705
	codeHasLease      = -706
	codeLeaseExpired  = -707
)

// Sentinel errors.
var (
	// ErrHelper: the helper process is not running or answered with an error.
	ErrHelper = fmt.Errorf("mooncake: helper: %w", l2.ErrUnavailable)
	// ErrStore: Mooncake returned a negative code for the key.
	ErrStore = fmt.Errorf("mooncake: store error: %w", l2.ErrUnavailable)
)

func codeName(c int64) string {
	switch c {
	case codeNotFound:
		return "OBJECT_NOT_FOUND"
	case codeAlreadyExists:
		return "OBJECT_ALREADY_EXISTS"
	case codeHasLease:
		return "OBJECT_HAS_LEASE"
	case codeLeaseExpired:
		return "LEASE_EXPIRED"
	case -703:
		return "REPLICA_IS_NOT_READY"
	case -200:
		return "NO_AVAILABLE_HANDLE"
	case -800:
		return "TRANSFER_FAIL"
	case -900:
		return "RPC_FAIL"
	case -600:
		return "INVALID_PARAMS"
	}
	return "error"
}

func init() { l2.Register(Type, New) }

// Config is what the adapter owns; everything else goes to Mooncake's
// setup(dict) unchanged (as strings, like LMCache).
type Config struct {
	Python       string        // "helper_python": interpreter with mooncake installed (default python3)
	BounceSize   int           // "bounce_buffer_size" bytes (default 64 MiB)
	SetupTimeout time.Duration // "setup_timeout_ms" (default 60 s)
	HelperLog    string        // "helper_log": file for the helper's stderr (default: discarded, tail kept)
	Setup        map[string]string
	Workers      int
}

// Backend runs Mooncake's client in a helper process (see doc.go).
type Backend struct {
	cfg     Config
	log     *slog.Logger
	tmpDir  string
	script  string
	segs    segments
	bounce  *hostproc.Pages
	bfile   *os.File
	nextID  atomic.Uint64
	nextSeg atomic.Int64
	stderr  *hostproc.Tail
	sup     hostproc.Supervisor[*proc] // the running helper
}

// restartEvery bounds how often a dead helper is restarted.
const restartEvery = 2 * time.Second

// New is the l2 factory for type "mooncake_store".
func New(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
	c := Config{Python: "python3", BounceSize: 64 << 20, SetupTimeout: 60 * time.Second, Workers: env.Lanes.Total()}
	ex := cfg.Extras()
	ex.String("helper_python", &c.Python)
	ex.Int("bounce_buffer_size", &c.BounceSize, bouncePage, 1<<40)
	var ms int
	if ex.Int("setup_timeout_ms", &ms, 1, 3600000) {
		c.SetupTimeout = time.Duration(ms) * time.Millisecond
	}
	ex.String("helper_log", &c.HelperLog)
	var prereg bool
	ex.Bool("preregister_l1_memory", &prereg) // LMCache's key: L1 segments are always registered here
	c.Setup = ex.Rest()
	for _, req := range []string{"local_hostname", "metadata_server"} {
		if c.Setup[req] == "" {
			ex.Fail(req, "missing (required by Mooncake setup)")
		}
	}
	if v, ok := c.Setup["master_server_address"]; ok {
		ex.Fail("master_server_address", "Mooncake ignores it; did you mean master_server_addr=%q?", v)
	}
	if err := ex.Err(); err != nil {
		return nil, err
	}
	return Start(c, env.Logger)
}

// Start launches the helper, runs setup and maps the bounce segment.
func Start(c Config, logger *slog.Logger) (*Backend, error) {
	if logger == nil {
		logger = slog.Default()
	}
	if c.Workers <= 0 {
		c.Workers = 4
	}
	if c.BounceSize < bouncePage {
		c.BounceSize = 64 << 20
	}
	tmp, err := os.MkdirTemp("", "kvshim-mooncake-")
	if err != nil {
		return nil, err
	}
	b := &Backend{cfg: c, log: logger, tmpDir: tmp, script: filepath.Join(tmp, "kvshim_mooncake_helper.py"),
		stderr: &hostproc.Tail{Max: 8 << 10, Label: "helper stderr"}}
	b.sup = hostproc.Supervisor[*proc]{Name: "helper", Sentinel: ErrHelper, Every: restartEvery, Spawn: b.spawn,
		Stop:      (*proc).stop,
		OnRestart: func(cause error) { b.log.Warn("mooncake: restarting the helper", "cause", cause) }}
	if err := os.WriteFile(b.script, helperPy, 0o600); err != nil {
		b.cleanup()
		return nil, err
	}
	if c.HelperLog != "" {
		if f, err := os.OpenFile(c.HelperLog, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
			b.stderr.File = f
		}
	}
	f, mem, err := hostproc.Memfd("kvshim-mooncake-bounce", c.BounceSize)
	if err != nil {
		b.cleanup()
		return nil, err
	}
	b.bfile, b.bounce = f, hostproc.NewPages(mem, bouncePage)
	b.segs.add(segment{id: 0, fd: int(f.Fd()), base: uintptrOf(mem), mem: mem})
	b.nextSeg.Store(1)
	p, err := b.spawn()
	if err != nil {
		b.cleanup()
		return nil, err
	}
	b.sup.Start(p)
	return b, nil
}

// spawn starts a helper process, runs setup and registers every known
// segment with it.
func (b *Backend) spawn() (*proc, error) {
	cmd := exec.Command(b.cfg.Python, "-u", b.script)
	cmd.Env = os.Environ()
	cmd.Stderr = b.stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%w: start %s: %w", ErrHelper, b.cfg.Python, err)
	}
	p := &proc{Child: hostproc.Watch(cmd, stdin), w: &frameWriter{w: stdin}, stderr: b.stderr}
	go p.readLoop(bufio.NewReaderSize(stdout, 1<<16))

	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.SetupTimeout)
	defer cancel()
	if _, err := b.callOn(ctx, p, &request{Op: "setup", Config: b.cfg.Setup, Workers: b.cfg.Workers}); err != nil {
		p.stop()
		return nil, fmt.Errorf("mooncake setup: %w", err)
	}
	for _, seg := range b.segs.all() {
		if err := b.registerOn(ctx, p, seg); err != nil {
			p.stop()
			return nil, err
		}
	}
	return p, nil
}

// proc returns the running helper, restarting a dead one (at most once
// per restartEvery; callers in between fail fast).
func (b *Backend) proc() (*proc, error) { return b.sup.Get() }

// RegisterL1Segment makes an L1 shared-memory segment (a memfd the caller
// keeps open for the adapter's life, mapped at mem) visible to the helper,
// so buffers inside it are stored and loaded with no copy. Buffers
// elsewhere go through the bounce buffer (one copy).
func (b *Backend) RegisterL1Segment(fd int, mem []byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.SetupTimeout)
	defer cancel()
	seg := segment{id: int(b.nextSeg.Add(1) - 1), fd: fd, base: uintptrOf(mem), mem: mem}
	p, err := b.proc()
	if err != nil {
		return err
	}
	if err := b.registerOn(ctx, p, seg); err != nil {
		return err
	}
	b.segs.add(seg)
	return nil
}

// registerOn maps seg in helper p. Only the fd number is used (never
// wrapped in an *os.File, whose finalizer would close the caller's fd).
func (b *Backend) registerOn(ctx context.Context, p *proc, seg segment) error {
	path := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), seg.fd)
	rep, err := b.callOn(ctx, p, &request{Op: "segment", Path: path, Size: len(seg.mem), Seg: []int{seg.id}})
	if err != nil {
		return fmt.Errorf("mooncake: register segment: %w", err)
	}
	if len(rep) == 1 && rep[0] != 0 {
		b.log.Warn("mooncake: register_buffer failed; TCP still works, RDMA will not", "code", rep[0])
	}
	return nil
}

// call sends req to the current helper and waits (bounded by ctx).
func (b *Backend) call(ctx context.Context, req *request) ([]int64, error) {
	p, err := b.proc()
	if err != nil {
		return nil, err
	}
	return b.callOn(ctx, p, req)
}

func (b *Backend) callOn(ctx context.Context, p *proc, req *request) ([]int64, error) {
	req.ID = b.nextID.Add(1)
	ch, err := p.send(req)
	if err != nil {
		return nil, err
	}
	select {
	case rep := <-ch:
		if rep.dead != nil {
			return nil, fmt.Errorf("mooncake: %s: %w", req.Op, rep.dead)
		}
		if rep.Error != "" {
			return nil, fmt.Errorf("%w: %s: %s", ErrHelper, req.Op, rep.Error)
		}
		if req.Keys != nil && len(rep.Res) != len(req.Keys) {
			return nil, fmt.Errorf("%w: %s: %d results for %d keys", ErrHelper, req.Op, len(rep.Res), len(req.Keys))
		}
		return rep.Res, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("mooncake: %s: %w", req.Op, ctx.Err())
	}
}

// Tiles implements l2.Tiler: one request per batch (Mooncake's batch calls
// parallelise internally; concurrency comes from concurrent batches).
func (b *Backend) Tiles(op l2.Op, keys, workers int) int { return 1 }

// Close stops the helper (stdin EOF, then SIGKILL after 5 s) and unmaps.
func (b *Backend) Close() error {
	if p := b.sup.Close(); p != nil {
		p.stop()
	}
	b.cleanup()
	return nil
}

func (b *Backend) cleanup() {
	if b.bounce != nil {
		_ = unix.Munmap(b.bounce.Mem)
		b.bounce = nil
	}
	if b.bfile != nil {
		_ = b.bfile.Close()
	}
	if b.stderr != nil && b.stderr.File != nil {
		_ = b.stderr.File.Close()
	}
	_ = os.RemoveAll(b.tmpDir)
}

// Samples are the helper's restarts as the adapter exports them
// (l2.Sampler: /metrics and STATS, label adapter=<name>).
func (b *Backend) Samples() []metric.Sample {
	return []metric.Sample{{Name: "kvshim_l2_mooncake_helper_restarts_total", Counter: true, Value: float64(b.sup.Restarts()),
		Help: "Mooncake helper processes started again after one died."}}
}

// Pid is the running helper's process id (0 when none).
func (b *Backend) Pid() int {
	if p := b.sup.Current(); p != nil {
		return p.Cmd.Process.Pid
	}
	return 0
}
