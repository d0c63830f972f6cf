package s3_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/prometheus/client_golang/prometheus"
	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/l2test"
	"github.com/kvshim/kvshim/server/l2/s3"
	"github.com/kvshim/kvshim/server/l2/s3/s3test"
)

// Every test here runs against a real SeaweedFS S3 gateway (s3test), and
// is named S3... so build/test.sh runs them in an invocation of their own.
// Not tested here: TLS endpoints and virtual-host bucket names (no
// certificate or DNS on loopback), credentials that SeaweedFS checks (it
// runs with no identities, so it accepts any signature; the tests check
// that the secret never shows, not that S3 refuses a wrong one), and
// AWS's own multipart limits.

var (
	sharedOnce sync.Once
	sharedWeed *s3test.Weed
	sharedErr  error
	sharedDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedWeed != nil {
		sharedWeed.Kill()
	}
	if sharedDir != "" {
		os.RemoveAll(sharedDir)
	}
	os.Exit(code)
}

// weed is the package's shared server (started by the first test).
func weed(t testing.TB) *s3test.Weed {
	t.Helper()
	sharedOnce.Do(func() {
		if _, sharedErr = s3test.Binary(); sharedErr != nil {
			return
		}
		if sharedDir, sharedErr = os.MkdirTemp("", "kvshim-weed-"); sharedErr != nil {
			return
		}
		sharedWeed, sharedErr = s3test.Start(sharedDir)
	})
	if errors.Is(sharedErr, s3test.ErrNoWeed) {
		t.Skip(sharedErr.Error())
	}
	assert.NilError(t, sharedErr)
	return sharedWeed
}

func config(w *s3test.Weed, bucket, extra string) string {
	return fmt.Sprintf(`{"type":"s3","endpoint":%q,"bucket":%q,"create_bucket":true,"num_workers":2,"per_op_workers":{"lookup":1},"op_timeout_ms":20000%s}`,
		w.Endpoint, bucket, extra)
}

func backend(a *l2.Adapter) *s3.Backend { return a.Backend().(*s3.Backend) }

// rewrite replaces k's object with f(its bytes).
func rewrite(t testing.TB, a *l2.Adapter, name string, f func([]byte) []byte) {
	t.Helper()
	b := backend(a)
	ctx := context.Background()
	o, err := b.Client().GetObject(ctx, b.Bucket(), name, minio.GetObjectOptions{})
	assert.NilError(t, err)
	data, err := io.ReadAll(o)
	assert.NilError(t, err)
	o.Close()
	data = f(data)
	_, err = b.Client().PutObject(ctx, b.Bucket(), name, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{})
	assert.NilError(t, err)
}

func TestS3Contract(t *testing.T) {
	w := weed(t)
	for _, tc := range []struct{ name, extra string }{
		{"single PUT", ""},
		{"multipart from 1 byte, small in-flight bound", `,"multipart_threshold_bytes":1,"max_inflight_bytes":1048576,"concurrency":2`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l2test.Run(t, l2test.Target{
				Open: func(t testing.TB) *l2.Adapter { return l2test.Open(t, config(w, "kvshim-contract", tc.extra)) },
				Corrupt: func(t testing.TB, a *l2.Adapter, k kv.Key) {
					rewrite(t, a, backend(a).Name(k), func(b []byte) []byte { b[10] ^= 0x40; return b })
				},
				// S3 has no fault that one key can be given alone (a
				// bucket policy would need identities): BreakStore nil.
			})
		})
	}
}

