package mooncake

import (
	"context"
	"errors"
	"fmt"
	"unsafe"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
)

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// staged is one batch's buffer placement: a registered segment (zero copy)
// or bounce pages.
type staged struct {
	req       *request
	bounced   []int // bounce offset per key, -1 when not bounced
	bufs      [][]byte
	releaseFn func()
}

// stage places a prefix of the batch (at least one key) and returns how
// many keys it placed: it stops before a key that would have to wait for
// bounce space this batch itself holds.
func (b *Backend) stage(ctx context.Context, op string, keys []kv.Key, bufs [][]byte, copyIn bool) (*staged, int, error) {
	s := &staged{req: &request{Op: op}, bufs: bufs}
	n := 0
	for i, k := range keys {
		first := -1
		seg, off, ok := b.segs.find(bufs[i])
		if !ok {
			var err error
			first, err = b.bounce.Alloc(ctx, len(bufs[i]), i == 0)
			if errors.Is(err, hostproc.ErrFull) {
				break
			}
			if err != nil {
				s.release()
				return nil, 0, fmt.Errorf("mooncake: bounce_buffer_size: %w (register the L1 segment instead)", err)
			}
			seg, off = 0, first
			if copyIn {
				copy(b.bounce.Mem[off:off+len(bufs[i])], bufs[i])
			}
		}
		s.req.Keys = append(s.req.Keys, k.String())
		s.req.Seg = append(s.req.Seg, seg)
		s.req.Off = append(s.req.Off, off)
		s.req.Len = append(s.req.Len, len(bufs[i]))
		s.bounced = append(s.bounced, first)
		n++
	}
	s.bufs = bufs[:n]
	s.releaseFn = func() {
		for i, first := range s.bounced {
			if first >= 0 {
				b.bounce.Free(first, len(s.bufs[i]))
			}
		}
	}
	return s, n, nil
}

func (s *staged) release() {
	if s.releaseFn != nil {
		s.releaseFn()
	}
}

// run sends a staged request and waits. Bounce pages are freed when the
// helper answers (not at a timeout: the helper may still write them).
func (b *Backend) run(ctx context.Context, s *staged) ([]int64, error) {
	p, err := b.proc()
	if err != nil {
		s.release()
		return nil, err
	}
	s.req.ID = b.nextID.Add(1)
	ch, err := p.send(s.req)
	if err != nil {
		s.release()
		return nil, err
	}
	select {
	case rep := <-ch:
		defer s.release()
		if rep.dead != nil {
			return nil, fmt.Errorf("mooncake: %s: %w", s.req.Op, rep.dead)
		}
		if rep.Error != "" {
			return nil, fmt.Errorf("%w: %s: %s", ErrHelper, s.req.Op, rep.Error)
		}
		if len(rep.Res) != len(s.req.Keys) {
			return nil, fmt.Errorf("%w: %s: %d results for %d keys", ErrHelper, s.req.Op, len(rep.Res), len(s.req.Keys))
		}
		if s.req.Op == "get" {
			for i, first := range s.bounced {
				if first >= 0 && rep.Res[i] == int64(len(s.bufs[i])) {
					copy(s.bufs[i], b.bounce.Mem[first:first+len(s.bufs[i])])
				}
			}
		}
		return rep.Res, nil
	case <-ctx.Done():
		go func() { <-ch; s.release() }()
		return nil, fmt.Errorf("mooncake: %s: %w", s.req.Op, ctx.Err())
	}
}

func storeErr(op string, k kv.Key, code int64) error {
	return fmt.Errorf("%w: %s %s: %d %s", ErrStore, op, k, code, codeName(code))
}

// Store implements l2.Backend (batch_put_from; an existing key is success).
func (b *Backend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.batches(ctx, "put", keys, bufs, r, func(i int, k kv.Key, buf []byte, c int64) {
		if c == 0 || c == codeAlreadyExists {
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(buf)})
		} else {
			r.Fail(i, storeErr("put", k, c))
		}
	})
}

// Load implements l2.Backend (batch_get_into).
func (b *Backend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.batches(ctx, "get", keys, bufs, r, func(i int, k kv.Key, buf []byte, c int64) {
		switch {
		case c == int64(len(buf)):
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(buf)})
		case c == 0 || c == codeNotFound:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		case c > 0:
			r.Fail(i, fmt.Errorf("mooncake: get %s: %d bytes, buffer %d: %w", k, c, len(buf), l2.ErrBufferSize))
		default:
			r.Fail(i, storeErr("get", k, c))
		}
	})
}

// batches runs op ("put" copies in, "get" copies out) over keys in the
// prefixes stage can place and hands each key's result code to report,
// with i counted from the start of keys (r is the whole batch's reporter).
func (b *Backend) batches(ctx context.Context, op string, keys []kv.Key, bufs [][]byte, r l2.Reporter,
	report func(i int, k kv.Key, buf []byte, c int64)) {
	for base := 0; base < len(keys); {
		s, n, err := b.stage(ctx, op, keys[base:], bufs[base:], op == "put")
		if err != nil {
			r.Sub(base).FailAll(len(keys)-base, err)
			return
		}
		res, err := b.run(ctx, s)
		if err != nil {
			r.Sub(base).FailAll(n, err)
		} else {
			for i, c := range res {
				report(base+i, keys[base+i], bufs[base+i], c)
			}
		}
		base += n
	}
}

func (b *Backend) keyed(ctx context.Context, op string, keys []kv.Key) ([]int64, error) {
	req := &request{Op: op, Keys: make([]string, len(keys))}
	for i, k := range keys {
		req.Keys[i] = k.String()
	}
	return b.call(ctx, req)
}

// Exists implements l2.Backend (batch_is_exist; a hit takes Mooncake's
// read lease, default_kv_lease_ttl).
func (b *Backend) Exists(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	res, err := b.keyed(ctx, "exists", keys)
	if err != nil {
		r.FailAll(len(keys), err)
		return
	}
	for i, c := range res {
		switch {
		case c == 1:
			r.Report(i, l2.Result{Status: l2.StatusOK})
		case c == 0:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, storeErr("exists", keys[i], c))
		}
	}
}

// Delete implements l2.Backend (batch_remove without force: a key under a
// lease fails with OBJECT_HAS_LEASE).
func (b *Backend) Delete(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	res, err := b.keyed(ctx, "remove", keys)
	if err != nil {
		r.FailAll(len(keys), err)
		return
	}
	for i, c := range res {
		switch c {
		case 0:
			r.Report(i, l2.Result{Status: l2.StatusOK})
		case codeNotFound:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, storeErr("remove", keys[i], c))
		}
	}
}
