package ipc

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// StatusError is a non-OK frame status with the server's message. It wraps
// ErrRemote.
type StatusError struct {
	Op     Op
	Status Status
	Msg    string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("ipc: op %d: status %d: %s", e.Op, e.Status, e.Msg)
}

// Unwrap makes errors.Is(err, ErrRemote) true.
func (e *StatusError) Unwrap() error { return ErrRemote }

// Service is the typed server interface: one method per op. Return a
// *StatusError to answer with that status and message; any other error
// answers StatusInternal with err.Error(). OpPing is answered by the adapter.
type Service interface {
	Alloc(*AllocReq) (*AllocResp, error)
	Commit(*CommitReq) (*CommitResp, error)
	Abort(*CommitReq) (*CommitResp, error)
	Lookup(*LookupReq) error
	LookupResult(*LookupResultReq) (*LookupResultResp, error)
	Free(*FreeReq) error
	Retrieve(*RetrieveReq) (*RetrieveResp, error)
	Release(*ReleaseReq) error
	Stats() (*StatsResp, error)
	Clear() (*ClearResp, error)
	Reset(*ResetReq) (*ResetResp, error)
}

// ServiceHandler adapts svc to a Handler: it decodes each request (a
// malformed body ends the session), calls svc and encodes the answer. Build
// one per session (svc can carry the session's state).
func ServiceHandler(svc Service) Handler {
	var out []byte // reused: Serve copies each answer into the ring before the next call
	return func(op Op, body []byte) (Status, []byte, error) {
		resp, err := dispatch(svc, op, body, out[:0])
		if err != nil {
			if errors.Is(err, ErrMalformed) {
				return 0, nil, fmt.Errorf("op %d: %w", op, err)
			}
			var se *StatusError
			if errors.As(err, &se) {
				return se.Status, AppendError(nil, se.Msg), nil
			}
			return StatusInternal, AppendError(nil, err.Error()), nil
		}
		if cap(resp) <= 1<<20 {
			out = resp
		}
		return StatusOK, resp, nil
	}
}

// errBadOp is answered (not fatal) for unknown op codes.
var errBadOp = errors.New("unknown op")

func dispatch(svc Service, op Op, b, out []byte) ([]byte, error) {
	switch op {
	case OpAlloc:
		return typed(b, out, DecodeAllocReq, svc.Alloc, AppendAllocResp)
	case OpCommit:
		return typed(b, out, DecodeCommitReq, svc.Commit, AppendCommitResp)
	case OpAbort:
		return typed(b, out, DecodeCommitReq, svc.Abort, AppendCommitResp)
	case OpLookup:
		return typed(b, out, DecodeLookupReq, func(r *LookupReq) (*LookupResultResp, error) { return lookup(svc, r) },
			appendAnswerIfAny)
	case OpLookupResult:
		return typed(b, out, DecodeLookupResultReq, svc.LookupResult, AppendLookupResultResp)
	case OpFree:
		return typed(b, out, DecodeFreeReq, noBody(svc.Free), appendNothing)
	case OpRetrieve:
		return typed(b, out, DecodeRetrieveReq, svc.Retrieve, AppendRetrieveResp)
	case OpRelease:
		return typed(b, out, DecodeReleaseReq, noBody(svc.Release), appendNothing)
	case OpStats:
		return typed(b, out, decodeNothing, func(struct{}) (*StatsResp, error) { return svc.Stats() }, AppendStatsResp)
	case OpClear:
		return typed(b, out, decodeNothing, func(struct{}) (*ClearResp, error) { return svc.Clear() }, AppendClearResp)
	case OpReset:
		return typed(b, out, DecodeResetReq, svc.Reset, AppendResetResp)
	case OpEvents:
		if es, ok := svc.(EventsService); ok {
			return typed(b, out, DecodeEventsReq, es.Events, AppendEventsResp)
		}
	case OpPing:
		return append(out, b...), nil // echo: a round-trip probe carrying any body
	}
	return nil, &StatusError{Op: op, Status: StatusBadRequest, Msg: errBadOp.Error()}
}

func typed[Req, Resp any](b, out []byte, dec func([]byte) (Req, error), call func(Req) (Resp, error), enc func([]byte, Resp) ([]byte, error)) ([]byte, error) {
	req, err := dec(b)
	if err != nil {
		return nil, err
	}
	resp, err := call(req)
	if err != nil {
		return nil, err
	}
	out, err = enc(out, resp)
	if err != nil {
		return nil, fmt.Errorf("encode answer: %v", err) // server bug, not the client's: not ErrMalformed
	}
	return out, nil
}

// lookup registers r and, when r asks for it, reads its answer if it is
// final already (the session's calls are serialized: nothing else reads
// it in between). An answer that cannot be read leaves the plain ack: the
// client asks with OpLookupResult, as before protocol 5.
func lookup(svc Service, r *LookupReq) (*LookupResultResp, error) {
	if err := svc.Lookup(r); err != nil || !r.AnswerFinal {
		return nil, err
	}
	res, err := svc.LookupResult(&LookupResultReq{LookupID: r.LookupID})
	if err != nil || res.Status != StatusOK {
		return nil, nil
	}
	return res, nil
}

// appendAnswerIfAny encodes a LOOKUP's ack: nothing, or its answer.
func appendAnswerIfAny(b []byte, r *LookupResultResp) ([]byte, error) {
	if r == nil {
		return b, nil
	}
	return AppendLookupResultResp(b, r)
}

