package ipc

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/kv"
)

// A direct client answers through the session's handler with the ring's
// semantics: the same typed calls, a past deadline is ErrTimeout, a
// malformed request ends the session, the server's EndDirect makes calls
// fail with ErrPeerGone, and the session's end runs once, after the last
// call. No rings, no mappings.
func TestDirectClient(t *testing.T) {
	path := t.TempDir() + "/kvshim.sock"
	_, err := DialDirect(path, Hello{Role: RoleScheduler}, nil)
	assert.Assert(t, errors.Is(err, ErrRefused), "%v", err)

	var ends, opened atomic.Int32
	var last *Client
	unreg := RegisterDirect(path, func(h Hello, c *Client) (Handler, func(), error) {
		if h.Role == RoleTool {
			return nil, nil, errors.New("no tools")
		}
		opened.Add(1)
		last = c
		return ServiceHandler(&testService{}), func() { ends.Add(1) }, nil
	})
	assert.Assert(t, HasDirect(path))
	_, err = DialDirect(path, Hello{Role: RoleTool}, nil)
	assert.ErrorContains(t, err, "no tools")

	c, err := DialDirect(path, Hello{Role: RoleScheduler}, nil)
	assert.NilError(t, err)
	assert.Assert(t, c.IsDirect() && last == c)
	ctx := context.Background()
	cr, err := c.Clear(ctx)
	assert.NilError(t, err)
	assert.Equal(t, *cr, ClearResp{Objects: 1, Bytes: 2})
	assert.NilError(t, c.Lookup(ctx, &LookupReq{Hashes: make([]kv.Hash, 3)}))
	assert.Assert(t, c.Free(ctx, &FreeReq{}) != nil) // the service's own error, as a status
	assert.Assert(t, errors.Is(c.Free(ctx, &FreeReq{}), ErrRemote))
	past, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	assert.Assert(t, errors.Is(c.Ping(past), ErrTimeout))
	assert.NilError(t, c.Ping(ctx)) // a timeout does not end the session
	assert.Equal(t, ends.Load(), int32(0))

	last.EndDirect(errors.New("server stopped"))
	assert.Assert(t, errors.Is(c.Ping(ctx), ErrPeerGone))
	<-c.Done()
	<-c.Freed()
	assert.Equal(t, ends.Load(), int32(1))
	c.Close()
	assert.Equal(t, ends.Load(), int32(1))

	// A malformed body ends the session like a ring's.
	c2, err := DialDirect(path, Hello{Role: RoleScheduler}, nil)
	assert.NilError(t, err)
	_, _, err = c2.Call(ctx, OpAlloc, []byte{1, 2, 3})
	assert.Assert(t, errors.Is(err, ErrMalformed), "%v", err)
	<-c2.Done()
	assert.Equal(t, ends.Load(), int32(2))

	// A later server on the same path is not removed by the earlier one's
	// unregister.
	unreg2 := RegisterDirect(path, func(Hello, *Client) (Handler, func(), error) {
		return ServiceHandler(&testService{}), func() {}, nil
	})
	unreg()
	assert.Assert(t, HasDirect(path))
	unreg2()
	assert.Assert(t, !HasDirect(path))
	assert.Equal(t, opened.Load(), int32(2))
}
