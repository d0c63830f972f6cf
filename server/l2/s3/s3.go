package s3

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
)

// Type is the adapter type name.
const Type = "s3"

// Defaults of the backend's keys.
const (
	DefaultRegion           = "us-east-1"
	DefaultMaxInflightBytes = 256 << 20
	DefaultConcurrency      = 8
	DefaultPartSize         = 16 << 20
	DefaultMaxRetries       = 3
	minPartSize             = 5 << 20 // S3's least part size
)

const (
	trailerSize = 72
	magic       = 0x3353564b // "KVS3" little-endian
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func init() { l2.Register(Type, New) }

// Config is the s3 backend's own config (doc.go, "Config").
type Config struct {
	Endpoint           string // "endpoint": http(s)://host[:port]
	Bucket             string
	Prefix             string
	Region             string
	Profile            string // AWS profile of the shared config/credentials files ("" = $AWS_PROFILE or default)
	CreateBucket       bool
	PathStyle          bool
	MaxInflightBytes   int64
	Concurrency        int   // keys of one tile in flight at once
	MultipartThreshold int64 // objects of at least this many bytes go multipart; 0 = never
	PartSize           int64
	MaxRetries         int // attempts per request (minio-go's retry with backoff), within the batch's deadline
	Logger             *slog.Logger
}

// secretKeys are refused in the adapter config: it is logged and shown by
// `kvshim stat`, so credentials come only from the AWS environment/files.
var secretKeys = []string{"access_key", "secret_key", "access_key_id", "secret_access_key", "aws_access_key_id",
	"aws_secret_access_key", "session_token", "aws_session_token", "credentials"}

// New is the l2 factory for type "s3".
func New(cfg *l2.Config, env l2.Env) (l2.Backend, error) {
	c := Config{Region: DefaultRegion, PathStyle: true, MaxInflightBytes: DefaultMaxInflightBytes,
		Concurrency: DefaultConcurrency, PartSize: DefaultPartSize, MaxRetries: DefaultMaxRetries, Logger: env.Logger}
	for _, k := range secretKeys {
		if _, ok := cfg.Extra[k]; ok {
			return nil, fmt.Errorf("%w: key %q: credentials are never read from the adapter config (it is logged and shown by kvshim stat); "+
				"set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile in ~/.aws/credentials (key \"profile\")", l2.ErrBadConfig, k)
		}
	}
	ex := cfg.Extras()
	ex.String("endpoint", &c.Endpoint)
	ex.String("bucket", &c.Bucket)
	ex.String("prefix", &c.Prefix)
	ex.String("region", &c.Region)
	ex.String("profile", &c.Profile)
	ex.Bool("create_bucket", &c.CreateBucket)
	ex.Bool("path_style", &c.PathStyle)
	var n int
	if ex.Int("max_inflight_bytes", &n, 1<<20, math.MaxInt) {
		c.MaxInflightBytes = int64(n)
	}
	ex.Int("concurrency", &c.Concurrency, 1, 1024)
	ex.Int("max_retries", &c.MaxRetries, 1, 20)
	if ex.Int("multipart_threshold_bytes", &n, 0, math.MaxInt) {
		c.MultipartThreshold = int64(n)
	}
	if ex.Int("part_size_bytes", &n, minPartSize, 5<<30) {
		c.PartSize = int64(n)
	}
	if c.Endpoint == "" {
		ex.Fail("endpoint", "missing (e.g. \"http://127.0.0.1:8333\" or \"https://s3.us-east-1.amazonaws.com\")")
	}
	if c.Bucket == "" {
		ex.Fail("bucket", "missing")
	}
	if err := ex.Done(); err != nil {
		return nil, err
	}
	return Open(c)
}

// Backend is the s3 backend.
type Backend struct {
	cfg      Config
	cl       *minio.Client
	core     minio.Core
	inflight *byteSem
	log      *slog.Logger
	tr       *http.Transport
}

// Open connects, checks the bucket (creating it with CreateBucket) and
// returns the backend.
func Open(c Config) (*Backend, error) {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Region == "" {
		c.Region = DefaultRegion
	}
	if c.Concurrency <= 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.MaxInflightBytes <= 0 {
		c.MaxInflightBytes = DefaultMaxInflightBytes
	}
	if c.MaxRetries <= 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.PartSize < minPartSize {
		c.PartSize = DefaultPartSize
	}
	u, err := url.Parse(c.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return nil, fmt.Errorf("%w: key \"endpoint\": %q: want http://host[:port] or https://host[:port]", l2.ErrBadConfig, c.Endpoint)
	}
	creds, source := awsCredentials(c.Profile)
	lookup := minio.BucketLookupPath
	if !c.PathStyle {
		lookup = minio.BucketLookupDNS
	}
	tr := &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          1024,
		MaxIdleConnsPerHost:   1024, // one per key in flight: lanes × concurrency
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: 30 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
	cl, err := minio.New(u.Host, &minio.Options{Creds: creds, Secure: u.Scheme == "https", Region: c.Region,
		BucketLookup: lookup, Transport: tr, MaxRetries: c.MaxRetries})
	if err != nil {
		return nil, fmt.Errorf("%w: s3: %v", l2.ErrBadConfig, err)
	}
	cl.SetAppInfo("kvshim", "l2")
	b := &Backend{cfg: c, cl: cl, core: minio.Core{Client: cl}, inflight: newByteSem(c.MaxInflightBytes), log: c.Logger, tr: tr}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ok, err := cl.BucketExists(ctx, c.Bucket)
	if err != nil {
		return nil, fmt.Errorf("%w: s3: bucket %q at %s: %v", l2.ErrUnavailable, c.Bucket, c.Endpoint, err)
	}
	if !ok {
		if !c.CreateBucket {
			return nil, fmt.Errorf("%w: key \"bucket\": %q does not exist at %s (create it, or set \"create_bucket\": true)", l2.ErrBadConfig, c.Bucket, c.Endpoint)
		}
		if err := cl.MakeBucket(ctx, c.Bucket, minio.MakeBucketOptions{Region: c.Region}); err != nil {
			if code := minio.ToErrorResponse(err).Code; code != "BucketAlreadyOwnedByYou" && code != "BucketAlreadyExists" {
				return nil, fmt.Errorf("%w: s3: create bucket %q: %v", l2.ErrUnavailable, c.Bucket, err)
			}
		}
	}
	// The credentials' source only, never a key or secret.
	c.Logger.Info("s3 L2: opened", "endpoint", c.Endpoint, "bucket", c.Bucket, "prefix", c.Prefix,
		"credentials", source, "max_inflight_bytes", c.MaxInflightBytes, "concurrency", c.Concurrency,
		"multipart_threshold_bytes", c.MultipartThreshold)
	return b, nil
}

// awsCredentials is the AWS chain: the environment (AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), then the shared files
// (~/.aws/config and ~/.aws/credentials, or AWS_CONFIG_FILE and
// AWS_SHARED_CREDENTIALS_FILE; profile, else AWS_PROFILE, else default),
// else anonymous requests. source names where they came from.
func awsCredentials(profile string) (*credentials.Credentials, string) {
	env := &credentials.EnvAWS{}
	file := &credentials.FileAWSCredentials{Profile: profile}
	source := "anonymous"
	if v, _ := (&credentials.EnvAWS{}).Retrieve(); v.AccessKeyID != "" {
		source = "environment (AWS_ACCESS_KEY_ID)"
	} else if v, _ := (&credentials.FileAWSCredentials{Profile: profile}).Retrieve(); v.AccessKeyID != "" {
		p := profile
		if p == "" {
			p = "AWS_PROFILE or default"
		}
		source = "AWS shared config/credentials files, profile " + p
	}
	return credentials.NewChainCredentials([]credentials.Provider{env, file}), source
}

// Name is k's object name.
func (b *Backend) Name(k kv.Key) string { return b.cfg.Prefix + k.String() }

// Client is the S3 client (tests use it to damage objects).
func (b *Backend) Client() *minio.Client { return b.cl }

// Bucket is the configured bucket.
func (b *Backend) Bucket() string { return b.cfg.Bucket }

func trailer(k kv.Key, crc uint32, n int) []byte {
	t := make([]byte, trailerSize)
	le := binary.LittleEndian
	le.PutUint32(t, magic)
	le.PutUint32(t[4:], crc)
	le.PutUint64(t[8:], uint64(n))
	copy(t[16:], k.Namespace[:])
	le.PutUint32(t[32:], k.Rank)
	copy(t[36:], k.Hash[:])
	return t
}

// checkTrailer returns the payload length and CRC t records for k, or
// errCorrupt when t is not k's trailer.
func checkTrailer(k kv.Key, t []byte) (int, uint32, error) {
	le := binary.LittleEndian
	n := le.Uint64(t[8:])
	crc := le.Uint32(t[4:])
	if n > math.MaxInt32*4 || !bytes.Equal(t, trailer(k, crc, int(n))) {
		return 0, 0, errCorrupt
	}
	return int(n), crc, nil
}

var errCorrupt = errors.New("s3: corrupt object (damaged, or another key's bytes)")

// fail classifies a client error: a missing bucket or an unreachable
// server wraps l2.ErrUnavailable (the key fails, it is not a miss).
func (b *Backend) fail(op string, k kv.Key, err error) error {
	resp := minio.ToErrorResponse(err)
	if resp.Code == "NoSuchBucket" {
		return fmt.Errorf("s3: %s %s: bucket %q does not exist: %w", op, k, b.cfg.Bucket, l2.ErrUnavailable)
	}
	var ne net.Error
	var oe *net.OpError
	if errors.As(err, &oe) || (errors.As(err, &ne) && !ne.Timeout()) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) ||
		resp.StatusCode >= 500 {
		return fmt.Errorf("s3: %s %s: %v: %w", op, k, err, l2.ErrUnavailable)
	}
	return fmt.Errorf("s3: %s %s: %w", op, k, err)
}

