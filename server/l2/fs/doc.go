// Package fs is the "fs" L2 adapter: one file per object on a local or
// shared (NFS) file system, registered as l2 type "fs".
//
// Layout (two levels of shard directories from the chunk hash):
//
//	<base_path>/<hash[0:2]>/<hash[2:4]>/<ns hex>@<rank %08x>@<hash hex>.kv
//	<base_path>/<hash[0:2]>/<hash[2:4]>/.tmp.<key>.<pid>.<random>   (writers only)
//
// File format (trailer, so the payload streams straight from the caller's
// buffer and loads read straight into the caller's buffer):
//
//	offset 0            payload (n bytes, opaque; carries its own layout header)
//	offset n            trailer, 16 bytes little-endian:
//	  +0  magic   uint32 "KVL2" (0x324c564b)
//	  +4  crc32c  uint32 (Castagnoli) of the payload
//	  +8  length  uint64 n
//
// Store: stat the final name (present ⇒ success: objects are immutable);
// else create a unique temporary file with O_CREAT|O_EXCL, write payload +
// trailer, optionally fsync, close, and publish with link(tmp, final) (EEXIST
// ⇒ another writer published the same object ⇒ success), then unlink tmp.
// File systems without hard links fall back to rename. Readers therefore see
// either no file or a complete one; no file locks are used (NFS-safe).
//
// Load: read the trailer, check magic, length == file size - 16 and length ==
// len(dst), read the payload directly into dst and verify the crc32c. A
// corrupt or truncated file is a miss and is unlinked, never served.
// A length that differs from len(dst) on an intact file is a failure
// (ErrBufferSize) and the file is kept.
//
// Exists is a stat (size >= 16); Delete is unlink (ENOENT ⇒ miss). Holds are
// the l2 layer's client-side counts: the fs adapter has no L2 eviction of its
// own, so a hold only blocks Delete through the same adapter.
//
// Config keys: "base_path" (required), "fsync" (bool, default false),
// "dir_mode" (default 0o755, given as an integer), "file_mode" (0o644),
// "sweep_tmp_older_than_s" (default 0 = off: when > 0, temporary files of
// crashed writers older than that are removed once, in the background,
// after open; Backend.SweepTmp runs it on demand).
package fs
