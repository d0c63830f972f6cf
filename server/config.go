package server

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvshim/kvshim/server/l1"
	"github.com/kvshim/kvshim/server/l2"
	_ "github.com/kvshim/kvshim/server/l2/adapters" // fs, redis, mooncake_store, s3, plugin
	"github.com/kvshim/kvshim/server/tier"
)

// GiB is 1<<30 bytes.
const GiB = 1 << 30

// Config is the server's configuration. The standalone `kvshim serve`
// command maps its flags onto it one to one:
//
//	--l1-size-gb N           L1SizeGB
//	--l1-prefault-gb N       L1PrefaultGB   (L1 created, faulted in and announced
//	                         ahead of use; 0: lazy growth only)
//	--eviction-policy LRU    EvictionPolicy (only "LRU")
//	--l1-high-watermark F    HighWatermark  (fraction of L1, eviction starts above)
//	--l1-low-watermark F     LowWatermark   (fraction of L1, eviction stops at)
//	--hold-ttl D             HoldTTL        (last-resort reclaim of forgotten holds)
//	--socket PATH            Socket
//	--metrics-port P         MetricsPort    (0: no metrics listener)
//	--l2-adapter JSON        L2Adapters     (repeatable, LMCache's format, e.g.
//	                         '{"type":"fs","base_path":"/mnt/kv","num_workers":4}')
//	--l2-store-policy P      L2StorePolicy  ("all" = default, "none")
//	--l2-store-after-lookups N L2StoreAfterLookups (0 = write-through at commit; N: after N lookups found it)
//	--l2-prefetch-budget-gb F L2PrefetchBudgetGB (0: a quarter of L1)
//	--l2-prefetch-timeout D  L2PrefetchTimeout  (0: 5 s)
//	--l2-admission-wait D    L2AdmissionWait    (0: 1 s; negative: never wait)
//	--l2-prefetch-retain     L2PrefetchRetain   (loaded objects stay resident)
//	--l2-store-max-inflight-gb F L2StoreMaxInflightGB (0: a quarter of L1)
//	--max-lookups-per-session N  MaxLookupsPerSession (0: 4096)
//	--max-lookup-cells-per-session N MaxLookupCellsPerSession (0: 1048576)
//
// Fields below the line have no flag; zero means "default".
type Config struct {
	L1SizeGB       float64
	EvictionPolicy string
	HighWatermark  float64
	LowWatermark   float64
	HoldTTL        time.Duration
	Socket         string
	MetricsPort    int
	// L1PrefaultGB is how much L1 the memfd server (Start) keeps created,
	// faulted in and announced to clients ahead of use: at start-up it
	// creates that many GiB of segments in the background, and whenever
	// the free part of what exists falls below it, the next segment. It is
	// rounded up to whole segments and capped at L1SizeGB (L1 never grows
	// past it). 0 keeps L1 lazy: a segment is created, unfaulted, by the
	// ALLOC that finds no space (which stays the last resort either way).
	// DefaultConfig: DefaultL1PrefaultGB.
	L1PrefaultGB float64

	// L2 tier (package tier). With no adapter the server is L1 only.
	L2Adapters           []string
	L2StorePolicy        string
	L2StoreAfterLookups  int // 0: write-through; N > 0: write an object once N lookups found it (admit.go)
	L2PrefetchBudgetGB   float64
	L2PrefetchTimeout    time.Duration
	L2AdmissionWait      time.Duration
	L2PrefetchRetain     bool
	L2StoreMaxInflightGB float64

	// Lookup limits: what one session's live lookups (registered, not
	// yet forgotten) may make the server hold; a LOOKUP past either is
	// refused with ErrLookupLimit (StatusBadRequest: the client's miss).
	// MaxLookupsPerSession bounds their number (default 4096: a vLLM
	// scheduler has one live lookup per waiting request it has looked up,
	// a few thousand at most). MaxLookupCellsPerSession bounds their hold
	// tables, chunks × readers summed over them (default 1Mi = MaxLookupCells,
	// so any one valid lookup fits an idle session: e.g. 256 prompts of
	// 128K tokens at TP 8, or 16 of the largest 65,536-chunk lookups at
	// TP 1). A lookup costs at most 512 bytes plus 61 per cell, so the
	// defaults bound a session's lookups to 64 MiB (doc.go).
	MaxLookupsPerSession     int
	MaxLookupCellsPerSession int
	// MaxSessionsPerUID bounds one uid's live sessions (default
	// ipc.DefaultMaxSessionsPerUID); past it a hello is refused.
	MaxSessionsPerUID int

	// SegmentSize is the size of one L1 shared segment (default 1 GiB, or
	// the whole L1 when smaller). It bounds the largest object.
	SegmentSize uint64
	// SlabSize is the target size of one slab (default 64 MiB).
	SlabSize uint64
	// StagingTTL reclaims staging space a live writer never committed or
	// aborted (default: HoldTTL).
	StagingTTL time.Duration
	// ReapInterval is how often expired holds and staging are reclaimed
	// (default: a quarter of the shorter TTL, at most one minute).
	ReapInterval time.Duration
	// MaxWorldSize bounds LookupReq.WorldSize (default 1024).
	MaxWorldSize uint32
}

