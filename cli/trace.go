package cli

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kvshim/kvshim/trace"
)

// kvshim trace FILE...: the lifecycle records of trace files (or
// directories of them) as a per-request timeline and a summary.

type traceEvent struct {
	TMS       float64 `json:"t_ms"` // since the request's first record
	Source    string  `json:"source"`
	Kind      string  `json:"kind"`
	Event     string  `json:"event"`
	Rank      int32   `json:"rank"`
	Chunk     *int32  `json:"chunk,omitempty"`
	Chunks    uint32  `json:"chunks,omitempty"`
	Matched   uint32  `json:"matched,omitempty"`
	Result    string  `json:"result,omitempty"`
	Reason    string  `json:"reason,omitempty"`
	Bytes     uint64  `json:"bytes,omitempty"`
	StopRank  *int32  `json:"stop_rank,omitempty"`
	L1        string  `json:"l1,omitempty"` // per-chunk L1 candidates: '1' present on every rank, '0' not
	PhaseNS   *phases `json:"phase_ns,omitempty"`
	mono      int64
	requestID string
}

type phases struct {
	Retrieve int64 `json:"retrieve"`
	Check    int64 `json:"check"`
	Copy     int64 `json:"copy"`
}

type traceRequest struct {
	RequestID string  `json:"request_id"`
	LookupID  uint64  `json:"lookup_id"`
	Owner     string  `json:"owner"`
	Namespace string  `json:"namespace"`
	Asked     uint32  `json:"asked_chunks"`
	Found     *uint32 `json:"found_chunks"`  // the lookup's final answer (nil: none seen)
	Used      *uint32 `json:"used_chunks"`   // chunks a load was planned for (nil: no load)
	Loaded    *uint32 `json:"loaded_chunks"` // chunks restored on every rank that loaded
	Stop      string  `json:"stop,omitempty"`
	Cancelled bool    `json:"cancelled"`
	// LoadDropped: aborted while its load was in flight; loaded_chunks is
	// what the workers loaded anyway, and vLLM dropped it.
	LoadDropped bool         `json:"load_dropped"`
	Failures    []traceFail  `json:"failures"`
	Saved       uint32       `json:"saved_chunks"`
	Timeline    []traceEvent `json:"timeline"`
	first       int64
	loaded      map[int32]uint32
}

type traceFail struct {
	Rank   int32  `json:"rank"`
	Chunk  int32  `json:"chunk"`
	Result string `json:"result"`
	Reason string `json:"reason"`
}

type traceSummary struct {
	Files          int               `json:"files"`
	Records        int               `json:"records"`
	DroppedRecords uint64            `json:"dropped_records"`
	Requests       int               `json:"requests"`
	Lookups        int               `json:"lookups"`
	ChunksAsked    uint64            `json:"chunks_asked"`
	HitsFound      uint64            `json:"hits_found"`
	HitsUsed       uint64            `json:"hits_used"`
	HitsLoaded     uint64            `json:"hits_loaded"`
	Failures       map[string]uint64 `json:"failures_by_result"`
	PhaseNS        phases            `json:"time_by_phase_ns"`
	BytesLoaded    uint64            `json:"bytes_loaded"`
	BytesSaved     uint64            `json:"bytes_saved"`
	SavesCommitted uint64            `json:"chunks_saved"`
	SavesSkipped   uint64            `json:"chunks_save_skipped"`
	SavesFailed    uint64            `json:"chunks_save_failed"`
	L2Saved        uint64            `json:"chunks_l2_saved"`
	L2SaveFailed   uint64            `json:"chunks_l2_save_failed"`
	BytesL2Saved   uint64            `json:"bytes_l2_saved"`
	Cancels        int               `json:"cancels"`
	Evictions      uint64            `json:"evictions"`
	EvictedBytes   uint64            `json:"evicted_bytes"`
}

type traceReport struct {
	Summary  traceSummary    `json:"summary"`
	Requests []*traceRequest `json:"requests"`
}

// traceFiles expands directories to the closed trace files in them.
func traceFiles(args []string) ([]string, error) {
	var out []string
	for _, a := range args {
		fi, err := os.Stat(a)
		if err != nil {
			return nil, err
		}
		if !fi.IsDir() {
			out = append(out, a)
			continue
		}
		fs, err := filepath.Glob(filepath.Join(a, "*"+trace.Suffix))
		if err != nil {
			return nil, err
		}
		out = append(out, fs...)
	}
	return out, nil
}

