package ipc

import (
	"context"

	"github.com/kvshim/kvshim/kv"
)

// KV events (protocol 4): the server tells a scheduler session which of the
// chunks it announced to vLLM's KV-event publisher left a tier, so that a
// router's view stays exact even when another instance's saves evicted them
// from a shared `kvshim serve`. The server notifies, nobody polls: once a
// session has something queued, every answer to it carries
// FlagEventsPending in its frame header (a direct session is marked
// through Client.MarkEventsPending), and the client fetches the queue with
// one OpEvents only then. Layouts (little-endian):
//
//	EventsReq   n u32 | n×(ns[16] hash[32] medium u8 pad[3])
//	EventsResp  lost u64 | n u32 | n×(ns[16] hash[32] medium u8 kind u8 pad[2])

// OpEvents announces chunk keys and takes the session's queued events.
const OpEvents Op = 13

// FlagEventsPending marks an answer to a session that has events queued
// (set only for sessions that sent OpEvents: an older client never sees it).
const FlagEventsPending uint8 = 1 << 1

// Medium is the tier an event names, in vLLM's vocabulary.
type Medium uint8

const (
	MediumL1 Medium = 0 // "CPU": the server's host memory
	MediumL2 Medium = 1 // "STORAGE": an L2 adapter
)

// EventKind says what happened to a chunk.
type EventKind uint8

const (
	EventRemoved EventKind = 0 // the chunk left Medium (L1 eviction, L2 drop)
	EventStored  EventKind = 1 // the chunk reached Medium (the L2 writer wrote it)
)

// EventKey names one chunk of a namespace (every rank's object of it).
type EventKey struct {
	Namespace kv.Namespace
	Hash      kv.Hash
	Medium    Medium
}

// EventsReq announces Keys (chunks this session's instance told vLLM it
// holds) and asks for the queued events.
type EventsReq struct {
	Keys []EventKey
}

// Event is one queued event.
type Event struct {
	Key  EventKey
	Kind EventKind
}

// EventsResp is the session's queue since its last OpEvents and how many
// events were lost to the queue's bound since then.
type EventsResp struct {
	Lost   uint64
	Events []Event
}

const eventKeyLen = kv.NamespaceSize + 32 + 4

// AppendEventsReq encodes r.
func AppendEventsReq(b []byte, r *EventsReq) ([]byte, error) {
	b = putU32(b, uint32(len(r.Keys)))
	for i := range r.Keys {
		k := &r.Keys[i]
		b = append(b, k.Namespace[:]...)
		b = append(b, k.Hash[:]...)
		b = append(b, uint8(k.Medium), 0, 0, 0)
	}
	return b, nil
}

func (d *dec) eventKey(k *EventKey) uint8 {
	d.fixed(k.Namespace[:])
	d.fixed(k.Hash[:])
	k.Medium = Medium(d.u8())
	if k.Medium > MediumL2 {
		d.fail("medium %d", k.Medium)
	}
	return d.u8()
}

func (d *dec) zero(n int) {
	for _, x := range d.take(n) {
		if x != 0 {
			d.fail("non-zero padding")
			return
		}
	}
}

// DecodeEventsReq decodes an EventsReq.
func DecodeEventsReq(b []byte) (*EventsReq, error) {
	d := newDec("events request", b)
	r := &EventsReq{}
	n := d.count(eventKeyLen)
	if n > MaxKeys {
		d.fail("%d keys exceeds %d", n, MaxKeys)
	}
	if n > 0 && d.err == nil {
		r.Keys = make([]EventKey, n)
		for i := range r.Keys {
			if pad := d.eventKey(&r.Keys[i]); pad != 0 {
				d.fail("non-zero padding")
			}
			d.zero(2)
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// AppendEventsResp encodes r.
func AppendEventsResp(b []byte, r *EventsResp) ([]byte, error) {
	b = putU64(b, r.Lost)
	b = putU32(b, uint32(len(r.Events)))
	for i := range r.Events {
		e := &r.Events[i]
		b = append(b, e.Key.Namespace[:]...)
		b = append(b, e.Key.Hash[:]...)
		b = append(b, uint8(e.Key.Medium), uint8(e.Kind), 0, 0)
	}
	return b, nil
}

// DecodeEventsResp decodes an EventsResp.
func DecodeEventsResp(b []byte) (*EventsResp, error) {
	d := newDec("events response", b)
	r := &EventsResp{Lost: d.u64()}
	if n := d.count(eventKeyLen); n > 0 && d.err == nil {
		r.Events = make([]Event, n)
		for i := range r.Events {
			e := &r.Events[i]
			e.Kind = EventKind(d.eventKey(&e.Key))
			if e.Kind > EventStored {
				d.fail("event kind %d", e.Kind)
			}
			d.zero(2)
		}
	}
	if err := d.done(); err != nil {
		return nil, err
	}
	return r, nil
}

// EventsService is the optional part of a Service that answers OpEvents
// (a Service without it answers StatusBadRequest, as an older server does).
type EventsService interface {
	Events(*EventsReq) (*EventsResp, error)
}

// Events sends OpEvents: it announces r.Keys and returns the queued
// events. It clears the pending mark first, so a mark set while the call
// is in flight is kept for the next call.
func (c *Client) Events(ctx context.Context, r *EventsReq) (*EventsResp, error) {
	c.evPending.Store(false)
	resp, err := call(c, ctx, OpEvents, r, AppendEventsReq, DecodeEventsResp)
	if err != nil {
		c.evPending.Store(true) // still to be fetched
	}
	return resp, err
}

// EventsPending reports whether the server said this session has events
// queued (an answer's FlagEventsPending, or MarkEventsPending).
func (c *Client) EventsPending() bool { return c.evPending.Load() }

// MarkEventsPending is how an in-process server (a direct session, which
// has no frame headers) tells the client that events are queued.
func (c *Client) MarkEventsPending() { c.evPending.Store(true) }
