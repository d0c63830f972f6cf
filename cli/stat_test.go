package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"
)

// TestStatNoServer: absent, stale and silent servers each give one line
// and exit 1 within the timeout.
func TestStatNoServer(t *testing.T) {
	absent := socketPath(t)

	stale := socketPath(t)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: stale, Net: "unixpacket"})
	assert.NilError(t, err)
	ln.SetUnlinkOnClose(false)
	ln.Close()

	// Accepted by the kernel (backlog) but never answered: a hung server.
	silent := socketPath(t)
	hung, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: silent, Net: "unixpacket"})
	assert.NilError(t, err)
	defer hung.Close()

	cases := []struct {
		name, socket, want string
	}{
		{"absent", absent, "kvshim stat: no kvshim server at " + absent + " (no socket file; start one with 'kvshim serve')\n"},
		{"stale", stale, "kvshim stat: no kvshim server at " + stale + " (stale socket: nothing is listening)\n"},
		{"silent", silent, "kvshim stat: the server at " + silent + " did not answer within 300ms\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			code, out, errOut := runCmd("stat", "--socket", tc.socket, "--timeout", "300ms")
			assert.Check(t, time.Since(start) < 3*time.Second, "took %v", time.Since(start))
			assert.Equal(t, code, 1)
			assert.Equal(t, out, "")
			assert.Equal(t, errOut, tc.want)
		})
	}
}

func TestStatBadFlags(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--timeout", "0s"}, "kvshim stat: --timeout must be > 0, got 0s"},
		{[]string{"--timeout", "soon"}, `kvshim stat: invalid value "soon" for flag -timeout: want a duration such as 500ms, 90s or 30m`},
		{[]string{"--socket", ""}, "kvshim stat: --socket must not be empty"},
		{[]string{"--jsonl"}, "kvshim stat: flag provided but not defined: -jsonl"},
		{[]string{"all"}, `kvshim stat: unexpected argument "all"`},
	}
	for _, tc := range cases {
		code, out, errOut := runCmd(append([]string{"stat"}, tc.args...)...)
		assert.Check(t, is.Equal(code, 2), "%v", tc.args)
		assert.Check(t, is.Equal(out, ""))
		assert.Check(t, is.Contains(errOut, tc.want))
	}
	code, out, errOut := runCmd("stat", "--help")
	assert.Equal(t, code, 0)
	assert.Equal(t, errOut, "")
	for _, f := range []string{"\n  --socket ", "\n  --json\n", "\n  --timeout ", "\n  --log-level "} {
		assert.Check(t, is.Contains(out, f))
	}
}

// TestPrintSnapshotUnknown: numbers this build does not lay out are still
// printed (latencies as durations), and missing families leave no gaps.
func TestPrintSnapshotUnknown(t *testing.T) {
	s := &snapshot{Socket: "/s", Server: "id", Stats: map[string]float64{}}
	add := func(n string, v float64) {
		s.order = append(s.order, n)
		s.Stats[n] = v
	}
	add("kvshim_l1_capacity_bytes", 1<<30)
	add("kvshim_l1_used_bytes", 3<<28)
	add("kvshim_l1_objects{state=resident}", 5)
	add("kvshim_l1_object_bytes{state=resident}", 5<<20)
	add("kvshim_server_op_seconds{op=alloc,quantile=0.5}", 12e-6)
	add("kvshim_l1_used_max_bytes", 1<<29)
	add("kvshim_l1_pinned", 2)
	add("kvshim_future_thing", 42)
	var b bytes.Buffer
	printSnapshot(&b, s)
	out := b.String()
	assert.Check(t, is.Contains(out, "L1          used 768.0 MiB of 1.0 GiB (75.0%)"))
	assert.Check(t, is.Contains(out, "objects     resident 5 (5.0 MiB)\n"))
	assert.Check(t, is.Contains(out, "; peak used 512.0 MiB (50.0%)\n"))
	assert.Check(t, is.Contains(out, "holds       0 read holds, 2 pinned for L2 writes\n"))
	assert.Check(t, !strings.Contains(out, "prefetch"), "optional numbers the server did not send are not printed")
	assert.Check(t, is.Contains(out, "latency     kvshim_server_op_seconds{op=alloc,quantile=0.5} 12µs\n"))
	assert.Check(t, is.Contains(out, "other       kvshim_future_thing 42\n"))
	assert.Check(t, strings.HasSuffix(out, "other       kvshim_future_thing 42\n"))
}

