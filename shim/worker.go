package shim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
	"github.com/kvshim/kvshim/objfmt"
)

// WorkerConfig configures the worker side of the connector (one per rank).
type WorkerConfig struct {
	Socket    string
	Namespace NamespaceSpec
	Rank      int
	Timeout   time.Duration // per server call and per copy job
	Instance  uuid.UUID
	Workers   int // host engine goroutines; 0 = GOMAXPROCS
	// Verify is kvshim.verify (objfmt.VerifyPolicy): under the default
	// (l2) saves seal headers only and loads check headers only; under
	// always both make a payload CRC pass; off is l2 for the worker.
	Verify objfmt.VerifyPolicy
}

// Worker is the worker-side state machine: it moves the bytes the
// scheduler's metadata asks for between vLLM's paged KV cache and the
// server's L1 segments, and reports what finished and what failed.
type Worker struct {
	cfg    WorkerConfig
	ns     kv.Namespace
	kvRank uint32
	writer bool // MLA: only one rank per TP group stores
	link   *link
	lat    latencies // load/save job durations for vLLM's /metrics (latency.go)

	mu       sync.Mutex
	layout   *layout.Layout   // KV-cache group 0's
	layouts  []*layout.Layout // every group's, by group id
	groupNS  []kv.Namespace   // every group's namespace (groupNS[0] == ns)
	engine   cuda.Engine
	pins     *pinner         // GPU caches only
	inflight map[string]int  // request -> copies not yet finished
	finish   map[string]bool // delay-freed requests to report when idle
	recving  []string        // loads finished since the last Poll
	errBlock []int64         // blocks whose load failed since the last Poll
	errReq   []string        // requests with a failed load since the last Poll (each once)
	stats    WorkerStats
	wg       sync.WaitGroup
	jobs     atomic.Int64 // background jobs running (Jobs)
	// reported gets a token when a load ends or a request's copies end
	// (WaitReport); capacity 1, never blocks a sender.
	reported chan struct{}
	// prewarming: Register's dial (link.prewarm) is still running; it
	// counts as a segment pending population in Stats.
	prewarming atomic.Bool
	layered    *layerStep // the current step's layer-wise loads (layerwise.go); guarded by mu
	saving     *layerSave // the current step's layer-wise saves (layersave.go); guarded by mu
	// saveReports: how each chunk of each save ended, for the scheduler's
	// KV events (events.go); recorded once TakeSaveReports was called.
	saveReports []SaveReport
	reportsOn   bool
	reportsLost uint64
}

// WorkerStats are cumulative counters of one worker.
type WorkerStats struct {
	SavedChunks, SkippedChunks, FailedSaves uint64
	LoadedChunks, FailedLoads               uint64
	SavedBytes, LoadedBytes                 uint64
	// CopySpans counts copy descriptors submitted (saves and loads): with
	// bytes, how well the KV layout coalesces (a GPU's cost is per span).
	CopySpans uint64
	// KeyMismatches counts retrieved objects whose header names another
	// key (bytes stored under the wrong name): load errors, never loaded.
	KeyMismatches uint64
	// L1 mappings populated ahead of copies (a CPU worker: ipc.Populate;
	// the process's counters, so two workers in one process add up) and
	// the current session's segments still waiting for it.
	PopulatedSegments, PopulatedBytes, PopulateNanos uint64
	PopulatePending                                  int
	// LayerwiseLoads counts loads run layer by layer (kvshim.layerwise);
	// LayerwiseSaves saves (one request's chunks of a step) run so.
	LayerwiseLoads, LayerwiseSaves uint64
}

// NewWorker checks cfg; Register must follow before any step.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	ns, err := cfg.Namespace.Namespace()
	if err != nil {
		return nil, err
	}
	kvRank, writer, err := cfg.Namespace.KVRank(cfg.Rank)
	if err != nil {
		return nil, err
	}
	_, specs, err := cfg.Namespace.GroupNamespaces()
	if err != nil {
		return nil, err
	}
	groupNS := make([]kv.Namespace, len(specs))
	for i, sp := range specs {
		if groupNS[i], err = sp.Namespace(); err != nil {
			return nil, err
		}
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	return &Worker{
		cfg: cfg, ns: ns, kvRank: kvRank, writer: writer, groupNS: groupNS,
		link:     newLink(cfg.Socket, ipc.RoleWorker, cfg.Instance, cfg.Timeout),
		inflight: map[string]int{}, finish: map[string]bool{},
		reported: make(chan struct{}, 1),
	}, nil
}

