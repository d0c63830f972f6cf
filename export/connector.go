package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/kvshim/kvshim/export/connector"
	"github.com/kvshim/kvshim/objfmt"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/shim"
	"github.com/kvshim/kvshim/trace"
)

// Roles "scheduler" and "worker": the vLLM connector's two sides. Their
// configuration and the embedded server live in package connector; this
// file opens the shim objects a handle owns.

// decodeStrict decodes the JSON argument what of an export (step_json,
// tensors_json), refusing unknown keys.
func decodeStrict(raw []byte, v any, what string) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%s: %w: %w", what, err, errInvalid)
	}
	return nil
}

func init() {
	openers["scheduler"] = openScheduler
	openers["worker"] = openWorker
}

func openScheduler(in *instance, raw []byte) error {
	cfg, r, err := connector.Parse(raw)
	if err != nil {
		return err
	}
	ns, err := cfg.Namespace.Spec()
	if err != nil {
		return err
	}
	if cfg.Embedded() {
		release, err := connector.AcquireEmbedded(r.Socket, cfg, server.BuildInfo{Version: version, ABI: abiVersion})
		if err != nil {
			return err
		}
		in.closers = append(in.closers, release)
	}
	role, err := shim.ParseRole(cfg.KVRole)
	if err != nil {
		return err
	}
	s, err := shim.NewScheduler(shim.SchedulerConfig{Socket: r.Socket, Namespace: ns, BlockSize: cfg.BlockSize,
		Timeout: r.Timeout, Instance: r.Instance, Role: role})
	if err != nil {
		return fmt.Errorf("%w: %w", err, errInvalid)
	}
	if cfg.TraceDir != "" {
		tw, err := trace.Open(cfg.TraceDir, trace.Options{Source: "scheduler"})
		if err != nil {
			s.Close()
			return fmt.Errorf("kvshim.trace_dir: %w", err)
		}
		s.SetTrace(tw)
		in.closers = append(in.closers, tw.Close) // closers run in reverse: after s.Close
	}
	in.state = s
	in.closers = append(in.closers, s.Close)
	return nil
}

func openWorker(in *instance, raw []byte) error {
	cfg, r, err := connector.Parse(raw)
	if err != nil {
		return err
	}
	ns, err := cfg.Namespace.Spec()
	if err != nil {
		return err
	}
	verify, err := objfmt.ParseVerifyPolicy(cfg.Verify)
	if err != nil {
		return fmt.Errorf("%w: %w", err, errInvalid)
	}
	w, err := shim.NewWorker(shim.WorkerConfig{Socket: r.Socket, Namespace: ns, Rank: cfg.Rank,
		Timeout: r.Timeout, Instance: r.Instance, Verify: verify})
	if err != nil {
		return fmt.Errorf("%w: %w", err, errInvalid)
	}
	if err := w.OpenTrace(cfg.TraceDir); err != nil {
		w.Close()
		return fmt.Errorf("kvshim.trace_dir: %w", err)
	}
	in.state = &workerState{w: w}
	in.closers = append(in.closers, w.CloseTrace, w.Close) // run in reverse: the trace closes last
	return nil
}

// workerState is a worker handle: the worker and the metadata bound for
// the current step.
type workerState struct {
	w        *shim.Worker
	mu       sync.Mutex
	bound    *shim.StepMeta
	reported map[string]uint64 // counters at the last kvshim_take_step_stats
}
