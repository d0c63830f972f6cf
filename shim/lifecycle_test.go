package shim

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"
	"gotest.tools/v3/assert"
)

// TestLifecycle drives a request's life in the scheduler (the table in
// doc.go) as data: each file in testdata/lifecycle is a scenario of vLLM's
// calls against the real scheduler, an in-process server and one worker
// rank with a CPU KV cache, and the answers the scenario expects. Run
// with -rewrite to write the answers after a deliberate change; read the
// diff before committing it.
//
// Commands (block lists are "10-15" ranges or "10,11,-1" lists):
//
//	prompt name=P len=N [base=B]          define a prompt of N token ids
//	match req=R prompt=P [local=N]        get_num_new_matched_tokens, polled until final
//	alloc req=R blocks=L external=N [local=N] [groups=G]
//	step                                  build_connector_meta, then every worker's copies;
//	                                      input lines: "new R blocks=L scheduled=N [groups=G]",
//	                                      "running R new=L scheduled=N", "preempted R"
//	finish req=R [prompt=P computed=N blocks=L]  request_finished (with the tokens: a normal finish)
//	fill blocks=L seed=S                  write random bytes into the KV cache's blocks
//	same a=L b=L                          whether blocks a hold the bytes of blocks b, block by block
//	stats                                 kvshim_take_step_stats of the scheduler and the server's holds
func TestLifecycle(t *testing.T) {
	datadriven.Walk(t, "testdata/lifecycle", func(t *testing.T, path string) {
		r := newRig(t, 1)
		prompts := map[string][]uint32{}
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			var out strings.Builder
			arg := func(key string) string {
				for _, a := range d.CmdArgs {
					if a.Key == key && len(a.Vals) > 0 {
						return strings.Join(a.Vals, ",")
					}
				}
				return ""
			}
			num := func(key string, def int) int {
				if v := arg(key); v != "" {
					n, err := strconv.Atoi(v)
					assert.NilError(t, err, "%s=%s", key, v)
					return n
				}
				return def
			}
			switch d.Cmd {
			case "prompt":
				prompts[arg("name")] = conversation(num("len", 0), uint32(num("base", 1)))
				return ""
			case "match":
				tokens, ok := prompts[arg("prompt")]
				assert.Assert(t, ok, "no prompt %q", arg("prompt"))
				return fmt.Sprintf("hit %d\n", r.match(t, arg("req"), tokens, Extras{}, num("local", 0)))
			case "alloc":
				err := r.sched.AfterAlloc(arg("req"), blockList(t, arg("blocks")), num("groups", 1), num("local", 0), num("external", 0))
				return errOrOK(err)
			case "step":
				st := &Step{}
				for _, line := range strings.Split(strings.TrimSpace(d.Input), "\n") {
					if f := strings.Fields(line); len(f) >= 2 {
						st = stepLine(t, st, f)
					}
				}
				raw, err := r.sched.BuildMeta(st)
				if err != nil {
					return "error: " + err.Error() + "\n"
				}
				m, err := DecodeStepMeta(raw, tChunk/tBS, tBlocks)
				assert.NilError(t, err)
				printMeta(&out, m)
				recv, errBlocks := r.copies(t, raw)
				if len(recv) > 0 {
					fmt.Fprintf(&out, "recving: %s\n", strings.Join(slices.Sorted(maps.Keys(recv)), " "))
				}
				if len(errBlocks) > 0 {
					fmt.Fprintf(&out, "load errors: %v\n", errBlocks)
				}
				if out.Len() == 0 {
					return "empty\n"
				}
				return out.String()
			case "finish":
				req := arg("req")
				if arg("prompt") == "" {
					return fmt.Sprintf("delay %v\n", r.sched.Finished(req))
				}
				fin := &FinishState{Tokens: prompts[arg("prompt")], Computed: num("computed", 0), Blocks: blockList(t, arg("blocks")), Groups: 1}
				delay, err := r.sched.FinishedSaving(req, fin)
				if err != nil {
					return fmt.Sprintf("delay %v, error: %v\n", delay, err)
				}
				return fmt.Sprintf("delay %v\n", delay)
			case "fill":
				for _, b := range blockList(t, arg("blocks")) {
					r.caches[0].fill(int(b), uint64(num("seed", 1)))
				}
				return ""
			case "same":
				a, b := blockList(t, arg("a")), blockList(t, arg("b"))
				assert.Equal(t, len(a), len(b))
				for i := range a {
					same := true
					for l := range tLayers {
						same = same && bytes.Equal(r.caches[0].block(l, int(a[i])), r.caches[0].block(l, int(b[i])))
					}
					fmt.Fprintf(&out, "%d=%d: %v\n", a[i], b[i], same)
				}
				return out.String()
			case "stats":
				st := r.sched.TakeStepStats()
				for _, k := range slices.Sorted(maps.Keys(st)) {
					fmt.Fprintf(&out, "%s %v\n", k, st[k])
				}
				fmt.Fprintf(&out, "holds %v\n", holds(t, r.srv))
				return out.String()
			}
			t.Fatalf("unknown command %q", d.Cmd)
			return ""
		})
	})
}