func isNoSuchKey(err error) bool {
	c := minio.ToErrorResponse(err).Code
	return c == "NoSuchKey" || c == "NotFound"
}

// each runs fn for every key of a tile, at most Concurrency at once, and
// stops starting keys once ctx ends (the rest fail with its error).
func (b *Backend) each(ctx context.Context, n int, r l2.Reporter, fn func(i int)) {
	sem := make(chan struct{}, b.cfg.Concurrency)
	var wg sync.WaitGroup
	for i := range n {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			r.FailAll(n, ctx.Err())
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			fn(i)
		})
	}
	wg.Wait()
}

// Store implements l2.Backend: one PUT per key (payload, then its trailer),
// multipart from MultipartThreshold on. A PUT of an existing key replaces it
// with the same bytes (content-addressed keys): success, and a corrupt
// object heals.
func (b *Backend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.each(ctx, len(keys), r, func(i int) {
		k, p := keys[i], bufs[i]
		size := int64(len(p)) + trailerSize
		if err := b.inflight.acquire(ctx, size); err != nil {
			r.Fail(i, fmt.Errorf("s3: store %s: %w", k, err))
			return
		}
		defer b.inflight.release(size)
		body := io.MultiReader(bytes.NewReader(p), bytes.NewReader(trailer(k, crc32.Checksum(p, castagnoli), len(p))))
		opts := minio.PutObjectOptions{ContentType: "application/octet-stream",
			// The object carries its own CRC-32C and key: no SHA-256 pass
			// over the payload for the signature (UNSIGNED-PAYLOAD).
			DisableContentSha256: true,
			DisableMultipart:     b.cfg.MultipartThreshold == 0 || size < b.cfg.MultipartThreshold,
			PartSize:             uint64(b.cfg.PartSize)}
		if _, err := b.cl.PutObject(ctx, b.cfg.Bucket, b.Name(k), body, size, opts); err != nil {
			r.Fail(i, b.fail("store", k, err))
			return
		}
		r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(p)})
	})
}

