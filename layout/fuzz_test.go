package layout

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/kvshim/kvshim/kv"
)

type fuzzBytes struct {
	b []byte
	i int
}

func (r *fuzzBytes) intn(n int) int {
	if r.i >= len(r.b) {
		return 0
	}
	v := r.b[r.i]
	r.i++
	return int(v) % n
}

type genTensor struct {
	desc  TensorDesc
	sizes map[Dim]int64
	strd  map[Dim]int64
}

// genGeometry builds a random, usually valid, set of tensors.
func genGeometry(r *fuzzBytes) ([]genTensor, int) {
	backends := []Backend{FlashAttn, FlashInfer, MLA, CrossLayer, Paged}
	be := backends[r.intn(len(backends))]
	dt := []int64{1, 2, 4}[r.intn(3)]
	sz := map[Dim]int64{DimBlocks: int64(1 + r.intn(6)), DimBlockSize: int64(1 + r.intn(4)),
		DimHeads: int64(1 + r.intn(3)), DimHead: int64(1 + r.intn(6)), DimKV: 2, DimLayers: int64(1 + r.intn(3))}
	rank := map[Backend]int{FlashAttn: 5, FlashInfer: 5, MLA: 3, CrossLayer: 6, Paged: 4}[be]
	names, _ := DefaultDims(be, rank)
	// Physical order, innermost first: a permutation, head usually first.
	phys := append([]Dim(nil), names...)
	for i := len(phys) - 1; i > 0; i-- {
		j := r.intn(i + 1)
		phys[i], phys[j] = phys[j], phys[i]
	}
	if r.intn(4) != 0 {
		for i, d := range phys {
			if d == DimHead {
				phys[0], phys[i] = phys[i], phys[0]
			}
		}
	}
	nt := 1
	if be != CrossLayer {
		nt = 1 + r.intn(3)
	}
	// Sometimes per-layer views over one block-major buffer (vLLM's BL..
	// layouts): blocks outermost, layer t's page at t*page inside each
	// block, occasionally with padding after the layers (no merge then).
	blockMajor := be != CrossLayer && nt > 1 && r.intn(3) == 0
	var out []genTensor
	base := uint64(4096)
	for t := 0; t < nt; t++ {
		st := map[Dim]int64{}
		cur := dt
		for _, d := range phys {
			if blockMajor && d == DimBlocks {
				continue
			}
			st[d] = cur
			cur = cur*sz[d] + int64(r.intn(3))*dt*int64(r.intn(2)) // optional gap
		}
		if blockMajor {
			// cur is one page; every layer's page has this size only if no
			// gap was drawn, which the merge needs and the generator does
			// not force: New must cope either way.
			st[DimBlocks] = int64(nt)*cur + int64(r.intn(2))*dt
		}
		if r.intn(16) == 0 { // occasional nonsense stride
			st[phys[r.intn(len(phys))]] = int64(r.intn(64)) * dt
		}
		d := TensorDesc{Layer: string(rune('a' + t)), Backend: be, Device: Device{Kind: CPU}, DataPtr: base,
			DTypeSize: int(dt)}
		for _, n := range names {
			d.Shape = append(d.Shape, sz[n])
			d.Strides = append(d.Strides, st[n])
		}
		out = append(out, genTensor{desc: d, sizes: sz, strd: st})
		switch {
		case blockMajor:
			base += uint64(cur) // the next layer's page, same block
		case r.intn(8) != 0:
			base += uint64(cur) + uint64(r.intn(4))*64
		}
	}
	return out, 1 + r.intn(int(sz[DimBlocks]))
}

