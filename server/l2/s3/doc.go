// Package s3 is the "s3" L2 adapter: one object per key in an
// S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph RGW), through
// github.com/minio/minio-go/v7. Registered as l2 type "s3"; the settings
// are in docs/l2-s3.md.
//
// Object: <prefix><key.String()>, the payload followed by a 72-byte
// trailer, little-endian:
//
//	+0  magic   uint32 "KVS3" (0x3353564b)
//	+4  crc32c  uint32 (Castagnoli) of the payload
//	+8  length  uint64
//	+16 namespace [16], +32 rank uint32, +36 hash [32], +68 zero uint32
//
// so a load streams the payload straight into the caller's buffer, then
// reads the trailer; the object is bound to its key (bytes stored or copied
// under another key's name are a miss, never served, and are removed), and
// its payload is checked.
//
// Operations, per key, a tile's keys concurrently (Config.Concurrency),
// all lanes' payload bytes bounded together (Config.MaxInflightBytes):
//
//   - Store: PUT payload+trailer (UNSIGNED-PAYLOAD: no SHA-256 pass over
//     the payload; the trailer's CRC is the integrity check). An existing
//     key is overwritten with the same bytes: success, and a damaged object
//     heals. Objects of MultipartThreshold bytes or more go multipart
//     (PartSize parts); off by default, see docs/l2-s3.md for the
//     measurement.
//   - Exists: HEAD. Present with a size that can hold a trailer ⇒ StatusOK
//     with Bytes = size - 72. The trailer is not read (loads verify).
//   - Load: GET. An object whose size is not len(dst)+72 is read again for
//     its last 72 bytes only: an intact trailer of this key ⇒ ErrBufferSize
//     (kept), else corrupt. A corrupt object ⇒ StatusMiss, removed.
//   - Delete: HEAD then DELETE (S3 answers DELETE of an absent key with
//     success; the contract wants a miss).
//
// Errors: NoSuchKey is a miss; NoSuchBucket, connection failures and 5xx
// answers fail the key wrapping l2.ErrUnavailable; a batch's deadline
// (op_timeout_ms) bounds every request.
//
// Credentials come from the AWS chain only (environment, then the shared
// config/credentials files with a profile, else anonymous); keys that would
// carry a secret in the adapter config are refused, and only the source is
// logged.
package s3
