package main

import (
	"bytes"
	"fmt"
	"syscall"
	"time"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// gpuBench measures the CUDA engine: a device KV cache of -gpu-cache-gib,
// pinned host objects (mmap + cuMemHostRegister, like L1 segments), saves
// (D2H) and restores (H2D) of every chunk for the per-layer and cross-layer
// layouts, with cuMemcpyBatchAsync and with per-span copies, against one
// large copy of the same bytes on the same engine in the same run.
func gpuBench(c *config, res map[string]any) error {
	info, err := cuda.Info()
	if err != nil {
		return err
	}
	res["cuda_driver_version"] = info.Version
	res["cuda_batch_api"] = info.BatchAPI
	eng, err := cuda.NewDeviceEngine(c.device)
	if err != nil {
		return err
	}
	defer eng.Close()
	spanEng, err := cuda.NewDeviceEngine(c.device, cuda.WithoutBatch())
	if err != nil {
		return err
	}
	defer spanEng.Close()

	bb := c.blockBytes()
	per := int64(c.chunk) / c.block
	nb := int64(c.gpuCacheGiB*(1<<30)) / bb / per * per
	size := nb * bb
	nChunks := nb / per
	objSize := uint64(per*bb) + layout.HeaderSize
	c.logf("gpu: driver %d, batch %q, %d blocks, %d chunks, %.2f GiB", info.Version, info.BatchAPI, nb, nChunks, float64(size)/(1<<30))
	dev, err := eng.AllocDevice(uint64(size))
	if err != nil {
		return err
	}
	defer eng.FreeDevice(dev)
	objs, oa, err := mapAnon(int64(objSize) * nChunks)
	if err != nil {
		return err
	}
	defer syscall.Munmap(objs)
	src, sa, err := mapAnon(size) // host pattern the device cache is loaded from
	if err != nil {
		return err
	}
	defer syscall.Munmap(src)
	pattern(src)
	t := time.Now()
	for _, r := range []struct {
		a uint64
		n int
	}{{oa, len(objs)}, {sa, len(src)}} {
		if err := eng.RegisterHost(r.a, uint64(r.n+4095)&^4095); err != nil { // whole pages
			return err
		}
		defer eng.UnregisterHost(r.a)
	}
	res["gpu_pin_seconds"] = round(time.Since(t).Seconds(), 3)
	res["gpu_cache_bytes"] = size

	// Raw: one span of all the bytes, each direction.
	one := func(dir kv.Direction) (time.Duration, error) {
		s := kv.Span{Src: sa, Dst: dev, Len: uint64(size)}
		if dir == kv.Save {
			s = kv.Span{Src: dev, Dst: oa, Len: uint64(size)}
		}
		t := time.Now()
		j, err := eng.Submit([]kv.Span{s}, dir)
		if err == nil {
			err = j.Wait(time.Minute)
		}
		return time.Since(t), err
	}
	var d2h, h2d []float64
	for range c.repeats + 1 { // first round warms up
		dt, err := one(kv.Load)
		if err != nil {
			return err
		}
		h2d = append(h2d, gbps(uint64(size), dt))
		if dt, err = one(kv.Save); err != nil {
			return err
		}
		d2h = append(d2h, gbps(uint64(size), dt))
	}
	rawD2H, rawH2D := median(d2h[1:]), median(h2d[1:])
	res["gpu_raw_d2h_gbps"], res["gpu_raw_h2d_gbps"] = round(rawD2H, 2), round(rawH2D, 2)
	c.logf("gpu raw: d2h %.2f GB/s, h2d %.2f GB/s", rawD2H, rawH2D)
	if _, err := one(kv.Load); err != nil { // device = src pattern again
		return err
	}

	for _, kind := range cacheKinds {
		l, err := layout.New(c.descs(dev, nb, kind, layout.Device{Kind: layout.CUDA, Index: c.device}), c.chunk)
		if err != nil {
			return err
		}
		ids := c.chunks(nb)
		for _, mode := range []struct {
			name string
			e    *cuda.DeviceEngine
		}{{"batch", eng}, {"per_span", spanEng}} {
			pfx := "gpu" + kind.name
			if mode.name == "per_span" {
				pfx += "_per_span"
			}
			var save, restore, submitNs []float64
			s0, calls0 := mode.e.Stats()
			for r := range c.repeats + 1 {
				d, sub, err := runChunksSubmit(mode.e, l, ids, oa, objSize, kv.Save)
				submitNs = append(submitNs, sub)
				if err != nil {
					return fmt.Errorf("%s save: %w", pfx, err)
				}
				if r == 0 {
					if err := checkSaved(c, l, kind, ids, src, sa, dev, objs, objSize); err != nil {
						return fmt.Errorf("%s: %w", pfx, err)
					}
				}
				save = append(save, gbps(uint64(size), d))
				if d, err = runChunks(mode.e, l, ids, oa, objSize, kv.Load); err != nil {
					return fmt.Errorf("%s restore: %w", pfx, err)
				}
				restore = append(restore, gbps(uint64(size), d))
			}
			s1, calls1 := mode.e.Stats()
			sv, rs := median(save[1:]), median(restore[1:])
			res[pfx+"_save_gbps"], res[pfx+"_restore_gbps"] = round(sv, 2), round(rs, 2)
			res[pfx+"_save_ratio"], res[pfx+"_restore_ratio"] = round(sv/rawD2H, 3), round(rs/rawH2D, 3)
			res[pfx+"_spans_per_chunk"] = int64(s1-s0) / int64(2*(c.repeats+1)*len(ids))
			res[pfx+"_driver_calls_per_chunk"] = round(float64(calls1-calls0)/float64(2*(c.repeats+1)*len(ids)), 1)
			res[pfx+"_submit_ns_per_span"] = round(median(submitNs[1:]), 1)
			c.logf("%s: save %.2f GB/s (%.2f of raw), restore %.2f GB/s (%.2f of raw)", pfx, sv, sv/rawD2H, rs, rs/rawH2D)
		}
	}
	return nil
}

// checkSaved compares the device-saved objects of the first chunks with
// objects the host engine makes from the host pattern the device holds.
func checkSaved(c *config, l *layout.Layout, kind cacheKind, ids [][]int64, src []byte, sa, dev uint64, objs []byte, objSize uint64) error {
	hl, err := layout.New(c.descs(sa, l.NumBlocks(), kind, layout.Device{Kind: layout.CPU}), c.chunk)
	if err != nil {
		return err
	}
	ref, ra, err := mapAnon(int64(objSize))
	if err != nil {
		return err
	}
	defer syscall.Munmap(ref)
	ref = ref[:objSize] // mapAnon rounds up to whole pages
	h := cuda.NewHostEngine(2)
	defer h.Close()
	for i := range min(4, len(ids)) {
		if _, err := runChunks(h, hl, ids[i:i+1], ra, objSize, kv.Save); err != nil {
			return err
		}
		o := objs[uint64(i)*objSize : uint64(i+1)*objSize]
		if !bytes.Equal(o[layout.HeaderSize:], ref[layout.HeaderSize:]) {
			return fmt.Errorf("chunk %d: device-saved object differs from the host reference", i)
		}
		if err := l.SealObject(o, benchKey(i)); err != nil {
			return err
		}
		if err := l.VerifyObject(o, benchKey(i)); err != nil {
			return err
		}
	}
	return nil
}
