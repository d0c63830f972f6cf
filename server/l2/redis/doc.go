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
//	store   SET <key> <payload> NX   (nil reply = already present = success)
//	lookup  STRLEN <key>             (> 0 = present, its size; no server-side hold)
//	load    GET <key>                (nil = miss; length must equal len(dst))
//	delete  DEL <key>                (0 = miss)
//
// The Redis key is key_prefix + l2.Key.String(); values are the raw object
// bytes (binary-safe). A load copies the reply into the caller's buffer once
// (go-redis has no read-into-buffer call). The connection pool has one
// connection per lane worker. Every call runs under the task's deadline
// (ContextTimeoutEnabled) and the socket read/write timeouts, so a dead or
// hung server turns into failed keys, never a hang.
//
// Config keys: "addrs" (list of host:port, or one string), or LMCache's
// "host" + "port"; "username", "password", "db", "key_prefix",
// "master_name", "dial_timeout_ms" (default 2000), "read_timeout_ms" and
// "write_timeout_ms" (default 5000), "max_retries" (default 1).
package redis
