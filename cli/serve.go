package cli

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/trace"
)

// validEvictionPolicies are the values --eviction-policy accepts.
var validEvictionPolicies = []string{"LRU"}

// serveOptions is what `kvshim serve` parsed from its flags.
type serveOptions struct {
	cfg         server.Config
	metricsHost string
	traceDir    string // --trace-dir ("": off)
}

// parseServe parses and checks the flags of `kvshim serve`. Every problem
// is reported on stderr; ok is false when the command must exit with
// status 2 (help: exit 0).
func parseServe(args []string, stdout, stderr io.Writer) (o serveOptions, code int, ok bool) {
	def := server.DefaultConfig()
	fs := newFlagSet("serve", "Run the kvshim MP server: L1 host memory in shared segments behind a Unix\n"+
		"socket, optional L2 adapters and a Prometheus metrics port. SIGTERM or\n"+
		"SIGINT stops it (sessions are closed, the socket is removed).")
	socket := fs.String("socket", ipc.DefaultSocketPath(), "Unix socket the server listens on")
	l1 := fs.Float64("l1-size-gb", def.L1SizeGB, "L1 host memory limit in `GiB` (segments are created lazily)")
	prefault := fs.Float64("l1-prefault-gb", def.L1PrefaultGB, "`GiB` of L1 kept created, faulted in and announced to clients ahead of use, from start-up\n"+
		"on, in the background (at most --l1-size-gb; 0: L1 grows lazily, on the requests' path)")
	policy := fs.String("eviction-policy", def.EvictionPolicy, "L1 eviction policy: "+joinQuoted(validEvictionPolicies))
	high := fs.Float64("l1-high-watermark", def.HighWatermark, "`fraction` of L1 above which eviction starts, in (0, 1]")
	low := fs.Float64("l1-low-watermark", def.LowWatermark, "`fraction` of L1 eviction brings usage down to, in [0, high)")
	holdTTL := fs.Duration("hold-ttl", def.HoldTTL, "last-resort reclaim of read holds nobody released (a `duration`: 90s, 30m)")
	port := fs.Int("metrics-port", 0, "serve Prometheus metrics at http://HOST:`PORT`/metrics (0: off)")
	host := fs.String("metrics-host", "127.0.0.1", "address the metrics listener binds")
	traceDir := fs.String("trace-dir", "", "write lifecycle traces (Arrow IPC files, read by kvshim trace) into `DIR` (default: off)")
	var l2 stringList
	fs.Var(&l2, "l2-adapter", "L2 adapter as a `JSON` object, LMCache style (repeatable), e.g.\n"+
		`'{"type": "fs", "base_path": "/mnt/kv", "num_workers": 4}'`)
	storePolicy := fs.String("l2-store-policy", "all", `which L1 objects are written to L2: "all" or "none"`)
	storeAfter := fs.Int("l2-store-after-lookups", 0, "write an object to L2 only once `N` lookups have found it in L1 (0: every object at commit, write-through)")
	prefetchBudget := fs.Float64("l2-prefetch-budget-gb", 0, "`GiB` of L1 that L2 prefetches may reserve (0: a quarter of L1)")
	prefetchTimeout := fs.Duration("l2-prefetch-timeout", 0, "how long a lookup waits for its L2 prefetch, a `duration` (0: 5s)")
	admissionWait := fs.Duration("l2-admission-wait", 0, "how long a prefetch waits for budget, a `duration` (0: 1s; negative: never waits)")
	prefetchRetain := fs.Bool("l2-prefetch-retain", false, "objects loaded from L2 stay resident in L1 after the read")
	storeInflight := fs.Float64("l2-store-max-inflight-gb", 0, "`GiB` of L1 pinned for L2 writes in flight (0: a quarter of L1)")
	maxLookups := fs.Int("max-lookups-per-session", server.DefaultMaxLookupsPerSession, "the most live lookups (`N`) one client session may have; more are refused (the client sees a miss)")
	maxCells := fs.Int("max-lookup-cells-per-session", server.DefaultMaxLookupCellsPerSession, "the most hold cells (`N` chunks × readers, each at most 37 bytes of server memory) one session's live lookups may have; more are refused (a miss)")
	maxSessions := fs.Int("max-sessions-per-uid", ipc.DefaultMaxSessionsPerUID, "the most live client sessions (`N`) of one uid; more are refused (each costs a 12 MiB ring pair)")
	config := fs.String("config", "", "read the flags from `FILE` first, one \"key = value\" a line, keys spelled as the flags\n"+
		"without dashes (l1-size-gb = 64; l2-adapter repeats); flags given here override it")
	if code, ok := fs.parse(args, stdout, stderr); !ok {
		return o, code, false
	}

	var problems []string
	if *config != "" {
		problems = applyConfig(fs, *config, "config")
	}
	cfg := def
	cfg.Socket = *socket
	cfg.L1SizeGB = *l1
	cfg.L1PrefaultGB = *prefault
	cfg.HighWatermark, cfg.LowWatermark = *high, *low
	cfg.HoldTTL = *holdTTL
	cfg.MetricsPort = *port
	cfg.L2Adapters = l2
	cfg.L2StorePolicy = *storePolicy
	cfg.L2StoreAfterLookups = *storeAfter
	cfg.L2PrefetchBudgetGB, cfg.L2StoreMaxInflightGB = *prefetchBudget, *storeInflight
	cfg.L2PrefetchTimeout, cfg.L2AdmissionWait = *prefetchTimeout, *admissionWait
	cfg.L2PrefetchRetain = *prefetchRetain
	cfg.MaxLookupsPerSession, cfg.MaxLookupCellsPerSession = *maxLookups, *maxCells
	cfg.MaxSessionsPerUID = *maxSessions
	if p := strings.ToUpper(strings.TrimSpace(*policy)); contains(validEvictionPolicies, p) {
		cfg.EvictionPolicy = p
	} else {
		problems = append(problems, fmt.Sprintf("--eviction-policy %q is not valid; valid values: %s", *policy, joinQuoted(validEvictionPolicies)))
	}
	if cfg.Socket == "" {
		problems = append(problems, "--socket must not be empty")
	}
	if strings.TrimSpace(*host) == "" {
		problems = append(problems, "--metrics-host must not be empty")
	}
	if err := cfg.Validate(); err != nil {
		msg := strings.TrimPrefix(err.Error(), server.ErrConfig.Error()+": ")
		problems = append(problems, strings.Split(msg, "; ")...)
	}
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintf(stderr, "kvshim serve: %s\n", p)
		}
		fmt.Fprintln(stderr, "run 'kvshim serve --help' for the flags")
		return o, 2, false
	}
	return serveOptions{cfg: cfg, metricsHost: *host, traceDir: *traceDir}, 0, true
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if x == y {
			return true
		}
	}
	return false
}