// Register validates the KV tensors vLLM registered and picks the copy
// engine: the host engine for CPU tensors, CUDA for GPU tensors. With
// several KV-cache groups (TensorDesc.Group) every group gets its own
// layout; the groups must be those of the namespace (0, 1, ...), on one
// device, with blocks of the same size and number (vLLM's hybrid
// allocator: one block pool, block ids shared by the groups).
func (w *Worker) Register(descs []layout.TensorDesc) error {
	ls, err := layout.NewGroups(descs, w.cfg.Namespace.RankChunkTokens()) // DCP: a rank holds a slice of each chunk
	if err != nil {
		return err
	}
	if len(ls) != len(w.groupNS) {
		return fmt.Errorf("%w: KV tensors of %d KV-cache groups, the namespace has %d", layout.ErrGeometry, len(ls), len(w.groupNS))
	}
	l := ls[0]
	for i, g := range ls {
		switch {
		case g.Group() != i:
			return fmt.Errorf("%w: KV-cache group %d registered, want groups 0..%d", layout.ErrGeometry, g.Group(), len(ls)-1)
		case g.Device() != l.Device():
			return fmt.Errorf("%w: KV-cache group %d on %v, group 0 on %v", layout.ErrGeometry, i, g.Device(), l.Device())
		case g.ChunkBlocks() != l.ChunkBlocks() || g.NumBlocks() != l.NumBlocks():
			return fmt.Errorf("%w: KV-cache group %d has %d blocks of %d tokens, group 0 %d of %d", layout.ErrGeometry,
				i, g.NumBlocks(), g.BlockSize(), l.NumBlocks(), l.BlockSize())
		}
	}
	var eng cuda.Engine
	var pins *pinner
	switch dev := l.Device(); dev.Kind {
	case layout.CPU:
		eng = cuda.NewHostEngine(w.cfg.Workers)
	default:
		de, err := cuda.NewDeviceEngine(dev.Index)
		if err != nil {
			return fmt.Errorf("KV cache on %s: %w", dev, err)
		}
		eng = de
		pins = &pinner{eng: de, done: map[*ipc.Segment]bool{}}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.layout != nil {
		eng.Close()
		return fmt.Errorf("%w: KV caches registered twice", layout.ErrGeometry)
	}
	w.layout, w.layouts, w.engine, w.pins = l, ls, eng, pins
	if pins != nil {
		// Register each session's L1 as soon as it is dialled, not on the
		// first copy (the first copy would wait on cuMemHostRegister).
		w.link.setOnDial(pins.watch)
	} else {
		// The host engine writes L1 through this process's own mapping:
		// populate it as segments are mapped, not page by page in the first
		// save into each (ipc.PopulateMode), and dial now so that happens
		// while vLLM is still starting.
		w.link.setPopulate(ipc.PopulateAuto)
		w.wg.Add(1)
		w.prewarming.Store(true)
		go func() {
			defer w.wg.Done()
			defer w.prewarming.Store(false)
			w.link.prewarm()
		}()
	}
	return nil
}

// Layout is the registered layout (nil before Register).
func (w *Worker) Layout() *layout.Layout {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.layout
}

func (w *Worker) ready() (*layout.Layout, cuda.Engine, error) {
	l, _, eng, err := w.group(0)
	return l, eng, err
}

// group is KV-cache group g's layout and namespace, and the copy engine.
func (w *Worker) group(g uint32) (*layout.Layout, kv.Namespace, cuda.Engine, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.layout == nil {
		return nil, kv.Namespace{}, nil, fmt.Errorf("%w: no KV caches registered", ErrBadMeta)
	}
	if int(g) >= len(w.layouts) {
		return nil, kv.Namespace{}, nil, fmt.Errorf("%w: KV-cache group %d of %d", ErrBadMeta, g, len(w.layouts))
	}
	return w.layouts[g], w.groupNS[g], w.engine, nil
}

// StartLoads starts the loads of one step's metadata and returns at once
// (start_load_kv is on the model runner's thread): retrieving, checking and
// copying run in the background. Failures are not returned: they become
// load errors reported by Poll, with the request reported as received.
//
// A request's loads (one per KV-cache group: disjoint blocks) run side by
// side, and the request is reported received once, after the last.
func (w *Worker) StartLoads(meta *StepMeta) {
	var order []string
	byReq := map[string][]*LoadSpec{}
	for i := range meta.Loads {
		ld := &meta.Loads[i]
		if _, ok := byReq[ld.Req]; !ok {
			order = append(order, ld.Req)
		}
		byReq[ld.Req] = append(byReq[ld.Req], ld)
	}
	for _, req := range order {
		lds := byReq[req]
		left := new(atomic.Int32)
		left.Store(int32(len(lds)))
		for _, ld := range lds {
			// The request is reported received when its last group's
			// load has ended (the RELEASEs may follow).
			ended := func() {
				if left.Add(-1) == 0 {
					w.mu.Lock()
					w.recving = append(w.recving, req)
					w.mu.Unlock()
					w.signalReport()
				}
			}
			w.background(req, func(func()) { w.load(ld, ended) })
		}
	}
}

// Load pipeline. A load is a stream of chunks: a checker goroutine resolves
// and checks chunk after chunk (header and key; the payload CRC too under
// kvshim.verify=always, then on several goroutines) while this goroutine
// plans each checked chunk and submits copy jobs, so the copy of chunk i
// runs while chunk i+1 is checked. Jobs carry a growing number of chunks
// (1, 2, 4, ... up to loadBatchMax): the first chunk's copy starts as soon
// as it is checked, later submits are amortized over more bytes; a batch is
// also submitted early when the next chunk is not checked yet, so checked
// chunks never wait. The load is reported when its last job has completed.

// loadBatchMax bounds the chunks of one load copy job. On the host engine
// the job size made no difference beyond the noise (BenchmarkLoadPipeline,
// 8 chunks of 32 MiB, 2 cores: 1 to 16 chunks a job all within 0.66-1.04
// of the engine alone); a CUDA submit (descriptors, an event) costs tens of
// µs against ~0.6 ms of DMA per 32 MiB chunk, so 8 keeps a 64-chunk load
// to 10 submits while its first copy still starts after one chunk.
var loadBatchMax = 8

// loadJob is one submitted copy of chunks [first, end) of a load.
type loadJob struct {
	job        cuda.Job
	first, end int
	spans      int
	bytes      uint64
}

func (w *Worker) load(ld *LoadSpec, done func()) {
	defer w.traceLoad(ld)()
	// This load counts as ended once its copies have ended (or it failed),
	// before the RELEASE of its holds: that round trip is not on the
	// request's path. done runs once, on every return.
	report := sync.OnceFunc(done)
	defer report()
	if ld.Start == ld.End && len(ld.Blocks) == 0 {
		// A group that needs no chunk at the hit (a chunked local group
		// whose attention chunk starts there): the scheduler freed the
		// lookup's holds already, and may have made the server forget
		// it, so there is nothing to retrieve or release.
		return
	}
	l, ns, eng, err := w.group(ld.Group)
	if err != nil {
		w.loadFailed(ld, 0, 1, err)
		return
	}
	cb := l.ChunkBlocks()
	var resp *ipc.RetrieveResp
	var client *ipc.Client
	// The reader's own row of holds: its global rank (a shared MLA object
	// is one key, rank 0, held once for every reader).
	rr := &ipc.RetrieveReq{Owner: kv.Tag(ld.Owner), LookupID: ld.Lookup, Rank: uint32(w.cfg.Rank), Start: ld.Start, End: ld.End}
	err = w.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		client = c
		resp, err = c.Retrieve(ctx, rr)
		return err
	})
	if err != nil {
		w.loadFailed(ld, 0, cb, err)
		return
	}
	w.traceLoadRetrieved(ld)
	// The objects stay mapped while this job reads them (Use), and their
	// holds are dropped on the same session once the copies have read them
	// (or failed); both are kept if a copy may still be reading.
	release, err := client.Use()
	if err != nil {
		w.loadFailed(ld, 0, cb, err) // the session ended: its holds are gone
		return
	}
	stuck := false
	defer func() {
		if stuck {
			return
		}
		_ = w.link.callOn(client, func(ctx context.Context, c *ipc.Client) error {
			return c.Release(ctx, &ipc.ReleaseReq{Owner: rr.Owner, LookupID: rr.LookupID, Rank: rr.Rank})
		})
		release()
	}()
	n := int(ld.End - ld.Start)
	// failAt is the first chunk not restored and why: every chunk from it
	// on is a load error, every chunk before it is restored.
	failAt, why := n, error(nil)
	fail := func(k int, err error) {
		if k < failAt {
			failAt, why = k, err
		}
	}
	chk := w.startChecks(l, ns, client, resp, ld.Hashes, n)
	var jobs []loadJob
	var spans []kv.Span // planned, not yet submitted: chunks [first, i)
	first, batch := 0, 1
	submit := func(end int) bool {
		if len(spans) > 0 {
			job, err := eng.Submit(spans, kv.Load)
			if err != nil {
				fail(first, err)
				return false
			}
			jobs = append(jobs, loadJob{job: job, first: first, end: end, spans: len(spans), bytes: spansBytes(spans)})
			spans = spans[:0] // Submit keeps nothing
			batch = min(2*batch, loadBatchMax)
		}
		first = end
		return true
	}
	for i := 0; i < n; i++ {
		if len(spans) > 0 && !chk.ready(i) && !submit(i) {
			break
		}
		obj, err := chk.wait(i)
		if err == nil {
			spans, err = l.AppendPlan(spans, ld.Blocks[i*cb:(i+1)*cb], addrOf(obj), kv.Load)
		}
		if err != nil {
			fail(i, err)
			submit(i) // the chunks before it still load
			break
		}
		if i+1-first >= batch && !submit(i+1) {
			break
		}
	}
	if failAt == n {
		submit(n)
	}
	chk.stop() // no more checks: the checkers are done with the mappings
	w.traceLoadChecked(ld, chk)
	for _, j := range jobs {
		if err := w.waitCopy(j.job, kv.Load, j.spans, stuck); err != nil {
			fail(j.first, err)
			stuck = stuck || errors.Is(err, errCopyStuck)
		}
	}
	if failAt > 0 && !client.Live() {
		// The server ended the session during the copies and released its
		// holds: the objects may have been evicted and rewritten under them.
		fail(0, fmt.Errorf("%w during the copy: %v", ErrUnavailable, client.Err()))
	}
	if failAt < n {
		w.loadFailed(ld, failAt, cb, why)
	}
	var loaded uint64
	for _, j := range jobs {
		if j.end <= failAt {
			loaded += j.bytes
		}
	}
	w.traceLoadBytes(ld, loaded)
	w.count(func(s *WorkerStats) {
		s.LoadedChunks += uint64(failAt)
		s.LoadedBytes += loaded
	})
	report() // then the deferred RELEASE
}

