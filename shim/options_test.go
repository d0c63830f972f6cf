package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/cli"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/trace"
)

func TestDecodeRequestOptions(t *testing.T) {
	closed := RequestOptions{SkipLoad: true, SkipSave: true}
	for _, tc := range []struct {
		name, in string
		want     RequestOptions
		err      string
	}{
		{"none", ``, RequestOptions{}, ""},
		{"null", `null`, RequestOptions{}, ""},
		{"others' keys", `{"do_remote_prefill": true, "remote_engine_id": "x"}`, RequestOptions{}, ""},
		{"skip load", `{"kvshim.skip_load": true}`, RequestOptions{SkipLoad: true}, ""},
		{"skip save", `{"kvshim.skip_save": true, "kvshim.skip_load": false}`, RequestOptions{SkipSave: true}, ""},
		{"unknown key", `{"kvshim.skip_saves": true}`, closed, `"kvshim.skip_saves"`},
		{"not a bool", `{"kvshim.skip_save": "yes"}`, closed, `kvshim.skip_save: want true or false`},
		{"not an object", `[1]`, closed, "not a JSON object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := DecodeRequestOptions([]byte(tc.in))
			assert.Equal(t, o, tc.want)
			if tc.err == "" {
				assert.NilError(t, err)
				return
			}
			assert.ErrorIs(t, err, ErrBadParams)
			assert.ErrorContains(t, err, tc.err)
		})
	}
}

func TestParseRole(t *testing.T) {
	for in, want := range map[string]Role{"": RoleBoth, "kv_both": RoleBoth, "kv_producer": RoleProducer, "kv_consumer": RoleConsumer} {
		r, err := ParseRole(in)
		assert.NilError(t, err)
		assert.Equal(t, r, want)
	}
	_, err := ParseRole("kv_prod")
	assert.ErrorIs(t, err, ErrBadRole)
	assert.ErrorContains(t, err, `"kv_prod"`)
}

func TestRequestSkipSaveAndSkipLoad(t *testing.T) {
	r := newRig(t, 1)
	tokens := tokensOf(3, 8)
	// skip_save: computed, nothing saved.
	r.sched.SetRequestOptions("private", RequestOptions{SkipSave: true})
	_, saved := saveChunks(t, r, "private", tokens, 3)
	assert.Equal(t, saved, 0)
	// Saved normally; then a skip_load request with the same prompt is a
	// miss that asks the server nothing, while a plain one hits.
	_, saved = saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)
	lookups := lookupsTotal(r)
	r.sched.SetRequestOptions("cold", RequestOptions{SkipLoad: true})
	assert.Equal(t, r.match(t, "cold", withTail(tokens), Extras{}, 0), 0)
	assert.Equal(t, lookupsTotal(r), lookups)
	r.sched.Finished("cold")
	assert.Equal(t, r.match(t, "warm", withTail(tokens), Extras{}, 0), 3*tChunk)
	r.sched.Finished("warm")
}

