package shim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvshim/kvshim/cuda"
	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/layout"
)

// Layer-wise saves. vLLM calls save_kv_layer(layer) after each attention
// layer has written its KV, then wait_for_save after the forward pass.
// SaveLayer marks that layer written; its first call of a step starts the
// step's saves (ALLOC, one goroutine per request, as StartSaves), and each
// save copies a layer as soon as it is marked, in registration order, while
// the forward pass computes the next ones. StartSaves of the same step
// (wait_for_save) marks every layer not marked yet (a cross-layer cache,
// layers vLLM did not name) after the forward pass's event, and the saves
// seal and COMMIT once all their layers are copied.
//
// Failure semantics are whole chunks': a chunk is committed only when every
// layer of it was copied; a layer's copy that fails (it carried every chunk
// of the save) aborts the save's chunks, a plan error aborts that chunk, a
// step that never ends (no StartSaves within layerSaveWait, another step's
// SaveLayer first, Close) aborts what it staged. An aborted chunk is a
// future miss, as any failed save.

// layerSaveWait bounds how long a save waits for the forward pass to mark
// its next layer (the step is abandoned then: its chunks aborted).
var layerSaveWait = time.Minute

// errStepAbandoned: the step's layer-wise saves never ended.
var errStepAbandoned = errors.New("layer-wise save abandoned")

// layerSave is one step's layer-wise saves.
type layerSave struct {
	meta    *StepMeta
	written []chan struct{} // per tensor of the layout: closed once the forward pass wrote it
	once    []sync.Once
	end     sync.Once
	gone    chan struct{} // closed when the step is abandoned
	goneBy  sync.Once
}

func newLayerSave(meta *StepMeta, tensors int) *layerSave {
	st := &layerSave{meta: meta, written: make([]chan struct{}, tensors), once: make([]sync.Once, tensors), gone: make(chan struct{})}
	for i := range st.written {
		st.written[i] = make(chan struct{})
	}
	return st
}

func (st *layerSave) mark(ti int) { st.once[ti].Do(func() { close(st.written[ti]) }) }

// finish marks every layer written (the forward pass has ended).
func (st *layerSave) finish() {
	st.end.Do(func() {
		for ti := range st.written {
			st.mark(ti)
		}
	})
}

func (st *layerSave) abandon() { st.goneBy.Do(func() { close(st.gone) }) }

// wait waits until layer ti is written; false if the step was abandoned.
func (st *layerSave) wait(ti int, timeout time.Duration) bool {
	select {
	case <-st.gone:
		return false
	default:
	}
	tm := time.NewTimer(timeout)
	defer tm.Stop()
	select {
	case <-st.written[ti]:
		select {
		case <-st.gone: // abandoned: the layer may not be what the step wrote
			return false
		default:
			return true
		}
	case <-st.gone:
		return false
	case <-tm.C:
		return false
	}
}

// layerwiseSaves reports whether a step's saves can run layer by layer:
// one KV-cache group (hybrid models' groups have other tensors), a
// registered layout and something to save.
func (w *Worker) layerwiseSaves(meta *StepMeta) (*layout.Layout, cuda.Engine, bool) {
	if !w.writer || len(meta.Saves) == 0 {
		return nil, nil, false
	}
	w.mu.Lock()
	l, multi, eng := w.layout, len(w.layouts) > 1, w.engine
	w.mu.Unlock()
	if l == nil || multi {
		return nil, nil, false
	}
	for i := range meta.Saves {
		if meta.Saves[i].Group != 0 {
			return nil, nil, false
		}
	}
	return l, eng, true
}

// SaveLayer is save_kv_layer: the forward pass has written the layer named
// name (vLLM's layer name, as registered) for the step meta. streamEvent is
// a CUevent recorded on vLLM's stream after that layer (0 for CPU caches);
// the caller may destroy it once SaveLayer returns. The first call of a
// step starts its saves; a name not registered on its own (a cross-layer
// cache) is saved when StartSaves ends the step. It returns at once;
// failures are failed saves (future misses), as StartSaves'.
func (w *Worker) SaveLayer(meta *StepMeta, name string, streamEvent uint64) {
	l, eng, ok := w.layerwiseSaves(meta)
	if !ok {
		return
	}
	ti := l.TensorIndex(name)
	if ti < 0 {
		return
	}
	w.mu.Lock()
	st := w.saving
	var old *layerSave
	if st == nil || st.meta != meta {
		old, st = st, newLayerSave(meta, l.NumTensors())
		w.saving = st
		w.mu.Unlock()
		if old != nil {
			// A new step began without its predecessor's wait_for_save:
			// what that step's unmarked layers hold is unknown.
			old.abandon()
		}
		w.startLayerSaves(meta, st)
	} else {
		w.mu.Unlock()
	}
	// The layer's copy is submitted after this wait on the save stream, so
	// it reads what the layer's kernels wrote.
	if err := eng.WaitEvent(kv.Save, streamEvent); err != nil {
		slog.Warn("kvshim: layer-wise saves of this step abandoned", "layer", name, "err", err)
		st.abandon()
		return
	}
	st.mark(ti)
}

// endLayerSaves is StartSaves for a step whose saves run layer by layer:
// it reports whether meta is that step (and then ended it).
func (w *Worker) endLayerSaves(meta *StepMeta, streamEvent uint64) bool {
	w.mu.Lock()
	st := w.saving
	if st == nil {
		w.mu.Unlock()
		return false
	}
	w.saving = nil
	eng := w.engine
	w.mu.Unlock()
	if st.meta != meta {
		st.abandon() // a step that never ended
		return false
	}
	if eng != nil {
		if err := eng.WaitEvent(kv.Save, streamEvent); err != nil {
			slog.Warn("kvshim: layer-wise saves of this step abandoned", "err", err)
			st.abandon()
			return true
		}
	}
	st.finish()
	return true
}