// checks resolves and checks a load's chunks ahead of the planner, in
// chunk order, on one goroutine (header checks: 128 bytes a chunk) or, when
// payloads are verified, on up to GOMAXPROCS.
type checks struct {
	objs [][]byte
	errs []error
	done []chan struct{}
	next atomic.Int64
	halt atomic.Bool
	wg   sync.WaitGroup
	n    int
}

func (w *Worker) startChecks(l *layout.Layout, ns kv.Namespace, c *ipc.Client, resp *ipc.RetrieveResp, hashes []kv.Hash, n int) *checks {
	ch := &checks{objs: make([][]byte, n), errs: make([]error, n), done: make([]chan struct{}, n), n: n}
	for i := range ch.done {
		ch.done[i] = make(chan struct{})
	}
	workers := 1
	if w.cfg.Verify == objfmt.VerifyAlways {
		workers = max(1, min(n, runtime.GOMAXPROCS(0)))
	}
	ch.wg.Add(workers)
	for range workers {
		go func() {
			defer ch.wg.Done()
			for !ch.halt.Load() {
				i := int(ch.next.Add(1) - 1)
				if i >= n {
					return
				}
				ch.objs[i], ch.errs[i] = w.checkChunk(l, ns, c, resp, hashes, i)
				close(ch.done[i])
			}
		}()
	}
	return ch
}

