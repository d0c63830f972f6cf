// Command kvshim-bench-idle measures what an idle `kvshim serve` costs with
// N connected sessions: the server's CPU (the sum of its threads'
// /proc/PID/task/*/schedstat run time, in ns, not 10 ms ticks) and its
// threads' context switches (wake-ups: a figure a loaded machine does not
// move) over -idle, then the round trip of an echo after 5 ms idle (the
// cost of waking the server). Servers given with -server (comma separated:
// e.g. a baseline build and this one) alternate, -rounds times, in one run.
// The last line of output is JSON.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
)

func main() {
	servers := flag.String("server", "out/kvshim", "kvshim binaries to compare, comma separated")
	sessions := flag.Int("sessions", 8, "idle sessions connected")
	idle := flag.Duration("idle", 30*time.Second, "idle period measured")
	rounds := flag.Int("rounds", 1, "rounds (servers alternate)")
	echoes := flag.Int("echoes", 100, "echoes after 5 ms idle")
	flag.Parse()
	out := map[string]any{}
	for r := 0; r < *rounds; r++ {
		for _, bin := range strings.Split(*servers, ",") {
			res, err := measure(bin, *sessions, *idle, *echoes)
			if err != nil {
				fmt.Fprintln(os.Stderr, "kvshim-bench-idle:", err)
				os.Exit(1)
			}
			fmt.Printf("%s round %d: %+v\n", bin, r, res)
			out[fmt.Sprintf("%s#%d", bin, r)] = res
		}
	}
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
}

type result struct {
	CPUPct        float64 `json:"cpu_pct_of_core"`
	WakeupsPerSec float64 `json:"ctx_switches_per_s"`
	Threads       int     `json:"threads"`
	EchoP50us     float64 `json:"echo_after_5ms_idle_p50_us"`
	EchoP90us     float64 `json:"echo_after_5ms_idle_p90_us"`
}

func measure(bin string, sessions int, idle time.Duration, echoes int) (*result, error) {
	dir, err := os.MkdirTemp("", "kvshim-idle-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "kvshim.sock")
	cmd := exec.Command(bin, "serve", "--socket", sock, "--l1-size-gb", "0.0625", "--l1-prefault-gb", "0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	defer func() { cmd.Process.Signal(os.Interrupt); cmd.Wait() }()
	var cs []*ipc.Client
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for deadline := time.Now().Add(20 * time.Second); len(cs) < sessions; {
		c, err := ipc.Dial(sock, ipc.Hello{Role: ipc.RoleWorker, Instance: uuid.New()}, 2*time.Second)
		if err != nil {
			if time.Now().After(deadline) {
				return nil, err
			}
			time.Sleep(50 * time.Millisecond)
			continue
		}
		cs = append(cs, c)
	}
	time.Sleep(3 * time.Second) // start-up done, every reader parked
	pid := cmd.Process.Pid
	ns0, sw0, _ := threads(pid)
	per0 := perThread(pid)
	t0 := time.Now()
	time.Sleep(idle)
	ns1, sw1, n := threads(pid)
	if os.Getenv("KVSHIM_IDLE_THREADS") != "" {
		per1 := perThread(pid)
		for tid, v := range per1 {
			if d := v - per0[tid]; d > 0 {
				fmt.Fprintf(os.Stderr, "  thread %s: %d switches\n", tid, d)
			}
		}
	}
	wall := time.Since(t0)
	res := &result{CPUPct: float64(ns1-ns0) / float64(wall.Nanoseconds()) * 100, WakeupsPerSec: float64(sw1-sw0) / wall.Seconds(), Threads: n}
	var lat []float64
	for i := 0; i < echoes; i++ {
		time.Sleep(5 * time.Millisecond)
		c := cs[i%len(cs)]
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		t := time.Now()
		err := c.Ping(ctx)
		d := time.Since(t)
		cancel()
		if err != nil {
			return nil, err
		}
		lat = append(lat, float64(d.Microseconds()))
	}
	slices.Sort(lat)
	res.EchoP50us, res.EchoP90us = lat[len(lat)/2], lat[len(lat)*9/10]
	return res, nil
}

func perThread(pid int) map[string]uint64 {
	m := map[string]uint64{}
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, e := range ents {
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, e.Name()))
		for _, line := range strings.Split(string(st), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.HasSuffix(k, "ctxt_switches") {
				x, _ := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
				m[e.Name()] += x
			}
		}
	}
	return m
}

// threads sums the run time (ns) and context switches of pid's threads.
func threads(pid int) (ns, switches uint64, n int) {
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, e := range ents {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, e.Name()))
		if err != nil {
			continue
		}
		if f := strings.Fields(string(b)); len(f) > 0 {
			v, _ := strconv.ParseUint(f[0], 10, 64)
			ns += v
		}
		st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, e.Name()))
		for _, line := range strings.Split(string(st), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.HasSuffix(k, "ctxt_switches") {
				x, _ := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
				switches += x
			}
		}
		n++
	}
	return ns, switches, n
}
