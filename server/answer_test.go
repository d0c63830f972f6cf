package server

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
)

// A LOOKUP with AnswerFinal (protocol 5) that is final at registration is
// answered, and consumed, by its ack: its holds stay for the workers, and
// OpLookupResult no longer knows it as unread. Without the flag the ack is
// empty and the answer is read as before; a miss is answered too (final 0).
// A lookup still pending (a fill from L2) keeps the empty ack: the shim's
// TestDirectAndRingLookupsAgree covers it through both paths.
func TestLookupAnswerFinalInTheAck(t *testing.T) {
	srv, path := startServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sched := dial(t, path, ipc.RoleScheduler)
	worker := dial(t, path, ipc.RoleWorker)
	hs := hashes("answer", 3)
	tag := kv.Tag(uuid.New())
	_, err := worker.Alloc(ctx, &ipc.AllocReq{Tag: tag, Namespace: ns1, Hashes: hs, Sizes: sizes(3)})
	assert.NilError(t, err)
	_, err = worker.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns1, Hashes: hs})
	assert.NilError(t, err)
	hit := ipc.LookupResultResp{Status: ipc.StatusOK, Chunks: 3, Sources: []ipc.SourceRun{{Tier: ipc.TierL1, Chunks: 3}}}

	res, err := sched.LookupAnswer(ctx, &ipc.LookupReq{LookupID: 1, Namespace: ns1, WorldSize: 1, AnswerFinal: true, Hashes: hs})
	assert.NilError(t, err)
	assert.Assert(t, res != nil)
	assert.DeepEqual(t, *res, hit)
	again, err := sched.LookupResult(ctx, &ipc.LookupResultReq{LookupID: 1})
	assert.NilError(t, err)
	assert.Equal(t, again.Status, ipc.StatusUnknown) // consumed by the ack
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_holds"), 3.0)
	owner := kv.Tag(sched.Hello().Instance)
	rr, err := worker.Retrieve(ctx, &ipc.RetrieveReq{Owner: owner, LookupID: 1, End: ^uint32(0)})
	assert.NilError(t, err)
	assert.Equal(t, len(rr.Locs), 3)
	assert.NilError(t, worker.Release(ctx, &ipc.ReleaseReq{Owner: owner, LookupID: 1}))
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_holds"), 0.0)

	res, err = sched.LookupAnswer(ctx, &ipc.LookupReq{LookupID: 2, Namespace: ns1, WorldSize: 1, Hashes: hs})
	assert.NilError(t, err)
	assert.Assert(t, res == nil) // not asked for: the ack only acknowledges
	lr, err := sched.LookupResult(ctx, &ipc.LookupResultReq{LookupID: 2})
	assert.NilError(t, err)
	assert.DeepEqual(t, *lr, hit)
	assert.NilError(t, sched.Free(ctx, &ipc.FreeReq{LookupID: 2, End: ^uint32(0)}))

	res, err = sched.LookupAnswer(ctx, &ipc.LookupReq{LookupID: 3, Namespace: ns1, WorldSize: 1, AnswerFinal: true, Hashes: hashes("absent", 2)})
	assert.NilError(t, err)
	assert.Assert(t, res != nil)
	assert.Equal(t, res.Status, ipc.StatusOK)
	assert.Equal(t, res.Chunks, uint32(0))
	assert.Equal(t, stat(t, srv.Core, "kvshim_l1_holds"), 0.0)
	assert.Equal(t, stat(t, srv.Core, "kvshim_lookups_live"), 0.0) // a consumed miss holds nothing: forgotten
}
