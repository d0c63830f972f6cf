package serverbench

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server"
	"golang.org/x/sys/unix"
)

// Options sizes a run; zero fields take the defaults.
type Options struct {
	Chunks       int           // lookup chunks (default 512)
	Ranks        int           // world size (default 8)
	Background   int           // other resident objects in the table (default 100,000)
	LookupIters  int           // timed lookups (default 2,000)
	AllocBatch   int           // keys per ALLOC (default 256)
	AllocObjects int           // objects stored for the throughput figure (default 200,000)
	MetaObjects  int           // objects for the metadata figure (default 500,000)
	MaxDuration  time.Duration // stop a phase early past this (default 20 s)
}

// Result is the JSON line a benchmark program prints.
type Result struct {
	Lookup4096KeysServerUs    float64 `json:"lookup_4096_keys_server_us"` // median LOOKUP (registration + holds)
	Lookup4096KeysServerP99Us float64 `json:"lookup_4096_keys_server_p99_us"`
	Lookup4096KeysServerMinUs float64 `json:"lookup_4096_keys_server_min_us"`
	Lookup4096KeysServerCPUUs float64 `json:"lookup_4096_keys_server_thread_cpu_us"` // median thread CPU time: robust on a shared machine
	LookupCycleUs             float64 `json:"lookup_cycle_us"`                       // LOOKUP + RESULT + FREE, median
	LookupKeys                int     `json:"lookup_keys"`
	AllocCommitObjectsPerS    float64 `json:"alloc_commit_objects_per_s"`
	MetadataBytesPerObject    float64 `json:"metadata_bytes_per_object"`
	BytesLeakedAfterClear     uint64  `json:"bytes_leaked_after_clear"`
	GoMaxProcs                int     `json:"gomaxprocs"`
}

func (o *Options) defaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.Chunks, 512)
	def(&o.Ranks, 8)
	def(&o.Background, 100_000)
	def(&o.LookupIters, 2000)
	def(&o.AllocBatch, 256)
	def(&o.AllocObjects, 200_000)
	def(&o.MetaObjects, 500_000)
	if o.MaxDuration <= 0 {
		o.MaxDuration = 20 * time.Second
	}
}

// MmapSource is a SegmentSource of anonymous private mappings.
type MmapSource struct {
	mu   sync.Mutex
	maps [][]byte
}

// NewSegment maps size bytes with MAP_NORESERVE.
func (m *MmapSource) NewSegment(id uint32, size uint64) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("mmap segment %d: %w", id, err)
	}
	m.mu.Lock()
	m.maps = append(m.maps, b)
	m.mu.Unlock()
	return b, nil
}

// Close unmaps everything.
func (m *MmapSource) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, b := range m.maps {
		errs = append(errs, unix.Munmap(b))
	}
	m.maps = nil
	return errors.Join(errs...)
}

func hashOf(seed string, i int) kv.Hash {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(i))
	return sha256.Sum256(append([]byte(seed), b[:]...))
}

func newCore(gib float64) (*server.Core, *server.Session, error) {
	cfg := server.DefaultConfig()
	cfg.L1SizeGB = gib
	cfg.HighWatermark, cfg.LowWatermark = 0.95, 0.9
	st, err := server.NewCore(cfg, server.Options{Source: &MmapSource{}})
	if err != nil {
		return nil, nil, err
	}
	s, err := st.OpenSession(kv.Tag{0xbe})
	if err != nil {
		st.Close()
		return nil, nil, err
	}
	return st, s, nil
}

// put stores hashes under rank (ALLOC + COMMIT), batch at a time.
func put(st *server.Core, s *server.Session, rank uint32, hs []kv.Hash, size uint64, batch int) error {
	sizes := make([]uint64, batch)
	for i := range sizes {
		sizes[i] = size
	}
	for i := 0; i < len(hs); i += batch {
		b := hs[i:min(i+batch, len(hs))]
		r, err := st.Alloc(s, &ipc.AllocReq{Tag: kv.Tag{1}, Rank: rank, Hashes: b, Sizes: sizes[:len(b)]})
		if err != nil {
			return err
		}
		for _, x := range r.Status {
			if x != ipc.StatusOK && x != ipc.StatusResident {
				return fmt.Errorf("alloc status %d", x)
			}
		}
		if _, err := st.Commit(s, &ipc.CommitReq{Tag: kv.Tag{1}, Rank: rank, Hashes: b}); err != nil {
			return err
		}
	}
	return nil
}

// threadCPU is this OS thread's CPU time.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// Run measures everything and returns the result.
func Run(o Options) (*Result, error) {
	o.defaults()
	res := &Result{GoMaxProcs: runtime.GOMAXPROCS(0), LookupKeys: o.Chunks * o.Ranks}
	if err := lookupBench(o, res); err != nil {
		return nil, fmt.Errorf("lookup: %w", err)
	}
	if err := allocBench(o, res); err != nil {
		return nil, fmt.Errorf("alloc: %w", err)
	}
	if err := metaBench(o, res); err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	return res, nil
}

