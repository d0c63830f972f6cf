// Package layout turns vLLM's paged KV-cache tensors into copy plans.
//
// The Python connector reports every registered KV tensor (TensorDesc: data
// pointer, device, dtype size, shape, strides in bytes, backend, layer, KV
// group). New validates them into a Layout; nothing about the physical order
// is assumed, it is read from the strides. Supported: vLLM 0.33's per-layer
// view (blocks, heads, block_size, K|V content) in any of its KVCacheLayout
// stride orders (Paged: what vLLM 0.33 registers, FlashAttention and MLA
// alike), the older FlashAttention (2, blocks, block_size, heads, head) and
// FlashInfer (blocks, 2, ...) in NHD or HND stride order, MLA (blocks,
// block_size, head), and the cross-layer tensor (blocks, layers, 2,
// block_size, heads, head) in any stride order.
//
// Each block of a tensor is a set of equal, contiguous runs: the dense inner
// dims (head, heads, block_size, ... up to the first gap) form one run, and
// the remaining non-block dims (K/V for FlashAttention) enumerate the runs.
//
//	FlashAttention NHD, one layer          object payload (chunk of n blocks)
//	┌────────────────────────────────┐     ┌─────────────────────────────────┐
//	│ K │ b0 │ b1 │ b2 │ ... │ bNB-1 │     │ layer0 K: ids[0] ids[1] .. [n-1]│
//	├───┼────┼────┼────┼─────┼───────┤     │ layer0 V: ids[0] ids[1] .. [n-1]│
//	│ V │ b0 │ b1 │ b2 │ ... │ bNB-1 │     │ layer1 K: ...                   │
//	└────────────────────────────────┘     │ ...                             │
//	  one cell = block_size*heads*head      └─────────────────────────────────┘
//	  elements = one run                    consecutive ids -> one span per run
//
//	cross-layer: ┌ b0: L0 K V │ L1 K V │ ... ┐┌ b1: ... ┐   one run per block
//	object:      [ ids[0] block ][ ids[1] block ] ...     consecutive ids ->
//	                                                       one span per chunk
//
// Per-layer views whose runs together tile every block of one block-major
// buffer (vLLM 0.33's BLNHC, BLHNC, BHLNC) are copied as one cross-layer
// tensor: one run per block for all layers (merge.go).
//
// An object is a 128-byte header (package objfmt: magic "KVSO", format
// version, payload size, chunk tokens, payload CRC-32C, layout fingerprint,
// the object's own key — namespace, rank, chunk hash — and a header CRC-32C)
// followed by the payload above: tensors in registration order, within a tensor the
// runs in address order, within a run the chunk's blocks in token order.
//
// Plan(blockIDs, objectBase, dir) returns the spans (Src, Dst, Len) that
// copy one chunk; spans contiguous on both sides are merged. A plan never
// touches a byte outside a tensor or outside the object; table tests with
// hand-computed offsets and a fuzz target check it.
package layout