// Test hooks (nil outside tests): beforeCheck runs before chunk i of a
// load is checked, beforeCommit before a save's COMMIT.
var beforeCheck func(i int)
var beforeCommit func()

// checkChunk resolves chunk i of a RETRIEVE answer and checks it.
func (w *Worker) checkChunk(l *layout.Layout, ns kv.Namespace, c *ipc.Client, resp *ipc.RetrieveResp, hashes []kv.Hash, i int) ([]byte, error) {
	if beforeCheck != nil {
		beforeCheck(i)
	}
	if i >= len(resp.Status) || i >= len(resp.Locs) {
		return nil, fmt.Errorf("chunk not in the RETRIEVE answer (%d chunks)", len(resp.Status))
	}
	if resp.Status[i] != ipc.StatusOK {
		return nil, fmt.Errorf("chunk not held (status %d)", resp.Status[i])
	}
	obj, err := w.resolve(c, resp.Locs[i])
	if err == nil {
		err = w.verifyLoaded(l, ns, obj, hashes, i)
	}
	return obj, err
}

// ready reports whether chunk i is checked.
func (ch *checks) ready(i int) bool {
	select {
	case <-ch.done[i]:
		return true
	default:
		return false
	}
}

// wait returns chunk i once it is checked.
func (ch *checks) wait(i int) ([]byte, error) {
	<-ch.done[i]
	return ch.objs[i], ch.errs[i]
}

