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
// Store: stat the final name. A valid object of the payload's size there
// (the trailer checked, the payload not read: loads verify it) ⇒ success,
// objects are immutable. Otherwise create a unique temporary file with
// O_CREAT|O_EXCL, set its mode (fchmod, so the umask cannot change it),
// write payload + trailer, optionally fsync, close, and publish with
// link(tmp, final) (EEXIST ⇒ another writer published the same object ⇒
// success), then unlink tmp. File systems without hard links fall back to
// rename. A file at the final name that cannot be the object (empty,
// truncated, bad trailer, another length) is replaced by rename(tmp, final)
// instead, so a key blocked by a broken file heals on its next store.
// Readers therefore see either no file or a complete one; no file locks are
// used (NFS-safe).
//
// Load: read the trailer, check magic, length == file size - 16 and length ==
// len(dst), read the payload directly into dst and verify the crc32c. A
// corrupt or truncated file is a miss and is unlinked, never served.
// A length that differs from len(dst) on an intact file is a failure
// (ErrBufferSize) and the file is kept.
//
// Exists opens the file and checks size and trailer as Load does (the
// payload is not read): a file that cannot be an object is a miss, never a
// hit that Load would then refuse. Delete is unlink (ENOENT ⇒ miss). Holds are
// the l2 layer's client-side counts: a hold blocks Delete through the same
// adapter and, with max_bytes, this server's eviction (below).
//
// Config keys: "base_path" (required), "fsync" (bool, default false),
// "sweep_tmp_older_than_s" (default 0 = off: when > 0, temporary files of
// crashed writers older than that are removed once, in the background,
// after open, and by every capacity scan; Backend.SweepTmp runs it on
// demand), the permission pair "dir_mode" / "file_mode", and the capacity
// keys "max_bytes", "eviction", "scan_interval_s", "touch_interval_ms".
//
// # Capacity
//
// Without "max_bytes" the directory grows without bound (an operator or
// a cron job prunes it). With "max_bytes": N the adapter keeps the object
// files under base_path at N bytes or less, evicting the least recently
// used objects. The adapter-owned key "eviction" may say so in LMCache's
// form, {"eviction_policy": "LRU"}; any other policy or key in it is
// refused (LRU is the only one implemented), and so are "eviction",
// "scan_interval_s" and "touch_interval_ms" without "max_bytes".
//
// Bytes counted: the sizes of the object files (payload + 16-byte trailer)
// in the shard directories, and of the writes in flight (a store's size is
// counted from before its temporary file exists). Directories, block
// rounding, files that are not objects and temporary files of writers
// that crashed are not counted (sweep_tmp_older_than_s removes the last).
//
// Nothing is kept in memory across restarts and nothing is shared between
// servers but the files, so the same directory can be shared NFS-style
// by several servers and survives restarts:
//
//   - Recency is the object file's mtime. It is set when the file is
//     written and set again ("touched") on every hit: a load that
//     verified, or a store of an object already present. atime is not
//     used (relatime and noatime mounts do not keep it). The touch is
//     futimens(UTIME_NOW) on the open file, so on NFS the server's clock
//     stamps it and every host orders hits the same way, and it is
//     rate-limited: a file whose mtime is less than "touch_interval_ms"
//     old (default 1000; 0 touches on every hit) is not touched again, so
//     recency has that granularity and a hot object costs at most one
//     SETATTR per interval per server. Touching needs write permission on
//     the file or ownership: a group member with file_mode 0640 cannot
//     touch another uid's files (EvictStats.TouchErrors counts it), and
//     those objects age by their write time.
//   - Usage is an estimate per server: the total found by its last scan
//     of base_path plus what it wrote and removed since. A scan (a walk of
//     the shard directories, stat of every object file) runs at open, in
//     the background, every "scan_interval_s" (default 60), and under
//     pressure when the last one is older than max(1 s, 4 × its duration).
//     A scan keeps the oldest files (up to half of max_bytes of them) as
//     eviction candidates, oldest mtime first.
//   - A store reserves its file's size before writing it. When the
//     estimate would pass max_bytes, the store waits (within its
//     operation deadline) for an eviction pass, which removes candidates
//     until the estimate is at 90% of max_bytes (or lower, so the waiting
//     store fits). When a pass cannot make room the store fails with
//     ErrFull, like an object larger than max_bytes; a failed store is a
//     lost save (best effort), never an error for the request. Stores
//     that run before the first scan has ended are not held back (the scan
//     counts them).
//   - Eviction never removes a file it did not mean to remove. A candidate
//     is checked with lstat (same inode, size and mtime as the scan saw:
//     a file touched by a hit since, or replaced by another server's store,
//     is skipped), then renamed to a private name (".evict.<key>.<pid>.<random>"
//     in the same directory, atomic), then the inode moved is checked again
//     and only then unlinked. A file that another server published or
//     touched between the check and the rename is linked back under its
//     name (or dropped when the name holds the same object again). A
//     ".evict." file left by an evictor that died is removed by the next
//     scan after a minute. Removing a file another server is reading is
//     the POSIX unlink: that reader keeps its open file (on NFS a read may
//     fail with ESTALE, which its load reports as a miss).
//   - Holds: a key found by a lookup of this server is not evicted by this
//     server until the lookup releases it (at most 60 s), so a planned load
//     is not undone by its own server. Other servers do not know these holds:
//     their eviction can remove an object between this server's lookup and
//     load, and the load is then a miss (the lookup's answer is shorter,
//     never wrong).
//
// Bounds. With one server, once its first scan has ended, the files it
// writes, temporary ones included, never pass max_bytes together (the
// estimate errs high: a file published while a scan walks may count twice
// until the next scan, and the pass then evicts a little early). With
// several servers sharing
// base_path, each sees the others' writes at its next scan: the directory
// can pass max_bytes by what the other servers wrote since this server's
// last scan (at most max_bytes per other server, since each one's own
// estimate stays under it), and every server that scans brings it back.
// Set scan_interval_s lower when several servers write at once. Evicting
// needs write permission on the shard directories (dir_mode 0770 for a
// group); without it a candidate is skipped. EvictStats reports the
// estimate, scans, evictions, skipped candidates and refused stores, and
// Samples exports them (kvshim_l2_fs_*, on /metrics and in STATS); Rescan
// forces a scan and pass.
//
// Permissions. KV files are as private as the server's socket: by default
// directories are 0700 and files 0600, for every directory the adapter
// creates (base_path and its missing parents included) and every object
// file, set exactly whatever the umask. For a group of uids sharing
// base_path (several servers under different uids, or readers in a
// group), set both keys as octal strings:
//
//	"dir_mode": "0750", "file_mode": "0640"   the group lists and reads
//	"dir_mode": "0770", "file_mode": "0640"   the group also stores (and
//	                                          replaces or deletes broken files)
//
// Accepted values are exactly dir_mode 0700, 0750, 0770 and file_mode
// 0600, 0640, with group bits in both or in neither; anything else is
// refused at open, a world (other-user) bit with its own message, and so is
// a JSON number (write "0640", not 640). Files get the creating uid's group
// unless the directory is setgid: make base_path setgid and owned by the
// shared group (chmod 2770); directories the adapter creates keep an
// inherited setgid bit. An existing base_path is never chmod-ed; when it is
// more open than dir_mode (files written before 0600 was the default may
// be readable through it), Open logs a warning.
package fs