func FuzzPlan(f *testing.F) {
	f.Add([]byte{0, 1, 3, 1, 1, 3, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 4, 5, 6})
	f.Add([]byte{1, 2, 5, 3, 2, 5, 2, 4, 3, 2, 1, 0, 1, 1, 0, 0, 2, 7, 9})
	f.Add([]byte{2, 0, 4, 2, 0, 7, 0, 1, 1, 0, 1, 2, 3, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{3, 1, 5, 1, 2, 5, 2, 9, 1, 0, 3, 2, 1, 5, 8, 1, 1, 1, 1, 0})
	f.Add([]byte{3, 2, 2, 3, 1, 2, 1, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 9, 9, 9})
	// Per-layer views that tile a block-major buffer (merged into one run).
	f.Add([]byte{0x2, 0x97, 0x76, 0x38, 0x98, 0x77, 0xbb, 0xef, 0x7e, 0x2c, 0x76, 0x21, 0xf0, 0x6b, 0xc0, 0xb7, 0xfc, 0x7,
		0x86, 0xe2, 0xb2, 0xd0, 0x42, 0x48, 0x3c, 0xcd, 0x4a, 0x59, 0xd2, 0x87, 0x2a, 0x6c, 0x5a, 0xc7, 0x3e, 0x21, 0x71})
	f.Add([]byte{0x82, 0xb1, 0x2b, 0x25, 0x3b, 0xb4, 0xb5, 0x50, 0x5, 0xe7, 0xa2, 0x2d, 0xe5, 0x6f, 0xa5, 0x4f, 0x1d, 0xfc,
		0xce, 0x30, 0xb1, 0xe4, 0xb4, 0xf1, 0x2b, 0x1e, 0x3c, 0xd, 0xe2, 0x7c, 0xea, 0x30, 0xce, 0x79, 0xb0, 0x8c, 0x8c})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &fuzzBytes{b: data}
		gen, k := genGeometry(r)
		descs := make([]TensorDesc, len(gen))
		for i := range gen {
			descs[i] = gen[i].desc
		}
		bs := int(gen[0].sizes[DimBlockSize])
		l, err := New(descs, k*bs)
		if err != nil {
			if !errors.Is(err, ErrGeometry) {
				t.Fatalf("New: %v not ErrGeometry", err)
			}
			return
		}
		nb := int(l.NumBlocks())
		perm := make([]int64, nb)
		for i := range perm {
			perm[i] = int64(i)
		}
		if r.intn(2) == 0 {
			for i := nb - 1; i > 0; i-- {
				j := r.intn(i + 1)
				perm[i], perm[j] = perm[j], perm[i]
			}
		}
		ids := perm[:k]
		const objBase = 1 << 40
		save, err := l.Plan(ids, objBase, kv.Save)
		if err != nil {
			t.Fatalf("Plan save: %v", err)
		}
		load, err := l.Plan(ids, objBase, kv.Load)
		if err != nil {
			t.Fatalf("Plan load: %v", err)
		}
		checkPlan(t, l, gen, ids, save, load, objBase)
		// A layer-wise load's plans, one per tensor, copy the same bytes.
		var saveLW, loadLW []kv.Span
		for ti := range l.NumTensors() {
			if saveLW, err = l.AppendPlanTensor(saveLW, ids, objBase, kv.Save, ti); err != nil {
				t.Fatalf("AppendPlanTensor save %d: %v", ti, err)
			}
			if loadLW, err = l.AppendPlanTensor(loadLW, ids, objBase, kv.Load, ti); err != nil {
				t.Fatalf("AppendPlanTensor load %d: %v", ti, err)
			}
		}
		checkPlan(t, l, gen, ids, saveLW, loadLW, objBase)
	})
}

