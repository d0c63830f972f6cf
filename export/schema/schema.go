// Package schema holds the JSON Schemas of the documents that cross the C
// ABI (export/kvshim.h): the kvshim_open config (open.json), the tensor
// descriptors of kvshim_worker_register (tensors.json) and the results of
// kvshim_worker_poll (poll.json), kvshim_stats (stats.json) and
// kvshim_take_step_stats (step_stats.json), and the
// vLLM connector's configuration (vllm_config.json: kvshim_vllm_config) and
// the input of kvshim_vllm_tensors (vllm_tensors.json). They are the one
// written form of those documents: Go's tests check that the Go structs
// and what Go emits agree with them, Python's tests
// (tests/test_schema.py) that what the connector sends does, and
// docs/c-abi.md points here instead of describing the fields again.
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
	"sync"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

//go:embed *.json
var files embed.FS

// Names are the schemas, by file name.
var Names = []string{"open.json", "tensors.json", "poll.json", "stats.json", "step_stats.json", "vllm_config.json", "vllm_tensors.json"}

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
	compiled    map[string]*jsonschema.Schema
	compileErr  error
)

func compile() {
	c := jsonschema.NewCompiler()
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

// Validate checks doc (JSON text) against the schema name.
func Validate(name string, doc []byte) error {
	compileOnce.Do(compile)
	if compileErr != nil {
		return compileErr
	}
	s := compiled[name]
	if s == nil {
		return fmt.Errorf("%w: %s", ErrUnknown, name)
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