func TestFmtBytes(t *testing.T) {
	for _, tc := range []struct {
		n    float64
		want string
	}{{0, "0 B"}, {1023, "1023 B"}, {1024, "1.0 KiB"}, {3 << 29, "1.5 GiB"}, {1 << 60, "1024.0 PiB"}} {
		assert.Check(t, is.Equal(fmtBytes(tc.n), tc.want))
	}
	assert.Check(t, is.Equal(pct(1, 0), "-"))
	assert.Check(t, is.Equal(pct(1, 8), "12.5%"))
}

var singleDash = regexp.MustCompile(`\n  -[a-z]`)

// TestUsage: help goes to stdout with exit 0 (for every command); a missing
// command is a usage error on stderr; --version prints one line.
func TestUsage(t *testing.T) {
	code, out, errOut := runCmd("--help")
	assert.Equal(t, code, 0)
	assert.Equal(t, errOut, "")
	for _, c := range []string{"\n  doctor ", "\n  serve ", "\n  stat ", "\n  demo "} {
		assert.Check(t, is.Contains(out, c))
	}
	assert.Check(t, is.Contains(out, "provided by the Python package"))
	for _, cmd := range []string{"doctor", "serve", "stat"} {
		code, out, errOut := runCmd(cmd, "--help")
		assert.Check(t, is.Equal(code, 0), cmd)
		assert.Check(t, is.Equal(errOut, ""), cmd)
		assert.Check(t, is.Contains(out, "usage: kvshim "+cmd), cmd)
		assert.Check(t, !singleDash.MatchString(out), "%s: a flag spelled -name, not --name:\n%s", cmd, out)
	}
	code, out, errOut = runCmd()
	assert.Equal(t, code, 2)
	assert.Equal(t, out, "")
	assert.Check(t, is.Contains(errOut, "usage: kvshim"))
	code, out, _ = runCmd("--version")
	assert.Equal(t, code, 0)
	assert.Check(t, is.Regexp(`^kvshim \S+ \(C ABI \d+\.\d+, protocol \d+\)\n$`, out))
	// doctor takes only flags; a bad log level is one line naming the flag.
	code, _, errOut = runCmd("doctor", "extra")
	assert.Equal(t, code, 2)
	assert.Check(t, is.Contains(errOut, `unexpected argument "extra"`))
	code, _, errOut = runCmd("stat", "--log-level", "loud")
	assert.Equal(t, code, 2)
	assert.Check(t, is.Contains(errOut, `--log-level: log level "loud" is not one of debug, info, warn, error`))
	code, _, errOut = runCmd("demo")
	assert.Equal(t, code, 2, "demo is Python's; the library reports it unknown")
	assert.Check(t, is.Contains(errOut, `unknown command "demo"`))
}

// A path that is not a socket is named as such, not as a stale socket.
func TestStatOnARegularFile(t *testing.T) {
	f := filepath.Join(t.TempDir(), "file")
	assert.NilError(t, os.WriteFile(f, nil, 0o600))
	code, _, errOut := runCmd("stat", "--socket", f)
	assert.Equal(t, code, 1)
	assert.Check(t, is.Contains(errOut, f+" is not a socket"))
}

