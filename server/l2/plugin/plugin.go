package plugin

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
)

// Type is the adapter type name.
const Type = "plugin"

// ABIVersion is the KVSHIM_L2_ABI_VERSION of include/kvshim_l2.h that this
// package speaks (TestABIVersionMatchesHeader).
const ABIVersion = 1

// HostName is the host program's file name (built by make into out/).
const HostName = "kvshim-l2-host"

// Environment variables.
const (
	// PathEnv lists the plugin directories searched for "plugin": NAME,
	// colon-separated, instead of DefaultDirs.
	PathEnv = "KVSHIM_L2_PLUGIN_PATH"
	// HostEnv names the host program when the config has no "host".
	HostEnv = "KVSHIM_L2_HOST"
)

// DefaultDirs are the plugin directories searched when PathEnv is unset
// (the user's first). A plugin named NAME is the file libkvshim-l2-NAME.so
// in one of them.
var DefaultDirs = []string{"~/.local/lib/kvshim/l2-plugins", "/usr/local/lib/kvshim/l2-plugins", "/usr/lib/kvshim/l2-plugins"}

// Defaults of the adapter-owned keys.
const (
	DefaultWindow     = 64 << 20
	DefaultHangGrace  = 5 * time.Second
	DefaultOpenTimout = 30 * time.Second
)

// restartEvery bounds how often a dead host is restarted; callers in
// between fail fast.
const restartEvery = time.Second

func init() { l2.Register(Type, New) }