// stop ends the checks and waits for the checkers to return.
func (ch *checks) stop() {
	ch.halt.Store(true)
	ch.wg.Wait()
}

// inParallel runs f(0), ..., f(n-1) on up to GOMAXPROCS goroutines and
// waits for them all.
func inParallel(n int, f func(i int)) {
	sem := make(chan struct{}, max(1, runtime.GOMAXPROCS(0)))
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			f(i)
		}()
	}
	wg.Wait()
}

// loadFailed turns chunk k of a load and every chunk after it into load
// errors: vLLM recomputes from the first failed block on.
func (w *Worker) loadFailed(ld *LoadSpec, k, cb int, why error) {
	slog.Warn("kvshim: load failed", "req", ld.Req, "chunk", int(ld.Start)+k, "err", why)
	w.traceLoadFailed(ld, k, why)
	w.mu.Lock()
	defer w.mu.Unlock()
	if !slices.Contains(w.errReq, ld.Req) {
		w.errReq = append(w.errReq, ld.Req)
	}
	for _, id := range ld.Blocks[min(k*cb, len(ld.Blocks)):] {
		if id >= 0 {
			w.errBlock = append(w.errBlock, id)
		}
	}
	w.stats.FailedLoads += uint64(int(ld.End-ld.Start) - k)
}

// StartSaves starts the saves of one step's metadata after the forward
// pass and returns at once; ALLOC, copy and COMMIT run in the background.
// streamEvent is a CUevent recorded on vLLM's stream (0 for CPU caches,
// whose forward pass has finished when this is called); the caller may
// destroy it once StartSaves returns. A full cache, a
// dead server or a failed copy skips the save: a future miss.
func (w *Worker) StartSaves(meta *StepMeta, streamEvent uint64) {
	if w.endLayerSaves(meta, streamEvent) {
		return // SaveLayer started them (layersave.go)
	}
	if !w.writer || len(meta.Saves) == 0 {
		return
	}
	w.traceSaveEvent(meta)
	// The saves copy blocks the forward pass wrote: the save stream waits
	// for vLLM's event, enqueued now, while the caller still owns it. (A
	// save of an earlier step not yet submitted then waits for this step's
	// forward pass too: later, never wrong.)
	if _, eng, err := w.ready(); err == nil {
		if err := eng.WaitEvent(kv.Save, streamEvent); err != nil {
			slog.Warn("kvshim: saves of this step skipped", "err", err)
			w.count(func(s *WorkerStats) {
				for _, sv := range meta.Saves {
					s.FailedSaves += uint64(len(sv.Hashes))
				}
			})
			for i := range meta.Saves {
				w.reportSave(&meta.Saves[i], nil)
			}
			return
		}
	}
	for i := range meta.Saves {
		sv := &meta.Saves[i]
		w.background(sv.Req, func(free func()) { w.save(sv, free) })
	}
}