// Defaults.
const (
	DefaultL1SizeGB             = 16
	DefaultHighWatermark        = 0.95
	DefaultLowWatermark         = 0.85
	DefaultHoldTTL              = 30 * time.Minute
	DefaultSegmentSize          = 1 * GiB
	DefaultSlabSize             = 64 << 20
	DefaultMaxWorldSize         = 1024
	DefaultMaxLookupsPerSession = 4096
	// DefaultMaxLookupCellsPerSession is MaxLookupCells: the largest
	// single lookup fits a session that holds nothing else.
	DefaultMaxLookupCellsPerSession = MaxLookupCells
	// DefaultL1PrefaultGB is DefaultConfig's L1PrefaultGB: 4 GiB, about
	// four requests' saves of an 8K-token Llama-3-8B prefix (1.1 GB each),
	// created in the background at 0.17-0.39 s of one core per GiB.
	DefaultL1PrefaultGB = 4
	// MaxL1SizeGB bounds --l1-size-gb (64 TiB).
	MaxL1SizeGB = 1 << 16
)

// DefaultConfig returns the defaults (socket and metrics port unset).
func DefaultConfig() Config {
	return Config{
		L1SizeGB:       DefaultL1SizeGB,
		L1PrefaultGB:   DefaultL1PrefaultGB,
		EvictionPolicy: "LRU",
		HighWatermark:  DefaultHighWatermark,
		LowWatermark:   DefaultLowWatermark,
		HoldTTL:        DefaultHoldTTL,
	}
}

// Validate checks c and returns every problem found, each wrapping ErrConfig.
func (c *Config) Validate() error {
	var errs []string
	add := func(f string, a ...any) { errs = append(errs, fmt.Sprintf(f, a...)) }
	if !(c.L1SizeGB > 0) || c.L1SizeGB > MaxL1SizeGB {
		add("--l1-size-gb must be > 0 and <= %d, got %v", MaxL1SizeGB, c.L1SizeGB)
	} else if c.capacity() < l1.PageSize {
		add("--l1-size-gb %v is smaller than one 4 KiB page", c.L1SizeGB)
	}
	if !(c.L1PrefaultGB >= 0) || c.L1PrefaultGB > MaxL1SizeGB {
		add("--l1-prefault-gb must be >= 0 and <= %d, got %v", MaxL1SizeGB, c.L1PrefaultGB)
	}
	if !strings.EqualFold(c.EvictionPolicy, "LRU") {
		add("--eviction-policy %q is not supported (only LRU)", c.EvictionPolicy)
	}
	if !(c.HighWatermark > 0 && c.HighWatermark <= 1) {
		add("--l1-high-watermark must be in (0, 1], got %v", c.HighWatermark)
	}
	if !(c.LowWatermark >= 0 && c.LowWatermark < 1) {
		add("--l1-low-watermark must be in [0, 1), got %v", c.LowWatermark)
	} else if c.LowWatermark >= c.HighWatermark {
		add("--l1-low-watermark (%v) must be below --l1-high-watermark (%v)", c.LowWatermark, c.HighWatermark)
	}
	if c.HoldTTL <= 0 {
		add("--hold-ttl must be > 0, got %v", c.HoldTTL)
	}
	if c.MetricsPort < 0 || c.MetricsPort > 65535 {
		add("--metrics-port must be in [0, 65535], got %d", c.MetricsPort)
	}
	if c.SegmentSize != 0 && c.SegmentSize%l1.PageSize != 0 {
		add("segment size %d is not a multiple of 4 KiB", c.SegmentSize)
	}
	if c.SlabSize != 0 && c.SlabSize%l1.PageSize != 0 {
		add("slab size %d is not a multiple of 4 KiB", c.SlabSize)
	}
	if c.StagingTTL < 0 || c.ReapInterval < 0 {
		add("staging TTL and reap interval must not be negative")
	}
	if c.MaxLookupsPerSession < 0 {
		add("--max-lookups-per-session must not be negative, got %d", c.MaxLookupsPerSession)
	}
	if c.MaxSessionsPerUID < 0 {
		add("--max-sessions-per-uid must not be negative, got %d", c.MaxSessionsPerUID)
	}
	if c.MaxLookupCellsPerSession < 0 {
		add("--max-lookup-cells-per-session must not be negative, got %d", c.MaxLookupCellsPerSession)
	}
	errs = append(errs, c.validateL2()...)
	if len(errs) > 0 {
		return fmt.Errorf("%w: %s", ErrConfig, strings.Join(errs, "; "))
	}
	return nil
}

