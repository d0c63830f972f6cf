package cli

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

var (
	readyRE   = regexp.MustCompile(`kvshim serve: listening on (\S+), L1 (\S+) GiB, metrics (\S+)\n`)
	summaryRE = regexp.MustCompile(`kvshim serve: stopped on (SIGTERM|SIGINT) after \S+: (\d+) sessions, (\d+) lookups, (\d+) commits, (\d+) evictions\n`)
)

// startServe runs `serve` in-process until the returned stop function is
// called, which returns serve's exit code. The metrics listener binds port
// 0 whatever --metrics-port says (a free port; the ready line names it).
func startServe(t *testing.T, args ...string) (ready []string, stdout *testkit.Buffer, stop func(os.Signal) int) {
	t.Helper()
	stdout = &testkit.Buffer{}
	stderr := &testkit.Buffer{}
	sig := make(chan os.Signal, 1)
	done := make(chan int, 1)
	anyPort := func(network, addr string) (net.Listener, error) {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		return net.Listen(network, net.JoinHostPort(host, "0"))
	}
	go func() { done <- serve(args, sig, serveHooks{listen: anyPort}, stdout, stderr) }()
	testkit.Eventually(t, 10*time.Second, "the ready line", func() bool {
		select {
		case code := <-done:
			t.Fatalf("serve exited with %d before it was ready: %s%s", code, stdout, stderr)
		default:
		}
		return readyRE.MatchString(stdout.String())
	})
	stopped := false
	stop = func(s os.Signal) int {
		stopped = true
		sig <- s
		select {
		case code := <-done:
			return code
		case <-time.After(10 * time.Second):
			t.Fatalf("serve did not stop within 10 s; stderr: %s", stderr)
			return -1
		}
	}
	t.Cleanup(func() {
		if !stopped {
			stop(syscall.SIGTERM)
		}
	})
	return readyRE.FindStringSubmatch(stdout.String()), stdout, stop
}

// storeOne writes one committed object of size bytes, as a worker would.
func storeOne(t *testing.T, sock string, size uint64) {
	t.Helper()
	c, err := ipc.Dial(sock, ipc.Hello{Role: ipc.RoleWorker}, 5*time.Second)
	assert.NilError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	tag, ns, hs := kv.Tag(uuid.New()), kv.Namespace{7}, []kv.Hash{{1, 2, 3}}
	ar, err := c.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: ns, Hashes: hs, Sizes: []uint64{size}})
	assert.NilError(t, err)
	assert.Equal(t, ar.Status[0], ipc.StatusOK)
	cr, err := c.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns, Hashes: hs})
	assert.NilError(t, err)
	assert.Equal(t, cr.Status[0], ipc.StatusOK)
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	cl := &http.Client{Timeout: 5 * time.Second}
	resp, err := cl.Get(url)
	assert.NilError(t, err)
	defer resp.Body.Close()
	assert.Equal(t, resp.StatusCode, http.StatusOK)
	b, err := io.ReadAll(resp.Body)
	assert.NilError(t, err)
	return string(b)
}

