package shim

import (
	"testing"

	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// BenchmarkSealChunks: the checksums of one save of 8 Llama-3-8B chunks
// (32 MiB objects), one chunk after the other and as the worker does them,
// in parallel over chunks.
func BenchmarkSealChunks(b *testing.B) {
	const layers, blocks, chunkTokens = 32, 16, 256
	page := int64(8 * 16 * 256 * 2) // heads, tokens, K|V, bf16
	mem, err := unix.Mmap(-1, 0, int(layers*blocks*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	assert.NilError(b, err)
	defer unix.Munmap(mem)
	var descs []layout.TensorDesc
	for i := range layers {
		descs = append(descs, layout.TensorDesc{Layer: "l" + string(rune('A'+i)), Backend: layout.Paged,
			Device: layout.Device{Kind: layout.CPU}, DataPtr: addrOf(mem) + uint64(int64(i)*blocks*page), DTypeSize: 2,
			Shape: []int64{blocks, 8, 16, 256}, Strides: []int64{page, 512, 8 * 512, 2}})
	}
	l, err := layout.New(descs, chunkTokens)
	assert.NilError(b, err)
	size, err := l.ObjectSize(chunkTokens)
	assert.NilError(b, err)
	objs := make([][]byte, 8)
	for i := range objs {
		o, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		assert.NilError(b, err)
		defer unix.Munmap(o)
		for k := range o {
			o[k] = byte(k * 7)
		}
		objs[i] = o
	}
	b.Run("sequential", func(b *testing.B) {
		for b.Loop() {
			for _, o := range objs {
				assert.NilError(b, l.SealObject(o, kv.Key{}))
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		for b.Loop() {
			inParallel(len(objs), func(i int) { assert.NilError(b, l.SealObject(objs[i], kv.Key{})) })
		}
	})
}
