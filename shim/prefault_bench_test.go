package shim

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/server"
)

// BenchmarkFirstSave times the first request's save into a fresh server
// (CPU host engine): 256 MiB, 32 chunks of 8 MiB (256 tokens, 8 layers of
// FlashAttention NHD, 8 heads of 128), from lookup to COMMIT. lazy: L1 is
// created by the ALLOC and faulted in by the copy; prefault: the server
// prepared L1 ahead of use (--l1-prefault-gb 1) before the request came;
// prefault+client_populated: as prefault, and the worker's own mapping of
// L1 populated before the request (what a GPU worker's registration does);
// warm: a second request into the same server, its slots reused (the
// steady state once L1 is full). Each iteration starts its own server:
//
//	go test -run '^$' -bench FirstSave -benchtime 3x ./shim
//
// A GPU worker's first save also waits for cuMemHostRegister of each new
// segment; the fake driver cannot time that (see prepin_test.go).
func BenchmarkFirstSave(b *testing.B) {
	const (
		layers, heads, head, bs, chunkTokens = 8, 8, 128, 16, 256
		chunks                               = 32
		blocks                               = chunks * chunkTokens / bs
		blockBytes                           = 2 * bs * heads * head * 2 // K and V of one layer
		layerBytes                           = blocks * blockBytes
		saveBytes                            = chunks * chunkTokens / bs * layers * blockBytes
	)
	for _, mode := range []struct {
		name      string
		prefault  float64
		populated bool
		warm      bool
	}{{"lazy", 0, false, false}, {"prefault", 1, false, false}, {"prefault+client_populated", 1, true, false}, {"warm", 0, false, true}} {
		b.Run(mode.name, func(b *testing.B) {
			mem, err := unix.Mmap(-1, 0, layers*layerBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				b.Fatal(err)
			}
			defer unix.Munmap(mem)
			for i := range mem {
				mem[i] = byte(i * 7)
			}
			var descs []layout.TensorDesc
			for i := range layers {
				descs = append(descs, layout.TensorDesc{
					Layer: fmt.Sprintf("layer%d", i), Backend: layout.FlashAttn, Device: layout.Device{Kind: layout.CPU},
					DataPtr: addrOf(mem) + uint64(i*layerBytes), DTypeSize: 2,
					Shape:   []int64{2, blocks, bs, heads, head},
					Strides: []int64{layerBytes / 2, bs * heads * head * 2, heads * head * 2, head * 2, 2},
				})
			}
			tokens := func(seed uint32) []uint32 {
				t := make([]uint32, chunks*chunkTokens)
				for i := range t {
					t[i] = seed*1_000_003 + uint32(i)
				}
				return t
			}
			var total time.Duration
			for n := range b.N {
				b.StopTimer()
				sock := filepath.Join(b.TempDir(), "kvshim.sock")
				cfg := server.DefaultConfig()
				cfg.Socket, cfg.L1SizeGB, cfg.L1PrefaultGB = sock, 1, mode.prefault
				cfg.SegmentSize = 256 << 20
				srv, err := server.Start(cfg, nil, server.Options{})
				if err != nil {
					b.Fatal(err)
				}
				ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "bench", ObjectFormat: 1, WorldSize: 1, ChunkSize: chunkTokens}
				s, err := NewScheduler(SchedulerConfig{Socket: sock, Namespace: ns, BlockSize: bs, Timeout: 10 * time.Second, Instance: uuid.New()})
				if err != nil {
					b.Fatal(err)
				}
				w, err := NewWorker(WorkerConfig{Socket: sock, Namespace: ns, Timeout: 10 * time.Second, Instance: uuid.New()})
				if err != nil {
					b.Fatal(err)
				}
				if err := w.Register(descs); err != nil {
					b.Fatal(err)
				}
				save := func(req string, seed uint32) time.Duration {
					t0 := time.Now()
					for {
						n, pending, err := s.Match(req, tokens(seed), Extras{}, 0)
						if err != nil || n != 0 {
							b.Fatalf("lookup: %d, %v", n, err)
						}
						if !pending {
							break
						}
					}
					blk := make([]int64, blocks)
					for i := range blk {
						blk[i] = int64(i)
					}
					if err := s.AfterAlloc(req, blk, 1, 0, 0); err != nil {
						b.Fatal(err)
					}
					raw, err := s.BuildMeta(&Step{Requests: []StepRequest{{Req: req, Blocks: blk, Scheduled: chunks * chunkTokens}}})
					if err != nil {
						b.Fatal(err)
					}
					m, err := DecodeStepMeta(raw, w.Layout().ChunkBlocks(), w.Layout().NumBlocks())
					if err != nil {
						b.Fatal(err)
					}
					saved := w.Stats().SavedChunks
					w.StartSaves(m, 0)
					w.wg.Wait()
					d := time.Since(t0)
					s.Finished(req)
					if got := w.Stats().SavedChunks - saved; got != chunks {
						b.Fatalf("saved %d chunks of %d", got, chunks)
					}
					return d
				}
				if mode.prefault > 0 { // the server had time to prepare L1
					for gauge(b, srv, "kvshim_l1_segments") < 4 {
						time.Sleep(time.Millisecond)
					}
				}
				if mode.populated {
					// What a CPU worker would gain by populating its own
					// mapping of each announced segment in the background
					// (a GPU worker's registration does that work).
					c, err := w.link.client()
					if err != nil {
						b.Fatal(err)
					}
					for _, seg := range c.Segments().Segments() {
						if err := unix.Madvise(seg.Mem(), unix.MADV_POPULATE_WRITE); err != nil {
							b.Fatal(err)
						}
					}
				}
				if mode.warm {
					save(fmt.Sprintf("first%d", n), uint32(2*n+1))
					sess, err := srv.Core.OpenSession(kv.Tag(uuid.New()))
					if err == nil {
						_, err = srv.Core.Clear(sess)
						srv.Core.CloseSession(sess)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				b.StartTimer()
				total += save(fmt.Sprintf("req%d", n), uint32(2*n+2))
				b.StopTimer()
				w.Close()
				s.Close()
				srv.Close()
			}
			b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/save")
			b.ReportMetric(float64(saveBytes)*float64(b.N)/total.Seconds()/1e9, "GB/s")
		})
	}
}

// gauge reads one of the store's metrics.
func gauge(b *testing.B, srv *server.Server, name string) float64 {
	mfs, err := srv.Core.Registry().Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	b.Fatalf("no metric %s", name)
	return 0
}