func lookupSetup(o Options) (*server.Core, *server.Session, []kv.Hash, error) {
	const size = 64 << 10
	total := o.Chunks*o.Ranks + o.Background
	st, s, err := newCore(float64(total)*size/server.GiB*1.2 + 1)
	if err != nil {
		return nil, nil, nil, err
	}
	bg := make([]kv.Hash, o.Background)
	for i := range bg {
		bg[i] = hashOf("bg", i)
	}
	// Background objects spread over the ranks, like a real table.
	per := (len(bg) + o.Ranks - 1) / o.Ranks
	for r := 0; r*per < len(bg); r++ {
		if err := put(st, s, uint32(r), bg[r*per:min((r+1)*per, len(bg))], size, 1024); err != nil {
			st.Close()
			return nil, nil, nil, err
		}
	}
	hs := make([]kv.Hash, o.Chunks)
	for i := range hs {
		hs[i] = hashOf("prompt", i)
	}
	for r := range o.Ranks {
		if err := put(st, s, uint32(r), hs, size, 1024); err != nil {
			st.Close()
			return nil, nil, nil, err
		}
	}
	return st, s, hs, nil
}

// lookupOnce runs LOOKUP + LOOKUP_RESULT + FREE for lookup id.
func lookupOnce(st *server.Core, s *server.Session, hs []kv.Hash, ranks int, id uint64) error {
	if err := st.Lookup(s, &ipc.LookupReq{LookupID: id, WorldSize: uint32(ranks), Hashes: hs}); err != nil {
		return err
	}
	r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: id})
	if err != nil {
		return err
	}
	if r.Chunks != uint32(len(hs)) {
		return fmt.Errorf("lookup found %d of %d chunks", r.Chunks, len(hs))
	}
	return st.Free(s, &ipc.FreeReq{LookupID: id, End: ^uint32(0)})
}

func lookupBench(o Options, res *Result) error {
	st, s, hs, err := lookupSetup(o)
	if err != nil {
		return err
	}
	defer st.Close()
	var lat, cyc, cpu []time.Duration
	deadline := time.Now().Add(o.MaxDuration)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for i := range o.LookupIters {
		c0 := threadCPU()
		t0 := time.Now()
		if err := st.Lookup(s, &ipc.LookupReq{LookupID: uint64(i), WorldSize: uint32(o.Ranks), Hashes: hs}); err != nil {
			return err
		}
		t1 := time.Now()
		cpu = append(cpu, threadCPU()-c0)
		r, err := st.LookupResult(s, &ipc.LookupResultReq{LookupID: uint64(i)})
		if err != nil {
			return err
		}
		if r.Chunks != uint32(o.Chunks) {
			return fmt.Errorf("lookup found %d of %d chunks", r.Chunks, o.Chunks)
		}
		if err := st.Free(s, &ipc.FreeReq{LookupID: uint64(i), End: ^uint32(0)}); err != nil {
			return err
		}
		lat = append(lat, t1.Sub(t0))
		cyc = append(cyc, time.Since(t0))
		if time.Now().After(deadline) {
			break
		}
	}
	slices.Sort(lat)
	slices.Sort(cyc)
	slices.Sort(cpu)
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	res.Lookup4096KeysServerUs = us(lat[len(lat)/2])
	res.Lookup4096KeysServerP99Us = us(lat[len(lat)*99/100])
	res.LookupCycleUs = us(cyc[len(cyc)/2])
	res.Lookup4096KeysServerMinUs = us(lat[0])
	res.Lookup4096KeysServerCPUUs = us(cpu[len(cpu)/2])
	return nil
}

func allocBench(o Options, res *Result) error {
	const size = 64 << 10
	// L1 holds a quarter of the objects: steady state evicts.
	st, s, err := newCore(float64(o.AllocObjects) * size / 4 / server.GiB)
	if err != nil {
		return err
	}
	hs := make([]kv.Hash, o.AllocObjects)
	for i := range hs {
		hs[i] = hashOf("alloc", i)
	}
	deadline := time.Now().Add(o.MaxDuration)
	t0 := time.Now()
	n := 0
	for n < len(hs) && time.Now().Before(deadline) {
		end := min(n+o.AllocBatch*16, len(hs))
		if err := put(st, s, 0, hs[n:end], size, o.AllocBatch); err != nil {
			return err
		}
		n = end
	}
	res.AllocCommitObjectsPerS = float64(n) / time.Since(t0).Seconds()
	// Leak check: everything unheld cleared, nothing may remain.
	st.CloseSession(s)
	s2, err := st.OpenSession(kv.Tag{0xbf})
	if err != nil {
		return err
	}
	if _, err := st.Clear(s2); err != nil {
		return err
	}
	for _, name := range []string{"kvshim_l1_used_bytes", "kvshim_l1_slab_bytes"} {
		v, _ := st.Stat(name)
		res.BytesLeakedAfterClear += uint64(v)
	}
	return st.Close()
}

func metaBench(o Options, res *Result) error {
	const size = 4096
	st, s, err := newCore(float64(o.MetaObjects)*size/server.GiB + 1)
	if err != nil {
		return err
	}
	defer st.Close()
	hs := make([]kv.Hash, o.MetaObjects)
	for i := range hs {
		hs[i] = hashOf("meta", i)
	}
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	if err := put(st, s, 0, hs, size, 4096); err != nil {
		return err
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	// hs itself (32 B/object) was allocated before m0.
	res.MetadataBytesPerObject = float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc)) / float64(o.MetaObjects)
	runtime.KeepAlive(hs)
	return nil
}