// An object overwritten with another key's bytes is a miss, never those
// bytes, and is removed.
func TestS3OtherKeysBytesAreAMiss(t *testing.T) {
	w := weed(t)
	a := l2test.Open(t, config(w, "kvshim-swap", ""))
	ctx := context.Background()
	k1, k2 := l2test.Key(int(time.Now().UnixNano()&0xffff)), l2test.Key(int(time.Now().UnixNano()&0xffff)|1<<20)
	src := [][]byte{l2test.Payload(1, 5000), l2test.Payload(2, 5000)}
	for _, r := range l2test.Wait(t, a.Store(ctx, []kv.Key{k1, k2}, src)) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	var k1obj []byte
	rewrite(t, a, backend(a).Name(k1), func(b []byte) []byte { k1obj = append([]byte(nil), b...); return b })
	rewrite(t, a, backend(a).Name(k2), func([]byte) []byte { return k1obj })
	dst := make([]byte, 5000)
	r := l2test.Wait(t, a.Load(ctx, []kv.Key{k2}, [][]byte{dst}))[0]
	// A miss: the buffer may hold what the GET streamed into it before the
	// trailer was read (l2: only StatusOK bytes may be consumed).
	assert.Equal(t, r.Status, l2.StatusMiss, "%v", r.Err)
	res := l2test.Wait(t, a.LookupAndHold(ctx, []kv.Key{k1, k2}))
	a.Release([]kv.Key{k1, k2})
	assert.Equal(t, res[0].Status, l2.StatusOK)
	assert.Equal(t, res[1].Status, l2.StatusMiss, "the misplaced object was kept")
	// A load into a buffer of another size than an intact object's: a
	// failure (ErrBufferSize), and the object stays.
	r = l2test.Wait(t, a.Load(ctx, []kv.Key{k1}, [][]byte{make([]byte, 4999)}))[0]
	assert.Equal(t, r.Status, l2.StatusFailed)
	assert.Assert(t, errors.Is(r.Err, l2.ErrBufferSize), "%v", r.Err)
	assert.Equal(t, l2test.Wait(t, a.Load(ctx, []kv.Key{k1}, [][]byte{dst}))[0].Status, l2.StatusOK)
	assert.Assert(t, bytes.Equal(dst, src[0]))
}

// A missing bucket: refused at open (unless create_bucket); under a running
// adapter a store fails (SeaweedFS answers AccessDenied, AWS NoSuchBucket,
// which wraps ErrUnavailable), and lookups, loads and deletes find nothing
// (a HEAD's 404 has no body to tell a missing bucket from a missing key:
// a miss or a failure, never bytes).
func TestS3BucketMissing(t *testing.T) {
	w := weed(t)
	_, err := l2.OpenJSON(fmt.Sprintf(`{"type":"s3","endpoint":%q,"bucket":"kvshim-nosuch"}`, w.Endpoint), l2.Options{})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.Assert(t, is.Contains(err.Error(), `"kvshim-nosuch" does not exist`))

	bucket := fmt.Sprintf("kvshim-gone-%d", time.Now().UnixNano()%1e9)
	a := l2test.Open(t, config(w, bucket, ""))
	ctx := context.Background()
	assert.NilError(t, backend(a).Client().RemoveBucket(ctx, bucket))
	keys := []kv.Key{l2test.Key(1), l2test.Key(2)}
	bufs := [][]byte{l2test.Payload(1, 100), l2test.Payload(2, 100)}
	for i, r := range l2test.Wait(t, a.Store(ctx, keys, bufs)) {
		assert.Equal(t, r.Status, l2.StatusFailed, "store key %d", i)
		assert.Assert(t, is.Contains(r.Err.Error(), keys[i].String()))
	}
	dst := [][]byte{make([]byte, 100), make([]byte, 100)}
	for _, task := range []*l2.Task{a.LookupAndHold(ctx, keys), a.Load(ctx, keys, dst), a.Delete(ctx, keys)} {
		for i, r := range l2test.Wait(t, task) {
			assert.Assert(t, r.Status != l2.StatusOK, "%s key %d: ok in a removed bucket", task.Op(), i)
		}
	}
	a.Release(keys)
}

