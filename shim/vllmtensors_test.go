package shim

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvshim/kvshim/layout"
)

// Geometry of the cases: 24 blocks of 16 tokens, 2 heads of 16 (K and V:
// 32 content elements), bf16.
const (
	vtNB, vtBS, vtH, vtD = 24, 16, 2, 16
)

// torchT is torch.empty(phys, dtype of esize bytes).permute(perm) at ptr,
// as the connector copies it (_raw): shape and strides in elements.
func torchT(layer string, ptr uint64, esize int, phys []int64, perm ...int) VLLMTensor {
	st := make([]int64, len(phys))
	n := int64(1)
	for i := len(phys) - 1; i >= 0; i-- {
		st[i] = n
		n *= phys[i]
	}
	if perm == nil {
		for i := range phys {
			perm = append(perm, i)
		}
	}
	shape, strides := make([]int64, len(perm)), make([]int64, len(perm))
	for i, p := range perm {
		shape[i], strides[i] = phys[p], st[p]
	}
	return VLLMTensor{Layer: layer, Device: "cpu", DataPtr: ptr, DTypeSize: esize, Shape: shape, Strides: strides,
		StoragePtr: ptr, StorageBytes: uint64(n) * uint64(esize)}
}

var (
	vtFull    = []string{"FullAttentionSpec", "AttentionSpec", "KVCacheSpec", "object"}
	vtSliding = []string{"SlidingWindowSpec", "AttentionSpec", "KVCacheSpec", "object"}
	vtMamba   = []string{"MambaSpec", "KVCacheSpec", "object"}
)

// vtDesc is the descriptor the Python connector wrote (worker.py's
// _tensor_desc before the move), strides in bytes.
func vtDesc(layer string, group int, be layout.Backend, ptr uint64, esize int, shape, strideBytes []int64) layout.TensorDesc {
	return layout.TensorDesc{Layer: layer, Group: group, Backend: be, Device: layout.Device{Kind: layout.CPU}, DataPtr: ptr,
		DTypeSize: esize, Shape: shape, Strides: strideBytes, StoragePtr: ptr}
}