// Config is what the adapter owns; every other key of the --l2-adapter
// object is the plugin's, passed to its open() as a JSON object.
type Config struct {
	Library     string        // "library": path of the plugin's .so
	Host        string        // "host": path of kvshim-l2-host ("" = found as doc.go says)
	Window      int           // "window_bytes": shared-memory window
	HangGrace   time.Duration // "hang_grace_ms": a call past its deadline by this much kills the host
	OpenTimeout time.Duration // "open_timeout_ms": the host's start and the plugin's open()
	PluginJSON  []byte        // the pass-through config
}

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,63}$`)

// New is the l2 factory for type "plugin".
func New(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
	c := Config{Window: DefaultWindow, HangGrace: DefaultHangGrace, OpenTimeout: DefaultOpenTimout}
	owned := []string{"library", "plugin", "host", "window_bytes", "hang_grace_ms", "open_timeout_ms"}
	ex := cfg.Extras()
	var name string
	ex.String("library", &c.Library)
	ex.String("plugin", &name)
	ex.String("host", &c.Host)
	ex.Int("window_bytes", &c.Window, windowPage, 1<<40)
	var ms int
	if ex.Int("hang_grace_ms", &ms, 0, 3600000) {
		c.HangGrace = time.Duration(ms) * time.Millisecond
	}
	if ex.Int("open_timeout_ms", &ms, 1, 3600000) {
		c.OpenTimeout = time.Duration(ms) * time.Millisecond
	}
	switch {
	case c.Library != "" && name != "":
		ex.Fail("plugin", "give \"library\" (a path) or \"plugin\" (an installed name), not both")
	case c.Library == "" && name == "":
		ex.Fail("library", "missing: give \"library\" (the plugin's .so) or \"plugin\" (the name of one installed in %s)", strings.Join(Dirs(), ":"))
	case name != "":
		if !nameRE.MatchString(name) {
			ex.Fail("plugin", "%q: a name is [a-z0-9_-], up to 64 characters", name)
			break
		}
		lib, err := Find(name)
		if err != nil {
			ex.Fail("plugin", "%v", err)
		}
		c.Library = lib
	}
	if err := ex.Err(); err != nil {
		return nil, err
	}
	pass := map[string]json.RawMessage{}
	for k, v := range cfg.Extra {
		pass[k] = v
	}
	for _, k := range owned {
		delete(pass, k)
	}
	js, err := json.Marshal(pass)
	if err != nil {
		return nil, fmt.Errorf("%w: plugin config: %v", l2.ErrBadConfig, err)
	}
	c.PluginJSON = js
	return Start(c, env.Logger)
}

// Dirs is the plugin search path: PathEnv's directories, or DefaultDirs.
func Dirs() []string {
	var dirs []string
	if v, ok := os.LookupEnv(PathEnv); ok {
		dirs = filepath.SplitList(v)
	} else {
		dirs = append(dirs, DefaultDirs...)
	}
	home, _ := os.UserHomeDir()
	out := dirs[:0:0]
	for _, d := range dirs {
		if strings.HasPrefix(d, "~/") && home != "" {
			d = filepath.Join(home, d[2:])
		}
		if d != "" {
			out = append(out, d)
		}
	}
	return out
}

// Find returns the path of the installed plugin name: the first
// libkvshim-l2-NAME.so in Dirs.
func Find(name string) (string, error) {
	file := "libkvshim-l2-" + name + ".so"
	dirs := Dirs()
	for _, d := range dirs {
		p := filepath.Join(d, file)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("no plugin %q: %s is in none of %s (set %s to add directories)", name, file, strings.Join(dirs, ", "), PathEnv)
}

// FindHost returns the host program: c.Host, else $KVSHIM_L2_HOST, else
// kvshim-l2-host beside the running executable, else on $PATH.
func FindHost(c Config) (string, error) {
	if c.Host != "" {
		return c.Host, nil
	}
	if v := os.Getenv(HostEnv); v != "" {
		return v, nil
	}
	tried := []string{}
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), HostName)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
		tried = append(tried, p)
	}
	if p, err := exec.LookPath(HostName); err == nil {
		return p, nil
	}
	tried = append(tried, "$PATH")
	return "", fmt.Errorf("%w: plugin: no %s (tried %s; set \"host\" or %s; `make` builds out/%s)",
		l2.ErrBadConfig, HostName, strings.Join(tried, ", "), HostEnv, HostName)
}

// Backend runs a plugin in a host process (see doc.go).
type Backend struct {
	cfg    Config
	host   string
	log    *slog.Logger
	win    *window
	stderr *hostproc.Tail
	name   string // the plugin's name, from its open reply
	nextID atomic.Uint64

	sup       hostproc.Supervisor[*proc] // the running host
	hangKills atomic.Int64
}

// Start starts the host, loads the plugin and opens it; a plugin that
// cannot be loaded, has another ABI version or refuses its config is an
// error wrapping l2.ErrBadConfig.
func Start(c Config, logger *slog.Logger) (*Backend, error) {
	if logger == nil {
		logger = slog.Default()
	}
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.OpenTimeout <= 0 {
		c.OpenTimeout = DefaultOpenTimout
	}
	if c.PluginJSON == nil {
		c.PluginJSON = []byte("{}")
	}
	lib, err := filepath.Abs(c.Library)
	if err != nil {
		return nil, fmt.Errorf("%w: key \"library\": %v", l2.ErrBadConfig, err)
	}
	if st, err := os.Stat(lib); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: key \"library\": %s is not a file", l2.ErrBadConfig, lib)
	}
	c.Library = lib
	host, err := FindHost(c)
	if err != nil {
		return nil, err
	}
	w, err := newWindow(c.Window)
	if err != nil {
		return nil, err
	}
	b := &Backend{cfg: c, host: host, log: logger, win: w, stderr: &hostproc.Tail{Max: 8 << 10, Label: "host stderr"}}
	b.sup = hostproc.Supervisor[*proc]{Name: "plugin host", Every: restartEvery, Spawn: b.spawn,
		Stop: func(p *proc) { p.Stop(time.Second) },
		OnRestart: func(cause error) {
			b.log.Warn("plugin L2: restarting the plugin host", "plugin", b.name, "cause", cause)
		}}
	p, err := b.spawn()
	if err != nil {
		w.close()
		return nil, err
	}
	b.sup.Start(p)
	logger.Info("plugin L2: opened", "plugin", b.name, "library", lib, "host", host, "abi", ABIVersion)
	return b, nil
}

// spawn starts a host and opens the plugin in it.
func (b *Backend) spawn() (*proc, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	cmd := exec.Command(b.host, b.cfg.Library)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, b.stderr
	cmd.ExtraFiles = []*os.File{b.win.f} // fd 3
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return nil, fmt.Errorf("%w: plugin: start %s: %w", l2.ErrUnavailable, b.host, err)
	}
	p := &proc{Child: hostproc.Watch(cmd, inW), stderr: b.stderr}
	go func() { p.readLoop(bufio.NewReaderSize(outR, 1<<16)); outR.Close() }()

	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.OpenTimeout)
	defer cancel()
	ch, err := p.send(b.nextID.Add(1), opOpen, nil, b.cfg.PluginJSON)
	if err != nil {
		p.Kill()
		return nil, err
	}
	var rep reply
	select {
	case rep = <-ch:
	case <-ctx.Done():
		p.Kill()
		return nil, fmt.Errorf("%w: plugin %s: open: no answer in %v", l2.ErrUnavailable, b.cfg.Library, b.cfg.OpenTimeout)
	}
	if rep.dead != nil {
		return nil, fmt.Errorf("plugin %s: open: %w", b.cfg.Library, rep.dead)
	}
	if len(rep.status) == 1 && rep.status[0] != ABIVersion {
		p.Stop(time.Second)
		return nil, fmt.Errorf("%w: %s speaks kvshim L2 plugin ABI %d; this kvshim speaks ABI %d (rebuild it: make)",
			l2.ErrBadConfig, b.host, rep.status[0], ABIVersion)
	}
	if rep.rc != stOK {
		p.Stop(time.Second)
		wrap := l2.ErrUnavailable
		if rep.rc == rcBadConf {
			wrap = l2.ErrBadConfig
		}
		return nil, fmt.Errorf("%w: plugin %s: open: %s: %s", wrap, b.cfg.Library, statusName(rep.rc), rep.msg)
	}
	b.name = rep.msg // the table's name
	if b.name == "" {
		b.name = strings.TrimSuffix(strings.TrimPrefix(filepath.Base(b.cfg.Library), "libkvshim-l2-"), ".so")
	}
	return p, nil
}

// proc returns the running host, restarting a dead one (at most once per
// restartEvery; callers in between fail fast with the death's cause).
func (b *Backend) proc() (*proc, error) { return b.sup.Get() }

// Stats are the host's restarts and the hung calls that killed one.
type Stats struct {
	Restarts  int64
	HangKills int64
}

// Stats returns the counters.
func (b *Backend) Stats() Stats {
	return Stats{Restarts: b.sup.Restarts(), HangKills: b.hangKills.Load()}
}

// Samples are the counters of Stats as the adapter exports them
// (l2.Sampler: /metrics and STATS, label adapter=<name>).
func (b *Backend) Samples() []metric.Sample {
	st := b.Stats()
	return []metric.Sample{
		{Name: "kvshim_l2_plugin_restarts_total", Counter: true, Value: float64(st.Restarts),
			Help: "Plugin host processes started again after one died (a crash, or a kill for a hung call)."},
		{Name: "kvshim_l2_plugin_hang_kills_total", Counter: true, Value: float64(st.HangKills),
			Help: "Plugin hosts killed because a call had not returned hang_grace_ms after its deadline."},
	}
}

// Pid is the running host's process id (0 when none).
func (b *Backend) Pid() int {
	if p := b.sup.Current(); p != nil {
		return p.Cmd.Process.Pid
	}
	return 0
}

// Close stops the host (stdin EOF: it waits for its calls and runs the
// plugin's close(); killed after 10 s) and unmaps the window.
func (b *Backend) Close() error {
	if p := b.sup.Close(); p != nil {
		p.Stop(10 * time.Second)
	}
	b.win.close()
	return nil
}
