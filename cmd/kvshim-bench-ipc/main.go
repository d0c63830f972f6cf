// Command kvshim-bench-ipc measures the Go-level ring round trip of kvshim's
// IPC: a client sends an ALLOC carrying 64 chunk keys and waits for its
// 64-entry answer, through a server in another process (or in-process with
// -inproc). It reports spin-mode and futex-mode latency, messages/s, and the
// CPU an idle client+server pair uses. The last line of output is JSON.
package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"golang.org/x/sys/unix"
)

func main() {
	role := flag.String("role", "bench", "bench | server (internal)")
	sock := flag.String("socket", "", "socket path (server role)")
	spin := flag.Duration("spin", 0, "server ring spin (server role; negative = futex only)")
	inproc := flag.Bool("inproc", false, "run the server in this process instead of a child")
	n := flag.Int("n", 20000, "round trips per spin run")
	nSleep := flag.Int("n-sleep", 3000, "round trips per sleep run")
	idle := flag.Duration("idle", 3*time.Second, "idle period for the CPU measurement")
	parkedSpin := flag.Duration("parked-client-spin", 0, "client spin in the parked run (0 = ipc.DefaultSpin)")
	flag.Parse()
	if *role == "server" {
		if err := serveChild(*sock, *spin); err != nil {
			fmt.Fprintln(os.Stderr, "server:", err)
			os.Exit(1)
		}
		return
	}
	if err := bench(*inproc, *n, *nSleep, *idle, *parkedSpin); err != nil {
		fmt.Fprintln(os.Stderr, "kvshim-bench-ipc:", err)
		os.Exit(1)
	}
}

// benchService answers ALLOC with one Loc per key and STATS with this
// process's CPU time (so the idle measurement covers the server process).
type benchService struct{ ipc.Service }

func (benchService) Alloc(r *ipc.AllocReq) (*ipc.AllocResp, error) {
	resp := &ipc.AllocResp{Status: make([]ipc.Status, len(r.Hashes)), Locs: make([]ipc.Loc, len(r.Hashes))}
	var off uint64
	for i, s := range r.Sizes {
		resp.Locs[i] = ipc.Loc{Segment: 1, Offset: off, Size: s}
		off += s
	}
	return resp, nil
}

func (benchService) Stats() (*ipc.StatsResp, error) {
	return &ipc.StatsResp{Stats: []ipc.Stat{{Name: "cpu_seconds", Value: cpuSeconds()}}}, nil
}

func cpuSeconds() float64 {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

func listen(path string, spin time.Duration) (*ipc.Listener, error) {
	l, err := ipc.Listen(path, &ipc.ServerConfig{Ring: ipc.RingOptions{Spin: spin},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))})
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go c.Serve(ipc.ServiceHandler(benchService{}))
		}
	}()
	return l, nil
}

// serveChild runs the server until stdin closes.
func serveChild(path string, spin time.Duration) error {
	l, err := listen(path, spin)
	if err != nil {
		return err
	}
	defer l.Close()
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	return nil
}

type server struct {
	stop func()
}

func startServer(inproc bool, path string, spin time.Duration) (*server, error) {
	if inproc {
		l, err := listen(path, spin)
		if err != nil {
			return nil, err
		}
		return &server{stop: func() { l.Close() }}, nil
	}
	cmd := exec.Command(os.Args[0], "-role=server", "-socket="+path, "-spin="+spin.String())
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "ready\n" {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("server child did not start: %q %v", line, err)
	}
	return &server{stop: func() { in.Close(); cmd.Wait() }}, nil
}

func request() *ipc.AllocReq {
	r := &ipc.AllocReq{Rank: 0, Hashes: make([]kv.Hash, 64), Sizes: make([]uint64, 64)}
	for i := range r.Hashes {
		r.Hashes[i][0], r.Hashes[i][31] = byte(i), 0x5a
		r.Sizes[i] = 1 << 20
	}
	return r
}

type result struct {
	p50, p99, p999, mean time.Duration
	perSec               float64
}

// roundTrips times n ALLOC calls (after a warm-up), gap apart.
func roundTrips(c *ipc.Client, n int, gap time.Duration) (result, error) {
	req := request()
	ctx := context.Background()
	for i := 0; i < n/10+100; i++ {
		if _, err := c.Alloc(ctx, req); err != nil {
			return result{}, err
		}
	}
	lat := make([]time.Duration, 0, n)
	var busy time.Duration
	for i := 0; i < n; i++ {
		if gap > 0 {
			time.Sleep(gap)
		}
		t0 := time.Now()
		resp, err := c.Alloc(ctx, req)
		d := time.Since(t0)
		if err != nil {
			return result{}, err
		}
		if len(resp.Locs) != 64 {
			return result{}, errors.New("short answer")
		}
		lat = append(lat, d)
		busy += d
	}
	slices.Sort(lat)
	q := func(p float64) time.Duration { return lat[min(len(lat)-1, int(p*float64(len(lat))))] }
	return result{p50: q(0.50), p99: q(0.99), p999: q(0.999), mean: busy / time.Duration(n), perSec: float64(n) / busy.Seconds()}, nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }

func run(inproc bool, dir, name string, serverSpin, clientSpin time.Duration, fn func(c *ipc.Client) error) error {
	path := filepath.Join(dir, name+".sock")
	s, err := startServer(inproc, path, serverSpin)
	if err != nil {
		return err
	}
	defer s.stop()
	c, err := ipc.DialConfig(path, ipc.Hello{Role: ipc.RoleTool}, 5*time.Second, &ipc.ClientConfig{Ring: ipc.RingOptions{Spin: clientSpin}})
	if err != nil {
		return err
	}
	defer c.Close()
	return fn(c)
}

func bench(inproc bool, n, nSleep int, idle, parkedSpin time.Duration) error {
	dir, err := os.MkdirTemp("", "kvshim-bench-ipc-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	out := map[string]any{"cpus": runtime.NumCPU(), "gomaxprocs": runtime.GOMAXPROCS(0), "inproc": inproc,
		"request_keys": 64, "go_version": runtime.Version()}
	fmt.Printf("kvshim-bench-ipc: ALLOC with 64 keys, %d CPUs, server in %s\n", runtime.NumCPU(), map[bool]string{true: "this process", false: "a child process"}[inproc])

	// Spin mode: both sides busy-poll (spin window longer than any gap).
	err = run(inproc, dir, "spin", time.Second, time.Second, func(c *ipc.Client) error {
		r, err := roundTrips(c, n, 0)
		if err != nil {
			return err
		}
		fmt.Printf("spin  : p50 %.2f µs  p99 %.2f µs  p99.9 %.2f µs  mean %.2f µs  %.0f msg/s (n=%d)\n", us(r.p50), us(r.p99), us(r.p999), us(r.mean), r.perSec, n)
		out["go_spin_p50_us"], out["go_spin_p99_us"], out["go_spin_p999_us"] = us(r.p50), us(r.p99), us(r.p999)
		out["go_spin_msgs_per_s"] = r.perSec
		return nil
	})
	if err != nil {
		return fmt.Errorf("spin: %w", err)
	}

	// Sleep mode: no spinning anywhere; every request wakes the server from
	// FUTEX_WAIT and every answer wakes the client.
	err = run(inproc, dir, "sleep", -1, -1, func(c *ipc.Client) error {
		r, err := roundTrips(c, nSleep, 0)
		if err != nil {
			return err
		}
		fmt.Printf("sleep : p50 %.2f µs  p99 %.2f µs  p99.9 %.2f µs  mean %.2f µs  %.0f msg/s (futex both ways, n=%d)\n", us(r.p50), us(r.p99), us(r.p999), us(r.mean), r.perSec, nSleep)
		out["go_sleep_p50_us"], out["go_sleep_p99_us"], out["go_sleep_p999_us"] = us(r.p50), us(r.p99), us(r.p999)
		out["go_sleep_msgs_per_s"] = r.perSec
		return nil
	})
	if err != nil {
		return fmt.Errorf("sleep: %w", err)
	}

	// Default (adaptive) settings after idle gaps: the server is parked in
	// FUTEX_WAIT when the request lands; the caller spins DefaultSpin for
	// its answer. This is what a scheduler step sees.
	err = run(inproc, dir, "parked", 0, parkedSpin, func(c *ipc.Client) error {
		r, err := roundTrips(c, nSleep, 2*time.Millisecond)
		if err != nil {
			return err
		}
		fmt.Printf("parked: p50 %.2f µs  p99 %.2f µs  p99.9 %.2f µs  (client spin %v, server asleep at each request, n=%d)\n", us(r.p50), us(r.p99), us(r.p999), cmp.Or(parkedSpin, ipc.DefaultSpin), nSleep)
		out["go_parked_p50_us"], out["go_parked_p99_us"] = us(r.p50), us(r.p99)
		return nil
	})
	if err != nil {
		return fmt.Errorf("parked: %w", err)
	}

	// Idle CPU of a connected client+server pair with default settings.
	err = run(inproc, dir, "idle", 0, 0, func(c *ipc.Client) error {
		ctx := context.Background()
		for i := 0; i < 100; i++ {
			if _, err := c.Alloc(ctx, request()); err != nil {
				return err
			}
		}
		time.Sleep(200 * time.Millisecond) // let spins and tickers settle
		srv0, err := serverCPU(ctx, c)
		if err != nil {
			return err
		}
		cli0, t0 := cpuSeconds(), time.Now()
		time.Sleep(idle)
		srv1, err := serverCPU(ctx, c)
		if err != nil {
			return err
		}
		wall := time.Since(t0).Seconds()
		cli := cpuSeconds() - cli0
		srv := srv1 - srv0
		if inproc {
			srv = 0 // one process: cpuSeconds already covers both
		}
		pct := 100 * (cli + srv) / wall
		fmt.Printf("idle  : %.3f%% of one core over %.1f s (client %.4f s, server %.4f s CPU)\n", pct, wall, cli, srv)
		out["idle_cpu_pct"] = pct
		out["idle_seconds"] = wall
		return nil
	})
	if err != nil {
		return fmt.Errorf("idle: %w", err)
	}
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
	return nil
}

func serverCPU(ctx context.Context, c *ipc.Client) (float64, error) {
	st, err := c.Stats(ctx)
	if err != nil {
		return 0, err
	}
	for _, s := range st.Stats {
		if s.Name == "cpu_seconds" {
			return s.Value, nil
		}
	}
	return 0, errors.New("no cpu_seconds in stats")
}
