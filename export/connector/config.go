// Package connector holds what kvshim_open's connector roles (scheduler,
// worker, tool) are configured with and the embedded server they share:
// the JSON a handle is opened with, parsed strictly and resolved (socket,
// instance id, timeout), and the lifetime of the in-process server that
// the scheduler role starts when no external one is configured.
//
// It sits beside package export (package main) and imports what export
// may import (shim, server, ipc) plus the leaves those use (layout, objfmt,
// trace); nothing below it imports it. Its failures wrap ErrConfig, which
// the C ABI reports as KVSHIM_EINVAL, or the server's own errors.
package connector

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/shim"
)

// ErrConfig marks a handle's configuration that is not valid: not the
// expected JSON, an unknown key, or a value out of range.
var ErrConfig = errors.New("connector: invalid config")

// DefaultTimeout is Config.TimeoutMS's default.
const DefaultTimeout = 5 * time.Second

// Config is the JSON of kvshim_open for roles "scheduler", "worker" and
// "tool" (the Python connector writes it from kv_connector_extra_config).
type Config struct {
	Role      string    `json:"role"`
	Server    string    `json:"server"`    // "embedded" (or empty) or a socket path
	EngineID  string    `json:"engine_id"` // names the embedded server's socket
	Instance  string    `json:"instance"`  // uuid; generated when empty
	Namespace Namespace `json:"namespace"`
	BlockSize int       `json:"block_size"` // scheduler
	Rank      int       `json:"rank"`       // worker
	// KVRole is vLLM's kv_role (scheduler): "kv_producer" saves and never
	// loads, "kv_consumer" loads and never saves, "kv_both" (or "") both.
	KVRole    string `json:"kv_role"`
	TimeoutMS int    `json:"timeout_ms"`

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

// Namespace is the JSON of Config.Namespace.
type Namespace struct {
	Model     string `json:"model"`
	DType     string `json:"dtype"`
	Layout    string `json:"layout"`
	Format    uint32 `json:"object_format,omitempty"` // optional: this build's layout.FormatVersion
	WorldSize int    `json:"world_size"`
	TPSize    int    `json:"tp_size"`
	ChunkSize int    `json:"chunk_size"`
	KVGroup   int    `json:"kv_group"`
	MLA       bool   `json:"mla"`
	DCPSize   int    `json:"dcp_size"` // optional: vLLM's decode context parallel size
}

// Spec is the namespace spec. The object format is the one this build
// reads and writes (it belongs in the namespace, so objects of another
// format miss): a caller may state it, but only to be told it differs.
func (n Namespace) Spec() (shim.NamespaceSpec, error) {
	if n.Format != 0 && n.Format != layout.FormatVersion {
		return shim.NamespaceSpec{}, fmt.Errorf("object_format %d: this library reads and writes format %d: %w",
			n.Format, layout.FormatVersion, ErrConfig)
	}
	return shim.NamespaceSpec{Model: n.Model, DType: n.DType, LayoutFingerprint: n.Layout, ObjectFormat: layout.FormatVersion,
		WorldSize: n.WorldSize, TPSize: n.TPSize, ChunkSize: n.ChunkSize, KVGroup: n.KVGroup, MLA: n.MLA, DCPSize: n.DCPSize}, nil
}

// Resolved is what a Config resolves to before anything is opened.
type Resolved struct {
	Socket   string        // where the server listens
	Instance uuid.UUID     // Config.Instance, or a new one
	Timeout  time.Duration // Config.TimeoutMS, or DefaultTimeout
}

// Parse decodes a connector config (unknown keys refused) and resolves
// its socket, instance id and timeout.
func Parse(raw []byte) (*Config, Resolved, error) {
	c := &Config{}
	if err := decodeStrict(raw, c); err != nil {
		return nil, Resolved{}, err
	}
	r, err := c.resolve()
	if err != nil {
		return nil, Resolved{}, err
	}
	return c, r, nil
}

// Embedded reports whether the handle uses the embedded server (no
// socket path given).
func (c *Config) Embedded() bool { return c.Server == "" || c.Server == "embedded" }

var engineIDPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// EmbeddedSocket is where the embedded server of engineID listens.
func EmbeddedSocket(engineID string) (string, error) {
	if !engineIDPattern.MatchString(engineID) {
		return "", fmt.Errorf("embedded server needs an engine_id of 1-64 letters, digits, '.', '_' or '-', got %q: %w",
			engineID, ErrConfig)
	}
	return filepath.Join(ipc.DefaultSocketDir(), "embedded-"+engineID+".sock"), nil
}

func (c *Config) resolve() (r Resolved, err error) {
	r.Socket = c.Server
	if c.Embedded() {
		if r.Socket, err = EmbeddedSocket(c.EngineID); err != nil {
			return Resolved{}, err
		}
	}
	r.Instance = uuid.New()
	if c.Instance != "" {
		if r.Instance, err = uuid.Parse(c.Instance); err != nil {
			return Resolved{}, fmt.Errorf("instance %q: %w: %w", c.Instance, err, ErrConfig)
		}
	}
	if err := c.check(); err != nil {
		return Resolved{}, err
	}
	r.Timeout = DefaultTimeout
	if c.TimeoutMS > 0 {
		r.Timeout = time.Duration(c.TimeoutMS) * time.Millisecond
	}
	return r, nil
}

// check refuses a value out of range, naming its field, whoever the caller
// is: the Python connector validates kv_connector_extra_config too, but
// another engine calling the C ABI must get the same answer, not a default
// silently put in place of a negative number. 0 keeps meaning "the default".
func (c *Config) check() error {
	for _, f := range []struct {
		name string
		bad  bool
		val  any
	}{
		{"timeout_ms", c.TimeoutMS < 0, c.TimeoutMS},
		{"block_size", c.BlockSize < 0, c.BlockSize},
		{"rank", c.Rank < 0, c.Rank},
		{"l1_size_gb", c.L1SizeGB < 0 || c.L1SizeGB != c.L1SizeGB, c.L1SizeGB},
		{"hold_ttl_s", c.HoldTTLS < 0 || c.HoldTTLS != c.HoldTTLS, c.HoldTTLS},
		{"l1_prefault_gb", c.L1PrefaultGB != nil && (*c.L1PrefaultGB < 0 || *c.L1PrefaultGB != *c.L1PrefaultGB), c.L1PrefaultGB},
		{"metrics_port", c.MetricsPort < 0 || c.MetricsPort > 65535, c.MetricsPort},
	} {
		if f.bad {
			if p, ok := f.val.(*float64); ok {
				f.val = *p
			}
			return fmt.Errorf("%s %v is out of range: %w", f.name, f.val, ErrConfig)
		}
	}
	// Keys only one role uses are checked for every role too: a bad value
	// is an error wherever it is given, never ignored because this role
	// does not read it.
	if _, err := objfmt.ParseVerifyPolicy(c.Verify); err != nil {
		return fmt.Errorf("%w: %w", err, ErrConfig) // names verify
	}
	if _, err := shim.ParseRole(c.KVRole); err != nil {
		return fmt.Errorf("%w: %w", err, ErrConfig) // names kv_role
	}
	if _, err := c.Namespace.Spec(); err != nil {
		return fmt.Errorf("namespace: %w", err)
	}
	sc := c.ServerConfig("")
	if err := sc.Validate(); err != nil { // l1_size_gb, l1_prefault_gb, hold_ttl_s, l2_adapters
		return fmt.Errorf("the embedded server's settings: %w: %w", err, ErrConfig)
	}
	return nil
}

func decodeStrict(raw []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("config: %w: %w", err, ErrConfig)
	}
	return nil
}
