package server

import (
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server/l1"
)

// The cost of L1 prepared ahead of use. Run with a small -benchtime (each
// iteration maps and faults in its own memory):
//
//	go test -run '^$' -bench 'Prefault|FaultIn' -benchtime 3x ./server

// BenchmarkPrefaultStartup: Start with --l1-prefault-gb 1 until every
// prepared segment (memfd, fallocate, announced) exists: the start-up
// cost per GiB, paid in the background.
func BenchmarkPrefaultStartup(b *testing.B) {
	const gib = 1
	var total time.Duration
	for range b.N {
		dir := b.TempDir()
		cfg := DefaultConfig()
		cfg.L1SizeGB, cfg.L1PrefaultGB = gib, gib
		cfg.SegmentSize = 256 << 20
		cfg.Socket = filepath.Join(dir, "kvshim.sock")
		t0 := time.Now()
		srv, err := Start(cfg, nil, Options{})
		if err != nil {
			b.Fatal(err)
		}
		for {
			srv.Core.mu.Lock()
			_, _, n, _ := srv.Core.l1.Growth()
			srv.Core.mu.Unlock()
			if n == 4 {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
		total += time.Since(t0)
		if err := srv.Close(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N)/gib, "ms/GiB")
	b.ReportMetric(gib*float64(b.N)/total.Seconds(), "GiB/s")
}

// BenchmarkFaultInMethods compares the ways to fault a 256 MiB memfd
// segment in (the server's preparation), and what a peer's first write of
// every page then costs (a CPU worker's first save into it; a GPU
// worker's cuMemHostRegister does the same work on its mapping).
func BenchmarkFaultInMethods(b *testing.B) {
	const size = 256 << 20
	src := make([]byte, 8<<20)
	methods := []struct {
		name  string
		fault func(seg *ipc.Segment) error
	}{
		{"lazy", func(*ipc.Segment) error { return nil }},
		{"fallocate", func(seg *ipc.Segment) error { return faultIn(seg.Fd(), seg.Mem()) }},
		{"populate_write", func(seg *ipc.Segment) error { return unix.Madvise(seg.Mem(), unix.MADV_POPULATE_WRITE) }},
		{"touch", func(seg *ipc.Segment) error {
			mem := seg.Mem()
			for off := 0; off < len(mem); off += l1.PageSize {
				mem[off] = 0
			}
			return nil
		}},
		{"map_populate", func(seg *ipc.Segment) error { // a second mapping
			mem, err := unix.Mmap(seg.Fd(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
			if err == nil {
				err = unix.Munmap(mem)
			}
			return err
		}},
	}
	for _, m := range methods {
		b.Run(m.name, func(b *testing.B) {
			var prep, peer time.Duration
			for range b.N {
				seg, err := ipc.CreateSegment(1, size)
				if err != nil {
					b.Fatal(err)
				}
				t0 := time.Now()
				if err := m.fault(seg); err != nil {
					b.Fatal(err)
				}
				prep += time.Since(t0)
				fd, err := unix.Dup(seg.Fd())
				if err != nil {
					b.Fatal(err)
				}
				p, err := ipc.MapSegment(1, fd, size)
				if err != nil {
					b.Fatal(err)
				}
				t0 = time.Now()
				for off := 0; off < size; off += len(src) {
					copy(p.Mem()[off:], src)
				}
				peer += time.Since(t0)
				p.Close()
				seg.Close()
			}
			n := float64(b.N) * size / GiB
			b.ReportMetric(float64(prep.Milliseconds())/n, "prep-ms/GiB")
			b.ReportMetric(float64(peer.Milliseconds())/n, "peer-first-write-ms/GiB")
		})
	}
}
