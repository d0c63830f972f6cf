package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/shim"
	"github.com/kvshim/kvshim/trace"
)

// connectorConfig is the JSON of kvshim_open for roles "scheduler" and
// "worker" (the Python connector writes it from kv_connector_extra_config).
type connectorConfig struct {
	Role      string        `json:"role"`
	Server    string        `json:"server"`    // "embedded" or a socket path
	EngineID  string        `json:"engine_id"` // names the embedded server's socket
	Instance  string        `json:"instance"`  // uuid; generated when empty
	Namespace namespaceJSON `json:"namespace"`
	BlockSize int           `json:"block_size"` // scheduler
	Rank      int           `json:"rank"`       // worker
	TimeoutMS int           `json:"timeout_ms"`

	// Verify is kvshim.verify (worker role): "l2" (default), "always" or
	// "off" (objfmt.ParseVerifyPolicy).
	Verify string `json:"verify"`

	// TraceDir is kvshim.trace_dir: lifecycle records (package trace) of
	// the worker and of the embedded server go there ("": off).
	TraceDir string `json:"trace_dir"`

	// The embedded server's settings (scheduler role only).
	L1SizeGB   float64  `json:"l1_size_gb"`
	HoldTTLS   float64  `json:"hold_ttl_s"`
	L2Adapters []string `json:"l2_adapters"` // one --l2-adapter JSON each
	// The embedded server's --l1-prefault-gb (server.Config.L1PrefaultGB):
	// absent, the default; 0, lazy L1.
	L1PrefaultGB *float64 `json:"l1_prefault_gb"`
	// MetricsPort is kvshim.metrics_port: the embedded server serves
	// /metrics and /healthz on 127.0.0.1:PORT (0: off), as `kvshim serve
	// --metrics-port` does.
	MetricsPort int `json:"metrics_port"`
}

type namespaceJSON struct {
	Model     string `json:"model"`
	DType     string `json:"dtype"`
	Layout    string `json:"layout"`
	Format    uint32 `json:"object_format"` // optional: this build's layout.FormatVersion
	WorldSize int    `json:"world_size"`
	TPSize    int    `json:"tp_size"`
	ChunkSize int    `json:"chunk_size"`
	KVGroup   int    `json:"kv_group"`
	MLA       bool   `json:"mla"`
}

// spec is the namespace spec. The object format is the one this build
// reads and writes (it belongs in the namespace, so objects of another
// format miss): a caller may state it, but only to be told it differs.
func (n namespaceJSON) spec() (shim.NamespaceSpec, error) {
	if n.Format != 0 && n.Format != layout.FormatVersion {
		return shim.NamespaceSpec{}, fmt.Errorf("object_format %d: this library reads and writes format %d: %w", n.Format, layout.FormatVersion, errInvalid)
	}
	return shim.NamespaceSpec{Model: n.Model, DType: n.DType, LayoutFingerprint: n.Layout, ObjectFormat: layout.FormatVersion,
		WorldSize: n.WorldSize, TPSize: n.TPSize, ChunkSize: n.ChunkSize, KVGroup: n.KVGroup, MLA: n.MLA}, nil
}

func decodeStrict(raw []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("config: %v: %w", err, errInvalid)
	}
	return nil
}

var engineIDPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// socketOf resolves where the server listens.
func (c *connectorConfig) socketOf() (string, error) {
	if c.Server != "" && c.Server != "embedded" {
		return c.Server, nil
	}
	if !engineIDPattern.MatchString(c.EngineID) {
		return "", fmt.Errorf("embedded server needs an engine_id of 1-64 letters, digits, '.', '_' or '-', got %q: %w", c.EngineID, errInvalid)
	}
	return filepath.Join(ipc.DefaultSocketDir(), "embedded-"+c.EngineID+".sock"), nil
}

// parseConnector decodes a scheduler, worker or tool config (unknown keys
// refused) and resolves its socket, instance id and timeout.
func parseConnector(raw []byte) (c *connectorConfig, socket string, inst uuid.UUID, timeout time.Duration, err error) {
	c = &connectorConfig{}
	if err = decodeStrict(raw, c); err != nil {
		return
	}
	socket, inst, timeout, err = c.common()
	return
}

func (c *connectorConfig) common() (socket string, inst uuid.UUID, timeout time.Duration, err error) {
	if socket, err = c.socketOf(); err != nil {
		return
	}
	inst = uuid.New()
	if c.Instance != "" {
		if inst, err = uuid.Parse(c.Instance); err != nil {
			return "", inst, 0, fmt.Errorf("instance %q: %v: %w", c.Instance, err, errInvalid)
		}
	}
	timeout = 5 * time.Second
	if c.TimeoutMS < 0 {
		return "", inst, 0, fmt.Errorf("timeout_ms %d is negative: %w", c.TimeoutMS, errInvalid)
	}
	if c.TimeoutMS > 0 {
		timeout = time.Duration(c.TimeoutMS) * time.Millisecond
	}
	return socket, inst, timeout, nil
}

// embedded servers by socket path, shared by the handles of one process and
// stopped when the last of them closes.
var embedded struct {
	mu sync.Mutex
	m  map[string]*embeddedServer
}

type embeddedServer struct {
	srv     *server.Server
	trace   *trace.Writer         // nil: off
	metrics *server.MetricsServer // nil: off
	refs    int
}

