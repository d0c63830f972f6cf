package l2

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"time"
)

// Defaults for the keys every adapter owns.
const (
	DefaultNumWorkers = 4
	DefaultOpTimeout  = 10 * time.Second
)

// Config is a parsed --l2-adapter JSON object. The keys named here are
// owned by the adapter layer; every other key is in Extra, for the backend
// named by Type (fs and redis refuse keys they do not know; mooncake_store
// passes them to its setup unchanged).
type Config struct {
	Type       string        // "type" (required)
	Name       string        // "name": metrics label; default Type
	NumWorkers int           // "num_workers": shared pool size
	Lanes      LaneConfig    // "num_workers" + "per_op_workers"
	OpTimeout  time.Duration // "op_timeout_ms": deadline of a task from submission
	Eviction   json.RawMessage
	Extra      map[string]json.RawMessage
}

// ParseAdapterConfig parses and validates an adapter config; a bad config is
// refused with the offending key named (errors wrap ErrBadConfig).
func ParseAdapterConfig(s string) (*Config, error) {
	dec := json.NewDecoder(bytes.NewReader([]byte(s)))
	dec.UseNumber()
	var raw map[string]json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("%w: not a JSON object: %v", ErrBadConfig, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: trailing data after the JSON object", ErrBadConfig)
	}
	if raw == nil {
		return nil, fmt.Errorf("%w: not a JSON object", ErrBadConfig)
	}
	c := &Config{NumWorkers: DefaultNumWorkers, OpTimeout: DefaultOpTimeout, Extra: map[string]json.RawMessage{}}
	perOp := map[Op]int{}
	for k, v := range raw {
		var err error
		switch k {
		case "type":
			err = json.Unmarshal(v, &c.Type)
		case "name":
			err = json.Unmarshal(v, &c.Name)
		case "num_workers":
			c.NumWorkers, err = jsonInt(v)
		case "op_timeout_ms":
			var ms int
			if ms, err = jsonInt(v); err == nil && ms <= 0 {
				err = fmt.Errorf("%d, want > 0", ms)
			}
			c.OpTimeout = time.Duration(ms) * time.Millisecond
		case "eviction":
			c.Eviction = v
		case "per_op_workers":
			var m map[string]json.RawMessage
			if err = json.Unmarshal(v, &m); err != nil {
				break
			}
			names := make([]string, 0, len(m))
			for name := range m {
				names = append(names, name)
			}
			sort.Strings(names)
			for _, name := range names {
				op, ok := ParseOp(name)
				if !ok {
					return nil, fmt.Errorf("%w: key \"per_op_workers.%s\": unknown lane (want lookup, retrieve, store or delete)", ErrBadConfig, name)
				}
				n, err := jsonInt(m[name])
				if err == nil && n <= 0 {
					err = fmt.Errorf("%d workers, want > 0", n)
				}
				if err != nil {
					return nil, fmt.Errorf("%w: key \"per_op_workers.%s\": %v", ErrBadConfig, name, err)
				}
				perOp[op] = n
			}
		default:
			c.Extra[k] = v
		}
		if err != nil {
			return nil, fmt.Errorf("%w: key %q: %v", ErrBadConfig, k, err)
		}
	}
	if c.Type == "" {
		return nil, fmt.Errorf("%w: key \"type\": missing", ErrBadConfig)
	}
	if c.Name == "" {
		c.Name = c.Type
	}
	c.Lanes = LaneConfig{Shared: c.NumWorkers, PerOp: perOp}
	if err := c.Lanes.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

func jsonInt(v json.RawMessage) (int, error) {
	var n json.Number
	if t := bytes.TrimSpace(v); len(t) > 0 && t[0] == '"' {
		return 0, fmt.Errorf("want an integer, got %s", t)
	}
	if err := json.Unmarshal(v, &n); err != nil {
		return 0, fmt.Errorf("want an integer: %v", err)
	}
	i, err := strconv.Atoi(n.String())
	if err != nil {
		return 0, fmt.Errorf("want an integer, got %s", n)
	}
	return i, nil
}

// Extras reads backend-owned keys out of Config.Extra and, in Done, refuses
// any key nothing read.
type Extras struct {
	typ  string
	m    map[string]json.RawMessage
	used map[string]bool
	err  error
}

// Extras starts reading the backend keys.
func (c *Config) Extras() *Extras {
	return &Extras{typ: c.Type, m: c.Extra, used: map[string]bool{}}
}

func (e *Extras) get(key string, dst any) bool {
	e.used[key] = true
	v, ok := e.m[key]
	if !ok || e.err != nil {
		return false
	}
	if err := json.Unmarshal(v, dst); err != nil {
		e.err = fmt.Errorf("%w: key %q: %v", ErrBadConfig, key, err)
		return false
	}
	return true
}

// String reads a string key into dst (left unchanged when absent).
func (e *Extras) String(key string, dst *string) bool { return e.get(key, dst) }

// Bool reads a bool key.
func (e *Extras) Bool(key string, dst *bool) bool { return e.get(key, dst) }

// Strings reads a list of strings; a single string is accepted as a list of one.
func (e *Extras) Strings(key string, dst *[]string) bool {
	e.used[key] = true
	v, ok := e.m[key]
	if !ok || e.err != nil {
		return false
	}
	var one string
	if json.Unmarshal(v, &one) == nil {
		*dst = []string{one}
		return true
	}
	return e.get(key, dst)
}

// Int reads an integer key and checks it against [lo, hi].
func (e *Extras) Int(key string, dst *int, lo, hi int) bool {
	e.used[key] = true
	v, ok := e.m[key]
	if !ok || e.err != nil {
		return false
	}
	n, err := jsonInt(v)
	if err == nil && (n < lo || n > hi) {
		err = fmt.Errorf("%d, want %d..%d", n, lo, hi)
	}
	if err != nil {
		e.err = fmt.Errorf("%w: key %q: %v", ErrBadConfig, key, err)
		return false
	}
	*dst = n
	return true
}

// Fail records a validation error for key.
func (e *Extras) Fail(key, format string, args ...any) {
	if e.err == nil {
		e.err = fmt.Errorf("%w: key %q: %s", ErrBadConfig, key, fmt.Sprintf(format, args...))
	}
}

// Err returns the first validation error without checking for unread keys
// (for pass-through backends).
func (e *Extras) Err() error { return e.err }

// Done returns the first error, or names the first (sorted) key nothing read.
func (e *Extras) Done() error {
	if e.err != nil {
		return e.err
	}
	var unknown []string
	for k := range e.m {
		if !e.used[k] {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return fmt.Errorf("%w: key %q: unknown for type %q", ErrBadConfig, unknown[0], e.typ)
	}
	return nil
}

// Rest returns the keys nothing read, as strings (JSON strings unquoted,
// everything else in its JSON text): the pass-through for backends such as
// Mooncake whose setup takes a string map.
func (e *Extras) Rest() map[string]string {
	out := map[string]string{}
	for k, v := range e.m {
		if e.used[k] {
			continue
		}
		var s string
		if json.Unmarshal(v, &s) == nil {
			out[k] = s
		} else {
			out[k] = string(bytes.TrimSpace(v))
		}
	}
	return out
}
