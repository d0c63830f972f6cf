package redis

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/kvshim/kvshim/server/l2"
)

// Type is the adapter type name.
const Type = "redis"

func init() { l2.Register(Type, New) }

// Backend is the redis backend.
type Backend struct {
	c      goredis.UniversalClient
	prefix string
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
	return &Backend{c: c, prefix: pfx}, nil
}

// Client is the underlying go-redis client.
func (b *Backend) Client() goredis.UniversalClient { return b.c }

func (b *Backend) rkey(k l2.Key) string {
	if b.prefix == "" {
		return k.String()
	}
	return b.prefix + k.String()
}

// pipelined queues cmd(i, key) for every key and sends them in one round
// trip; each command carries its own result or error.
func pipelined[C any](ctx context.Context, b *Backend, keys []l2.Key, cmd func(p goredis.Pipeliner, i int, key string) C) []C {
	cmds := make([]C, len(keys))
	_, _ = b.c.Pipelined(ctx, func(p goredis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = cmd(p, i, b.rkey(k))
		}
		return nil
	})
	return cmds
}

func keyErr(op string, k l2.Key, err error) error {
	return fmt.Errorf("redis: %s %s: %w: %w", op, k, l2.ErrUnavailable, err)
}

// Store implements l2.Backend.
func (b *Backend) Store(ctx context.Context, keys []l2.Key, bufs [][]byte, r l2.Reporter) {
	cmds := pipelined(ctx, b, keys, func(p goredis.Pipeliner, i int, k string) *goredis.StatusCmd {
		return p.SetArgs(ctx, k, bufs[i], goredis.SetArgs{Mode: "NX"})
	})
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && !errors.Is(err, goredis.Nil) {
			r.Fail(i, keyErr("store", keys[i], err))
			continue
		}
		r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(bufs[i])})
	}
}

// Exists implements l2.Backend with STRLEN: as cheap as EXISTS, and it
// reports the object's size (Result.Bytes), which a prefetch needs to
// reserve L1 staging. 0 means absent (objects are never empty).
func (b *Backend) Exists(ctx context.Context, keys []l2.Key, r l2.Reporter) {
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

// Load implements l2.Backend.
func (b *Backend) Load(ctx context.Context, keys []l2.Key, bufs [][]byte, r l2.Reporter) {
	cmds := pipelined(ctx, b, keys, func(p goredis.Pipeliner, _ int, k string) *goredis.StringCmd { return p.Get(ctx, k) })
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
func (b *Backend) Delete(ctx context.Context, keys []l2.Key, r l2.Reporter) {
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