// Exists implements l2.Backend (HEAD): an object too short to hold a
// trailer is a miss; the trailer itself is checked by loads.
func (b *Backend) Exists(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	b.each(ctx, len(keys), r, func(i int) {
		info, err := b.cl.StatObject(ctx, b.cfg.Bucket, b.Name(keys[i]), minio.StatObjectOptions{})
		switch {
		case err != nil && isNoSuchKey(err):
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		case err != nil:
			r.Fail(i, b.fail("lookup", keys[i], err))
		case info.Size < trailerSize:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: int(info.Size - trailerSize)})
		}
	})
}

// Load implements l2.Backend: one GET per key straight into the caller's
// buffer, then the trailer: it must name this key and length, and the
// payload's CRC-32C must match, else the object is a miss and is deleted.
func (b *Backend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.each(ctx, len(keys), r, func(i int) {
		k, dst := keys[i], bufs[i]
		size := int64(len(dst)) + trailerSize
		if err := b.inflight.acquire(ctx, size); err != nil {
			r.Fail(i, fmt.Errorf("s3: load %s: %w", k, err))
			return
		}
		defer b.inflight.release(size)
		res, err := b.load(ctx, k, dst)
		if errors.Is(err, errCorrupt) {
			b.log.Warn("s3 L2: corrupt object removed", "key", k.String(), "cause", err)
			if rerr := b.cl.RemoveObject(ctx, b.cfg.Bucket, b.Name(k), minio.RemoveObjectOptions{}); rerr != nil {
				b.log.Warn("s3 L2: removing a corrupt object failed", "key", k.String(), "err", rerr)
			}
			r.Report(i, l2.Result{Status: l2.StatusMiss, Err: err})
			return
		}
		if err != nil {
			r.Fail(i, err)
			return
		}
		r.Report(i, res)
	})
}