func acquireEmbedded(socket string, cfg *connectorConfig) (release func() error, err error) {
	embedded.mu.Lock()
	defer embedded.mu.Unlock()
	if embedded.m == nil {
		embedded.m = map[string]*embeddedServer{}
	}
	e := embedded.m[socket]
	if e == nil {
		sc := server.DefaultConfig()
		sc.Socket = socket
		if cfg.L1SizeGB > 0 {
			sc.L1SizeGB = cfg.L1SizeGB
		}
		if cfg.L1PrefaultGB != nil {
			sc.L1PrefaultGB = *cfg.L1PrefaultGB
		}
		if cfg.HoldTTLS > 0 {
			sc.HoldTTL = time.Duration(cfg.HoldTTLS * float64(time.Second))
		}
		sc.L2Adapters = cfg.L2Adapters
		sc.MetricsPort = cfg.MetricsPort
		if err := ipc.EnsureSocketDir(filepath.Dir(socket)); err != nil {
			return nil, err
		}
		srv, err := server.Start(sc, nil, server.Options{})
		if err != nil {
			return nil, fmt.Errorf("embedded server: %w", err)
		}
		e = &embeddedServer{srv: srv}
		if cfg.TraceDir != "" {
			if e.trace, err = trace.Open(cfg.TraceDir, trace.Options{Source: "server"}); err != nil {
				srv.Close()
				return nil, fmt.Errorf("kvshim.trace_dir: %w", err)
			}
			srv.Core.SetTrace(e.trace)
		}
		if sc.MetricsPort != 0 {
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(sc.MetricsPort)))
			if err != nil {
				srv.Close()
				e.trace.Close()
				return nil, fmt.Errorf("kvshim.metrics_port: %w", err)
			}
			e.metrics = srv.Core.ServeMetrics(ln, server.BuildInfo{Version: version, ABI: abiVersion})
		}
		embedded.m[socket] = e
	}
	e.refs++
	return func() error {
		embedded.mu.Lock()
		defer embedded.mu.Unlock()
		if e.refs--; e.refs > 0 {
			return nil
		}
		delete(embedded.m, socket)
		return errors.Join(e.metrics.Close(), e.srv.Close(), e.trace.Close())
	}, nil
}

func init() {
	openers["scheduler"] = openScheduler
	openers["worker"] = openWorker
	codeMappers = append(codeMappers, func(err error) int {
		switch {
		case errors.Is(err, shim.ErrUnavailable):
			return codeIO
		case errors.Is(err, shim.ErrBadMeta), errors.Is(err, shim.ErrBadChunkSize), errors.Is(err, shim.ErrBadExtras),
			errors.Is(err, shim.ErrBadNamespaceSpec), errors.Is(err, server.ErrConfig):
			return codeInval
		}
		return 0
	})
}

func openScheduler(in *instance, raw []byte) error {
	cfg, socket, inst, timeout, err := parseConnector(raw)
	if err != nil {
		return err
	}
	ns, err := cfg.Namespace.spec()
	if err != nil {
		return err
	}
	if cfg.Server == "" || cfg.Server == "embedded" {
		release, err := acquireEmbedded(socket, cfg)
		if err != nil {
			return err
		}
		in.closers = append(in.closers, release)
	}
	s, err := shim.NewScheduler(shim.SchedulerConfig{Socket: socket, Namespace: ns, BlockSize: cfg.BlockSize,
		Timeout: timeout, Instance: inst})
	if err != nil {
		return fmt.Errorf("%v: %w", err, errInvalid)
	}
	if cfg.TraceDir != "" {
		tw, err := trace.Open(cfg.TraceDir, trace.Options{Source: "scheduler"})
		if err != nil {
			s.Close()
			return fmt.Errorf("kvshim.trace_dir: %w", err)
		}
		s.SetTrace(tw)
		in.closers = append(in.closers, tw.Close) // closers run in reverse: after s.Close
	}
	in.state = s
	in.closers = append(in.closers, s.Close)
	return nil
}

func openWorker(in *instance, raw []byte) error {
	cfg, socket, inst, timeout, err := parseConnector(raw)
	if err != nil {
		return err
	}
	ns, err := cfg.Namespace.spec()
	if err != nil {
		return err
	}
	verify, err := objfmt.ParseVerifyPolicy(cfg.Verify)
	if err != nil {
		return fmt.Errorf("%v: %w", err, errInvalid)
	}
	w, err := shim.NewWorker(shim.WorkerConfig{Socket: socket, Namespace: ns, Rank: cfg.Rank,
		Timeout: timeout, Instance: inst, Verify: verify})
	if err != nil {
		return fmt.Errorf("%v: %w", err, errInvalid)
	}
	if err := w.OpenTrace(cfg.TraceDir); err != nil {
		w.Close()
		return fmt.Errorf("kvshim.trace_dir: %w", err)
	}
	in.state = &workerState{w: w}
	in.closers = append(in.closers, w.CloseTrace, w.Close) // run in reverse: the trace closes last
	return nil
}

// workerState is a worker handle: the worker and the metadata bound for
// the current step.
type workerState struct {
	w     *shim.Worker
	mu    sync.Mutex
	bound *shim.StepMeta
}
