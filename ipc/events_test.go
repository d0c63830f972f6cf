package ipc

import (
	"testing"

	"github.com/kvshim/kvshim/kv"
	"gotest.tools/v3/assert"
)

func TestEventsCodec(t *testing.T) {
	req := &EventsReq{Keys: []EventKey{{Namespace: kv.Namespace{1}, Hash: kv.Hash{2}}, {Namespace: kv.Namespace{3}, Hash: kv.Hash{4}, Medium: MediumL2}}}
	b, err := AppendEventsReq(nil, req)
	assert.NilError(t, err)
	got, err := DecodeEventsReq(b)
	assert.NilError(t, err)
	assert.DeepEqual(t, got, req)
	resp := &EventsResp{Lost: 7, Events: []Event{{Key: req.Keys[0], Kind: EventRemoved}, {Key: req.Keys[1], Kind: EventStored}}}
	b, err = AppendEventsResp(nil, resp)
	assert.NilError(t, err)
	gotR, err := DecodeEventsResp(b)
	assert.NilError(t, err)
	assert.DeepEqual(t, gotR, resp)
	// Bad medium, kind, padding and a lying count are malformed.
	bad := append([]byte(nil), b...)
	bad[12+48] = 9
	_, err = DecodeEventsResp(bad)
	assert.ErrorIs(t, err, ErrMalformed)
	bad = append([]byte(nil), b...)
	bad[12+49] = 9
	_, err = DecodeEventsResp(bad)
	assert.ErrorIs(t, err, ErrMalformed)
	rb, _ := AppendEventsReq(nil, req)
	rb[4+50] = 1
	_, err = DecodeEventsReq(rb)
	assert.ErrorIs(t, err, ErrMalformed)
	_, err = DecodeEventsReq([]byte{0xff, 0xff, 0, 0})
	assert.ErrorIs(t, err, ErrMalformed)
	// The flag is valid on an answer only.
	h := AppendFrameHeader(nil, FrameHeader{Flags: FlagEventsPending, Op: OpStats})
	_, _, err = DecodeFrame(h)
	assert.ErrorIs(t, err, ErrMalformed)
	h = AppendFrameHeader(nil, FrameHeader{Flags: FlagEventsPending | FlagResponse, Op: OpStats})
	fh, _, err := DecodeFrame(h)
	assert.NilError(t, err)
	assert.Equal(t, fh.Flags, FlagEventsPending|FlagResponse)
}
