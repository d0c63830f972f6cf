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
// the l2 layer's client-side counts: the fs adapter has no L2 eviction of its
// own, so a hold only blocks Delete through the same adapter.
//
// Config keys: "base_path" (required), "fsync" (bool, default false),
// "sweep_tmp_older_than_s" (default 0 = off: when > 0, temporary files of
// crashed writers older than that are removed once, in the background,
// after open; Backend.SweepTmp runs it on demand), and the permission pair
// "dir_mode" / "file_mode".
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
