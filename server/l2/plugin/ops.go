package plugin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
)

// call sends one request and waits for its reply, bounded by ctx. When ctx
// ends first, done still runs when the host answers (or dies), and a host
// that has not answered HangGrace after ctx ended is killed: a plugin call
// that hangs holds its window pages and one of the host's threads, and only
// ending the host frees them.
func (b *Backend) call(ctx context.Context, op uint32, recs []record, done func(reply)) (reply, error) {
	p, err := b.proc()
	if err != nil {
		if done != nil {
			done(reply{dead: err})
		}
		return reply{}, err
	}
	ch, err := p.send(b.nextID.Add(1), op, recs, nil)
	if err != nil {
		if done != nil {
			done(reply{dead: err})
		}
		return reply{}, err
	}
	select {
	case rep := <-ch:
		if done != nil {
			done(rep)
		}
		if rep.dead != nil {
			return rep, rep.dead
		}
		if len(rep.status) != len(recs) {
			return rep, fmt.Errorf("%w: plugin host: %d results for %d keys", l2.ErrUnavailable, len(rep.status), len(recs))
		}
		return rep, nil
	case <-ctx.Done():
		go func() {
			t := time.NewTimer(b.cfg.HangGrace)
			defer t.Stop()
			select {
			case rep := <-ch:
				if done != nil {
					done(rep)
				}
				return
			case <-t.C:
			}
			b.hangKills.Add(1)
			b.log.Error("plugin L2: a plugin call did not return; killing its host", "plugin", b.name,
				"past_deadline", b.cfg.HangGrace, "pid", p.Cmd.Process.Pid)
			p.Kill()
			rep := <-ch // the host's death answers it
			if done != nil {
				done(rep)
			}
		}()
		return reply{}, fmt.Errorf("plugin %s: %w", b.name, ctx.Err())
	}
}

// keyErr is the error of a key the plugin failed.
func (b *Backend) keyErr(op string, k kv.Key, st int32, msg string) error {
	var wrap error
	switch st {
	case stESize:
		wrap = l2.ErrBufferSize
	case stEUnav:
		wrap = l2.ErrUnavailable
	case stEInval:
		wrap = l2.ErrBadBatch
	}
	s := fmt.Sprintf("plugin %s: %s %s: %s", b.name, op, k, statusName(st))
	if msg != "" {
		s += " (" + msg + ")"
	}
	if wrap != nil {
		return fmt.Errorf("%s: %w", s, wrap)
	}
	return errors.New(s)
}

// staged is a prefix of a batch placed in the window.
type staged struct {
	recs []record
}

// place puts a prefix of bufs (at least one) in the window and returns
// it: it stops before a buffer that would have to wait for space the batch
// itself holds.
func (b *Backend) place(ctx context.Context, keys []kv.Key, bufs [][]byte, copyIn bool) (*staged, error) {
	s := &staged{}
	for i, k := range keys {
		off, err := b.win.Alloc(ctx, len(bufs[i]), i == 0)
		if errors.Is(err, hostproc.ErrFull) {
			break
		}
		if err != nil {
			b.free(s)
			return nil, fmt.Errorf("plugin: window_bytes: %w", err)
		}
		if copyIn {
			copy(b.win.Mem[off:off+len(bufs[i])], bufs[i])
		}
		s.recs = append(s.recs, record{key: k, off: uint64(off), len: uint64(len(bufs[i]))})
	}
	return s, nil
}

func (b *Backend) free(s *staged) {
	for _, r := range s.recs {
		b.win.Free(int(r.off), int(r.len))
	}
}

// Store implements l2.Backend: the payloads are copied into the window and
// the plugin's store() reads them there.
func (b *Backend) Store(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.moved(ctx, opStore, "store", keys, bufs, r)
}

// Load implements l2.Backend: the plugin's load() writes into the window,
// and only the buffers of keys it reports OK are copied out, into bufs.
func (b *Backend) Load(ctx context.Context, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	b.moved(ctx, opLoad, "load", keys, bufs, r)
}

func (b *Backend) moved(ctx context.Context, op uint32, name string, keys []kv.Key, bufs [][]byte, r l2.Reporter) {
	for len(keys) > 0 {
		s, err := b.place(ctx, keys, bufs, op == opStore)
		if err != nil {
			r.FailAll(len(keys), err)
			return
		}
		n := len(s.recs)
		var copied bool
		rep, err := b.call(ctx, op, s.recs, func(rep reply) {
			// Runs once, when the host answered or died: copy out in time
			// (the caller still waits) or only free.
			if op == opLoad && rep.dead == nil && len(rep.status) == n && ctx.Err() == nil {
				for i, st := range rep.status {
					if st == stOK {
						off := int(s.recs[i].off)
						copy(bufs[i], b.win.Mem[off:off+len(bufs[i])])
					}
				}
				copied = true
			}
			b.free(s)
		})
		if err != nil {
			r.FailAll(n, err)
		} else {
			for i, st := range rep.status {
				switch {
				case st == stOK && (op == opStore || copied):
					r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: len(bufs[i])})
				case st == stOK:
					r.Fail(i, fmt.Errorf("plugin %s: %s %s: %w", b.name, name, keys[i], context.DeadlineExceeded))
				case st == stMiss && op == opLoad:
					r.Report(i, l2.Result{Status: l2.StatusMiss})
				default:
					r.Fail(i, b.keyErr(name, keys[i], st, rep.msg))
				}
			}
		}
		keys, bufs, r = keys[n:], bufs[n:], r.Sub(n)
	}
}

func records(keys []kv.Key) []record {
	recs := make([]record, len(keys))
	for i, k := range keys {
		recs[i].key = k
	}
	return recs
}

// Exists implements l2.Backend (a hit reports the object's size).
func (b *Backend) Exists(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	b.keyOp(ctx, opLookup, "lookup", keys, r)
}

// Delete implements l2.Backend (the adapter never passes a held key).
func (b *Backend) Delete(ctx context.Context, keys []kv.Key, r l2.Reporter) {
	b.keyOp(ctx, opRemove, "remove", keys, r)
}

// keyOp runs a keys-only op and reports each key: ok (with the size the
// host answered: the host zeroes it for remove), miss, or the key's error.
func (b *Backend) keyOp(ctx context.Context, op uint32, name string, keys []kv.Key, r l2.Reporter) {
	rep, err := b.call(ctx, op, records(keys), nil)
	if err != nil {
		r.FailAll(len(keys), err)
		return
	}
	for i, st := range rep.status {
		switch st {
		case stOK:
			r.Report(i, l2.Result{Status: l2.StatusOK, Bytes: int(rep.sizes[i])})
		case stMiss:
			r.Report(i, l2.Result{Status: l2.StatusMiss})
		default:
			r.Fail(i, b.keyErr(name, keys[i], st, rep.msg))
		}
	}
}