func lookupKey(owner string, id uint64) string { return fmt.Sprintf("%s/%d", owner, id) }

// buildTraceReport joins the records: worker records name the request and
// its (owner, lookup id); server records of that lookup join it.
func buildTraceReport(recs []trace.Record, files int) *traceReport {
	rep := &traceReport{Summary: traceSummary{Files: files, Records: len(recs), Failures: map[string]uint64{}}}
	sum := &rep.Summary
	reqOf := map[string]string{} // lookup key -> request id
	for _, r := range recs {
		if r.RequestID != "" && (r.LookupID != 0 || r.Kind == trace.KindLoad) {
			reqOf[lookupKey(r.Owner, r.LookupID)] = r.RequestID
		}
	}
	byKey := map[string]*traceRequest{}
	var order []string
	get := func(key string, r *trace.Record) *traceRequest {
		q := byKey[key]
		if q == nil {
			q = &traceRequest{LookupID: r.LookupID, Owner: r.Owner, Namespace: r.Namespace, first: r.Mono,
				Failures: []traceFail{}, loaded: map[int32]uint32{}}
			byKey[key] = q
			order = append(order, key)
		}
		if q.RequestID == "" {
			q.RequestID = r.RequestID
		}
		if q.LookupID == 0 {
			q.LookupID, q.Owner = r.LookupID, r.Owner
		}
		return q
	}
	for i := range recs {
		r := &recs[i]
		switch r.Kind {
		case trace.KindWriter:
			sum.DroppedRecords += r.Dropped
			continue
		case trace.KindEvict:
			sum.Evictions += uint64(r.Chunks)
			sum.EvictedBytes += r.Bytes
			continue
		}
		var key string
		switch {
		case r.Kind == trace.KindSave && r.RequestID == "":
			// the server's COMMIT and L2 records name no request
			if r.Event == "l2_saved" {
				sum.L2Saved += uint64(r.Matched)
				sum.L2SaveFailed += uint64(r.Failed)
				sum.BytesL2Saved += r.Bytes
			}
			continue
		case r.RequestID != "":
			key = "req:" + r.RequestID
		case reqOf[lookupKey(r.Owner, r.LookupID)] != "":
			key = "req:" + reqOf[lookupKey(r.Owner, r.LookupID)]
			r.RequestID = reqOf[lookupKey(r.Owner, r.LookupID)]
		default:
			key = "lookup:" + lookupKey(r.Owner, r.LookupID)
		}
		q := get(key, r)
		ev := traceEvent{TMS: float64(r.Mono-q.first) / 1e6, Source: r.Source, Kind: r.Kind.String(), Event: r.Event, Rank: r.Rank,
			Chunks: r.Chunks, Matched: r.Matched, Result: r.Result, Reason: r.Reason, Bytes: r.Bytes, mono: r.Mono}
		if r.Chunk >= 0 && (r.Kind == trace.KindLoad && r.Event == "chunk" || r.Kind == trace.KindLookup && r.Chunk >= 0) {
			c := r.Chunk
			ev.Chunk = &c
		}
		switch r.Kind {
		case trace.KindLookup:
			if r.StopRank >= 0 {
				sr := r.StopRank
				ev.StopRank = &sr
			}
			switch r.Event {
			case "registered":
				var b strings.Builder
				for c := range int(r.Chunks) {
					if trace.Bit(r.L1, c) {
						b.WriteByte('1')
					} else {
						b.WriteByte('0')
					}
				}
				ev.L1 = b.String()
				q.Asked = r.Chunks
				sum.Lookups++
				sum.ChunksAsked += uint64(r.Chunks)
			case "final":
				m := r.Matched
				q.Found = &m
				q.Stop = r.Result
				if r.Reason != "" {
					q.Stop += ": " + r.Reason
				}
				sum.HitsFound += uint64(m)
			}
		case trace.KindLoad:
			switch r.Event {
			case "planned":
				if q.Used == nil || *q.Used < r.Chunks {
					u := r.Chunks
					q.Used = &u
				}
			case "chunk":
				if r.Result != "ok" && r.Result != "not_loaded" {
					q.Failures = append(q.Failures, traceFail{Rank: r.Rank, Chunk: r.Chunk, Result: r.Result, Reason: r.Reason})
					sum.Failures[r.Result]++
				}
			case "done":
				q.loaded[r.Rank] = r.Matched
				ev.PhaseNS = &phases{r.RetrieveNS, r.CheckNS, r.CopyNS}
				sum.PhaseNS.Retrieve += r.RetrieveNS
				sum.PhaseNS.Check += r.CheckNS
				sum.PhaseNS.Copy += r.CopyNS
				sum.BytesLoaded += r.Bytes
			}
		case trace.KindSave:
			if r.Event == "commit" {
				q.Saved += r.Matched
				sum.SavesCommitted += uint64(r.Matched)
				sum.SavesSkipped += uint64(r.Skipped)
				sum.SavesFailed += uint64(r.Failed)
				sum.BytesSaved += r.Bytes
			}
		case trace.KindCancel:
			q.Cancelled = true
			sum.Cancels++
			if r.Event == "load_dropped" {
				q.LoadDropped = true
				if q.Used == nil {
					u := r.Chunks
					q.Used = &u
				}
			}
		}
		q.Timeline = append(q.Timeline, ev)
	}
	for _, k := range order {
		q := byKey[k]
		if len(q.loaded) > 0 {
			var m *uint32
			for _, v := range q.loaded {
				if m == nil || v < *m {
					v := v
					m = &v
				}
			}
			q.Loaded = m
			if q.Used != nil {
				sum.HitsUsed += uint64(*q.Used)
			}
			sum.HitsLoaded += uint64(*m)
		}
		rep.Requests = append(rep.Requests, q)
	}
	sum.Requests = len(rep.Requests)
	return rep
}