// checkPlan verifies that the plan copies exactly the chosen blocks'
// elements, each once, into exactly the object's payload.
func checkPlan(t *testing.T, l *Layout, gen []genTensor, ids []int64, save, load []kv.Span, objBase uint64) {
	payload, _ := l.PayloadSize(l.ChunkTokens())
	if len(save) != len(load) {
		t.Fatalf("save %d spans, load %d", len(save), len(load))
	}
	objCov := make([]bool, payload)
	// Device bytes per generated tensor (the layout may have merged them).
	devCov := make([][]bool, len(gen))
	for i, g := range gen {
		extent := g.desc.DTypeSize
		for k, n := range g.desc.Shape {
			extent += int(n-1) * int(g.desc.Strides[k])
		}
		devCov[i] = make([]bool, extent)
	}
	// Expected device bytes: every element of every chosen block.
	want := make([][]bool, len(gen))
	for ti, g := range gen {
		want[ti] = make([]bool, len(devCov[ti]))
		names := g.desc.Dims
		if names == nil {
			names, _ = DefaultDims(g.desc.Backend, len(g.desc.Shape))
		}
		idx := make([]int64, len(names))
		var walk func(k int)
		walk = func(k int) {
			if k == len(names) {
				var off int64
				for i := range names {
					off += idx[i] * g.desc.Strides[i]
				}
				for b := int64(0); b < int64(g.desc.DTypeSize); b++ {
					want[ti][off+b] = true
				}
				return
			}
			if names[k] == DimBlocks {
				for _, b := range ids {
					idx[k] = b
					walk(k + 1)
				}
				return
			}
			for i := int64(0); i < g.desc.Shape[k]; i++ {
				idx[k] = i
				walk(k + 1)
			}
		}
		walk(0)
	}
	for i, s := range save {
		if load[i] != (kv.Span{Src: s.Dst, Dst: s.Src, Len: s.Len}) {
			t.Fatalf("load span %d %+v is not save span %+v reversed", i, load[i], s)
		}
		if s.Len == 0 {
			t.Fatalf("empty span %d", i)
		}
		if s.Dst < objBase+HeaderSize || s.Dst+s.Len > objBase+HeaderSize+payload {
			t.Fatalf("span %+v writes outside the payload", s)
		}
		for o := s.Dst - objBase - HeaderSize; o < s.Dst-objBase-HeaderSize+s.Len; o++ {
			if objCov[o] {
				t.Fatalf("object byte %d written twice", o)
			}
			objCov[o] = true
		}
		// Device side: inside one tensor; a span may cross into an
		// adjacent tensor only byte by byte, so check every byte.
		for a := s.Src; a < s.Src+s.Len; a++ {
			hit := false
			for ti, g := range gen {
				base := g.desc.DataPtr
				if a >= base && a < base+uint64(len(want[ti])) && want[ti][a-base] {
					if devCov[ti][a-base] {
						t.Fatalf("device byte %#x read twice", a)
					}
					devCov[ti][a-base] = true
					hit = true
					break
				}
			}
			if !hit {
				t.Fatalf("span %+v reads %#x outside the chosen blocks of every tensor", s, a)
			}
		}
	}
	for o, c := range objCov {
		if !c {
			t.Fatalf("object byte %d never written", o)
		}
	}
	for ti := range gen {
		for a := range want[ti] {
			if want[ti][a] != devCov[ti][a] {
				t.Fatalf("tensor %d byte %d: in block %v, copied %v", ti, a, want[ti][a], devCov[ti][a])
			}
		}
	}
}

// FuzzVerifyObject: the object checks never panic on any bytes; an object
// they accept is exactly what SealObject writes for its payload under the
// key it was checked against (so no other key, layout or size passes), and
// any error is corruption.
func FuzzVerifyObject(f *testing.F) {
	l, err := New([]TensorDesc{mla("l0", 0x1000)}, tBS)
	if err != nil {
		f.Fatal(err)
	}
	key := kv.Key{Namespace: [16]byte{0xA1}, Rank: 1, Hash: [32]byte{7}}
	size, _ := l.ObjectSize(tBS)
	good := make([]byte, size)
	for i := range good {
		good[i] = byte(i)
	}
	if err := l.SealObject(good, key); err != nil {
		f.Fatal(err)
	}
	f.Add(good, false)
	f.Add(good[:HeaderSize], true)
	other := append([]byte(nil), good...)
	other[HeaderSize] ^= 1
	if err := l.SealObject(other, kv.Key{Namespace: key.Namespace, Rank: 2, Hash: key.Hash}); err != nil {
		f.Fatal(err)
	}
	f.Add(other, false)
	f.Fuzz(func(t *testing.T, obj []byte, headerOnly bool) {
		check := l.VerifyObject
		if headerOnly {
			check = l.CheckHeader
		}
		err := check(obj, key)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%v does not wrap ErrCorrupt", err)
			}
			return
		}
		if uint64(len(obj)) != size {
			t.Fatalf("accepted an object of %d bytes, want %d", len(obj), size)
		}
		want := append([]byte(nil), obj...)
		n := len(obj)
		if headerOnly {
			// The payload CRC is not checked: the header must be what
			// SealObject writes for a payload with that CRC.
			n = HeaderSize
			h := Header{PayloadSize: size - HeaderSize, ChunkTokens: tBS, Fingerprint: l.Fingerprint(), Key: key,
				PayloadCRC: binary.LittleEndian.Uint32(obj[120:]), HasPayloadCRC: string(obj[124:128]) == "CRC1"}
			h.Encode(want)
		} else if err := l.SealObject(want, key); err != nil {
			t.Fatal(err)
		}
		if string(obj[:n]) != string(want[:n]) {
			t.Fatalf("accepted header\n%x\nbut SealObject writes\n%x", obj[:HeaderSize], want[:HeaderSize])
		}
	})
}