// Prefill/decode disaggregation through one server: the producer saves and
// never looks up, the consumer loads and never saves.
// schedulerAs is a second scheduler on r's server and namespace in role
// (kv_role), closed when the test ends.
func (r *rig) schedulerAs(t *testing.T, role Role) *Scheduler {
	t.Helper()
	s, err := NewScheduler(SchedulerConfig{Socket: r.cfg.Socket, Namespace: r.sched.cfg.Namespace, BlockSize: tBS,
		Timeout: 2 * time.Second, Instance: uuid.New(), Role: role})
	assert.NilError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func TestRolesProducerAndConsumer(t *testing.T) {
	r := newRig(t, 1)
	consumer := r.schedulerAs(t, RoleConsumer)
	r.sched = consumer
	tokens := tokensOf(11, 2)
	_, saved := saveChunks(t, r, "C0", tokens, 3)
	assert.Equal(t, saved, 0, "a consumer saves nothing")

	r.sched = r.schedulerAs(t, RoleProducer)
	_, saved = saveChunks(t, r, "P1", tokens, 3)
	assert.Equal(t, saved, 3)
	lookups := lookupsTotal(r)
	assert.Equal(t, r.match(t, "P2", withTail(tokens), Extras{}, 0), 0, "a producer never loads")
	assert.Equal(t, lookupsTotal(r), lookups)
	r.sched.Finished("P2")

	r.sched = consumer
	r.loadHit(t, "C1", tokens, 3)
	r.sched.Finished("C1")
}

// An abort after the load was planned (vLLM: WAITING_FOR_REMOTE_KVS) is a
// cancel: the scheduler's record says the load was dropped, and `kvshim
// trace` shows it beside the chunks the workers loaded anyway.
func TestAbortDuringLoadIsACancel(t *testing.T) {
	r := newRig(t, 1)
	tokens := tokensOf(13, 5)
	_, saved := saveChunks(t, r, "A", tokens, 3)
	assert.Equal(t, saved, 3)
	dir := t.TempDir()
	cw, err := trace.Open(dir, trace.Options{Source: "scheduler"})
	assert.NilError(t, err)
	r.sched.SetTrace(cw)
	assert.NilError(t, r.workers[0].OpenTrace(dir))

	// Loaded, seen received, then finished: no cancel.
	n := r.match(t, "done", withTail(tokens), Extras{}, 0)
	r.load(t, "done", n)
	r.sched.Received([]string{"done"})
	r.sched.Finished("done")
	assert.Equal(t, r.sched.CancelledLoads(), uint64(0))

	// Aborted while loading: the workers still load it.
	n = r.match(t, "aborted", withTail(tokens), Extras{}, 0)
	r.load(t, "aborted", n)
	r.sched.Finished("aborted")
	assert.Equal(t, r.sched.CancelledLoads(), uint64(1))

	r.sched.SetTrace(nil)
	assert.NilError(t, cw.Close())
	assert.NilError(t, r.workers[0].CloseTrace())
	var out, errb bytes.Buffer
	assert.Equal(t, cli.Trace([]string{"--json", dir}, &out, &errb), 0, errb.String())
	var rep struct {
		Requests []struct {
			RequestID   string  `json:"request_id"`
			Loaded      *uint32 `json:"loaded_chunks"`
			Cancelled   bool    `json:"cancelled"`
			LoadDropped bool    `json:"load_dropped"`
		} `json:"requests"`
	}
	assert.NilError(t, json.Unmarshal(out.Bytes(), &rep))
	found := 0
	for _, q := range rep.Requests {
		switch q.RequestID {
		case "aborted":
			found++
			assert.Assert(t, q.Cancelled && q.LoadDropped)
			assert.Assert(t, q.Loaded != nil && *q.Loaded == 3, "loaded anyway: %v", q.Loaded)
		case "done":
			found++
			assert.Assert(t, !q.Cancelled && !q.LoadDropped)
		}
	}
	assert.Equal(t, found, 2, out.String())
	out.Reset()
	assert.Equal(t, cli.Trace([]string{"--request", "aborted", dir}, &out, &errb), 0, errb.String())
	assert.Assert(t, strings.Contains(out.String(), "CANCELLED (aborted during its load: 3 chunks loaded anyway, dropped)"), out.String())
}

func lookupsTotal(r *rig) float64 {
	v, _ := r.srv.Core.Stat("kvshim_lookups_total")
	return v
}

// A producer never looks up, so no lookup answer tells it of a reset made
// by a consumer: it asks the server again (at most once a second) and its
// saves move to the new generation, where the consumer finds them.
func TestProducerLearnsAResetWithoutLookups(t *testing.T) {
	r := newRig(t, 1)
	producer, consumer := r.schedulerAs(t, RoleProducer), r.schedulerAs(t, RoleConsumer)
	tokens := tokensOf(19, 4)
	r.sched = producer
	_, saved := saveChunks(t, r, "P1", tokens, 3)
	assert.Equal(t, saved, 3)
	gen, err := consumer.Reset()
	assert.NilError(t, err)
	r.sched = consumer
	assert.Equal(t, r.match(t, "C1", withTail(tokens), Extras{}, 0), 0)
	r.sched.Finished("C1")
	time.Sleep(genRefresh + 100*time.Millisecond)
	r.sched = producer
	_, saved = saveChunks(t, r, "P2", tokens, 3)
	assert.Equal(t, saved, 3, "saved under the new generation: new keys")
	assert.Equal(t, producer.Generation(), gen)
	r.sched = consumer
	r.loadHit(t, "C2", tokens, 3)
	r.sched.Finished("C2")
}

// Prefill/decode disaggregation through a shared L2 with two servers: the
// producer's server writes its chunks through to the fs L2, the consumer's
// server (its own L1, empty) fills them from disk.
func TestRolesThroughASharedL2(t *testing.T) {
	dir := t.TempDir()
	ns := NamespaceSpec{Model: "m", DType: "bfloat16", LayoutFingerprint: "test", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk}
	withL2 := func(c *server.Config) { c.L2Adapters = []string{fmt.Sprintf(`{"type":"fs","base_path":%q}`, dir)} }
	prefill, decode := newRigWith(t, ns, withL2, nil), newRigWith(t, ns, withL2, nil)
	prefill.sched, decode.sched = prefill.schedulerAs(t, RoleProducer), decode.schedulerAs(t, RoleConsumer)
	tokens := tokensOf(23, 6)
	_, saved := saveChunks(t, prefill, "P", tokens, 3)
	assert.Equal(t, saved, 3)
	prefill.flushL2(t)
	n := decode.loadHit(t, "D", tokens, 3)
	assert.DeepEqual(t, decode.sched.HitSources("D", n), map[HitSource]int{SourceDisk: 3 * tChunk})
	decode.sched.Finished("D")
	assert.Equal(t, decode.workers[0].Stats().SavedChunks, uint64(0))
}