func TestVLLMTensors(t *testing.T) {
	const mb = 1 << 20
	kernelDims := []layout.Dim{layout.DimBlocks, layout.DimKernelBlocks, layout.DimHeads, layout.DimBlockSize, layout.DimHead}
	for _, tc := range []struct {
		name   string
		groups []VLLMGroup
		in     []VLLMTensor
		want   []layout.TensorDesc // StorageBytes not compared
		layout bool                // the answer passes layout.NewGroups
	}{
		{name: "flash_attn NHD", in: []VLLMTensor{torchT("l0", mb, 2, []int64{2, vtNB, vtBS, vtH, vtD})},
			want: []layout.TensorDesc{vtDesc("l0", 0, layout.FlashAttn, mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 64, 32, 2})}, layout: true},
		{name: "flash_attn HND: heads stored before tokens", in: []VLLMTensor{torchT("l0", mb, 2, []int64{2, vtNB, vtH, vtBS, vtD}, 0, 1, 3, 2, 4)},
			want: []layout.TensorDesc{vtDesc("l0", 0, layout.FlashAttn, mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 32, 512, 2})}, layout: true},
		{name: "flashinfer", in: []VLLMTensor{torchT("l0", mb, 2, []int64{vtNB, 2, vtBS, vtH, vtD})},
			want: []layout.TensorDesc{vtDesc("l0", 0, layout.FlashInfer, mb, 2, []int64{vtNB, 2, vtBS, vtH, vtD}, []int64{2048, 1024, 64, 32, 2})}, layout: true},
		{name: "mla", in: []VLLMTensor{torchT("l0", mb, 2, []int64{vtNB, vtBS, 64})},
			want: []layout.TensorDesc{vtDesc("l0", 0, layout.MLA, mb, 2, []int64{vtNB, vtBS, 64}, []int64{2048, 128, 2})}, layout: true},
		{name: "paged LBNHC", in: []VLLMTensor{torchT("l0", mb, 2, []int64{vtNB, vtBS, vtH, 2 * vtD}, 0, 2, 1, 3)},
			want: []layout.TensorDesc{vtDesc("l0", 0, layout.Paged, mb, 2, []int64{vtNB, vtH, vtBS, 2 * vtD}, []int64{2048, 64, 128, 2})}, layout: true},
		{
			// Kernel blocks of 8 tokens, token-major (LBNHC): kernel block
			// 2b+1's tokens follow 2b's, so the whole blocks are the
			// (blocks, heads, 16, content) view of the same memory: the
			// descriptor of "paged LBNHC".
			name:   "kernel split LBNHC: viewed in whole blocks",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"l0"}, BlockSize: vtBS}},
			in:     []VLLMTensor{torchT("l0", mb, 2, []int64{2 * vtNB, 8, vtH, 2 * vtD}, 0, 2, 1, 3)},
			want:   []layout.TensorDesc{vtDesc("l0", 0, layout.Paged, mb, 2, []int64{vtNB, vtH, vtBS, 2 * vtD}, []int64{2048, 64, 128, 2})}, layout: true,
		},
		{
			// Head-major (LBHNC): a head's 8 tokens, then the next head's;
			// a block is its 2 kernel blocks.
			name:   "kernel split LBHNC: a kernel_blocks dimension",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"l0"}, BlockSize: vtBS}},
			in:     []VLLMTensor{torchT("l0", mb, 2, []int64{2 * vtNB, vtH, 8, 2 * vtD})},
			want: []layout.TensorDesc{func() layout.TensorDesc {
				d := vtDesc("l0", 0, layout.Paged, mb, 2, []int64{vtNB, 2, vtH, 8, 2 * vtD}, []int64{2048, 1024, 512, 64, 2})
				d.Dims = kernelDims
				return d
			}()}, layout: true,
		},
		{
			// No kv_cache_config: the scheduler's block size decides the split.
			name: "kernel split, no groups", in: []VLLMTensor{torchT("l0", mb, 2, []int64{4 * vtNB, vtH, 4, 2 * vtD})},
			want: []layout.TensorDesc{func() layout.TensorDesc {
				d := vtDesc("l0", 0, layout.Paged, mb, 2, []int64{vtNB, 4, vtH, 4, 2 * vtD}, []int64{2048, 512, 256, 64, 2})
				d.Dims = kernelDims
				return d
			}()}, layout: true,
		},
		{
			// The group's block size is the block, not the scheduler's.
			name:   "a group's block_size",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"l0"}, BlockSize: 2 * vtBS}},
			in:     []VLLMTensor{torchT("l0", mb, 2, []int64{vtNB, 2 * vtBS, vtH, 2 * vtD}, 0, 2, 1, 3)},
			want:   []layout.TensorDesc{vtDesc("l0", 0, layout.Paged, mb, 2, []int64{vtNB, vtH, 2 * vtBS, 2 * vtD}, []int64{4096, 64, 128, 2})}, layout: true,
		},
		{
			// 0: the spec had none (Python's `or`): the scheduler's.
			name:   "a group's block_size 0",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"l0"}}},
			in:     []VLLMTensor{torchT("l0", mb, 2, []int64{vtNB, vtBS, vtH, 2 * vtD}, 0, 2, 1, 3)},
			want:   []layout.TensorDesc{vtDesc("l0", 0, layout.Paged, mb, 2, []int64{vtNB, vtH, vtBS, 2 * vtD}, []int64{2048, 64, 128, 2})}, layout: true,
		},
		{
			// Only a 4-dim view is split: the 5-dim backends' block_size
			// is what they have.
			name: "5 dims never split", in: []VLLMTensor{torchT("l0", mb, 2, []int64{2, vtNB, 8, vtH, vtD})},
			want: []layout.TensorDesc{vtDesc("l0", 0, layout.FlashAttn, mb, 2, []int64{2, vtNB, 8, vtH, vtD}, []int64{12288, 512, 64, 32, 2})},
		},
		{
			// vLLM 0.33's Mamba page view: (blocks, heads, 1 state, state
			// bytes) int8; the block stands for 16 tokens (not split
			// though dim 2 is not 16).
			name: "mamba state",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"attn"}, BlockSize: vtBS},
				{Classes: vtMamba, Layers: []string{"ssm"}, BlockSize: vtBS}},
			in: []VLLMTensor{torchT("ssm", 8*mb, 1, []int64{vtNB, 1, 1, 4096}), torchT("attn", mb, 2, []int64{vtNB, vtBS, vtH, 2 * vtD}, 0, 2, 1, 3)},
			want: []layout.TensorDesc{
				func() layout.TensorDesc {
					d := vtDesc("ssm", 1, layout.Paged, 8*mb, 1, []int64{vtNB, 1, 1, 4096}, []int64{4096, 4096, 4096, 1})
					d.BlockTokens = vtBS
					return d
				}(),
				vtDesc("attn", 0, layout.Paged, mb, 2, []int64{vtNB, vtH, vtBS, 2 * vtD}, []int64{2048, 64, 128, 2}),
			},
			layout: true,
		},
		{
			// vLLM's hybrid allocator: the i-th layers of both groups view
			// one tensor, each registered in its group. "x" reads l0's KV
			// (KV sharing, in no group): not registered; "y" (in no group,
			// its own tensor) is, in group 0, after the groups' layers.
			// "g0" is named by a group but this rank has no tensor of it.
			name: "hybrid groups, KV sharing, layers in no group",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"l0", "l2", "g0"}, BlockSize: vtBS},
				{Classes: vtSliding, Layers: []string{"l1", "l3"}, BlockSize: vtBS}},
			in: []VLLMTensor{
				torchT("y", 9*mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}),
				torchT("x", mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}),
				torchT("l0", mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}),
				torchT("l1", mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}),
				torchT("l2", 2*mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}),
				torchT("l3", 2*mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}),
			},
			want: []layout.TensorDesc{
				vtDesc("l0", 0, layout.FlashAttn, mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 64, 32, 2}),
				vtDesc("l1", 1, layout.FlashAttn, mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 64, 32, 2}),
				vtDesc("l2", 0, layout.FlashAttn, 2*mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 64, 32, 2}),
				vtDesc("l3", 1, layout.FlashAttn, 2*mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 64, 32, 2}),
				vtDesc("y", 0, layout.FlashAttn, 9*mb, 2, []int64{2, vtNB, vtBS, vtH, vtD}, []int64{24576, 1024, 64, 32, 2}),
			},
			layout: true,
		},
		{
			// KV sharing inside a group, and between two layers of no
			// group: the first registered only. A skipped tensor's shape
			// is not read (the Python skipped it first).
			name:   "KV sharing in a group and in none",
			groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"a", "b"}, BlockSize: vtBS}},
			in: []VLLMTensor{
				torchT("c", 4*mb, 2, []int64{vtNB, vtBS, 64}),
				torchT("d", 4*mb, 2, []int64{vtNB, 64}), // unsupported shape, never read
				torchT("a", mb, 2, []int64{vtNB, vtBS, 64}),
				torchT("b", mb, 2, []int64{vtNB, vtBS, 64}),
			},
			want: []layout.TensorDesc{
				vtDesc("a", 0, layout.MLA, mb, 2, []int64{vtNB, vtBS, 64}, []int64{2048, 128, 2}),
				vtDesc("c", 0, layout.MLA, 4*mb, 2, []int64{vtNB, vtBS, 64}, []int64{2048, 128, 2}),
			},
			layout: true,
		},
		{name: "no tensors", want: []layout.TensorDesc{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := VLLMTensors(VLLMTensorsIn{BlockSize: vtBS, Groups: tc.groups, Tensors: tc.in})
			if err != nil {
				t.Fatal(err)
			}
			for i := range got {
				got[i].StorageBytes = 0
			}
			if got == nil || !vtDescsEqual(got, tc.want) {
				t.Fatalf("got\n%+v\nwant\n%+v", got, tc.want)
			}
			if tc.layout {
				if _, err := layout.NewGroups(got, 4*vtBS); err != nil {
					t.Fatalf("layout refuses the answer: %v", err)
				}
			}
		})
	}
}

