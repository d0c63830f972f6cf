package mooncake

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"sync"
)

// request is one message to the helper (see helper.py).
type request struct {
	ID      uint64            `json:"id"`
	Op      string            `json:"op"`
	Config  map[string]string `json:"config,omitempty"`
	Workers int               `json:"workers,omitempty"`
	Path    string            `json:"path,omitempty"`
	Size    int               `json:"size,omitempty"`
	Keys    []string          `json:"keys,omitempty"`
	Seg     []int             `json:"seg,omitempty"`
	Off     []int             `json:"off,omitempty"`
	Len     []int             `json:"len,omitempty"`
}

type segRequest struct {
	ID   uint64 `json:"id"`
	Op   string `json:"op"`
	Seg  int    `json:"seg"`
	Path string `json:"path"`
	Size int    `json:"size"`
}

// reply is the helper's answer: per-key Mooncake codes, or an error.
type reply struct {
	ID    uint64  `json:"id"`
	Res   []int64 `json:"res"`
	Error string  `json:"error"`
	dead  error   // set (not sent) when the helper died before answering
}

const maxFrame = 64 << 20

// frameWriter writes length-prefixed JSON frames; safe for concurrent use.
type frameWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (f *frameWriter) write(msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	var hdr [4]byte
	binary.LittleEndian.PutUint32(hdr[:], uint32(len(b)))
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.w.Write(hdr[:]); err != nil {
		return err
	}
	_, err = f.w.Write(b)
	return err
}

// readFrame reads one length-prefixed JSON frame.
func readFrame(r *bufio.Reader) (reply, error) {
	var rep reply
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return rep, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if n > maxFrame {
		return rep, fmt.Errorf("mooncake: helper frame of %d bytes", n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return rep, err
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		return rep, fmt.Errorf("mooncake: helper frame: %w", err)
	}
	return rep, nil
}