func runTrace(args []string, _ Info, stdout, stderr io.Writer) int {
	fs := newFlagSet("trace", "Print the lifecycle records of trace files (kvshim serve --trace-dir, the\n"+
		"connector's kvshim.trace_dir) as a per-request timeline and a summary: hits\n"+
		"found vs used vs loaded, failures by reason, time by phase, bytes.\n"+
		"Arguments are .arrow files or directories of them (.part files, still\n"+
		"being written, are skipped). usage: kvshim trace [flags] FILE|DIR...")
	asJSON := fs.Bool("json", false, "print one JSON object: {summary, requests: [{..., timeline}]}")
	reqFilter := fs.String("request", "", "only the request with this `id`")
	level := fs.String("log-level", "", "log `level`: debug, info, warn or error")
	err := fs.FlagSet.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "usage: kvshim trace [flags] FILE|DIR...\n\n%s\n\nflags:\n", fs.head)
		fs.printDefaults(stdout)
		return 0
	case err != nil:
		fmt.Fprintf(stderr, "kvshim trace: %v\nrun 'kvshim trace --help' for the flags\n", err)
		return 2
	case fs.NArg() == 0:
		fmt.Fprintln(stderr, "kvshim trace: no trace file or directory given\nrun 'kvshim trace --help' for the flags")
		return 2
	}
	if *level != "" {
		if err := SetLogLevel(*level); err != nil {
			fmt.Fprintf(stderr, "kvshim trace: --log-level: %v\n", err)
			return 2
		}
	}
	files, err := traceFiles(fs.Args())
	if err != nil {
		fmt.Fprintf(stderr, "kvshim trace: %v\n", err)
		return 1
	}
	recs, err := trace.ReadFiles(files)
	if err != nil {
		fmt.Fprintf(stderr, "kvshim trace: %v\n", err)
		return 1
	}
	rep := buildTraceReport(recs, len(files))
	if *reqFilter != "" {
		var keep []*traceRequest
		for _, q := range rep.Requests {
			if q.RequestID == *reqFilter {
				keep = append(keep, q)
			}
		}
		rep.Requests = keep
	}
	if rep.Requests == nil {
		rep.Requests = []*traceRequest{}
	}
	if *asJSON {
		if err := json.NewEncoder(stdout).Encode(rep); err != nil {
			return 1
		}
		return 0
	}
	printTraceReport(stdout, rep)
	return 0
}

