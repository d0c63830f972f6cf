package shim

import (
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/server/tier"
)

// BenchmarkLoadPipeline: restores of 8 Llama-3-8B chunks (32 MiB objects,
// vLLM 0.33's LBNHC views, CPU caches) through a real server and the
// worker, timed from StartLoads to the request's report, by job size
// (loadBatchMax: chunks per copy job) and kvshim.verify, each against the
// host engine copying the same chunks from the same L1 objects alone, in
// the same iteration (load/engine: the median of the per-iteration
// ratios of engine time to load time; 1 = as fast as the engine alone).
//
//	go test -run x -bench LoadPipeline -benchtime 20x ./shim
func BenchmarkLoadPipeline(b *testing.B) {
	const layers, nBlocks, chunkTokens, bs, chunks = 32, 160, 256, 16, 8
	page := int64(8 * 16 * 256 * 2) // one block of one layer: heads, tokens, K|V, bf16
	mem, err := unix.Mmap(-1, 0, int(layers*nBlocks*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Munmap(mem)
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	var descs []layout.TensorDesc
	for i := range layers {
		descs = append(descs, layout.TensorDesc{Layer: fmt.Sprint("l", i), Backend: layout.Paged,
			Device: layout.Device{Kind: layout.CPU}, DataPtr: addrOf(mem) + uint64(int64(i)*nBlocks*page), DTypeSize: 2,
			Shape: []int64{nBlocks, 8, 16, 256}, Strides: []int64{page, 512, 8 * 512, 2}})
	}
	sock := filepath.Join(b.TempDir(), "kvshim.sock")
	cfg := server.DefaultConfig()
	cfg.Socket, cfg.L1SizeGB = sock, 1
	srv, err := server.Start(cfg, nil, server.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	ns := NamespaceSpec{Model: "bench", DType: "bfloat16", LayoutFingerprint: "LBNHC", ObjectFormat: 1, WorldSize: 1, ChunkSize: chunkTokens}
	sched, err := NewScheduler(SchedulerConfig{Socket: sock, Namespace: ns, BlockSize: bs, Timeout: 10 * time.Second, Instance: uuid.New()})
	if err != nil {
		b.Fatal(err)
	}
	defer sched.Close()
	w, err := NewWorker(WorkerConfig{Socket: sock, Namespace: ns, Timeout: 10 * time.Second, Instance: uuid.New()})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	if err := w.Register(descs); err != nil {
		b.Fatal(err)
	}
	l := w.Layout()
	src := seq(0, chunks*chunkTokens/bs+1)
	match := func(req string, tokens []uint32) int {
		for range 5000 {
			n, pending, err := sched.Match(req, tokens, Extras{}, 0)
			if err != nil {
				b.Fatal(err)
			}
			if !pending {
				return n
			}
			time.Sleep(100 * time.Microsecond)
		}
		b.Fatal("lookup pending")
		return 0
	}
	step := func(st *Step, saves bool) {
		meta, err := sched.BuildMeta(st)
		if err != nil {
			b.Fatal(err)
		}
		m, err := DecodeStepMeta(meta, l.ChunkBlocks(), l.NumBlocks())
		if err != nil {
			b.Fatal(err)
		}
		w.StartLoads(m)
		if saves {
			w.StartSaves(m, 0)
		}
		w.wg.Wait()
	}
	// One prompt per kvshim.verify, saved under it (under always with its
	// payload CRCs, which loads under always require).
	prompts := map[string][]uint32{}
	for k, verify := range []string{"l2", "always"} {
		tokens := make([]uint32, chunks*chunkTokens+1)
		for i := range tokens {
			tokens[i] = uint32(i*13 + 1 + k)
		}
		prompts[verify] = tokens
		setLoadOptions(w, 1, verify)
		req := "save" + verify
		if n := match(req, tokens); n != 0 {
			b.Fatalf("hit %d before the save", n)
		}
		if err := sched.AfterAlloc(req, src, 1, 0, 0); err != nil {
			b.Fatal(err)
		}
		saved := w.Stats().SavedChunks
		step(&Step{Requests: []StepRequest{{Req: req, Blocks: src, Scheduled: len(tokens)}}}, true)
		sched.Finished(req)
		if s := w.Stats(); s.SavedChunks-saved != chunks {
			b.Fatalf("saved %d chunks", s.SavedChunks-saved)
		}
	}
	dst := seq(nBlocks-len(src), len(src))

	// The engine alone: the same L1 objects the loads read (the server's
	// mapping of them), into the same blocks, on a host engine of the same
	// size.
	hs, err := ChunkHashes(sched.ns, prompts["l2"], chunkTokens, Extras{})
	if err != nil {
		b.Fatal(err)
	}
	var spans []kv.Span
	cb := l.ChunkBlocks()
	for c := range chunks {
		o, ok := srv.Core.Pin(sched.ns, 0, hs[c])
		if !ok {
			b.Fatalf("chunk %d not resident", c)
		}
		defer srv.Core.Unpin([]tier.Object{o})
		if spans, err = l.AppendPlan(spans, dst[c*cb:(c+1)*cb], addrOf(o.Mem), kv.Load); err != nil {
			b.Fatal(err)
		}
	}
	eng := cuda.NewHostEngine(0)
	defer eng.Close()
	engine := func() time.Duration {
		start := time.Now()
		job, err := eng.Submit(spans, kv.Load)
		if err == nil {
			err = job.Wait(10 * time.Second)
		}
		if err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	bytes := float64(spansBytes(spans))

	// Each iteration times the engine alone, then the same chunks through
	// the worker (StartLoads to the request's report): on a busy machine
	// their ratio, per iteration, is steadier than either figure.
	for _, verify := range []string{"l2", "always"} {
		for _, batch := range []int{1, 2, 4, 8, 16} {
			if !setLoadOptions(w, batch, verify) && batch > 1 {
				continue // a build without these options: one run
			}
			b.Run(fmt.Sprintf("verify=%s/batch=%d", verify, batch), func(b *testing.B) {
				var te, tl []time.Duration
				for i := 0; i < b.N; i++ {
					req := fmt.Sprintf("load-%s-%d-%d", verify, batch, i)
					if n := match(req, prompts[verify]); n != chunks*chunkTokens {
						b.Fatalf("hit %d tokens", n)
					}
					if err := sched.AfterAlloc(req, dst, 1, -1, chunks*chunkTokens); err != nil {
						b.Fatal(err)
					}
					meta, err := sched.BuildMeta(&Step{})
					if err != nil {
						b.Fatal(err)
					}
					m, err := DecodeStepMeta(meta, l.ChunkBlocks(), l.NumBlocks())
					if err != nil {
						b.Fatal(err)
					}
					te = append(te, engine())
					start := time.Now()
					w.StartLoads(m)
					w.wg.Wait()
					tl = append(tl, time.Since(start))
					if _, recv, errs := w.Poll(); len(recv) != 1 || len(errs) != 0 {
						b.Fatalf("load: %v, errors %v", recv, errs)
					}
					sched.Finished(req)
				}
				ratios := make([]float64, len(te))
				for i := range te {
					ratios[i] = float64(te[i]) / float64(tl[i])
				}
				b.ReportMetric(bytes/median(tl)/1e9, "load-GB/s")
				b.ReportMetric(bytes/median(te)/1e9, "engine-GB/s")
				b.ReportMetric(medianF(ratios), "load/engine")
			})
		}
	}
}

func median(d []time.Duration) float64 {
	f := make([]float64, len(d))
	for i, x := range d {
		f[i] = float64(x) / 1e9
	}
	return medianF(f)
}

func medianF(f []float64) float64 {
	f = slices.Clone(f)
	slices.Sort(f)
	n := len(f)
	if n%2 == 1 {
		return f[n/2]
	}
	return (f[n/2-1] + f[n/2]) / 2
}
