// Package objfmt is the byte format of a chunk object's header, shared by
// the writer and reader of objects (package layout, in the vLLM worker) and
// by the server's L2 fill path (package server/tier), which never knows the
// KV layout. It imports only the standard library, so every package can
// use it.
//
// A chunk object is a header of HeaderSize bytes followed by the payload
// (the chunk's KV bytes in the layout's natural order). Format version 2,
// all integers little-endian:
//
//	 off  size  field
//	+----+----+------------------------------------------------------+
//	|   0|   4| magic "KVSO"                                         |
//	|   4|   2| format version (2)                                   |
//	|   6|   2| header size (128)                                    |
//	|   8|   8| payload size in bytes                                |
//	|  16|   4| chunk tokens                                         |
//	|  20|   4| payload CRC-32C (Castagnoli) over the payload         |
//	|  24|  32| layout fingerprint (SHA-256, package layout)          |
//	|  56|  16| key: namespace fingerprint                           |
//	|  72|   4| key: rank (the KV rank in the object's key)          |
//	|  76|  32| key: chunk hash                                      |
//	| 108|  16| reserved, zero                                       |
//	| 124|   4| header CRC-32C over bytes 0..123                     |
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
// Decode accepts exactly the headers Encode writes: magic, version, header
// size, header CRC and zero reserved bytes are checked. Version 1 objects
// (64-byte header, no key) are rejected as a format version mismatch; they
// are misses, never migrated.
//
// Errors wrap ErrCorrupt; a header that names another key wraps
// ErrKeyMismatch, which itself wraps ErrCorrupt, so callers that only ask
// "corrupt?" still match and those that count mismatches can tell them
// apart.
package objfmt