func optU(p *uint32) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprint(*p)
}

func printTraceReport(w io.Writer, rep *traceReport) {
	for _, q := range rep.Requests {
		name := q.RequestID
		if name == "" {
			name = "(no request id)"
		}
		fmt.Fprintf(w, "request %s  lookup %d  owner %.8s  asked %d  found %s  used %s  loaded %s  saved %d",
			name, q.LookupID, q.Owner, q.Asked, optU(q.Found), optU(q.Used), optU(q.Loaded), q.Saved)
		if q.Cancelled {
			fmt.Fprint(w, "  CANCELLED")
		}
		if q.LoadDropped {
			fmt.Fprintf(w, " (aborted during its load: %s chunks loaded anyway, dropped)", optU(q.Loaded))
		}
		fmt.Fprintln(w)
		if q.Stop != "" {
			fmt.Fprintf(w, "  stop: %s\n", q.Stop)
		}
		for _, e := range q.Timeline {
			line := fmt.Sprintf("  %+10.3fms  %-10s %-6s %-10s", e.TMS, e.Source, e.Kind, e.Event)
			if e.Rank >= 0 {
				line += fmt.Sprintf(" rank=%d", e.Rank)
			}
			if e.Chunk != nil {
				line += fmt.Sprintf(" chunk=%d", *e.Chunk)
			}
			if e.Chunks > 0 {
				line += fmt.Sprintf(" chunks=%d", e.Chunks)
			}
			if e.Matched > 0 {
				line += fmt.Sprintf(" matched=%d", e.Matched)
			}
			if e.L1 != "" {
				line += " l1=" + e.L1
			}
			if e.Bytes > 0 {
				line += fmt.Sprintf(" bytes=%d", e.Bytes)
			}
			if e.PhaseNS != nil {
				line += fmt.Sprintf(" retrieve=%.3fms check=%.3fms copy=%.3fms", float64(e.PhaseNS.Retrieve)/1e6, float64(e.PhaseNS.Check)/1e6, float64(e.PhaseNS.Copy)/1e6)
			}
			if e.Result != "" {
				line += " result=" + e.Result
			}
			if e.Reason != "" {
				line += " (" + e.Reason + ")"
			}
			fmt.Fprintln(w, line)
		}
	}
	s := rep.Summary
	fmt.Fprintf(w, "\nsummary: %d files, %d records (%d dropped by the writers), %d requests, %d lookups\n",
		s.Files, s.Records, s.DroppedRecords, s.Requests, s.Lookups)
	fmt.Fprintf(w, "  chunks: asked %d, hits found %d, used (load planned) %d, loaded %d\n", s.ChunksAsked, s.HitsFound, s.HitsUsed, s.HitsLoaded)
	if len(s.Failures) > 0 {
		keys := make([]string, 0, len(s.Failures))
		for k := range s.Failures {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		fmt.Fprint(w, "  load failures:")
		for _, k := range keys {
			fmt.Fprintf(w, " %s=%d", k, s.Failures[k])
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "  time by phase: retrieve %.3fms, check %.3fms, copy %.3fms\n",
		float64(s.PhaseNS.Retrieve)/1e6, float64(s.PhaseNS.Check)/1e6, float64(s.PhaseNS.Copy)/1e6)
	fmt.Fprintf(w, "  bytes: loaded %d, saved %d; saves: %d chunks committed, %d skipped, %d failed\n",
		s.BytesLoaded, s.BytesSaved, s.SavesCommitted, s.SavesSkipped, s.SavesFailed)
	if s.L2Saved+s.L2SaveFailed > 0 {
		fmt.Fprintf(w, "  L2 writes: %d chunks saved (%d bytes), %d failed\n", s.L2Saved, s.BytesL2Saved, s.L2SaveFailed)
	}
	fmt.Fprintf(w, "  cancels %d, evictions %d (%d bytes)\n", s.Cancels, s.Evictions, s.EvictedBytes)
}

func init() {
	commands["trace"] = command{"print trace files (--trace-dir) as per-request timelines and a summary", runTrace}
}

// Trace runs `kvshim trace` with args (for tests and embedders).
func Trace(args []string, stdout, stderr io.Writer) int {
	return runTrace(args, Info{}, stdout, stderr)
}