func noBody[Req any](f func(Req) error) func(Req) (struct{}, error) {
	return func(r Req) (struct{}, error) { return struct{}{}, f(r) }
}

func appendNothing(b []byte, _ struct{}) ([]byte, error) { return b, nil }

func decodeNothing(b []byte) (struct{}, error) { return struct{}{}, DecodeEmpty("request", b) }

// Typed client calls. Each returns a *StatusError (wrapping ErrRemote) for a
// non-OK frame status, and ErrMalformed if the answer does not decode.

func call[Req, Resp any](c *Client, ctx context.Context, op Op, req Req, enc func([]byte, Req) ([]byte, error), dec func([]byte) (Resp, error)) (Resp, error) {
	var zero Resp
	bp := encPool.Get().(*[]byte)
	b, err := enc((*bp)[:0], req)
	if err != nil {
		encPool.Put(bp)
		return zero, err
	}
	st, body, err := c.Call(ctx, op, b) // Call copies b into the ring
	if cap(b) <= 1<<20 {
		*bp = b[:0]
	}
	encPool.Put(bp)
	if err != nil {
		return zero, err
	}
	if st != StatusOK {
		msg, _ := DecodeError(body)
		return zero, &StatusError{Op: op, Status: st, Msg: msg}
	}
	return dec(body)
}

// encPool recycles request encoding buffers of the typed client calls.
var encPool = sync.Pool{New: func() any { b := make([]byte, 0, 4096); return &b }}

func encNothing(b []byte, _ struct{}) ([]byte, error) { return b, nil }

func decEmpty(b []byte) (struct{}, error) { return struct{}{}, DecodeEmpty("answer", b) }

// Alloc sends OpAlloc.
func (c *Client) Alloc(ctx context.Context, r *AllocReq) (*AllocResp, error) {
	return call(c, ctx, OpAlloc, r, AppendAllocReq, DecodeAllocResp)
}

// Commit sends OpCommit.
func (c *Client) Commit(ctx context.Context, r *CommitReq) (*CommitResp, error) {
	return call(c, ctx, OpCommit, r, AppendCommitReq, DecodeCommitResp)
}

// Abort sends OpAbort.
func (c *Client) Abort(ctx context.Context, r *CommitReq) (*CommitResp, error) {
	return call(c, ctx, OpAbort, r, AppendCommitReq, DecodeCommitResp)
}

// Lookup sends OpLookup (the answer acknowledges registration). A request
// with AnswerFinal goes through LookupAnswer, which keeps the answer.
func (c *Client) Lookup(ctx context.Context, r *LookupReq) error {
	_, err := c.LookupAnswer(ctx, r)
	return err
}

// LookupAnswer sends OpLookup and returns what the ack carries: for a
// request with AnswerFinal, the lookup's final answer when it was final at
// once (consumed: OpLookupResult then says Unknown); nil otherwise (ask with
// LookupResult).
func (c *Client) LookupAnswer(ctx context.Context, r *LookupReq) (*LookupResultResp, error) {
	return call(c, ctx, OpLookup, r, AppendLookupReq, decodeAnswerIfAny)
}

func decodeAnswerIfAny(b []byte) (*LookupResultResp, error) {
	if len(b) == 0 {
		return nil, nil
	}
	return DecodeLookupResultResp(b)
}

// LookupResult sends OpLookupResult.
func (c *Client) LookupResult(ctx context.Context, r *LookupResultReq) (*LookupResultResp, error) {
	return call(c, ctx, OpLookupResult, r, AppendLookupResultReq, DecodeLookupResultResp)
}

// Free sends OpFree.
func (c *Client) Free(ctx context.Context, r *FreeReq) error {
	_, err := call(c, ctx, OpFree, r, AppendFreeReq, decEmpty)
	return err
}

// Retrieve sends OpRetrieve.
func (c *Client) Retrieve(ctx context.Context, r *RetrieveReq) (*RetrieveResp, error) {
	return call(c, ctx, OpRetrieve, r, AppendRetrieveReq, DecodeRetrieveResp)
}

// Release sends OpRelease.
func (c *Client) Release(ctx context.Context, r *ReleaseReq) error {
	_, err := call(c, ctx, OpRelease, r, AppendReleaseReq, decEmpty)
	return err
}

// Stats sends OpStats.
func (c *Client) Stats(ctx context.Context) (*StatsResp, error) {
	return call(c, ctx, OpStats, struct{}{}, encNothing, DecodeStatsResp)
}

// Clear sends OpClear.
func (c *Client) Clear(ctx context.Context) (*ClearResp, error) {
	return call(c, ctx, OpClear, struct{}{}, encNothing, DecodeClearResp)
}

// Reset sends OpReset.
func (c *Client) Reset(ctx context.Context, r *ResetReq) (*ResetResp, error) {
	return call(c, ctx, OpReset, r, AppendResetReq, DecodeResetResp)
}

// Ping sends OpPing (a round trip through the server's session loop).
func (c *Client) Ping(ctx context.Context) error {
	_, err := c.Echo(ctx, nil)
	return err
}

// Echo sends OpPing carrying body; the server answers with the same bytes
// (a round-trip probe with a payload, for benchmarks and health checks).
func (c *Client) Echo(ctx context.Context, body []byte) ([]byte, error) {
	st, resp, err := c.Call(ctx, OpPing, body)
	if err != nil {
		return nil, err
	}
	if st != StatusOK {
		msg, _ := DecodeError(resp)
		return nil, &StatusError{Op: OpPing, Status: st, Msg: msg}
	}
	return resp, nil
}
