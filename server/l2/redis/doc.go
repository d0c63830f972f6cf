// Package redis is the "redis" L2 adapter (a Redis server, or a Redis
// Cluster when given several addresses), registered as l2 type "redis".
//
// It uses github.com/redis/go-redis/v9's UniversalClient: one address is a
// plain client, several are a cluster client (MOVED/ASK handled by the
// client), "master_name" makes it a Sentinel failover client. Every tile of
// a batch is one pipeline (a cluster pipeline is split per node by the
// client); each command's reply is that key's result, so a partial failure
// names exactly the failed keys.
//
//	store   SET <key> <payload> NX [EX ttl_s]   (nil reply = already present = success)
//	lookup  STRLEN <key>             (> 0 = present, its size; no server-side hold)
//	load    GET <key>                (nil = miss; length must equal len(dst))
//	        GETEX <key> EX ttl_s     (with ttl_s: a hit extends the object's life)
//	delete  DEL <key>                (0 = miss)
//
// The Redis key is key_prefix + kv.Key.String(); values are the raw object
// bytes (binary-safe). A load copies the reply into the caller's buffer once
// (go-redis has no read-into-buffer call). The connection pool has one
// connection per lane worker. Every call runs under the task's deadline
// (ContextTimeoutEnabled) and the socket read/write timeouts, so a dead or
// hung server turns into failed keys, never a hang.
//
// Capacity. The adapter evicts nothing itself: Redis's own memory limit
// does. Give the Redis server maxmemory and a maxmemory-policy that evicts
// (allkeys-lru or allkeys-lfu: every object is a cache entry that kvshim
// can recompute); the adapter-owned key "eviction" is refused, since it
// would be silently ignored. Optionally, "ttl_s" (seconds, default 0 = no
// expiry) makes every object expire ttl_s after its store, and every hit
// (a load) extends it to ttl_s from then (GETEX, Redis 6.2 or later), so
// objects not used for ttl_s go away even without memory pressure.
//
// A Redis that is full and cannot evict (noeviction, the default policy,
// or a volatile-* policy with nothing to evict) answers OOM to SET. Such a
// store fails with ErrOOM (not l2.ErrUnavailable: Redis is up, it serves
// lookups, loads and deletes); like every failed store it is a lost save,
// not retried, and the request still succeeds. For OOMBackoff (1 s) after
// an OOM answer, stores fail with ErrOOM at once, without sending their
// payloads to a Redis that would refuse them. Both are counted
// (Backend.Stats: OOM, OOMSkipped; exported as kvshim_l2_redis_oom_total
// and kvshim_l2_redis_oom_skipped_total, Backend.Samples) and logged as one
// WARN at the first OOM, then at most one per 10 s with the counts since
// the last.
//
// Config keys: "addrs" (list of host:port, or one string), or LMCache's
// "host" + "port"; "username", "password", "db", "key_prefix",
// "master_name", "dial_timeout_ms" (default 2000), "read_timeout_ms" and
// "write_timeout_ms" (default 5000), "max_retries" (default 1), "ttl_s"
// (default 0).
package redis