// validateL2 checks the L2 settings: each --l2-adapter is parsed (a bad
// one names the offending key) and its type must be registered; names
// (metrics labels) must be unique.
func (c *Config) validateL2() []string {
	var errs []string
	names := map[string]int{}
	types := l2.Types()
	for i, raw := range c.L2Adapters {
		ac, err := l2.ParseAdapterConfig(raw)
		if err != nil {
			errs = append(errs, fmt.Sprintf("--l2-adapter #%d: %v", i+1, err))
			continue
		}
		if !slices.Contains(types, ac.Type) {
			errs = append(errs, fmt.Sprintf("--l2-adapter #%d: key \"type\": %q is not a registered adapter type %v", i+1, ac.Type, types))
		}
		if j, dup := names[ac.Name]; dup {
			errs = append(errs, fmt.Sprintf("--l2-adapter #%d: key \"name\": %q is already adapter #%d's name (set \"name\" to tell them apart)", i+1, ac.Name, j))
		}
		names[ac.Name] = i + 1
	}
	if len(c.L2Adapters) > 64 {
		errs = append(errs, fmt.Sprintf("at most 64 --l2-adapter, got %d", len(c.L2Adapters)))
	}
	if c.L2StoreAfterLookups < 0 {
		errs = append(errs, fmt.Sprintf("--l2-store-after-lookups must be >= 0 (0: write-through), got %d", c.L2StoreAfterLookups))
	}
	if _, err := tier.ParseStorePolicy(c.L2StorePolicy); err != nil {
		errs = append(errs, fmt.Sprintf("--l2-store-policy: %v", err))
	}
	if c.L2PrefetchBudgetGB < 0 || (c.L2PrefetchBudgetGB > c.L1SizeGB && c.L1SizeGB > 0) {
		errs = append(errs, fmt.Sprintf("--l2-prefetch-budget-gb must be in [0, --l1-size-gb], got %v", c.L2PrefetchBudgetGB))
	}
	if c.L2StoreMaxInflightGB < 0 || (c.L2StoreMaxInflightGB > c.L1SizeGB && c.L1SizeGB > 0) {
		errs = append(errs, fmt.Sprintf("--l2-store-max-inflight-gb must be in [0, --l1-size-gb], got %v", c.L2StoreMaxInflightGB))
	}
	if c.L2PrefetchTimeout < 0 {
		errs = append(errs, fmt.Sprintf("--l2-prefetch-timeout must not be negative, got %v", c.L2PrefetchTimeout))
	}
	return errs
}

// l2Budgets are the prefetch admission budget and the writer's
// pinned-bytes cap, in bytes (default: a quarter of L1 each).
func (c *Config) l2Budgets() (prefetch, store uint64) {
	capacity := c.capacity()
	prefetch, store = capacity/4, capacity/4
	if c.L2PrefetchBudgetGB > 0 {
		prefetch = uint64(c.L2PrefetchBudgetGB * GiB)
	}
	if c.L2StoreMaxInflightGB > 0 {
		store = uint64(c.L2StoreMaxInflightGB * GiB)
	}
	return max(prefetch, l1.PageSize), max(store, l1.PageSize)
}

// prefaultBytes is L1PrefaultGB in bytes, at most the L1 size (0: lazy).
func (c *Config) prefaultBytes() uint64 {
	return min(l1.RoundPage(uint64(c.L1PrefaultGB*GiB)), c.capacity())
}

// capacity is the L1 size in bytes, rounded down to a page.
func (c *Config) capacity() uint64 {
	return uint64(c.L1SizeGB*GiB) &^ (l1.PageSize - 1)
}

// withDefaults fills the fields below the line.
func (c Config) withDefaults() Config {
	capacity := c.capacity()
	if c.SegmentSize == 0 {
		c.SegmentSize = DefaultSegmentSize
	}
	if c.SegmentSize > capacity {
		c.SegmentSize = capacity
	}
	if c.SlabSize == 0 {
		c.SlabSize = DefaultSlabSize
	}
	if c.SlabSize > c.SegmentSize {
		c.SlabSize = c.SegmentSize
	}
	if c.StagingTTL == 0 {
		c.StagingTTL = c.HoldTTL
	}
	if c.ReapInterval == 0 {
		c.ReapInterval = min(c.HoldTTL, c.StagingTTL) / 4
		c.ReapInterval = max(min(c.ReapInterval, time.Minute), time.Millisecond)
	}
	if c.MaxWorldSize == 0 {
		c.MaxWorldSize = DefaultMaxWorldSize
	}
	if c.MaxLookupsPerSession == 0 {
		c.MaxLookupsPerSession = DefaultMaxLookupsPerSession
	}
	if c.MaxLookupCellsPerSession == 0 {
		c.MaxLookupCellsPerSession = DefaultMaxLookupCellsPerSession
	}
	return c
}