func vtDescsEqual(a, b []layout.TensorDesc) bool {
	return slices.EqualFunc(a, b, func(x, y layout.TensorDesc) bool {
		return x.Layer == y.Layer && x.Group == y.Group && x.Backend == y.Backend && x.Device == y.Device &&
			x.DataPtr == y.DataPtr && x.DTypeSize == y.DTypeSize && slices.Equal(x.Shape, y.Shape) &&
			slices.Equal(x.Strides, y.Strides) && slices.Equal(x.Dims, y.Dims) && x.StoragePtr == y.StoragePtr &&
			x.StorageBytes == y.StorageBytes && x.BlockTokens == y.BlockTokens
	})
}

// torch's "cuda" (no index) is cuda:0, as the connector wrote it.
func TestVLLMTensorsDevice(t *testing.T) {
	for dev, want := range map[string]string{"cuda": "cuda:0", "cuda:3": "cuda:3", "cpu": "cpu"} {
		x := torchT("l0", 1<<20, 2, []int64{vtNB, vtBS, 64})
		x.Device = dev
		in := []VLLMTensor{x}
		got, err := VLLMTensors(VLLMTensorsIn{BlockSize: vtBS, Tensors: in})
		if err != nil || got[0].Device.String() != want || in[0].Device != dev {
			t.Errorf("%s: %v, %v (input now %q); want %s", dev, got, err, in[0].Device, want)
		}
	}
}

