package l2

import (
	"context"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/internal/metric"
)

// Backend is one storage system. The adapter calls it from lane workers,
// concurrently, with a tile (a sub-slice) of a batch; it must report a
// Result for every key of the tile through r (unreported keys are failed
// with ErrNotReported when the call returns) and honour ctx's deadline.
type Backend interface {
	// Store writes bufs[i] under keys[i]. An existing key is success
	// (objects are immutable, a key always names the same bytes).
	Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r Reporter)
	// Exists reports StatusOK for present keys, StatusMiss for absent ones.
	// Backends with server-side leases take them here.
	Exists(ctx context.Context, keys []kv.Key, r Reporter)
	// Load reads keys[i] into bufs[i] (the whole object must fit exactly:
	// otherwise StatusFailed wrapping ErrBufferSize). A corrupt object is
	// StatusMiss and must not be served again.
	Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r Reporter)
	// Delete removes keys; StatusMiss for absent ones.
	Delete(ctx context.Context, keys []kv.Key, r Reporter)
	// Close releases connections; called once, after the lanes drained.
	Close() error
}

// Releaser is implemented by backends whose holds need an explicit release.
type Releaser interface {
	Release(keys []kv.Key)
}

// DropNotifier is implemented by backends that can tell when an object
// leaves them on their own (the fs adapter's max_bytes eviction): f is
// called, from the backend's goroutine with no lock of the caller held,
// for every object dropped. Set once, before any store (KV events'
// BlockRemoved with medium "STORAGE").
type DropNotifier interface {
	OnDrop(f func(kv.Key))
}

// Tiler is implemented by backends that want batches cut differently from
// the default (one tile per lane worker, at most one per key). Mooncake's
// batch calls parallelise internally and want 1.
type Tiler interface {
	Tiles(op Op, keys, workers int) int
}

// SegmentRegistrar is implemented by backends that work on shared memory
// from another process (mooncake_store's helper) or register memory with a
// NIC: the L1 store registers each shared-memory segment (a memfd it keeps
// open, mapped at mem) once, as it creates it. Buffers inside a registered
// segment move with no copy.
type SegmentRegistrar interface {
	RegisterL1Segment(fd int, mem []byte) error
}

// Sampler is implemented by backends with numbers of their own (the fs
// adapter's evictions, Redis's OOM answers, the plugin host's restarts).
// The adapter exports them with its own numbers, in the server's one style
// (server/internal/metric): on /metrics with the const label
// adapter=<Config.Name>, and in STATS (Adapter.Samples). Samples is called
// on every scrape and STATS, from any goroutine: it reads atomics, takes no
// lock the backend's operations hold for long, and returns the same names
// and label names every time (the collector's descriptors come from its
// first call, at NewAdapter). Names are kvshim_l2_<type>_..., counters end
// in _total, and Help says what is counted.
type Sampler interface {
	Samples() []metric.Sample
}
