package l2test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
)

// WaitTimeout bounds Wait: a task ends by its own op_timeout, so a task
// still running after this long is a bug (a key never reported).
const WaitTimeout = 30 * time.Second

// Key is test key i: distinct for every i below 1<<24, in namespace 5a…,
// ranks 0-3, its hash's first two bytes (an fs shard directory) i's low
// bytes.
func Key(i int) kv.Key {
	k := kv.Key{Rank: uint32(i % 4)}
	k.Namespace[0] = 0x5a
	k.Hash[0], k.Hash[1], k.Hash[2], k.Hash[31] = byte(i), byte(i>>8), byte(i>>16), 0xee
	return k
}

// nasty is binary that breaks text protocols: CR LF, NUL, a RESP bulk
// header.
const nasty = "\r\n\x00$-1\r\n"

// Payload is test object i of n bytes: every byte value, and from 16 bytes
// on the bytes of nasty at offset 4, so payloads of different i differ in
// their first bytes.
func Payload(i, n int) []byte {
	b := make([]byte, n)
	for j := range b {
		b[j] = byte(i*131 + j*7)
	}
	if n >= 16 {
		copy(b[4:], nasty)
	}
	return b
}

// Wait waits (at most WaitTimeout) for task and returns its results.
func Wait(t testing.TB, task *l2.Task) []l2.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), WaitTimeout)
	defer cancel()
	res, err := task.Wait(ctx)
	noErr(t, err)
	return res
}

// Open opens the adapter of a JSON config (metrics on a private registry)
// and closes it when the test ends.
func Open(t testing.TB, cfg string) *l2.Adapter {
	t.Helper()
	a, err := l2.OpenJSON(cfg, l2.Options{Registerer: prometheus.NewRegistry()})
	noErr(t, err)
	t.Cleanup(func() { noErr(t, a.Close()) })
	return a
}