// save stores one request's new chunks: ALLOC, D2H copy into the staged
// slots, seal, COMMIT. free reports the request's blocks free (Poll,
// WaitFor) as soon as the copy has stopped: vLLM may reuse them then, since
// sealing and COMMIT touch only L1 (the staged copy, which no one else
// writes, is what COMMIT publishes). A copy that may still be running
// keeps them until save returns, as before.
func (w *Worker) save(sv *SaveSpec, free func()) {
	defer w.traceSave(sv)()
	var committed []kv.Hash
	defer func() { w.reportSave(sv, committed) }()
	if w.reporting() {
		// KV events: the blocks come back (finished_sending) once the
		// COMMIT is reported (background frees them when save returns, after
		// the deferred report), so the step that frees them carries the
		// report: vLLM keeps stepping while it waits for finished_sending,
		// and an idle engine would otherwise hold the events until its next
		// request. The blocks stay out of vLLM's pool for the seal and
		// COMMIT (microseconds under kvshim.verify=l2).
		free = func() {}
	}
	st, err := w.stageSave(sv)
	if err != nil {
		w.count(func(s *WorkerStats) { s.FailedSaves += uint64(len(sv.Hashes)) })
		return
	}
	l, ns, eng, size, cb, tag, req, resp, client, release := st.l, st.ns, st.eng, st.size, st.cb, st.tag, st.req, st.resp, st.client, st.release
	stuck := false
	defer func() {
		if !stuck {
			release()
		}
	}()
	var spans []kv.Span
	var objs [][]byte
	var hashes []kv.Hash
	for i, st := range resp.Status {
		if st != ipc.StatusOK {
			w.count(func(s *WorkerStats) { s.SkippedChunks++ }) // resident already, or no space
			continue
		}
		obj, err := w.resolve(client, resp.Locs[i])
		if err == nil {
			spans, err = l.AppendPlan(spans, sv.Blocks[i*cb:(i+1)*cb], addrOf(obj), kv.Save)
		}
		if err != nil {
			w.abort(client, tag, ns, req.Hashes[i:i+1])
			continue
		}
		objs, hashes = append(objs, obj), append(hashes, req.Hashes[i])
	}
	if len(objs) == 0 {
		return
	}
	err = w.copy(eng, spans, kv.Save)
	if !errors.Is(err, errCopyStuck) {
		free() // the copy has read the blocks (or stopped): they are vLLM's again
	}
	saved := 0
	switch {
	case err == nil:
		// COMMIT on the session that staged the objects: a later session
		// of this writer tag may stage the same keys for another copy.
		committed, saved, err = w.sealCommit(client, l, ns, tag, objs, hashes)
	case errors.Is(err, errCopyStuck):
		stuck = true
	default:
		w.abort(client, tag, ns, hashes)
	}
	w.traceSaved(sv, len(hashes), saved, size, err)
	w.count(func(s *WorkerStats) {
		s.SavedChunks += uint64(saved)
		s.SavedBytes += uint64(saved) * size
		s.FailedSaves += uint64(len(hashes) - saved)
	})
}

// stagedSave is what stageSave returns: the group's layout, the ALLOC
// asked and answered on client, and release, which unmaps the staged slots.
type stagedSave struct {
	l       *layout.Layout
	ns      kv.Namespace
	eng     cuda.Engine
	size    uint64
	cb      int
	tag     kv.Tag
	req     *ipc.AllocReq
	resp    *ipc.AllocResp
	client  *ipc.Client
	release func()
}

// stageSave ALLOCs L1 slots for sv's chunks and keeps the session's
// mappings of them alive (Use) while the job writes them; a copy that may
// still be running keeps them mapped for good (the caller skips release).
func (w *Worker) stageSave(sv *SaveSpec) (*stagedSave, error) {
	l, ns, eng, err := w.group(sv.Group)
	if err != nil {
		return nil, err
	}
	size, _ := l.ObjectSize(l.ChunkTokens())
	st := &stagedSave{l: l, ns: ns, eng: eng, size: size, cb: l.ChunkBlocks(), tag: kv.Tag(w.cfg.Instance)}
	st.req = &ipc.AllocReq{Tag: st.tag, Namespace: ns, Rank: w.kvRank, Hashes: make([]kv.Hash, len(sv.Hashes)), Sizes: make([]uint64, len(sv.Hashes))}
	for i, h := range sv.Hashes {
		st.req.Hashes[i], st.req.Sizes[i] = kv.Hash(h), size
	}
	if err := w.link.call(func(ctx context.Context, c *ipc.Client) (err error) {
		st.client = c
		st.resp, err = c.Alloc(ctx, st.req)
		return err
	}); err != nil {
		return nil, err
	}
	if st.release, err = st.client.Use(); err != nil {
		return nil, err
	}
	return st, nil
}

