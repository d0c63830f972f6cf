package redis

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/internal/metric"
	"github.com/kvshim/kvshim/server/l2"
)

// Type is the adapter type name.
const Type = "redis"

func init() { l2.Register(Type, New) }

// ErrOOM marks a store refused because Redis is full: it answered OOM
// (used memory over maxmemory under the noeviction policy, or a volatile-*
// policy with nothing to evict), or did less than OOMBackoff ago.
var ErrOOM = fmt.Errorf("redis: out of memory (maxmemory reached): %w", l2.ErrFull)

// OOMBackoff is how long stores fail at once, without sending their
// payloads, after Redis answered OOM.
const OOMBackoff = time.Second

// oomWarnEvery rate-limits the OOM warning.
const oomWarnEvery = 10 * time.Second

// Backend is the redis backend.
type Backend struct {
	c      goredis.UniversalClient
	prefix string
	ttl    time.Duration // 0: objects do not expire
	log    *slog.Logger

	oomUntil   atomic.Int64 // unix ns: stores fail fast until then
	ooms       atomic.Int64 // stores Redis answered OOM
	oomSkipped atomic.Int64 // stores failed during the backoff, not sent

	warnMu             sync.Mutex
	warnAt             time.Time
	warnOOMs, warnSkip int64 // counts at the last warning
}

// Stats are the OOM counters.
type Stats struct {
	// OOM: stores Redis answered OOM. OOMSkipped: stores failed with
	// ErrOOM without being sent, within OOMBackoff of an OOM answer.
	OOM, OOMSkipped int64
}

// Stats returns the counters now.
func (b *Backend) Stats() Stats {
	return Stats{OOM: b.ooms.Load(), OOMSkipped: b.oomSkipped.Load()}
}

// Samples are the OOM counters as the adapter exports them (l2.Sampler:
// /metrics and STATS, label adapter=<name>).
func (b *Backend) Samples() []metric.Sample {
	st := b.Stats()
	return []metric.Sample{
		{Name: "kvshim_l2_redis_oom_total", Counter: true, Value: float64(st.OOM),
			Help: "Stores Redis refused with OOM (maxmemory reached and nothing it may evict): failed saves."},
		{Name: "kvshim_l2_redis_oom_skipped_total", Counter: true, Value: float64(st.OOMSkipped),
			Help: "Stores failed with ErrOOM without being sent, within 1 s of an OOM answer."},
	}
}

// New is the l2 factory for type "redis".
func New(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
	ex := cfg.Extras()
	var (
		addrs                 []string
		host, user, pass, pfx string
		master                string
		port, db              int
		dialMS, readMS, wrMS  = 2000, 5000, 5000
		retries               = 1
		ttlS                  int
	)
	ex.Strings("addrs", &addrs)
	ex.String("host", &host)
	ex.Int("port", &port, 1, 65535)
	ex.String("username", &user)
	ex.String("password", &pass)
	ex.Int("db", &db, 0, 1<<16)
	ex.String("key_prefix", &pfx)
	ex.String("master_name", &master)
	ex.Int("dial_timeout_ms", &dialMS, 1, 600000)
	ex.Int("read_timeout_ms", &readMS, 1, 600000)
	ex.Int("write_timeout_ms", &wrMS, 1, 600000)
	ex.Int("max_retries", &retries, 0, 100)
	ex.Int("ttl_s", &ttlS, 0, 1<<31-1)
	if e := bytes.TrimSpace(cfg.Eviction); len(e) > 0 && string(e) != "null" {
		ex.Fail("eviction", `the redis adapter evicts nothing itself: give the Redis server maxmemory and a maxmemory-policy (e.g. allkeys-lru), or set "ttl_s"`)
	}
	switch {
	case len(addrs) > 0 && host != "":
		ex.Fail("host", "give either addrs or host/port, not both")
	case host != "":
		if port == 0 {
			port = 6379
		}
		addrs = []string{net.JoinHostPort(host, strconv.Itoa(port))}
	case len(addrs) == 0:
		ex.Fail("addrs", "missing (or host/port)")
	}
	if err := ex.Done(); err != nil {
		return nil, err
	}
	maxRetries := retries
	if maxRetries == 0 {
		maxRetries = -1 // go-redis: -1 disables retries, 0 means the default
	}
	pool := max(env.Lanes.Total(), 1)
	c := goredis.NewUniversalClient(&goredis.UniversalOptions{
		Addrs:                 addrs,
		Username:              user,
		Password:              pass,
		DB:                    db,
		MasterName:            master,
		DialTimeout:           time.Duration(dialMS) * time.Millisecond,
		ReadTimeout:           time.Duration(readMS) * time.Millisecond,
		WriteTimeout:          time.Duration(wrMS) * time.Millisecond,
		ContextTimeoutEnabled: true,
		MaxRetries:            maxRetries,
		PoolSize:              pool,
		MinIdleConns:          0,
		// Replies of up to an object's size; the default buffers are fine.
	})
	log := env.Logger
	if log == nil {
		log = slog.Default()
	}
	// Say at once, and in the log, when Redis cannot be reached: without
	// this the first sign would be every save failing silently as a miss.
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := c.Ping(ctx).Err(); err != nil && !errors.Is(err, goredis.ErrClosed) {
			log.Warn("redis L2: cannot reach Redis; its stores and loads fail (misses) until it answers", "addrs", addrs, "err", err)
		}
	}()
	return &Backend{c: c, prefix: pfx, ttl: time.Duration(ttlS) * time.Second, log: log}, nil
}