func (w *Worker) startLayerSaves(meta *StepMeta, st *layerSave) {
	w.traceSaveEvent(meta)
	for i := range meta.Saves {
		sv := &meta.Saves[i]
		w.background(sv.Req, func(free func()) { w.saveLayered(sv, st, free) })
	}
}

// saveLayered is save for one request of a layer-wise step: ALLOC, then
// each layer's copy as soon as it is written, then seal and COMMIT of the
// chunks whose every layer was copied.
func (w *Worker) saveLayered(sv *SaveSpec, st *layerSave, free func()) {
	defer w.traceSave(sv)()
	var committed []kv.Hash
	defer func() { w.reportSave(sv, committed) }()
	if w.reporting() {
		free = func() {} // as save: the blocks come back with the COMMIT's report
	}
	failAll := func() { w.count(func(s *WorkerStats) { s.FailedSaves += uint64(len(sv.Hashes)) }) }
	staged, err := w.stageSave(sv)
	if err != nil {
		failAll()
		return
	}
	l, ns, eng, size, cb, tag, req, resp, client, release := staged.l, staged.ns, staged.eng, staged.size, staged.cb, staged.tag, staged.req, staged.resp, staged.client, staged.release
	stuck := false
	defer func() {
		if !stuck {
			release()
		}
	}()
	// The staged chunks: their objects, keys and blocks; ok[k] until one of
	// chunk k's layers fails.
	var objs [][]byte
	var hashes []kv.Hash
	var blocks [][]int64
	for i, s := range resp.Status {
		if s != ipc.StatusOK {
			w.count(func(s *WorkerStats) { s.SkippedChunks++ })
			continue
		}
		obj, err := w.resolve(client, resp.Locs[i])
		if err != nil {
			w.abort(client, tag, ns, req.Hashes[i:i+1])
			continue
		}
		objs, hashes = append(objs, obj), append(hashes, req.Hashes[i])
		blocks = append(blocks, sv.Blocks[i*cb:(i+1)*cb])
	}
	if len(objs) == 0 {
		return
	}
	ok := make([]bool, len(objs))
	for k := range ok {
		ok[k] = true
	}
	left := len(objs)
	failChunk := func(k int) {
		if ok[k] {
			ok[k], left = false, left-1
		}
	}
	var spans []kv.Span
	var why error
	for ti := 0; ti < l.NumTensors() && left > 0; ti++ {
		if !st.wait(ti, layerSaveWait) {
			why = fmt.Errorf("%w at layer %d", errStepAbandoned, ti)
			for k := range objs {
				failChunk(k)
			}
			break
		}
		spans = spans[:0]
		for k := range objs {
			if !ok[k] {
				continue
			}
			var perr error
			if spans, perr = l.AppendPlanTensor(spans, blocks[k], addrOf(objs[k]), kv.Save, ti); perr != nil {
				failChunk(k)
				why = perr
			}
		}
		if len(spans) == 0 {
			continue
		}
		job, err := eng.Submit(spans, kv.Save)
		if err == nil {
			err = w.waitCopy(job, kv.Save, len(spans), false)
		}
		if err != nil { // this layer of every chunk it carried is not saved
			stuck = errors.Is(err, errCopyStuck)
			why = fmt.Errorf("layer %d: %w", ti, err)
			for k := range objs {
				failChunk(k)
			}
		}
	}
	if !stuck {
		free() // every copy has read the blocks (or stopped)
	}
	if why != nil {
		slog.Warn("kvshim: layer-wise save failed", "req", sv.Req, "err", why)
	}
	var good, bad []kv.Hash
	var goodObjs [][]byte
	for k := range objs {
		if ok[k] {
			good, goodObjs = append(good, hashes[k]), append(goodObjs, objs[k])
		} else {
			bad = append(bad, hashes[k])
		}
	}
	if stuck {
		w.traceSaved(sv, len(hashes), 0, size, why)
		w.count(func(s *WorkerStats) { s.FailedSaves += uint64(len(hashes)) })
		return
	}
	if len(bad) > 0 {
		w.abort(client, tag, ns, bad)
	}
	saved := 0
	if len(good) > 0 {
		var err error
		committed, saved, err = w.sealCommit(client, l, ns, tag, goodObjs, good)
		if err != nil && why == nil {
			why = err
		}
	}
	w.traceSaved(sv, len(hashes), saved, size, why)
	w.count(func(s *WorkerStats) {
		s.SavedChunks += uint64(saved)
		s.SavedBytes += uint64(saved) * size
		s.FailedSaves += uint64(len(hashes) - saved)
		s.LayerwiseSaves++
	})
}

// sealCommit seals copied objects and COMMITs them on the session that
// staged them (aborting them if the seal fails): the keys committed.
func (w *Worker) sealCommit(client *ipc.Client, l *layout.Layout, ns kv.Namespace, tag kv.Tag, objs [][]byte, hashes []kv.Hash) (committed []kv.Hash, saved int, err error) {
	if err := w.seal(l, ns, objs, hashes); err != nil {
		w.abort(client, tag, ns, hashes)
		return nil, 0, err
	}
	if beforeCommit != nil {
		beforeCommit()
	}
	err = w.link.callOn(client, func(ctx context.Context, c *ipc.Client) error {
		resp, err := c.Commit(ctx, &ipc.CommitReq{Tag: tag, Namespace: ns, Rank: w.kvRank, Hashes: hashes})
		if err == nil {
			for i, st := range resp.Status {
				if st == ipc.StatusOK {
					saved++
					if i < len(hashes) {
						committed = append(committed, hashes[i])
					}
				}
			}
		}
		return err
	})
	return committed, saved, err
}
