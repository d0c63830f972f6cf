package shim

import (
	"context"
	"fmt"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
	"github.com/kvshim/kvshim/server"
)

// The embedded server's own scheduler calls the server core directly
// (ipc.DialDirect); SchedulerConfig.RingOnly sends the same calls over the
// ring. One table of lookups runs through both and must give the same
// answers and leave the server in the same state: a miss, a save, a full
// hit loaded, a shorter prefix asked twice (the answer consumed once, the
// second ask served from the scheduler), a hit vLLM declines (holds given
// back), a local prefix, and a restart with the chunks in L2 only (pending
// while the fill runs, then final), a stopped server (a miss, not a hang).
// What cannot be tested here: that the two paths time a lookup out the
// same way under a slow L2 (no L2 adapter of this repository stalls on
// demand); the timeout is the scheduler's own clock in both (Timeout), and
// a direct call past its deadline fails like a ring call (ipc tests).
func TestDirectAndRingLookupsAgree(t *testing.T) {
	run := func(t *testing.T, ringOnly bool) []string {
		r := newRig(t, 1)
		l2dir := t.TempDir()
		r.cfg.L2Adapters = []string{fmt.Sprintf(`{"type":"fs","base_path":%q}`, l2dir)}
		restart := func() {
			assert.NilError(t, r.srv.Close())
			srv, err := server.Start(r.cfg, nil, server.Options{})
			assert.NilError(t, err)
			t.Cleanup(func() { srv.Close() })
			r.srv = srv
		}
		restart() // with the L2 from the start
		cfg := r.sched.cfg
		cfg.RingOnly = ringOnly
		r.sched.Close()
		s, err := NewScheduler(cfg)
		assert.NilError(t, err)
		t.Cleanup(func() { s.Close() })
		r.sched = s

		var log []string
		ask := func(req string, tokens []uint32, local int) int {
			n := r.match(t, req, tokens, Extras{}, local)
			again, pending, err := r.sched.Match(req, tokens, Extras{}, local) // asked again: the same, final
			assert.NilError(t, err)
			assert.Assert(t, !pending)
			log = append(log, fmt.Sprintf("%s: %d again %d holds %v live %v", req, n, again,
				metric(t, r.srv, "kvshim_l1_holds"), metric(t, r.srv, "kvshim_lookups_live")))
			return n
		}
		tokens := tokensOf(7, 3)
		tokens = append(tokens, 9, 9, 9) // 3 chunks and a tail
		saveAfterRestart(t, r, "save", tokens[:3*tChunk], 3)
		// The L2 writer holds each object while it stores it: wait for it,
		// so the holds counted below are the lookups' alone.
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NilError(t, r.srv.Core.Writer().Flush(ctx))
		log = append(log, fmt.Sprintf("saved, L1 used %v", metric(t, r.srv, "kvshim_l1_used_bytes")))
		// A full hit, loaded.
		n := ask("full", tokens, 0)
		assert.NilError(t, r.sched.AfterAlloc("full", seq(20, 7), 1, -1, n))
		recv, errs := r.step(t, &Step{})
		log = append(log, fmt.Sprintf("full loaded %d errs %d", recv["full"], len(errs)))
		r.sched.Finished("full")
		// A shorter prefix: the third chunk differs.
		other := append([]uint32(nil), tokens...)
		other[2*tChunk+1]++
		n = ask("prefix", other, 0)
		assert.NilError(t, r.sched.AfterAlloc("prefix", seq(30, 7), 1, -1, 0)) // vLLM loads nothing
		r.step(t, &Step{})
		r.sched.Finished("prefix")
		log = append(log, fmt.Sprintf("prefix %d declined, holds %v", n, metric(t, r.srv, "kvshim_l1_holds")))
		// vLLM's own prefix cache has the first chunk.
		n = ask("local", tokens, tChunk)
		assert.NilError(t, r.sched.AfterAlloc("local", seq(40, 7), 1, tChunk, n-tChunk))
		recv, _ = r.step(t, &Step{})
		r.sched.Finished("local")
		log = append(log, fmt.Sprintf("local loaded %d", recv["local"]))

		// Restart: L1 empty, the chunks in L2.
		assert.NilError(t, r.srv.Core.Writer().Flush(ctx))
		restart()
		// The worker notices the old session's end on its own (its socket's
		// EOF): a load issued before that would try the dead session.
		testkit.Eventually(t, 5*time.Second, "the worker to notice the old session's end", func() bool {
			c := r.workers[0].link.current()
			return c == nil || c.Err() != nil
		})
		req, n := firstHitAfterRestart(t, r, tokens)
		log = append(log, fmt.Sprintf("after restart %d holds %v", n, metric(t, r.srv, "kvshim_l1_holds")))
		assert.NilError(t, r.sched.AfterAlloc(req, seq(50, 7), 1, -1, n))
		recv, errs = r.step(t, &Step{})
		r.sched.Finished(req)
		log = append(log, fmt.Sprintf("restart loaded %d errs %d", recv[req], len(errs)))
		c := r.sched.link.current()
		assert.Assert(t, c != nil)
		assert.Equal(t, c.IsDirect(), !ringOnly)

		// The server stops: a miss at once, then hits again once back.
		assert.NilError(t, r.srv.Close())
		t0 := time.Now()
		n, pending, err := r.sched.Match("down", tokens, Extras{}, 0)
		assert.NilError(t, err)
		assert.Assert(t, time.Since(t0) < time.Second)
		log = append(log, fmt.Sprintf("down %d pending %v", n, pending))
		r.sched.Finished("down")
		return log
	}
	ring := run(t, true)
	direct := run(t, false)
	assert.DeepEqual(t, direct, ring)
	t.Logf("%q", direct)
}

// metric reads one of the server's metrics (0 when it is not registered).
func metric(t testing.TB, srv *server.Server, name string) float64 {
	mfs, err := srv.Core.Registry().Gather()
	assert.NilError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	return -1
}