// TestStatJSONPlainKeys: --json names each number by its metric name with
// its labels as fields, as a jq user selects them.
func TestStatJSONPlainKeys(t *testing.T) {
	s := &snapshot{Socket: "/s", Server: "id", Stats: map[string]float64{}}
	for _, n := range []string{"kvshim_l1_capacity_bytes", "kvshim_l1_objects{state=resident}",
		"kvshim_l2_task_seconds{adapter=a,b,op=store,quantile=0.99}", "kvshim_odd"} {
		s.order = append(s.order, n)
		s.Stats[n] = float64(len(s.order))
	}
	s.Stats["kvshim_odd"] = math.NaN()
	var b bytes.Buffer
	assert.Equal(t, printJSON(&b, s), 0)
	var js struct {
		Socket, Server string
		Metrics        []struct {
			Name   string            `json:"name"`
			Labels map[string]string `json:"labels"`
			Value  *float64          `json:"value"`
		} `json:"metrics"`
	}
	assert.NilError(t, json.Unmarshal(b.Bytes(), &js))
	assert.Equal(t, len(js.Metrics), 4)
	for _, m := range js.Metrics {
		assert.Check(t, !strings.ContainsAny(m.Name, "{}="), "labels inside the name %q", m.Name)
	}
	assert.Check(t, is.Equal(js.Metrics[0].Name, "kvshim_l1_capacity_bytes"))
	assert.Check(t, is.DeepEqual(js.Metrics[0].Labels, map[string]string{}))
	assert.Check(t, is.Equal(*js.Metrics[0].Value, 1.0))
	assert.Check(t, is.Equal(js.Metrics[1].Name, "kvshim_l1_objects"))
	assert.Check(t, is.DeepEqual(js.Metrics[1].Labels, map[string]string{"state": "resident"}))
	assert.Check(t, is.DeepEqual(js.Metrics[2].Labels, map[string]string{"adapter": "a,b", "op": "store", "quantile": "0.99"}))
	assert.Check(t, js.Metrics[3].Value == nil, "NaN is null")
	assert.Check(t, is.Contains(b.String(), `{"name":"kvshim_l1_objects","labels":{"state":"resident"},"value":2}`))
}

// TestStatL2Adapters: a server with an fs L2 adapter named "disk" asked
// for a chunk it lacks (the prefetch looks it up in L2, finds nothing); `kvshim
// stat` shows the adapter by name with its errors and latency and its
// backend's own numbers (max_bytes: the fs capacity counters), and the
// adapter's numbers are not left under "latency" / "other".
func TestStatL2Adapters(t *testing.T) {
	sock := socketPath(t)
	dir := t.TempDir()
	_, _, stop := startServe(t, "--socket", sock, "--l1-size-gb", "0.01",
		"--l2-adapter", `{"type": "fs", "base_path": "`+dir+`", "name": "disk", "max_bytes": 1048576}`)
	defer stop(syscall.SIGTERM)
	c, err := ipc.Dial(sock, ipc.Hello{Role: ipc.RoleScheduler}, 5*time.Second)
	assert.NilError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	assert.NilError(t, c.Lookup(ctx, &ipc.LookupReq{LookupID: 1, Namespace: kv.Namespace{7}, WorldSize: 1, Hashes: []kv.Hash{{9}}}))
	testkit.Eventually(t, 5*time.Second, "the lookup's answer", func() bool {
		lr, err := c.LookupResult(ctx, &ipc.LookupResultReq{LookupID: 1})
		assert.NilError(t, err)
		return lr.Status == ipc.StatusOK
	})

	code, out, errOut := runCmd("stat", "--socket", sock)
	assert.Equal(t, code, 0, errOut)
	assert.Check(t, is.Contains(out, "\nL2 adapter  disk: saved 0 objects (0 B), 0 write errors; loaded 0 chunks (0 B), 0 missed, 0 failed, 0 rejected\n"))
	assert.Check(t, is.Regexp(`\n            disk errors: [a-z]+ 0(, [a-z]+ 0)+\n`, out))
	assert.Check(t, is.Regexp(`\n            disk latency: lookup p50 \S+, p99 \S+, mean \S+ \(1 tasks\)\n`, out))
	assert.Check(t, is.Regexp(`\n            disk: fs_max_bytes 1048576, .*fs_evicted_objects_total 0, .*fs_full_stores_total 0`, out))
	assert.Check(t, !strings.Contains(out, "adapter="), "adapter numbers left unformatted:\n%s", out)

	code, js, errOut := runCmd("stat", "--socket", sock, "--json")
	assert.Equal(t, code, 0, errOut)
	assert.Check(t, is.Contains(js, `{"name":"kvshim_l2_errors_total","labels":{"adapter":"disk","op":"lookup"},"value":0}`))
	assert.Check(t, is.Contains(js, `{"name":"kvshim_l2_task_seconds_count","labels":{"adapter":"disk","op":"lookup"},"value":1}`))
	assert.Check(t, is.Contains(js, `{"name":"kvshim_l2_fs_evicted_objects_total","labels":{"adapter":"disk"},"value":0}`))
	assert.Check(t, is.Contains(js, `{"name":"kvshim_l2_tasks_total","labels":{"adapter":"disk","op":"lookup"},"value":1}`))
}