// seal seals the headers of saved objects. Under kvshim.verify=l2 or off
// it writes 128 bytes a chunk and reads no payload (the L2 store sets the
// payload CRC later, off this path); under always it computes each
// payload's CRC (a pass over every byte, in parallel over chunks).
func (w *Worker) seal(l *layout.Layout, ns kv.Namespace, objs [][]byte, hashes []kv.Hash) error {
	if w.cfg.Verify != objfmt.VerifyAlways {
		for i, obj := range objs {
			if err := l.SealHeader(obj, w.objectKey(ns, kv.Hash(hashes[i]))); err != nil {
				return err
			}
		}
		return nil
	}
	errs := make([]error, len(objs))
	inParallel(len(objs), func(i int) { errs[i] = l.SealObject(objs[i], w.objectKey(ns, kv.Hash(hashes[i]))) })
	return errors.Join(errs...)
}

func (w *Worker) abort(client *ipc.Client, tag kv.Tag, ns kv.Namespace, hashes []kv.Hash) {
	_ = w.link.callOn(client, func(ctx context.Context, c *ipc.Client) error {
		_, err := c.Abort(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns, Rank: w.kvRank, Hashes: hashes})
		return err
	})
}

func (w *Worker) count(f func(*WorkerStats)) {
	w.mu.Lock()
	f(&w.stats)
	w.mu.Unlock()
}

// background runs f off the caller's thread; req counts as in flight (for
// Poll's delay-free reports and WaitFor) until f calls free or returns.
func (w *Worker) background(req string, f func(free func())) {
	w.mu.Lock()
	w.inflight[req]++
	w.mu.Unlock()
	var once sync.Once
	free := func() {
		once.Do(func() {
			w.mu.Lock()
			idle := false
			if w.inflight[req]--; w.inflight[req] <= 0 {
				delete(w.inflight, req)
				idle = true
			}
			w.mu.Unlock()
			if idle {
				w.signalReport()
			}
		})
	}
	w.wg.Add(1)
	w.jobs.Add(1)
	go func() {
		defer w.wg.Done()
		defer w.jobs.Add(-1)
		defer free()
		f(free)
	}()
}

// Jobs is the number of load and save jobs still running, including saves
// whose blocks were already handed back and that have yet to COMMIT.
func (w *Worker) Jobs() int64 { return w.jobs.Load() }

// copyStuckAfter bounds the wait for a copy that outlived the timeout.
var copyStuckAfter = time.Minute

// errCopyStuck: a copy still running after copyStuckAfter. Its memory may
// still be read or written, so the caller keeps its holds and staging
// (leaked until the session ends) instead of handing them back.
var errCopyStuck = errors.New("copy still running")

// copy runs one copy job to its end (waitCopy).
func (w *Worker) copy(eng cuda.Engine, spans []kv.Span, dir kv.Direction) error {
	job, err := eng.Submit(spans, dir)
	if err != nil {
		return err
	}
	return w.waitCopy(job, dir, len(spans), false)
}

// waitCopy waits for a submitted copy job of spans descriptors. A copy
// slower than the timeout is a failure, but waitCopy returns only once it
// has stopped: until then it may still read or write vLLM's blocks and the
// L1 objects, and the caller's cleanup (release, abort, recompute) must not
// race it. After copyStuckAfter more it gives up (errCopyStuck); once a
// copy of a load is stuck (stuck), the later ones are not waited for: they
// are stuck too unless done already.
func (w *Worker) waitCopy(job cuda.Job, dir kv.Direction, spans int, stuck bool) error {
	w.count(func(s *WorkerStats) { s.CopySpans += uint64(spans) })
	if stuck {
		if job.Done() {
			return job.Err()
		}
		return fmt.Errorf("%w: behind a stuck copy", errCopyStuck)
	}
	err := job.Wait(w.cfg.Timeout)
	if !errors.Is(err, cuda.ErrTimeout) {
		return err
	}
	slog.Warn("kvshim: copy slower than the timeout; waiting for it to stop", "dir", dir, "spans", spans, "timeout", w.cfg.Timeout)
	if werr := job.Wait(copyStuckAfter); errors.Is(werr, cuda.ErrTimeout) {
		slog.Error("kvshim: copy still running; its L1 memory is kept, not reused", "dir", dir, "after", copyStuckAfter+w.cfg.Timeout)
		return fmt.Errorf("%w after %v: %w", errCopyStuck, copyStuckAfter, err)
	}
	return err
}

