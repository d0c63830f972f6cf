package shim

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	"gotest.tools/v3/assert"
)

func TestWorkerStatsCountersByMetricName(t *testing.T) {
	c := WorkerStats{SavedChunks: 3, LoadedBytes: 7, KeyMismatches: 1, LayerwiseSaves: 2, PopulatedBytes: 9, PopulatePending: 4}.Counters()
	assert.DeepEqual(t, c, map[string]uint64{
		"saved_chunks": 3, "skipped_chunks": 0, "failed_saves": 0, "loaded_chunks": 0, "failed_loads": 0,
		"saved_bytes": 0, "loaded_bytes": 7, "copy_spans": 0, "key_mismatches": 1, "layerwise_loads": 0, "layerwise_saves": 2,
	}) // the Populate* fields are the start-up's, not a step's
}

// The scheduler counts what vLLM was told to load, reported once.
func TestSchedulerStepStatsCountHits(t *testing.T) {
	spec := NamespaceSpec{Model: "m", DType: "bfloat16", ObjectFormat: 1, WorldSize: 1, ChunkSize: tChunk, LayoutFingerprint: "l"}
	s, err := NewScheduler(SchedulerConfig{Socket: filepath.Join(t.TempDir(), "none.sock"), Namespace: spec, BlockSize: tBS,
		Timeout: 200 * time.Millisecond, Instance: uuid.New()})
	assert.NilError(t, err)
	defer s.Close()
	assert.NilError(t, s.AfterAlloc("A", seq(0, 4), 1, 0, 2*tChunk))
	assert.NilError(t, s.AfterAlloc("B", seq(4, 4), 1, 0, 0)) // no hit
	assert.NilError(t, s.AfterAlloc("C", seq(8, 4), 1, 0, tChunk))
	assert.DeepEqual(t, s.TakeStepStats(), map[string]any{"hit_tokens": uint64(3 * tChunk), "hit_requests": uint64(2)})
	assert.DeepEqual(t, s.TakeStepStats(), map[string]any{"hit_tokens": uint64(0), "hit_requests": uint64(0)})
}
