package l2

import (
	"fmt"
	"log/slog"
	"sort"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Env is what a factory gets besides the config.
type Env struct {
	Lanes  LaneConfig
	Logger *slog.Logger
}

// Factory builds a backend from its config. It reads its own keys with
// cfg.Extras() and refuses a bad config with ErrBadConfig naming the key.
type Factory func(cfg *Config, env Env) (Backend, error)

var (
	regMu     sync.RWMutex
	factories = map[string]Factory{}
)

// Register adds an adapter type; backend packages call it from init.
// Registering a type twice panics.
func Register(typ string, f Factory) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := factories[typ]; dup {
		panic("l2: adapter type registered twice: " + typ)
	}
	factories[typ] = f
}

// Types lists the registered adapter types.
func Types() []string {
	regMu.RLock()
	defer regMu.RUnlock()
	t := make([]string, 0, len(factories))
	for k := range factories {
		t = append(t, k)
	}
	sort.Strings(t)
	return t
}

// Options are the process-side inputs of Open.
type Options struct {
	// Registerer receives the adapter's metrics (a private registry); nil
	// means no metrics are registered.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Open builds the adapter named by cfg.Type.
func Open(cfg *Config, opts Options) (*Adapter, error) {
	regMu.RLock()
	f, ok := factories[cfg.Type]
	regMu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: key \"type\": %q (registered: %v)", ErrUnknownType, cfg.Type, Types())
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.Default()
	}
	logger = logger.With("l2", cfg.Name)
	b, err := f(cfg, Env{Lanes: cfg.Lanes, Logger: logger})
	if err != nil {
		return nil, fmt.Errorf("l2: open %s adapter %q: %w", cfg.Type, cfg.Name, err)
	}
	a, err := NewAdapter(b, cfg, opts.Registerer, logger)
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	return a, nil
}

// OpenJSON parses s with ParseAdapterConfig and opens it.
func OpenJSON(s string, opts Options) (*Adapter, error) {
	cfg, err := ParseAdapterConfig(s)
	if err != nil {
		return nil, err
	}
	return Open(cfg, opts)
}