// Finishing marks delay-freed requests: Poll reports each once its copies end.
func (w *Worker) Finishing(reqs []string) {
	w.mu.Lock()
	for _, r := range reqs {
		w.finish[r] = true
	}
	w.mu.Unlock()
}

// Poll answers get_finished and get_block_ids_with_load_errors: requests
// whose blocks vLLM may free now, requests whose loads ended (with or
// without errors) and the blocks whose loads failed.
func (w *Worker) Poll() (sending, recving []string, errBlocks []int64) {
	sending, recving, errBlocks, _ = w.PollFailed()
	return sending, recving, errBlocks
}

// PollFailed is Poll plus the requests whose loads failed (vLLM's
// failed_recving: a model with several KV-cache groups cannot take block
// ids, which are unique only within a group). A request's failure is
// reported no later than the end of its load (recving).
func (w *Worker) PollFailed() (sending, recving []string, errBlocks []int64, failed []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for r := range w.finish {
		if w.inflight[r] == 0 {
			sending = append(sending, r)
			delete(w.finish, r)
		}
	}
	recving, errBlocks, failed = w.recving, w.errBlock, w.errReq
	w.recving, w.errBlock, w.errReq = nil, nil, nil
	return sending, recving, errBlocks, failed
}

func (w *Worker) signalReport() {
	select {
	case w.reported <- struct{}{}:
	default:
	}
}

// WaitReport blocks until Poll has something to report (a load ended, or a
// delay-freed request's copies ended) or timeout passes, and says whether
// it has. A caller that waits for a request's completion blocks here
// instead of polling (each Poll enters Go and takes a P from the copies).
func (w *Worker) WaitReport(timeout time.Duration) bool {
	var t *time.Timer
	for {
		w.mu.Lock()
		ready := len(w.recving) > 0 || len(w.errBlock) > 0
		for r := range w.finish {
			if ready {
				break
			}
			ready = w.inflight[r] == 0
		}
		w.mu.Unlock()
		if ready {
			return true
		}
		if t == nil {
			t = time.NewTimer(timeout)
			defer t.Stop()
		}
		select {
		case <-w.reported:
		case <-t.C:
			return false
		}
	}
}

// WaitFor blocks until the copies of reqs end or the timeout passes
// (handle_preemptions: vLLM reuses their blocks next).
func (w *Worker) WaitFor(reqs []string, timeout time.Duration) (err error) {
	defer func() { w.tracePreempted(reqs, err) }()
	deadline := time.Now().Add(timeout)
	for {
		w.mu.Lock()
		busy := ""
		for _, r := range reqs {
			if w.inflight[r] > 0 {
				busy = r
				break
			}
		}
		w.mu.Unlock()
		if busy == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: copies of %q still running after %v", cuda.ErrTimeout, busy, timeout)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// Stats returns the worker's counters.
func (w *Worker) Stats() WorkerStats {
	w.mu.Lock()
	st := w.stats
	w.mu.Unlock()
	pc := ipc.PopulateCounters()
	st.PopulatedSegments, st.PopulatedBytes, st.PopulateNanos = pc.Segments, pc.Bytes, pc.Nanos
	if c := w.link.current(); c != nil {
		st.PopulatePending = c.PopulatePending()
	}
	if w.prewarming.Load() {
		st.PopulatePending++
	}
	return st
}

// Close waits (bounded) for copies, then closes the engine and the session.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.saving != nil {
		w.saving.abandon() // a step that never ended: its saves abort now
		w.saving = nil
	}
	w.mu.Unlock()
	done := make(chan struct{})
	go func() { w.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * w.cfg.Timeout):
	}
	w.mu.Lock()
	eng := w.engine
	w.engine, w.layout, w.layouts = nil, nil, nil
	w.mu.Unlock()
	var errs []error
	if eng != nil {
		errs = append(errs, eng.Close())
	}
	errs = append(errs, w.link.close())
	return errors.Join(errs...)
}

func spansBytes(spans []kv.Span) (n uint64) {
	for _, s := range spans {
		n += s.Len
	}
	return n
}