// TestServeStatMetrics runs serve in-process and reads it three ways:
// stat, stat --json and the metrics port; then stops it like SIGTERM does.
func TestServeStatMetrics(t *testing.T) {
	sock := socketPath(t)
	ready, stdout, stop := startServe(t, "--socket", sock, "--l1-size-gb", "0.01", "--eviction-policy", "lru",
		"--l1-high-watermark", "0.9", "--l1-low-watermark", "0.5", "--hold-ttl", "2m", "--metrics-port", "9")
	assert.Equal(t, ready[1], sock)
	assert.Equal(t, ready[2], "0.01")
	assert.Assert(t, is.Regexp(`^http://127\.0\.0\.1:\d+/metrics$`, ready[3]))
	const capacity = 10735616 // 0.01 GiB rounded down to 4 KiB
	storeOne(t, sock, 1<<20)

	code, out, errOut := runCmd("stat", "--socket", sock)
	assert.Equal(t, code, 0, errOut)
	for _, want := range []string{
		"kvshim server at " + sock,
		"L1          used 1.0 MiB of 10.2 MiB (9.8%)",
		"objects     staging 0 (0 B), resident 1 (1.0 MiB), temporary 0 (0 B)",
		"holds       0 read holds",
		"lookups     0 total, 0 live, 0 pending; chunks hit 0, miss 0 (- hit)",
		"evictions   0 objects, 0 B",
		"writes      1 commits, 0 aborts",
		"alloc keys  ok 1, resident 0, in_progress 0, no_space 0",
	} {
		assert.Check(t, is.Contains(out, want))
	}
	// The worker's session may still be closing: only the shape is fixed.
	assert.Check(t, is.Regexp(`\nsessions    [12] connected \(2 opened, [01] closed\)\n`, out))

	code, out, errOut = runCmd("stat", "--socket", sock, "--json")
	assert.Equal(t, code, 0, errOut)
	assert.Equal(t, strings.Count(out, "\n"), 1, "one JSON object on one line")
	var js struct {
		Socket  string `json:"socket"`
		Server  string `json:"server"`
		Metrics []struct {
			Name   string            `json:"name"`
			Labels map[string]string `json:"labels"`
			Value  float64           `json:"value"`
		} `json:"metrics"`
	}
	assert.NilError(t, json.Unmarshal([]byte(out), &js))
	assert.Equal(t, js.Socket, sock)
	_, err := uuid.Parse(js.Server)
	assert.NilError(t, err)
	stats := map[string]float64{} // Prometheus text form: name{k="v"}
	for _, m := range js.Metrics {
		name := m.Name
		if len(m.Labels) > 0 {
			var ls []string
			for k, v := range m.Labels {
				ls = append(ls, k+`="`+v+`"`)
			}
			sort.Strings(ls)
			name += "{" + strings.Join(ls, ",") + "}"
		}
		stats[name] = m.Value
	}
	assert.Equal(t, stats["kvshim_l1_capacity_bytes"], float64(capacity))
	assert.Equal(t, stats[`kvshim_l1_objects{state="resident"}`], 1.0)
	assert.Equal(t, stats["kvshim_l1_used_bytes"], float64(1<<20))

	// The metrics port exports the same numbers.
	text := httpGet(t, ready[3])
	assert.Check(t, is.Contains(text, "# TYPE kvshim_l1_capacity_bytes gauge"))
	assert.Check(t, is.Contains(text, "kvshim_l1_capacity_bytes 1.0735616e+07\n"))
	assert.Check(t, is.Contains(text, `kvshim_l1_objects{state="resident"} 1`+"\n"))
	assert.Check(t, is.Contains(text, "kvshim_l1_used_bytes 1.048576e+06\n"))
	assert.Check(t, is.Regexp(`\nkvshim_build_info\{abi="\d+\.\d+",protocol="\d+",version="[^"]+"\} 1\n`, text))
	assert.Check(t, is.Contains(text, "\ngo_goroutines "))
	// Every STATS number is on the metrics page with the same value (the
	// stat client's own session may have closed in between).
	for name, v := range stats {
		if name == "kvshim_sessions" || name == "kvshim_sessions_closed_total" {
			continue
		}
		assert.Check(t, is.Contains(text, "\n"+name+" "+strconv.FormatFloat(v, 'g', -1, 64)+"\n"))
	}

	// A second server on the same socket is refused; the first keeps going.
	code, _, errOut = runCmd("serve", "--socket", sock, "--l1-size-gb", "0.01")
	assert.Equal(t, code, 1)
	assert.Check(t, is.Contains(errOut, "a server is already listening"))

	assert.Equal(t, stop(syscall.SIGTERM), 0)
	m := summaryRE.FindStringSubmatch(stdout.String())
	assert.Assert(t, m != nil, "no summary line in %q", stdout.String())
	assert.DeepEqual(t, m[1:], []string{"SIGTERM", "3", "0", "1", "0"})
	_, err = os.Stat(sock)
	assert.Check(t, errors.Is(err, fs.ErrNotExist), "socket left behind")
	_, err = (&http.Client{Timeout: time.Second}).Get(ready[3])
	assert.Check(t, err != nil, "metrics port still open")

	code, _, errOut = runCmd("stat", "--socket", sock)
	assert.Equal(t, code, 1)
	assert.Check(t, is.Contains(errOut, "kvshim stat: no kvshim server at "+sock))
}

// TestServeMetricsOff: port 0 means no listener, and the ready line says so.
func TestServeMetricsOff(t *testing.T) {
	sock := socketPath(t)
	ready, _, stop := startServe(t, "--socket", sock, "--l1-size-gb", "0.01")
	assert.Equal(t, ready[3], "off")
	assert.Equal(t, stop(syscall.SIGINT), 0)
}

// TestServeL2FS: --l2-adapter JSON reaches the store (a real fs adapter).
func TestServeL2FS(t *testing.T) {
	sock := socketPath(t)
	dir := t.TempDir()
	_, stdout, stop := startServe(t, "--socket", sock, "--l1-size-gb", "0.01",
		"--l2-adapter", `{"type": "fs", "base_path": "`+dir+`", "name": "disk"}`, "--l2-store-policy", "all")
	assert.Check(t, is.Contains(stdout.String(), "kvshim serve: L2 adapters: fs (disk)\n"))
	storeOne(t, sock, 64<<10)
	code, _, errOut := runCmd("stat", "--socket", sock)
	assert.Equal(t, code, 0, errOut)
	assert.Equal(t, stop(syscall.SIGTERM), 0)
}
