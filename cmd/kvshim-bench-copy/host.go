package main

import (
	"fmt"
	"hash/crc32"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// mapAnon maps n bytes outside the Go heap (like torch CPU tensors and L1
// segments) and touches every page so page faults stay out of the timings.
func mapAnon(n int64) ([]byte, uint64, error) {
	n = (n + 4095) &^ 4095
	b, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, 0, fmt.Errorf("mmap %d bytes: %w", n, err)
	}
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1
	}
	return b, uint64(uintptr(unsafe.Pointer(&b[0]))), nil
}

// pattern fills b quickly with non-trivial bytes.
func pattern(b []byte) {
	x := uint32(12345)
	n := min(len(b), 1<<20)
	for i := range b[:n] {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
	for done := n; done < len(b); done *= 2 {
		copy(b[done:], b[:done])
	}
}

// runChunks plans and submits every chunk as its own job (as the connector
// does), then waits for all of them.
func runChunks(e cuda.Engine, l *layout.Layout, chunks [][]int64, objA, objSize uint64, dir kv.Direction) (time.Duration, error) {
	d, _, err := runChunksSubmit(e, l, chunks, objA, objSize, dir)
	return d, err
}

// runChunksSubmit also returns the time spent inside Submit per span.
func runChunksSubmit(e cuda.Engine, l *layout.Layout, chunks [][]int64, objA, objSize uint64, dir kv.Direction) (time.Duration, float64, error) {
	buf := make([]kv.Span, 0, 4096)
	jobs := make([]cuda.Job, 0, len(chunks))
	var submit time.Duration
	spans := 0
	start := time.Now()
	for i, ids := range chunks {
		var err error
		buf, err = l.AppendPlan(buf[:0], ids, objA+uint64(i)*objSize, dir)
		if err != nil {
			return 0, 0, err
		}
		t := time.Now()
		j, err := e.Submit(buf, kv.Direction(dir))
		submit += time.Since(t)
		spans += len(buf)
		if err != nil {
			return 0, 0, err
		}
		jobs = append(jobs, j)
	}
	for _, j := range jobs {
		if err := j.Wait(time.Minute); err != nil {
			return 0, 0, err
		}
	}
	return time.Since(start), float64(submit.Nanoseconds()) / float64(max(spans, 1)), nil
}

func hostBench(c *config, res map[string]any) error {
	bb := c.blockBytes()
	per := int64(c.chunk) / c.block
	nb := int64(c.cacheGiB*(1<<30)) / bb / per * per
	if nb < per {
		return fmt.Errorf("cache of %.3f GiB holds less than one chunk", c.cacheGiB)
	}
	size := nb * bb
	chunks := nb / per
	objSize := uint64(per*bb) + layout.HeaderSize
	c.logf("host: %d blocks of %d KiB, %d chunks of %d MiB, %d workers", nb, bb>>10, chunks, per*bb>>20, c.workers)
	cache, ca, err := mapAnon(size)
	if err != nil {
		return err
	}
	defer syscall.Munmap(cache)
	objs, oa, err := mapAnon(int64(objSize) * chunks)
	if err != nil {
		return err
	}
	defer syscall.Munmap(objs)
	pattern(cache)
	e := cuda.NewHostEngine(c.workers)
	defer e.Close()

	type variant struct {
		pfx, planKey            string
		l                       *layout.Layout
		ids                     [][]int64
		save, restore, planNs   []float64
		saveRatio, restoreRatio []float64
		spans                   int
	}
	var vs []*variant
	for _, kind := range cacheKinds {
		v := &variant{pfx: "host" + kind.name, planKey: "plan_ns_per_chunk" + kind.name}
		if v.l, err = layout.New(c.descs(ca, nb, kind, layout.Device{Kind: layout.CPU}), c.chunk); err != nil {
			return err
		}
		v.ids = c.chunks(nb)
		vs = append(vs, v)
	}
	// Each repeat measures the memmove baseline and every variant back to
	// back, so ratios compare runs under the same machine load; the medians
	// of the per-repeat ratios are reported.
	var memcpyS []float64
	buf := make([]kv.Span, 0, 4096)
	for range c.repeats {
		t := time.Now()
		copy(objs[:size], cache)
		m := gbps(uint64(size), time.Since(t))
		memcpyS = append(memcpyS, m)
		for _, v := range vs {
			v.spans = 0
			t := time.Now()
			for i, b := range v.ids {
				buf, _ = v.l.AppendPlan(buf[:0], b, oa+uint64(i)*objSize, kv.Save)
				v.spans += len(buf)
			}
			v.planNs = append(v.planNs, float64(time.Since(t).Nanoseconds())/float64(len(v.ids)))
			d, err := runChunks(e, v.l, v.ids, oa, objSize, kv.Save)
			if err != nil {
				return err
			}
			v.save = append(v.save, gbps(uint64(size), d))
			v.saveRatio = append(v.saveRatio, gbps(uint64(size), d)/m)
			if d, err = runChunks(e, v.l, v.ids, oa, objSize, kv.Load); err != nil {
				return err
			}
			v.restore = append(v.restore, gbps(uint64(size), d))
			v.restoreRatio = append(v.restoreRatio, gbps(uint64(size), d)/m)
		}
	}
	memcpy := median(memcpyS)
	res["host_cache_bytes"] = size
	res["memcpy_gbps"] = round(memcpy, 2)
	for _, v := range vs {
		l, ids, pfx := v.l, v.ids, v.pfx
		// Correctness once, outside the timings: save, seal and verify every
		// object, wipe the cache, restore, compare.
		want := crc32.ChecksumIEEE(cache)
		if _, err := runChunks(e, l, ids, oa, objSize, kv.Save); err != nil {
			return err
		}
		t := time.Now()
		for i := range ids {
			if err := l.SealObject(objs[uint64(i)*objSize:uint64(i+1)*objSize], benchKey(i)); err != nil {
				return err
			}
		}
		sealNs := float64(time.Since(t).Nanoseconds()) / float64(len(ids))
		t = time.Now()
		for i := range ids {
			if err := l.VerifyObject(objs[uint64(i)*objSize:uint64(i+1)*objSize], benchKey(i)); err != nil {
				return err
			}
		}
		verifyNs := float64(time.Since(t).Nanoseconds()) / float64(len(ids))
		clear(cache)
		if _, err := runChunks(e, l, ids, oa, objSize, kv.Load); err != nil {
			return err
		}
		if got := crc32.ChecksumIEEE(cache); got != want {
			return fmt.Errorf("%s: restored cache differs (crc %08x, want %08x)", pfx, got, want)
		}
		s, r := median(v.save), median(v.restore)
		res[pfx+"_save_gbps"] = round(s, 2)
		res[pfx+"_restore_gbps"] = round(r, 2)
		res[pfx+"_save_ratio"] = round(median(v.saveRatio), 3)
		res[pfx+"_restore_ratio"] = round(median(v.restoreRatio), 3)
		res[pfx+"_spans_per_chunk"] = v.spans / len(ids)
		res[pfx+"_seal_ns_per_chunk"] = int64(sealNs)
		res[pfx+"_verify_ns_per_chunk"] = int64(verifyNs)
		res[v.planKey] = int64(median(v.planNs))
		c.logf("%s: save %.2f GB/s (%.3f of memcpy) restore %.2f GB/s (%.3f), memcpy %.2f, %d spans/chunk, plan %.0f ns/chunk",
			pfx, s, median(v.saveRatio), r, median(v.restoreRatio), memcpy, v.spans/len(ids), median(v.planNs))
	}
	return spanCost(c, e, ca, oa, res)
}

// spanCost measures the CPU cost of one submitted span: many 64-byte spans
// in one job, so the per-span overhead dominates the copy.
func spanCost(c *config, e *cuda.HostEngine, src, dst uint64, res map[string]any) error {
	const n = 1 << 16
	spans := make([]kv.Span, n)
	for i := range spans {
		spans[i] = kv.Span{Src: src + uint64(i)*4096, Dst: dst + uint64(i)*4096, Len: 64}
	}
	var submit, wall, cpu []float64
	for range c.repeats {
		cpu0 := cpuTime()
		t := time.Now()
		j, err := e.Submit(spans, kv.Save)
		if err != nil {
			return err
		}
		ts := time.Since(t)
		if err := j.Wait(time.Minute); err != nil {
			return err
		}
		wall = append(wall, float64(time.Since(t).Nanoseconds())/n)
		submit = append(submit, float64(ts.Nanoseconds())/n)
		cpu = append(cpu, float64((cpuTime()-cpu0).Nanoseconds())/n)
	}
	res["submit_ns_per_span"] = round(median(submit), 1)
	res["wall_ns_per_span"] = round(median(wall), 1)
	res["cpu_ns_per_span"] = round(median(cpu), 1)
	c.logf("per span (64 B): submit %.1f ns, wall %.1f ns, cpu %.1f ns", median(submit), median(wall), median(cpu))
	return nil
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
