package mooncake

import (
	"bufio"
	"fmt"
	"time"

	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/internal/hostproc"
)

// proc is one helper process and its outstanding requests.
type proc struct {
	*hostproc.Child
	w      *frameWriter
	stderr *hostproc.Tail
	calls  hostproc.Calls[reply]
}

// Err is nil while the helper serves calls (hostproc.Proc).
func (p *proc) Err() error { return p.calls.Err() }

// send registers req.ID and writes req; the reply arrives on the channel
// (an error reply when the helper dies first).
func (p *proc) send(req *request) (chan reply, error) {
	ch, err := p.calls.Add(req.ID)
	if err != nil {
		return nil, err
	}
	if req.Op == "segment" {
		err = p.w.write(segRequest{ID: req.ID, Op: "segment", Seg: req.Seg[0], Path: req.Path, Size: req.Size})
	} else {
		err = p.w.write(req)
	}
	if err != nil {
		p.calls.Drop(req.ID)
		return nil, fmt.Errorf("%w: %w: write: %w%s", l2.ErrUnavailable, ErrHelper, err, p.stderr.Suffix())
	}
	return ch, nil
}

func (p *proc) readLoop(r *bufio.Reader) {
	for {
		rep, err := readFrame(r)
		if err != nil {
			dead := fmt.Errorf("%w: %w: helper exited (%v)%s", l2.ErrUnavailable, ErrHelper, err, p.stderr.Suffix())
			p.calls.Fail(dead, func(id uint64) reply { return reply{ID: id, dead: dead} })
			return
		}
		p.calls.Deliver(rep.ID, rep)
	}
}

// stop closes stdin (the helper exits at EOF) and kills it after 5 s.
func (p *proc) stop() { p.Stop(5 * time.Second) }
