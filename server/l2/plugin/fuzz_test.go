package plugin

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"testing"
)

// FuzzReadReply: the host's reply frames are decoded without a panic, and
// a frame that decodes has one status and size per key it says.
func FuzzReadReply(f *testing.F) {
	le := binary.LittleEndian
	frame := func(id uint64, rc int32, st []int32, msg string) []byte {
		body := make([]byte, 16+12*len(st)+4+len(msg))
		le.PutUint64(body, id)
		le.PutUint32(body[8:], uint32(rc))
		le.PutUint32(body[12:], uint32(len(st)))
		for i, s := range st {
			le.PutUint32(body[16+12*i:], uint32(s))
			le.PutUint64(body[20+12*i:], uint64(i))
		}
		le.PutUint32(body[16+12*len(st):], uint32(len(msg)))
		copy(body[20+12*len(st):], msg)
		return append(le.AppendUint32(nil, uint32(len(body))), body...)
	}
	f.Add(frame(1, 0, []int32{0, 1, -2}, "x"))
	f.Add(frame(7, -100, []int32{1}, "bad config"))
	f.Add([]byte{20, 0, 0, 0, 1, 2, 3})
	f.Add(frame(2, 0, nil, "")[:10])
	f.Fuzz(func(t *testing.T, b []byte) {
		_, rep, err := readReply(bufio.NewReader(bytes.NewReader(b)))
		if err != nil {
			return
		}
		if len(rep.status) != len(rep.sizes) {
			t.Fatalf("%d statuses, %d sizes", len(rep.status), len(rep.sizes))
		}
	})
}
