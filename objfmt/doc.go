// Package objfmt is the byte format of a chunk object's header, shared by
// the writer and reader of objects (package layout, in the vLLM worker) and
// by the server's L2 store and fill paths (package server/tier), which never
// know the KV layout. It imports only the standard library, so every
// package can use it.
//
// A chunk object is a header of HeaderSize bytes followed by the payload
// (the chunk's KV bytes in the layout's natural order). Format version 3,
// all integers little-endian:
//
//	 off  size  field
//	+----+----+------------------------------------------------------+
//	|   0|   4| magic "KVSO"                                         |
//	|   4|   2| format version (3)                                   |
//	|   6|   2| header size (128)                                    |
//	|   8|   8| payload size in bytes                                |
//	|  16|   4| chunk tokens                                         |
//	|  20|   4| reserved, zero                                       |
//	|  24|  32| layout fingerprint (SHA-256, package layout)          |
//	|  56|  16| key: namespace fingerprint                           |
//	|  72|   4| key: rank (the KV rank in the object's key)          |
//	|  76|  32| key: chunk hash                                      |
//	| 108|   8| reserved, zero                                       |
//	| 116|   4| header CRC-32C over bytes 0..115                     |
//	+----+----+------------------------------------------------------+
//	| 120|   4| payload CRC-32C (Castagnoli)   \ the payload CRC slot:|
//	| 124|   4| slot state: 0 empty, "CRC1" set / not under the      |
//	|    |    |                                  header CRC          |
//	+----+----+------------------------------------------------------+
//	| 128|   n| payload (n = payload size)                           |
//	+----+----+------------------------------------------------------+
//
// The header is a multiple of 64 bytes, so payloads stay cache-line (and
// DMA) aligned where objects are. The key fields bind the bytes to the
// object's key (namespace, rank, chunk hash): bytes stored or copied under
// another key (a file copied over another, a stale writer) fail Verify or
// CheckKey with ErrKeyMismatch instead of being served.
//
// # The payload CRC slot
//
// The header CRC covers every byte before it; the last 8 bytes are the
// payload CRC slot, the only part of an object that may change after it is
// sealed: empty (all zero) or set (the payload's CRC-32C, then "CRC1").
// SealHeader seals an object without reading its payload (128 bytes a
// chunk), leaving the slot empty; SetPayloadCRC later computes the CRC and
// sets the slot with one atomic 8-byte store, while the object may be read,
// so a concurrent reader (Decode loads the slot atomically) sees it empty
// or set, never torn. Seal does both at once. Any other slot is corrupt.
// Since the header CRC does not cover the slot, a flipped bit in a set CRC
// is caught by the payload check (a mismatch), not by Decode; a flipped bit
// in the state makes the slot corrupt or empty, and an empty slot fails
// every check that needs a payload CRC (ErrNoPayloadCRC).
//
// # Where payloads are checked (VerifyPolicy, kvshim.verify)
//
// Corruption enters where bytes cross a disk or a network: L2. Objects
// that a worker writes into L1 by DMA and another reads back by DMA are not
// re-read by the CPU. Under the default policy (VerifyL2):
//
//   - a worker's save copies the chunk into L1, seals the header only
//     (SealHeader) and commits: no pass over the payload on the save path;
//   - the server's L2 store, which pins the committed object and hands its
//     bytes to the adapters anyway, first sets its payload CRC in L1
//     (SetPayloadCRC), so every L2 copy carries one;
//   - an L2 fill serves an object only if Verify passes: header, key, size
//     and a set payload CRC that matches (an L2 object without one is
//     rejected);
//   - every L1 read checks the header, fingerprint, sizes and key (128
//     bytes), never the payload.
//
// VerifyAlways adds a payload pass to the worker: saves Seal (CRC set
// before COMMIT) and every load verifies it; VerifyOff skips payload checks
// everywhere, L2 fills included (unsafe with L2).
//
// Decode accepts exactly the headers Encode writes: magic, version, header
// size, header CRC, zero reserved bytes and the slot's form are checked.
// Objects of format version 1 (64-byte header, no key) or 2 (payload CRC
// under the header CRC) are rejected as a format version mismatch; they
// are misses, never migrated (the version is part of every namespace).
//
// Errors wrap ErrCorrupt; a header that names another key wraps
// ErrKeyMismatch, and a payload check of an object without a payload CRC
// wraps ErrNoPayloadCRC, both of which wrap ErrCorrupt, so callers that only
// ask "corrupt?" still match and those that count them can tell them apart.
package objfmt