// The server killed: every key fails (never a miss, never bytes) within the
// deadline; restarted, the objects stored before load intact.
func TestS3ServerKilled(t *testing.T) {
	weed(t) // skip early without a binary
	dir := t.TempDir()
	w, err := s3test.Start(dir)
	assert.NilError(t, err)
	t.Cleanup(w.Kill)
	a := l2test.Open(t, config(w, "kvshim-killed", ""))
	ctx := context.Background()
	keys := []kv.Key{l2test.Key(7), l2test.Key(8)}
	src := [][]byte{l2test.Payload(7, 70000), l2test.Payload(8, 3)}
	for _, r := range l2test.Wait(t, a.Store(ctx, keys, src)) {
		assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	}
	w.Kill()
	dst := [][]byte{make([]byte, 70000), make([]byte, 3)}
	start := time.Now()
	dead, cancel := context.WithTimeout(ctx, 5*time.Second) // each batch's deadline
	defer cancel()
	for _, task := range []*l2.Task{a.Store(dead, keys, src), a.LookupAndHold(dead, keys), a.Load(dead, keys, dst), a.Delete(dead, keys)} {
		for i, r := range l2test.Wait(t, task) {
			assert.Equal(t, r.Status, l2.StatusFailed, "%s key %d with the server dead: %v", task.Op(), i, r.Err)
		}
	}
	assert.Assert(t, time.Since(start) < 30*time.Second, "failing took %v", time.Since(start))
	assert.Assert(t, !bytes.Equal(dst[0], src[0]))
	assert.NilError(t, w.Restart())
	deadline := time.Now().Add(60 * time.Second)
	for {
		res := l2test.Wait(t, a.Load(ctx, keys, dst))
		if res[0].Status == l2.StatusOK && res[1].Status == l2.StatusOK {
			break
		}
		for i, r := range res {
			assert.Assert(t, r.Status != l2.StatusMiss, "key %d: a miss after the restart: %v", i, r.Err)
		}
		assert.Assert(t, time.Now().Before(deadline), "no load 60 s after the restart: %v", res)
		time.Sleep(500 * time.Millisecond)
	}
	assert.Assert(t, bytes.Equal(dst[0], src[0]) && bytes.Equal(dst[1], src[1]))
}

// Credentials come from the AWS environment and are never logged, nor
// echoed by a refused config.
func TestS3CredentialsNeverShown(t *testing.T) {
	w := weed(t)
	const id, secret = "AKIAKVSHIMTESTKEY01", "kvshim/Secret+never-logged-0123456789"
	t.Setenv("AWS_ACCESS_KEY_ID", id)
	t.Setenv("AWS_SECRET_ACCESS_KEY", secret)
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	a, err := l2.OpenJSON(config(w, "kvshim-creds", ""), l2.Options{Registerer: prometheus.NewRegistry(), Logger: logger})
	assert.NilError(t, err)
	ctx := context.Background()
	k := l2test.Key(42)
	r := l2test.Wait(t, a.Store(ctx, []kv.Key{k}, [][]byte{l2test.Payload(1, 10)}))[0]
	assert.Equal(t, r.Status, l2.StatusOK, "%v", r.Err)
	// a corrupt object's warning goes to the same log
	rewrite(t, a, backend(a).Name(k), func(b []byte) []byte { b[0] ^= 1; return b })
	assert.Equal(t, l2test.Wait(t, a.Load(ctx, []kv.Key{k}, [][]byte{make([]byte, 10)}))[0].Status, l2.StatusMiss)
	assert.NilError(t, a.Close())
	out := logs.String() + fmt.Sprint(backend(a)) + fmt.Sprintf("%+v", backend(a))
	assert.Assert(t, is.Contains(logs.String(), "credentials=\"environment (AWS_ACCESS_KEY_ID)\""))
	assert.Assert(t, !strings.Contains(out, secret), "the secret was shown: %s", out)
	assert.Assert(t, !strings.Contains(out, id), "the key id was shown: %s", out)

	_, err = l2.OpenJSON(fmt.Sprintf(`{"type":"s3","endpoint":%q,"bucket":"b","secret_key":%q}`, w.Endpoint, secret), l2.Options{})
	assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%v", err)
	assert.Assert(t, !strings.Contains(err.Error(), secret), "%v", err)
	assert.Assert(t, is.Contains(err.Error(), "AWS_SECRET_ACCESS_KEY"))
}

// Config errors name the key; they need no server.
func TestConfigRefused(t *testing.T) {
	for _, tc := range []struct{ json, key string }{
		{`{"type":"s3","bucket":"b"}`, `"endpoint"`},
		{`{"type":"s3","endpoint":"http://127.0.0.1:1"}`, `"bucket"`},
		{`{"type":"s3","endpoint":"ftp://x","bucket":"b"}`, `"endpoint"`},
		{`{"type":"s3","endpoint":"http://127.0.0.1:1","bucket":"b","part_size_bytes":1}`, `"part_size_bytes"`},
		{`{"type":"s3","endpoint":"http://127.0.0.1:1","bucket":"b","regoin":"x"}`, `"regoin"`},
	} {
		_, err := l2.OpenJSON(tc.json, l2.Options{})
		assert.Assert(t, errors.Is(err, l2.ErrBadConfig), "%s: %v", tc.json, err)
		assert.Assert(t, is.Contains(err.Error(), tc.key), tc.json)
	}
}