func errOrOK(err error) string {
	if err != nil {
		return "error: " + err.Error() + "\n"
	}
	return "ok\n"
}

// blockList reads "10-15" (10..15) or "10,11,-1".
func blockList(t *testing.T, s string) []int64 {
	if s == "" {
		return nil
	}
	if from, to, ok := strings.Cut(s, "-"); ok && from != "" {
		a, err1 := strconv.Atoi(from)
		b, err2 := strconv.Atoi(to)
		assert.Assert(t, err1 == nil && err2 == nil && b >= a, "bad range %q", s)
		return seq(a, b-a+1)
	}
	var out []int64
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.ParseInt(f, 10, 64)
		assert.NilError(t, err, "bad block list %q", s)
		out = append(out, n)
	}
	return out
}

// stepLine adds one input line of "step" to st.
func stepLine(t *testing.T, st *Step, f []string) *Step {
	kind, req := f[0], f[1]
	if kind == "preempted" {
		st.Preempted = append(st.Preempted, req)
		return st
	}
	sr := StepRequest{Req: req, Groups: 1}
	for _, kv := range f[2:] {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "blocks":
			sr.Blocks = blockList(t, v)
		case "new":
			sr.NewBlocks = blockList(t, v)
		case "groups":
			n, err := strconv.Atoi(v)
			assert.NilError(t, err)
			sr.Groups = n
		case "scheduled", "computed":
			n, err := strconv.Atoi(v)
			assert.NilError(t, err)
			if k == "scheduled" {
				sr.Scheduled = n
			} else {
				sr.Computed = n
			}
		default:
			t.Fatalf("step line %v: unknown %q", f, k)
		}
	}
	assert.Assert(t, kind == "new" || kind == "running", "step line %v", f)
	if kind == "running" && sr.NewBlocks == nil {
		sr.NewBlocks = []int64{}
	}
	st.Requests = append(st.Requests, sr)
	return st
}

// printMeta writes the metadata's loads, saves and lists, one per line.
func printMeta(out *strings.Builder, m *StepMeta) {
	for _, ld := range m.Loads {
		fmt.Fprintf(out, "load %s chunks %d-%d into %v\n", ld.Req, ld.Start, ld.End-1, ld.Blocks)
	}
	for _, sv := range m.Saves {
		fmt.Fprintf(out, "save %s chunks %d-%d from %v\n", sv.Req, sv.First, int(sv.First)+len(sv.Hashes)-1, sv.Blocks)
	}
	if len(m.Finished) > 0 {
		fmt.Fprintf(out, "finished: %s\n", strings.Join(m.Finished, " "))
	}
	if len(m.Preempted) > 0 {
		fmt.Fprintf(out, "preempted: %s\n", strings.Join(m.Preempted, " "))
	}
}
