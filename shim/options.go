package shim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Roles and per-request settings: what a request may take from kvshim
// (loads) and give it (saves).

// Role is vLLM's kv_role: whether this instance saves, loads or both.
type Role uint8

const (
	RoleBoth     Role = iota // kv_both (and no role): loads and saves
	RoleProducer             // kv_producer: saves, never loads (a prefill instance)
	RoleConsumer             // kv_consumer: loads, never saves (a decode instance)
)

// ErrBadRole: a kv_role kvshim does not know.
var ErrBadRole = errors.New("kvshim: kv_role")

// ParseRole reads vLLM's kv_role ("" is kv_both).
func ParseRole(s string) (Role, error) {
	switch s {
	case "", "kv_both":
		return RoleBoth, nil
	case "kv_producer":
		return RoleProducer, nil
	case "kv_consumer":
		return RoleConsumer, nil
	}
	return 0, fmt.Errorf("%w %q: want \"kv_producer\", \"kv_consumer\" or \"kv_both\"", ErrBadRole, s)
}

// ErrBadParams: a request's kv_transfer_params with a kvshim key that is
// unknown or whose value is not valid.
var ErrBadParams = errors.New("kvshim: kv_transfer_params")

// RequestOptions are one request's kvshim settings, from its
// kv_transfer_params.
type RequestOptions struct {
	SkipLoad bool // never loaded from kvshim (a benchmark's cold run)
	SkipSave bool // never saved (private data)
}

// ParamKeys are the kv_transfer_params keys kvshim reads and what they do.
var ParamKeys = map[string]string{
	"kvshim.skip_load": "true: the request is not looked up or loaded from kvshim (vLLM computes it)",
	"kvshim.skip_save": "true: nothing the request computes is saved to kvshim",
}

// DecodeRequestOptions reads the kvshim keys of a request's
// kv_transfer_params (a JSON object; keys without the "kvshim." prefix
// belong to other connectors and are passed over). An unknown kvshim key
// or a value that is no boolean is an error naming it; the options then
// returned skip both loads and saves (a typo in "kvshim.skip_save" must
// never save private data), and the caller serves the request without
// kvshim rather than failing it.
func DecodeRequestOptions(raw []byte) (RequestOptions, error) {
	var m map[string]json.RawMessage
	if len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null" {
		return RequestOptions{}, nil
	}
	closed := RequestOptions{SkipLoad: true, SkipSave: true}
	if err := json.Unmarshal(raw, &m); err != nil {
		return closed, fmt.Errorf("%w: not a JSON object: %v", ErrBadParams, err)
	}
	var o RequestOptions
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if !strings.HasPrefix(k, "kvshim.") {
			continue
		}
		var dst *bool
		switch k {
		case "kvshim.skip_load":
			dst = &o.SkipLoad
		case "kvshim.skip_save":
			dst = &o.SkipSave
		default:
			return closed, fmt.Errorf("%w: unknown key %q (valid: %s); the request is served without kvshim",
				ErrBadParams, k, strings.Join(slices.Sorted(maps.Keys(ParamKeys)), ", "))
		}
		if err := json.Unmarshal(m[k], dst); err != nil {
			return closed, fmt.Errorf("%w: %s: want true or false, got %s; the request is served without kvshim", ErrBadParams, k, m[k])
		}
	}
	return o, nil
}

// SetRequestOptions records req's settings before its first Match (a
// request already keyed keeps what it had; a preempted one keeps them when
// keyed again; its finish forgets them). Nothing
// of a request that skips loads is looked up; nothing of one that skips
// saves is saved.
func (s *Scheduler) SetRequestOptions(req string, o RequestOptions) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o == (RequestOptions{}) {
		delete(s.opts, req)
		return
	}
	if s.opts == nil {
		s.opts = map[string]RequestOptions{}
	}
	s.opts[req] = o
}

// options are req's settings: its own, and this instance's role.
// s.mu held.
func (s *Scheduler) options(req string) RequestOptions {
	o := s.opts[req]
	o.SkipLoad = o.SkipLoad || s.cfg.Role == RoleProducer
	o.SkipSave = o.SkipSave || s.cfg.Role == RoleConsumer
	return o
}