func (b *Backend) load(ctx context.Context, k kv.Key, dst []byte) (l2.Result, error) {
	name := b.Name(k)
	body, info, _, err := b.core.GetObject(ctx, b.cfg.Bucket, name, minio.GetObjectOptions{})
	if err != nil {
		if isNoSuchKey(err) {
			return l2.Result{Status: l2.StatusMiss}, nil
		}
		return l2.Result{}, b.fail("load", k, err)
	}
	defer body.Close()
	if info.Size < trailerSize {
		return l2.Result{}, fmt.Errorf("%w: %s: %d bytes", errCorrupt, k, info.Size)
	}
	if info.Size != int64(len(dst))+trailerSize {
		// Another size: an intact object of another length is the
		// caller's error (kept); anything else is corrupt.
		_ = body.Close()
		var opts minio.GetObjectOptions
		_ = opts.SetRange(info.Size-trailerSize, info.Size-1)
		tb, _, _, err := b.core.GetObject(ctx, b.cfg.Bucket, name, opts)
		if err != nil {
			return l2.Result{}, b.fail("load", k, err)
		}
		defer tb.Close()
		t := make([]byte, trailerSize)
		if _, err := io.ReadFull(tb, t); err != nil {
			return l2.Result{}, b.fail("load", k, err)
		}
		n, _, err := checkTrailer(k, t)
		if err != nil || int64(n) != info.Size-trailerSize {
			return l2.Result{}, fmt.Errorf("%w: %s", errCorrupt, k)
		}
		return l2.Result{}, fmt.Errorf("s3: load %s: object of %d bytes, buffer %d: %w", k, n, len(dst), l2.ErrBufferSize)
	}
	if _, err := io.ReadFull(body, dst); err != nil {
		return l2.Result{}, b.fail("load", k, err)
	}
	t := make([]byte, trailerSize)
	if _, err := io.ReadFull(body, t); err != nil {
		return l2.Result{}, b.fail("load", k, err)
	}
	n, crc, err := checkTrailer(k, t)
	if err != nil || n != len(dst) {
		return l2.Result{}, fmt.Errorf("%w: %s: trailer", errCorrupt, k)
	}
	if crc32.Checksum(dst, castagnoli) != crc {
		return l2.Result{}, fmt.Errorf("%w: %s: payload checksum", errCorrupt, k)
	}
	return l2.Result{Status: l2.StatusOK, Bytes: len(dst)}, nil
}

// Delete implements l2.Backend: HEAD (S3's DELETE succeeds for an absent
// key, and the contract wants a miss), then DELETE.
func (b *Backend) Delete(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	b.each(ctx, len(keys), r, func(i int) {
		name := b.Name(keys[i])
		if _, err := b.cl.StatObject(ctx, b.cfg.Bucket, name, minio.StatObjectOptions{}); err != nil {
			if isNoSuchKey(err) {
				r.Report(i, l2.Result{Status: l2.StatusMiss})
			} else {
				r.Fail(i, b.fail("delete", keys[i], err))
			}
			return
		}
		if err := b.cl.RemoveObject(ctx, b.cfg.Bucket, name, minio.RemoveObjectOptions{}); err != nil {
			r.Fail(i, b.fail("delete", keys[i], err))
			return
		}
		r.Report(i, l2.Result{Status: l2.StatusOK})
	})
}

// Close implements l2.Backend.
func (b *Backend) Close() error {
	b.tr.CloseIdleConnections()
	return nil
}

// byteSem bounds the payload bytes in flight over all lanes. An object
// larger than the bound runs alone.
type byteSem struct {
	mu   sync.Mutex
	max  int64
	used int64
	wake chan struct{}
}

func newByteSem(max int64) *byteSem { return &byteSem{max: max, wake: make(chan struct{})} }

func (s *byteSem) acquire(ctx context.Context, n int64) error {
	n = min(n, s.max)
	for {
		s.mu.Lock()
		if s.used+n <= s.max {
			s.used += n
			s.mu.Unlock()
			return nil
		}
		wake := s.wake
		s.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return fmt.Errorf("waiting for max_inflight_bytes: %w", ctx.Err())
		}
	}
}

func (s *byteSem) release(n int64) {
	n = min(n, s.max)
	s.mu.Lock()
	s.used -= n
	close(s.wake)
	s.wake = make(chan struct{})
	s.mu.Unlock()
}

// String describes the backend without credentials.
func (b *Backend) String() string {
	return fmt.Sprintf("s3 %s bucket %s prefix %q", b.cfg.Endpoint, b.cfg.Bucket, strings.TrimSpace(b.cfg.Prefix))
}