// Client is the underlying go-redis client.
func (b *Backend) Client() goredis.UniversalClient { return b.c }

func (b *Backend) rkey(k kv.Key) string {
	if b.prefix == "" {
		return k.String()
	}
	return b.prefix + k.String()
}

// pipelined queues cmd(i, key) for every key and sends them in one round
// trip; each command carries its own result or error.
func pipelined[C any](ctx context.Context, b *Backend, keys []kv.Key, cmd func(p goredis.Pipeliner, i int, key string) C) []C {
	cmds := make([]C, len(keys))
	_, _ = b.c.Pipelined(ctx, func(p goredis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = cmd(p, i, b.rkey(k))
		}
		return nil
	})
	return cmds
}

func keyErr(op string, k kv.Key, err error) error {
	return fmt.Errorf("redis: %s %s: %w: %w", op, k, l2.ErrUnavailable, err)
}

// Store implements l2.Backend. With ttl_s the object expires ttl_s after
// its store (SET ... NX EX), unless loads extend it. An OOM answer fails
// that key with ErrOOM (a full Redis is a lost save, not an outage); for
// OOMBackoff after one, stores fail with ErrOOM without being sent.
func (b *Backend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	if until := b.oomUntil.Load(); until != 0 && time.Now().UnixNano() < until {
		b.oomSkipped.Add(int64(len(keys)))
		b.warnOOM()
		for i, k := range keys {
			r.Fail(i, fmt.Errorf("redis: store %s: %w: not sent, Redis answered OOM less than %v ago", k, ErrOOM, OOMBackoff))
		}
		return
	}
	args := goredis.SetArgs{Mode: "NX", TTL: b.ttl}
	cmds := pipelined(ctx, b, keys, func(p goredis.Pipeliner, i int, k string) *goredis.StatusCmd {
		return p.SetArgs(ctx, k, bufs[i], args)
	})
	oom := false
	for i, cmd := range cmds {
		err := cmd.Err()
		switch {
		case err == nil || errors.Is(err, goredis.Nil):
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(bufs[i])})
		case goredis.IsOOMError(err):
			oom = true
			b.ooms.Add(1)
			r.Fail(i, fmt.Errorf("redis: store %s: %w: %w", keys[i], ErrOOM, err))
		default:
			r.Fail(i, keyErr("store", keys[i], err))
		}
	}
	if oom {
		b.oomUntil.Store(time.Now().Add(OOMBackoff).UnixNano())
		b.warnOOM()
	}
}

// warnOOM logs that Redis is full: the first time at once, then at most
// once per oomWarnEvery, with the counts since the previous line.
func (b *Backend) warnOOM() {
	b.warnMu.Lock()
	defer b.warnMu.Unlock()
	now := time.Now()
	if !b.warnAt.IsZero() && now.Sub(b.warnAt) < oomWarnEvery {
		return
	}
	ooms, skipped := b.ooms.Load(), b.oomSkipped.Load()
	b.log.Warn("redis L2: Redis is full (OOM: used memory over maxmemory): stores fail and are not retried; give Redis a maxmemory-policy that evicts (allkeys-lru) or set ttl_s",
		"oom_answers", ooms-b.warnOOMs, "not_sent", skipped-b.warnSkip)
	b.warnAt, b.warnOOMs, b.warnSkip = now, ooms, skipped
}

// Exists implements l2.Backend with STRLEN: as cheap as EXISTS, and it
// reports the object's size (Result.Bytes), which a prefetch needs to
// reserve L1 staging. 0 means absent (objects are never empty).
func (b *Backend) Exists(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	cmds := pipelined(ctx, b, keys, func(p goredis.Pipeliner, _ int, k string) *goredis.IntCmd { return p.StrLen(ctx, k) })
	for i, cmd := range cmds {
		n, err := cmd.Result()
		switch {
		case err != nil:
			r.Fail(i, keyErr("exists", keys[i], err))
		case n > 0:
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: int(n)})
		default:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		}
	}
}

// Load implements l2.Backend. With ttl_s a hit extends the object's life
// to ttl_s from now (GETEX ... EX, Redis 6.2 or later), so objects in use
// do not expire.
func (b *Backend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	cmds := pipelined(ctx, b, keys, func(p goredis.Pipeliner, _ int, k string) *goredis.StringCmd {
		if b.ttl > 0 {
			return p.GetEx(ctx, k, b.ttl)
		}
		return p.Get(ctx, k)
	})
	for i, cmd := range cmds {
		v, err := cmd.Bytes()
		switch {
		case errors.Is(err, goredis.Nil):
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		case err != nil:
			r.Fail(i, keyErr("load", keys[i], err))
		case len(v) != len(bufs[i]):
			r.Fail(i, fmt.Errorf("redis: load %s: object %d bytes, buffer %d: %w", keys[i], len(v), len(bufs[i]), l2.ErrBufferSize))
		default:
			copy(bufs[i], v)
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(v)})
		}
	}
}

// Delete implements l2.Backend.
func (b *Backend) Delete(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	cmds := pipelined(ctx, b, keys, func(p goredis.Pipeliner, _ int, k string) *goredis.IntCmd { return p.Del(ctx, k) })
	for i, cmd := range cmds {
		n, err := cmd.Result()
		switch {
		case err != nil:
			r.Fail(i, keyErr("delete", keys[i], err))
		case n > 0:
			r.Report(i, l2.Result{Status: l2.StatusOK})
		default:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		}
	}
}

// Close implements l2.Backend.
func (b *Backend) Close() error { return b.c.Close() }
