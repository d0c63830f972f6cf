// Package schema holds the JSON Schemas of the documents that cross the C
// ABI (export/kvshim.h), one file per document (or per function, its
// answer in $defs.out):
//
//   - open.json: the kvshim_open config
//   - tensors.json: kvshim_worker_register's tensor descriptors
//   - poll.json, stats.json, step_stats.json: the results of
//     kvshim_worker_poll, kvshim_stats and kvshim_take_step_stats
//   - step.json: kvshim_sched_build_meta's step_json
//   - extras.json: kvshim_sched_match's (and _match_list's) extras_json
//   - request_options.json: kvshim_sched_request_options' params_json
//   - received.json: kvshim_sched_received's ids_json
//   - hit_sources.json: kvshim_sched_hit_sources' result
//   - latencies.json: kvshim_worker_take_latencies' result
//   - save_reports.json: kvshim_worker_take_save_reports' result, and in
//     $defs.step kvshim_sched_save_reports' input
//   - events.json: kvshim_sched_take_events' result
//   - vllm_namespace.json: kvshim_vllm_namespace's input (shim.VLLMSpec)
//     and answer
//   - vllm_config.json: the vLLM connector's configuration
//     (kvshim_vllm_config) and answer
//   - vllm_tensors.json: kvshim_vllm_tensors' input
//   - meta.json: kvshim_meta_json's result (tests and debugging only)
//
// They are the one written form of those documents: Go's tests
// (export/schema_test.go) check that the Go structs and what Go emits
// agree with them, Python's tests (tests/test_schema.py) that what the
// connector sends and reads does, and kvshim.h and docs/c-abi.md point here
// instead of describing the fields again.
//
// The library itself does not validate against them at run time (Go's
// strict decoding and range checks do that, naming the field); the
// validator here is for tests and tools.
package schema

import (
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

//go:embed *.json
var files embed.FS

// Names are the schemas, by file name.
var Names = []string{"open.json", "tensors.json", "poll.json", "stats.json", "step_stats.json", "vllm_config.json",
	"vllm_tensors.json", "step.json", "extras.json", "request_options.json", "received.json", "hit_sources.json",
	"latencies.json", "save_reports.json", "events.json", "vllm_namespace.json", "meta.json"}

// ErrUnknown: no schema of that name.
var ErrUnknown = errors.New("schema: unknown schema")

// ErrInvalid: a document does not match its schema.
var ErrInvalid = errors.New("schema: document does not match")

// Raw returns a schema's text.
func Raw(name string) ([]byte, error) {
	b, err := files.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("%w: %s", ErrUnknown, name)
	}
	return b, nil
}

var (
	compileOnce sync.Once
	compiler    *jsonschema.Compiler
	compiled    map[string]*jsonschema.Schema
	compileErr  error
	partsMu     sync.Mutex // compiled's file#pointer entries, added on first use
)

// lookup is the compiled schema of name (a file, or file#pointer).
func lookup(name string) (*jsonschema.Schema, error) {
	partsMu.Lock()
	defer partsMu.Unlock()
	if s := compiled[name]; s != nil {
		return s, nil
	}
	file, ptr, ok := strings.Cut(name, "#")
	if !ok || !slices.Contains(Names, file) || !strings.HasPrefix(ptr, "/") {
		return nil, fmt.Errorf("%w: %s", ErrUnknown, name)
	}
	s, err := compiler.Compile(name)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrUnknown, name, err)
	}
	compiled[name] = s
	return s, nil
}

func compile() {
	c := jsonschema.NewCompiler()
	compiler = c
	compiled = map[string]*jsonschema.Schema{}
	for _, n := range Names {
		raw, _ := files.ReadFile(n)
		doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
		if err != nil {
			compileErr = fmt.Errorf("schema %s: %w", n, err)
			return
		}
		if err := c.AddResource(n, doc); err != nil {
			compileErr = fmt.Errorf("schema %s: %w", n, err)
			return
		}
	}
	for _, n := range Names {
		s, err := c.Compile(n)
		if err != nil {
			compileErr = fmt.Errorf("schema %s: %w", n, err)
			return
		}
		compiled[n] = s
	}
}

// Validate checks doc (JSON text) against the schema name: a file of
// Names, or one of its parts as file#pointer (vllm_config.json#/$defs/out).
func Validate(name string, doc []byte) error {
	compileOnce.Do(compile)
	if compileErr != nil {
		return compileErr
	}
	s, err := lookup(name)
	if err != nil {
		return err
	}
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(doc))
	if err != nil {
		return fmt.Errorf("%w: %s: not JSON: %w", ErrInvalid, name, err)
	}
	if err := s.Validate(v); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrInvalid, name, err)
	}
	return nil
}

// Examples returns the documented examples of a schema (its "examples"),
// each as JSON text.
func Examples(name string) ([][]byte, error) {
	raw, err := Raw(name)
	if err != nil {
		return nil, err
	}
	var s struct {
		Examples []json.RawMessage `json:"examples"`
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, fmt.Errorf("schema %s: %w", name, err)
	}
	out := make([][]byte, len(s.Examples))
	for i, e := range s.Examples {
		out[i] = e
	}
	return out, nil
}

// Properties returns the property names a schema allows at the JSON
// pointer path (a list of keys through "properties", "items", "$defs"),
// for tests that hold a Go struct's fields to the schema.
func Properties(name string, path ...string) ([]string, error) {
	raw, err := Raw(name)
	if err != nil {
		return nil, err
	}
	var node any
	if err := json.Unmarshal(raw, &node); err != nil {
		return nil, err
	}
	for _, p := range path {
		m, ok := node.(map[string]any)
		if !ok || m[p] == nil {
			return nil, fmt.Errorf("schema %s: no %q in %v", name, p, path)
		}
		node = m[p]
	}
	m, _ := node.(map[string]any)
	props, ok := m["properties"].(map[string]any)
	if !ok {
		return nil, fmt.Errorf("schema %s: no properties at %v", name, path)
	}
	out := make([]string, 0, len(props))
	for k := range props {
		out = append(out, k)
	}
	return out, nil
}