// The JSON in and out: what kvshim_vllm_tensors reads and writes.
func TestParseVLLMTensors(t *testing.T) {
	doc := `{"block_size": 16, "groups": [{"classes": ["MambaSpec", "KVCacheSpec", "object"], "layers": ["m"], "block_size": 16,
	  "dtype": "torch.float16", "mamba_cache_mode": "align"}],
	  "tensors": [{"layer": "m", "device": "cuda", "data_ptr": 4096, "dtype_size": 1, "shape": [24, 1, 1, 4096],
	   "strides": [4096, 4096, 4096, 1], "storage_ptr": 4096, "storage_bytes": 98304}]}`
	got, err := ParseVLLMTensors([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(got)
	want := `[{"layer":"m","group":0,"backend":"paged","device":"cuda:0","data_ptr":4096,"dtype_size":1,"shape":[24,1,1,4096],` +
		`"stride_bytes":[4096,4096,4096,1],"storage_ptr":4096,"storage_bytes":98304,"block_tokens":16}]`
	if string(b) != want {
		t.Fatalf("got  %s\nwant %s", b, want)
	}
	b, _ = json.Marshal(vtMust(ParseVLLMTensors([]byte(`{"block_size": 16, "groups": null, "tensors": []}`))))
	if string(b) != "[]" {
		t.Fatalf("no tensors: %s", b)
	}
}

func vtMust[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// Every bad field is layout.ErrGeometry (KVSHIM_EINVAL) naming it.
func TestVLLMTensorsRefusals(t *testing.T) {
	one := func(edit func(*VLLMTensor)) string {
		x := torchT("l0", 1<<20, 2, []int64{vtNB, vtBS, vtH, 2 * vtD}, 0, 2, 1, 3)
		edit(&x)
		b, _ := json.Marshal(VLLMTensorsIn{BlockSize: vtBS, Tensors: []VLLMTensor{torchT("l9", 1<<30, 2, []int64{vtNB, vtBS, 64}), x}})
		return string(b)
	}
	mamba := func(shape ...int64) string {
		b, _ := json.Marshal(VLLMTensorsIn{BlockSize: vtBS, Groups: []VLLMGroup{{Classes: vtMamba, Layers: []string{"m"}, BlockSize: vtBS}},
			Tensors: []VLLMTensor{torchT("m", 1<<20, 1, shape)}})
		return string(b)
	}
	for _, tc := range []struct{ doc, want string }{
		{`{"block_size": 0, "tensors": []}`, "block_size: 0 (want > 0)"},
		{`{"tensors": []}`, "block_size: 0 (want > 0)"},
		{`{"block_size": 16, "groups": [{"classes": ["A"], "layers": []}, {"classes": [], "layers": []}]}`, "groups[1].classes: empty"},
		{`{"block_size": 16, "groups": [{"classes": ["A"], "block_size": -16}]}`, "groups[0].block_size: -16"},
		{`{"block_size": 16, "groups": [{"classes": ["A"], "layers": ["a", "b"]}, {"classes": ["B"], "layers": ["c", "a"]}]}`,
			`groups[1].layers[1]: layer "a" is in group 0 too`},
		{one(func(x *VLLMTensor) { x.Layer = "" }), "tensors[1].layer: empty"},
		{one(func(x *VLLMTensor) { x.Layer = "l9" }), `tensors[1].layer: "l9" twice`},
		{one(func(x *VLLMTensor) { x.Device = "tpu" }), `tensors[1].device: "tpu" is not cpu, cuda or cuda:N`},
		{one(func(x *VLLMTensor) { x.Device = "cuda:-1" }), `tensors[1].device`},
		{one(func(x *VLLMTensor) { x.Device = "" }), `tensors[1].device`},
		{one(func(x *VLLMTensor) { x.DTypeSize = 0 }), "tensors[1].dtype_size: 0"},
		{one(func(x *VLLMTensor) { x.Strides = x.Strides[:3] }), "tensors[1].strides: 3 strides for 4 dims"},
		{one(func(x *VLLMTensor) { x.Shape[1] = -2 }), "tensors[1].shape: dim 1 has size -2"},
		{one(func(x *VLLMTensor) { x.Strides[0] = 1 << 62 }), "tensors[1].strides: stride 4611686018427387904 of dim 0 overflows"},
		{one(func(x *VLLMTensor) { x.Shape = []int64{2, 3}; x.Strides = []int64{3, 1} }),
			`tensors[1].shape: KV tensor "l0": unsupported shape [2, 3] (want vLLM 0.33's`},
		{one(func(x *VLLMTensor) { x.Shape = []int64{3, 3, 16, 2, 16}; x.Strides = []int64{1, 1, 1, 1, 1} }),
			`tensors[1].shape: KV tensor "l0": unsupported shape [3, 3, 16, 2, 16]`},
		{one(func(x *VLLMTensor) { x.Shape[2] = 5 }), `tensors[1].shape: KV tensor "l0": kernel blocks of 5 tokens do not divide vLLM's 16-token blocks`},
		{one(func(x *VLLMTensor) { x.Shape[2] = 32 }), "kernel blocks of 32 tokens do not divide"},
		{one(func(x *VLLMTensor) { x.Shape[2] = 0 }), "kernel blocks of 0 tokens do not divide"},
		{one(func(x *VLLMTensor) { x.Shape[0], x.Shape[2] = 47, 8 }), "kernel blocks of 8 tokens do not divide"},
		{one(func(x *VLLMTensor) { x.Shape[2] = 8; x.Strides[0] = 1 << 61 }), "tensors[1].strides: KV tensor \"l0\": a block's stride"},
		{mamba(vtNB, 1, 2, 4096), `tensors[0].shape: Mamba state tensor "m": shape [24, 1, 2, 4096], want vLLM 0.33's (blocks, heads, 1, state bytes) view`},
		{mamba(vtNB, 1, 4096), `Mamba state tensor "m": shape [24, 1, 4096]`},
		// the decoder: strict, each entry named
		{`{"block_size": 16, "tensor": []}`, `vLLM tensors: json: unknown field "tensor"`},
		{`{"block_size": 16, "tensors": [{"layer": "a"}, {"layer": "b", "stride": []}]}`, `tensors[1]: json: unknown field "stride"`},
		{`{"block_size": 16, "tensors": [{"layer": "a", "data_ptr": -1}]}`, `tensors[0]: json: cannot unmarshal number -1`},
		{`{"block_size": 16, "groups": [{"classes": "A"}]}`, `groups[0]: json: cannot unmarshal string`},
		{`{"block_size": 16, "groups": [{"classes": ["A"], "kind": 1}]}`, `groups[0]: json: unknown field "kind"`},
		{`{"block_size": 16} {}`, "vLLM tensors: data after the JSON value"},
		{`[`, "vLLM tensors: unexpected EOF"},
		{``, "vLLM tensors: EOF"},
	} {
		_, err := ParseVLLMTensors([]byte(tc.doc))
		if !errors.Is(err, layout.ErrGeometry) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want ErrGeometry with %q", tc.doc, err, tc.want)
		}
	}
}

// Whatever the bytes, the decoder answers an error or descriptors that
// kvshim_worker_register can read: one per layer, a backend layout knows
// with the dims its rank needs, byte strides, and the same after a JSON
// round trip; layout.NewGroups may refuse their geometry, with
// ErrGeometry and no panic.
func FuzzVLLMTensors(f *testing.F) {
	fa := torchT("l0", 1<<20, 2, []int64{2, vtNB, vtBS, vtH, vtD})
	lbnhc := torchT("l1", 1<<21, 2, []int64{2 * vtNB, 8, vtH, 2 * vtD}, 0, 2, 1, 3)
	lbhnc := torchT("l2", 1<<22, 2, []int64{2 * vtNB, vtH, 8, 2 * vtD})
	ssm := torchT("m", 1<<23, 1, []int64{vtNB, 1, 1, 4096})
	for _, in := range []VLLMTensorsIn{
		{BlockSize: vtBS, Tensors: []VLLMTensor{fa, lbnhc, lbhnc}},
		{BlockSize: vtBS, Groups: []VLLMGroup{{Classes: vtFull, Layers: []string{"l0", "l1"}, BlockSize: vtBS},
			{Classes: vtMamba, Layers: []string{"m", "l2"}, BlockSize: vtBS}}, Tensors: []VLLMTensor{ssm, fa, lbnhc, lbhnc}},
		{BlockSize: 8, Groups: []VLLMGroup{{Classes: vtSliding, Layers: []string{"l2"}}}, Tensors: []VLLMTensor{lbhnc, fa}},
	} {
		b, err := json.Marshal(in)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(`{"block_size": 16, "tensors": [{"layer": "a", "device": "cuda", "dtype_size": 2, "shape": [4, 2, 0, 8], "strides": [0, 0, 0, 1]}]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		descs, err := ParseVLLMTensors(b)
		if err != nil {
			if !errors.Is(err, layout.ErrGeometry) {
				t.Fatalf("%v: not ErrGeometry", err)
			}
			return
		}
		var in VLLMTensorsIn
		if err := json.Unmarshal(b, &in); err != nil {
			t.Fatalf("accepted what encoding/json refuses: %v", err)
		}
		inputs := map[string]VLLMTensor{}
		for _, x := range in.Tensors {
			inputs[x.Layer] = x
		}
		layers := map[string]bool{}
		for _, d := range descs {
			x, ok := inputs[d.Layer]
			switch {
			case !ok || layers[d.Layer]:
				t.Fatalf("%s: not one of the input's layers, or twice", d.Layer)
			case d.Group < 0 || d.Group >= max(1, len(in.Groups)):
				t.Fatalf("%s: group %d of %d", d.Layer, d.Group, len(in.Groups))
			case d.DTypeSize != x.DTypeSize || d.DTypeSize < 1 || d.DataPtr != x.DataPtr:
				t.Fatalf("%s: dtype_size %d, data_ptr %d of %+v", d.Layer, d.DTypeSize, d.DataPtr, x)
			case d.Device.Kind != layout.CPU && d.Device.Kind != layout.CUDA:
				t.Fatalf("%s: device %v", d.Layer, d.Device)
			case len(d.Shape) != len(d.Strides):
				t.Fatalf("%s: shape %v, strides %v", d.Layer, d.Shape, d.Strides)
			}
			layers[d.Layer] = true
			if d.Dims == nil {
				if _, ok := layout.DefaultDims(d.Backend, len(d.Shape)); !ok {
					t.Fatalf("%s: backend %s has no default dims for rank %d", d.Layer, d.Backend, len(d.Shape))
				}
			} else if len(d.Dims) != len(d.Shape) || !slices.Contains(d.Dims, layout.DimKernelBlocks) || d.Shape[0]*d.Shape[1] != x.Shape[0] {
				t.Fatalf("%s: dims %v for shape %v (input %v)", d.Layer, d.Dims, d.Shape, x.Shape)
			}
			for _, s := range d.Strides {
				if s%int64(d.DTypeSize) != 0 {
					t.Fatalf("%s: stride %d bytes of %d-byte elements", d.Layer, s, d.DTypeSize)
				}
			}
			if d.BlockTokens != 0 && (len(d.Shape) != 4 || d.Shape[2] != 1) {
				t.Fatalf("%s: block_tokens %d with shape %v", d.Layer, d.BlockTokens, d.Shape)
			}
		}
		out, err := json.Marshal(descs)
		if err != nil {
			t.Fatal(err)
		}
		var back []layout.TensorDesc
		if err := json.Unmarshal(out, &back); err != nil || !vtDescsEqual(back, descs) {
			t.Fatalf("%s does not read back: %v", out, err)
		}
		if len(descs) > 0 {
			if _, err := layout.NewGroups(descs, 64); err != nil && !errors.Is(err, layout.ErrGeometry) {
				t.Fatalf("layout: %v", err)
			}
		}
	})
}