// serveHooks are the seams tests use; the zero value is production.
type serveHooks struct {
	// listen binds the metrics listener (default net.Listen).
	listen func(network, addr string) (net.Listener, error)
	// info names the build in kvshim_build_info.
	info Info
}

func runServe(args []string, info Info, stdout, stderr io.Writer) int {
	sig := make(chan os.Signal, 1)
	// In libkvshim.so (c-shared, inside Python) Go installs its handlers
	// only for the signals passed to Notify; Stop puts Python's back.
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sig)
	return serve(args, sig, serveHooks{info: info}, stdout, stderr)
}

// serve runs the server until a value arrives on stop, then shuts it down.
func serve(args []string, stop <-chan os.Signal, hooks serveHooks, stdout, stderr io.Writer) int {
	o, code, ok := parseServe(args, stdout, stderr)
	if !ok {
		return code
	}
	if hooks.listen == nil {
		hooks.listen = net.Listen
	}
	started := time.Now()
	srv, err := server.Start(o.cfg, nil, server.Options{})
	if err != nil {
		if errors.Is(err, l2.ErrBadConfig) { // found only when the adapter opens
			fmt.Fprintf(stderr, "kvshim serve: %s\n", strings.TrimPrefix(err.Error(), server.ErrConfig.Error()+": "))
			fmt.Fprintln(stderr, "run 'kvshim serve --help' for the flags")
			return 2
		}
		fmt.Fprintf(stderr, "kvshim serve: %v\n", err)
		return 1
	}
	if o.traceDir != "" {
		tw, err := trace.Open(o.traceDir, trace.Options{Source: "server"})
		if err != nil {
			fmt.Fprintf(stderr, "kvshim serve: --trace-dir: %v\n", err)
			srv.Close()
			return 1
		}
		srv.Core.SetTrace(tw)
		defer tw.Close() // after the server's shutdown below
	}
	metricsURL := "off"
	var ms *server.MetricsServer
	var httpErr <-chan error
	if o.cfg.MetricsPort != 0 {
		ln, err := hooks.listen("tcp", net.JoinHostPort(o.metricsHost, strconv.Itoa(o.cfg.MetricsPort)))
		if err != nil {
			fmt.Fprintf(stderr, "kvshim serve: metrics listener: %v\n", err)
			srv.Close()
			return 1
		}
		ms = srv.Core.ServeMetrics(ln, server.BuildInfo{Version: hooks.info.Version, ABI: hooks.info.ABI})
		httpErr = ms.Failed()
		metricsURL = ms.URL()
	}
	if as := srv.Core.L2Adapters(); len(as) > 0 {
		names := make([]string, len(as))
		for i, a := range as {
			names[i] = a.Type()
			if a.Name() != a.Type() {
				names[i] += " (" + a.Name() + ")"
			}
		}
		fmt.Fprintf(stdout, "kvshim serve: L2 adapters: %s\n", strings.Join(names, ", "))
	}
	fmt.Fprintf(stdout, "kvshim serve: listening on %s, L1 %g GiB, metrics %s\n", o.cfg.Socket, o.cfg.L1SizeGB, metricsURL)

	var why string
	failed := false
	select {
	case s := <-stop:
		why = "on " + signalName(s)
	case err := <-httpErr:
		why, failed = fmt.Sprintf("after a metrics listener failure: %v", err), true
		fmt.Fprintf(stderr, "kvshim serve: metrics listener: %v\n", err)
	}
	stat := func(n string) float64 { v, _ := srv.Core.Stat(n); return v }
	sessions, lookups := stat("kvshim_sessions_opened_total"), stat("kvshim_lookups_total")
	commits, evictions := stat("kvshim_l1_commits_total"), stat("kvshim_l1_evictions_total")
	closed := make(chan error, 1)
	go func() {
		ms.Close()
		closed <- srv.Close()
	}()
	select {
	case err := <-closed:
		if err != nil {
			fmt.Fprintf(stderr, "kvshim serve: shutdown: %v\n", err)
			failed = true
		}
	case s := <-stop:
		// A second signal: the operator does not want to wait for the
		// sessions to end (the process exits soon after we return).
		fmt.Fprintf(stderr, "kvshim serve: %s during shutdown: not waiting for sessions to close\n", signalName(s))
		failed = true
	}
	fmt.Fprintf(stdout, "kvshim serve: stopped %s after %s: %.0f sessions, %.0f lookups, %.0f commits, %.0f evictions\n",
		why, time.Since(started).Round(time.Millisecond), sessions, lookups, commits, evictions)
	if failed {
		return 1
	}
	return 0
}

func signalName(s os.Signal) string {
	switch s {
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGINT:
		return "SIGINT"
	}
	return s.String()
}

func init() {
	commands["serve"] = command{"run the kvshim server (L1 shared memory, Unix socket, optional metrics port)", runServe}
}
