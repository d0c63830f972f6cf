// Command kvshim-bench-l2 measures the L2 adapters per operation (LMCache
// PR #3227's table: 1,024 keys, 1 MiB values, 4 concurrent stores per
// round), with a shared worker pool and with per-op lanes, and lookup
// latency idle vs during a store burst. The last line of output is JSON.
//
//	go run ./cmd/kvshim-bench-l2 -adapters fs,redis,mooncake_store,plugin,s3
//
// plugin is the example plugin (examples/l2-plugin, files in a temporary
// directory, as fs) through kvshim-l2-host, both compiled with cc; s3 is
// the s3 adapter against a SeaweedFS S3 gateway it starts (needs the weed
// binary of build/seaweedfs.sh, or $KVSHIM_WEED).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	_ "github.com/kvshim/kvshim/server/l2/fs"
	_ "github.com/kvshim/kvshim/server/l2/mooncake"
	"github.com/kvshim/kvshim/server/l2/mooncake/mctest"
	_ "github.com/kvshim/kvshim/server/l2/plugin"
	"github.com/kvshim/kvshim/server/l2/plugin/plugintest"
	_ "github.com/kvshim/kvshim/server/l2/redis"
	"github.com/kvshim/kvshim/server/l2/redis/redisserver"
	_ "github.com/kvshim/kvshim/server/l2/s3"
	"github.com/kvshim/kvshim/server/l2/s3/s3test"
)

var (
	flagAdapters = flag.String("adapters", "fs,redis,mooncake_store,plugin,s3", "adapters to run (skipped with a reason when unavailable)")
	flagKeys     = flag.Int("keys", 1024, "resident keys (populated first)")
	flagValue    = flag.Int("value", 1<<20, "value size in bytes")
	flagStores   = flag.Int("stores", 4, "concurrent store batches per burst round")
	flagBatch    = flag.Int("store-batch", 64, "keys per store batch")
	flagLookup   = flag.Int("lookup-batch", 16, "keys per lookup and per load")
	flagRounds   = flag.Int("rounds", 3, "store-burst rounds per mode")
	flagIdle     = flag.Int("idle-lookups", 300, "idle lookups per mode")
	flagDir      = flag.String("dir", "", "fs base directory (default: a temporary directory, removed)")
	flagRedis    = flag.String("redis-addr", "", "use this Redis instead of starting redis-server")
	flagS3       = flag.String("s3-extra", "", `extra s3 keys, e.g. ',"multipart_threshold_bytes":8388608'`)
	flagShared   = flag.String("shared", `"num_workers":4`, "lane config of the shared-pool mode")
	flagLanes    = flag.String("lanes", `"num_workers":1,"per_op_workers":{"lookup":1,"retrieve":1,"store":2}`, "lane config of the per-op mode")
)

// stats are latencies of one op kind in one phase.
type stats []time.Duration

func (s stats) avg() float64 {
	if len(s) == 0 {
		return 0
	}
	var t time.Duration
	for _, d := range s {
		t += d
	}
	return ms(t / time.Duration(len(s)))
}

