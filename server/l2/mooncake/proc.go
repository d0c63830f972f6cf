package mooncake

import (
	"bufio"
	"fmt"
	"io"
	"os/exec"
	"sync"
	"time"

	"github.com/kvshim/kvshim/server/l2"
)

// proc is one helper process and its outstanding requests.
type proc struct {
	cmd    *exec.Cmd
	stdin  io.Closer
	w      *frameWriter
	exited chan struct{}
	stderr *tail

	mu      sync.Mutex
	pending map[uint64]chan reply
	dead    error
}

func (p *proc) err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dead
}

// send registers req.ID and writes req; the reply arrives on the channel
// (an error reply when the helper dies first).
func (p *proc) send(req *request) (chan reply, error) {
	ch := make(chan reply, 1)
	p.mu.Lock()
	if p.dead != nil {
		err := p.dead
		p.mu.Unlock()
		return nil, err
	}
	p.pending[req.ID] = ch
	p.mu.Unlock()
	var err error
	if req.Op == "segment" {
		err = p.w.write(segRequest{ID: req.ID, Op: "segment", Seg: req.Seg[0], Path: req.Path, Size: req.Size})
	} else {
		err = p.w.write(req)
	}
	if err != nil {
		p.mu.Lock()
		delete(p.pending, req.ID)
		p.mu.Unlock()
		return nil, fmt.Errorf("%w: %w: write: %w%s", l2.ErrUnavailable, ErrHelper, err, p.stderr.suffix())
	}
	return ch, nil
}

func (p *proc) readLoop(r *bufio.Reader) {
	for {
		rep, err := readFrame(r)
		if err != nil {
			p.mu.Lock()
			p.dead = fmt.Errorf("%w: %w: helper exited (%v)%s", l2.ErrUnavailable, ErrHelper, err, p.stderr.suffix())
			for id, ch := range p.pending {
				ch <- reply{ID: id, dead: p.dead}
				delete(p.pending, id)
			}
			p.mu.Unlock()
			return
		}
		p.mu.Lock()
		ch := p.pending[rep.ID]
		delete(p.pending, rep.ID)
		p.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

// stop closes stdin (the helper exits at EOF) and kills it after 5 s.
func (p *proc) stop() {
	_ = p.stdin.Close()
	select {
	case <-p.exited:
		return
	case <-time.After(5 * time.Second):
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
	}
}