func (s stats) p99() float64 {
	if len(s) == 0 {
		return 0
	}
	c := append(stats(nil), s...)
	sort.Slice(c, func(i, j int) bool { return c[i] < c[j] })
	return ms(c[min(len(c)-1, (len(c)*99+99)/100-1)])
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

type modeResult struct {
	LookupIdleAvg, LookupIdleP99   float64
	LookupBurstAvg, LookupBurstP99 float64
	LoadAvg, LoadP99               float64
	StoreAvg, StoreP99             float64
	Lookups, Loads, Stores         int
	Errors                         int
}

// buffers live in one memfd mapping, registered with backends that can
// use shared memory directly (mooncake_store).
type buffers struct {
	fd   int
	mem  []byte
	src  [][]byte // store sources (store-batch of them)
	dst  [][]byte // load destinations (lookup-batch of them)
	size int
}

func newBuffers(value, nsrc, ndst int) (*buffers, error) {
	size := value * (nsrc + ndst)
	fd, err := unix.MemfdCreate("kvshim-bench-l2", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return nil, err
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	b := &buffers{fd: fd, mem: mem, size: size}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < nsrc+ndst; i++ {
		s := mem[i*value : (i+1)*value]
		if i < nsrc {
			for j := 0; j < len(s); j += 8 {
				s[j] = byte(rng.Uint32())
			}
			b.src = append(b.src, s)
		} else {
			b.dst = append(b.dst, s)
		}
	}
	return b, nil
}

func key(ns byte, round, i int) kv.Key {
	k := kv.Key{Rank: uint32(round)}
	k.Namespace[0] = ns
	k.Hash[0], k.Hash[1], k.Hash[2], k.Hash[3] = byte(i), byte(i>>8), byte(round), byte(rand.Uint32())
	return k
}

func waitTask(t *l2.Task) ([]l2.Result, time.Duration, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := t.Wait(ctx)
	return res, time.Since(start), err
}

func failed(res []l2.Result) int {
	n := 0
	for _, r := range res {
		if r.Status == l2.StatusFailed {
			n++
		}
	}
	return n
}

func main() {
	flag.Parse()
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	bufs, err := newBuffers(*flagValue, *flagBatch, *flagLookup)
	if err != nil {
		fmt.Fprintln(os.Stderr, "buffers:", err)
		os.Exit(1)
	}
	out := map[string]any{}
	skipped := map[string]string{}
	for _, name := range strings.Split(*flagAdapters, ",") {
		name = strings.TrimSpace(name)
		base, cleanup, err := backendConfig(name)
		if err != nil {
			skipped[name] = err.Error()
			fmt.Printf("%s: skipped: %v\n", name, err)
			continue
		}
		res, err := runAdapter(name, base, bufs)
		cleanup()
		if err != nil {
			skipped[name] = err.Error()
			fmt.Printf("%s: failed: %v\n", name, err)
			continue
		}
		out[name] = res
	}
	line, _ := json.Marshal(map[string]any{"bench": "kvshim-bench-l2", "keys": *flagKeys, "value_bytes": *flagValue,
		"stores_per_round": *flagStores, "store_batch": *flagBatch, "lookup_batch": *flagLookup,
		"adapters": out, "skipped": skipped})
	fmt.Println(string(line))
}

// backendConfig returns the JSON fragment naming the backend (without lane
// keys) and starts what it needs.
func backendConfig(name string) (string, func(), error) {
	switch name {
	case "fs":
		dir := *flagDir
		cleanup := func() {}
		if dir == "" {
			d, err := os.MkdirTemp("", "kvshim-bench-l2-fs-")
			if err != nil {
				return "", nil, err
			}
			dir, cleanup = d, func() { os.RemoveAll(d) }
		}
		return fmt.Sprintf(`"type":"fs","base_path":%q`, dir), cleanup, nil
	case "redis":
		if *flagRedis != "" {
			return fmt.Sprintf(`"type":"redis","addrs":[%q]`, *flagRedis), func() {}, nil
		}
		d, err := os.MkdirTemp("", "kvshim-bench-l2-redis-")
		if err != nil {
			return "", nil, err
		}
		s, err := redisserver.Start(d)
		if err != nil {
			os.RemoveAll(d)
			return "", nil, err
		}
		return fmt.Sprintf(`"type":"redis","addrs":[%q]`, s.Addr), func() { s.Kill(); os.RemoveAll(d) }, nil
	case "mooncake_store":
		py, pkg, err := mctest.Python()
		if err != nil {
			return "", nil, err
		}
		d, err := os.MkdirTemp("", "kvshim-bench-l2-mc-")
		if err != nil {
			return "", nil, err
		}
		m, err := mctest.StartMaster(pkg, d, 10000)
		if err != nil {
			os.RemoveAll(d)
			return "", nil, err
		}
		seg := (*flagKeys + *flagStores**flagBatch + 64) * *flagValue * 5 / 4
		c := mctest.Config(py, m, seg, 64<<20, "")
		return strings.TrimSuffix(strings.TrimPrefix(c, "{"), "}"), func() { m.Stop(); os.RemoveAll(d) }, nil
	case "plugin":
		b, err := plugintest.Build()
		if err != nil {
			return "", nil, err
		}
		d, err := os.MkdirTemp("", "kvshim-bench-l2-plugin-")
		if err != nil {
			return "", nil, err
		}
		return fmt.Sprintf(`"type":"plugin","library":%q,"host":%q,"dir":%q`, b.Example, b.Host, d),
			func() { os.RemoveAll(d); plugintest.Remove() }, nil
	case "s3":
		d, err := os.MkdirTemp("", "kvshim-bench-l2-s3-")
		if err != nil {
			return "", nil, err
		}
		w, err := s3test.Start(d)
		if err != nil {
			os.RemoveAll(d)
			return "", nil, err
		}
		return fmt.Sprintf(`"type":"s3","endpoint":%q,"bucket":"kvshim-bench","create_bucket":true%s`, w.Endpoint, *flagS3),
			func() { w.Kill(); os.RemoveAll(d) }, nil
	}
	return "", nil, fmt.Errorf("unknown adapter %q", name)
}

func runAdapter(name, base string, bufs *buffers) (map[string]any, error) {
	resident := make([]kv.Key, *flagKeys)
	for i := range resident {
		resident[i] = key(1, 0, i)
	}
	modes := map[string]modeResult{}
	var populate stats
	for mi, mode := range []struct{ name, lanes string }{{"shared", *flagShared}, {"lanes", *flagLanes}} {
		a, err := l2.OpenJSON("{"+base+","+mode.lanes+`,"op_timeout_ms":120000}`, l2.Options{})
		if err != nil {
			return nil, err
		}
		if err := a.RegisterL1Segment(bufs.fd, bufs.mem); err != nil {
			a.Close()
			return nil, err
		}
		if mi == 0 {
			// populate: rounds of `stores` concurrent batches
			for off := 0; off < len(resident); off += *flagStores * *flagBatch {
				var wg sync.WaitGroup
				var mu sync.Mutex
				var ferr error
				for s := 0; s < *flagStores; s++ {
					lo := off + s**flagBatch
					if lo >= len(resident) {
						break
					}
					hi := min(lo+*flagBatch, len(resident))
					wg.Add(1)
					go func() {
						defer wg.Done()
						res, d, err := waitTask(a.Store(context.Background(), resident[lo:hi], bufs.src[:hi-lo]))
						mu.Lock()
						defer mu.Unlock()
						populate = append(populate, d)
						if err == nil && failed(res) > 0 {
							err = fmt.Errorf("populate: %d keys failed: %v", failed(res), firstErr(res))
						}
						if err != nil && ferr == nil {
							ferr = err
						}
					}()
				}
				wg.Wait()
				if ferr != nil {
					a.Close()
					return nil, ferr
				}
			}
		}
		r, err := runMode(a, resident, bufs, mi)
		a.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", mode.name, err)
		}
		modes[mode.name] = r
		fmt.Printf("%-15s %-7s lookup idle avg %7.3f p99 %7.3f | lookup burst avg %7.3f p99 %8.3f | load avg %8.3f p99 %8.3f | store avg %8.3f p99 %8.3f ms (errors %d)\n",
			name, mode.name, r.LookupIdleAvg, r.LookupIdleP99, r.LookupBurstAvg, r.LookupBurstP99,
			r.LoadAvg, r.LoadP99, r.StoreAvg, r.StoreP99, r.Errors)
	}
	sh, ln := modes["shared"], modes["lanes"]
	return map[string]any{
		"lookup_p99_ms_idle":               ln.LookupIdleP99,
		"lookup_p99_ms_store_burst_shared": sh.LookupBurstP99,
		"lookup_p99_ms_store_burst_lanes":  ln.LookupBurstP99,
		"load_avg_ms":                      ln.LoadAvg,
		"store_avg_ms":                     ln.StoreAvg,
		"populate_store_avg_ms":            populate.avg(),
		"modes":                            modes,
	}, nil
}

func firstErr(res []l2.Result) error {
	for _, r := range res {
		if r.Err != nil {
			return r.Err
		}
	}
	return nil
}

// runMode measures idle lookups, then `rounds` bursts of `stores`
// concurrent store batches of new keys while a lookup loop and a load loop
// run back to back.
func runMode(a *l2.Adapter, resident []kv.Key, bufs *buffers, mode int) (modeResult, error) {
	var r modeResult
	lb := *flagLookup
	pick := func(rng *rand.Rand) []kv.Key {
		off := rng.IntN(len(resident) - lb + 1)
		return resident[off : off+lb]
	}
	rng := rand.New(rand.NewPCG(uint64(mode), 7))
	var idle stats
	for i := 0; i < *flagIdle; i++ {
		ks := pick(rng)
		res, d, err := waitTask(a.LookupAndHold(context.Background(), ks))
		if err != nil {
			return r, err
		}
		a.Release(ks)
		r.Errors += failed(res)
		idle = append(idle, d)
	}
	var burst, loads, stores stats
	for round := 0; round < *flagRounds; round++ {
		done := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		var newKeys []kv.Key
		for s := 0; s < *flagStores; s++ {
			ks := make([]kv.Key, *flagBatch)
			for i := range ks {
				ks[i] = key(2, 1000*mode+round, s**flagBatch+i)
			}
			newKeys = append(newKeys, ks...)
			t := a.Store(context.Background(), ks, bufs.src[:len(ks)])
			wg.Add(1)
			go func() {
				defer wg.Done()
				res, d, err := waitTask(t)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					r.Errors += len(ks)
					return
				}
				r.Errors += failed(res)
				stores = append(stores, d)
			}()
		}
		go func() { wg.Wait(); close(done) }()
		var lw sync.WaitGroup
		lw.Add(2)
		go func() { // lookups, back to back
			defer lw.Done()
			rng := rand.New(rand.NewPCG(uint64(round), 11))
			for {
				select {
				case <-done:
					return
				default:
				}
				ks := pick(rng)
				res, d, err := waitTask(a.LookupAndHold(context.Background(), ks))
				a.Release(ks)
				mu.Lock()
				if err == nil {
					r.Errors += failed(res)
					burst = append(burst, d)
				}
				mu.Unlock()
				time.Sleep(time.Millisecond)
			}
		}()
		go func() { // loads into the staging buffers, back to back
			defer lw.Done()
			rng := rand.New(rand.NewPCG(uint64(round), 13))
			for {
				select {
				case <-done:
					return
				default:
				}
				ks := pick(rng)
				res, d, err := waitTask(a.Load(context.Background(), ks, bufs.dst[:lb]))
				mu.Lock()
				if err == nil {
					r.Errors += failed(res)
					loads = append(loads, d)
				}
				mu.Unlock()
			}
		}()
		lw.Wait()
		if _, _, err := waitTask(a.Delete(context.Background(), newKeys)); err != nil {
			return r, err
		}
	}
	r.LookupIdleAvg, r.LookupIdleP99 = idle.avg(), idle.p99()
	r.LookupBurstAvg, r.LookupBurstP99 = burst.avg(), burst.p99()
	r.LoadAvg, r.LoadP99 = loads.avg(), loads.p99()
	r.StoreAvg, r.StoreP99 = stores.avg(), stores.p99()
	r.Lookups, r.Loads, r.Stores = len(idle)+len(burst), len(loads), len(stores)
	return r, nil
}
