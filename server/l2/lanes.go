package l2

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"
)

// Op is an L2 operation; each op runs on its lane.
type Op uint8

// Lanes, named as in LMCache's per_op_workers.
const (
	OpLookup   Op = iota // exists (+hold)
	OpRetrieve           // load into caller buffers
	OpStore              // write
	OpDelete             // remove
	numOps
)

var opNames = [numOps]string{"lookup", "retrieve", "store", "delete"}

func (o Op) String() string {
	if o < numOps {
		return opNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// ParseOp maps a lane name ("lookup", "retrieve", "store", "delete") to its Op.
func ParseOp(s string) (Op, bool) {
	for i, n := range opNames {
		if n == s {
			return Op(i), true
		}
	}
	return 0, false
}

// LaneConfig says how many workers serve each op: ops listed in PerOp get
// their own queue and workers, the others share one queue served by Shared
// workers.
type LaneConfig struct {
	Shared int
	PerOp  map[Op]int
}

// Validate refuses n <= 0 and a shared pool of no workers that some op needs.
func (c LaneConfig) Validate() error {
	for op, n := range c.PerOp {
		if op >= numOps {
			return fmt.Errorf("%w: per_op_workers: unknown lane %d", ErrBadConfig, op)
		}
		if n <= 0 {
			return fmt.Errorf("%w: per_op_workers.%s: %d workers, want > 0", ErrBadConfig, op, n)
		}
	}
	if len(c.PerOp) < int(numOps) && c.Shared <= 0 {
		return fmt.Errorf("%w: num_workers: %d, want > 0 (lanes not in per_op_workers share it)", ErrBadConfig, c.Shared)
	}
	return nil
}

// Workers is the number of workers serving op.
func (c LaneConfig) Workers(op Op) int {
	if n, ok := c.PerOp[op]; ok {
		return n
	}
	return c.Shared
}

// Total is the number of workers over all queues (a connection-pool size).
func (c LaneConfig) Total() int {
	t := 0
	if len(c.PerOp) < int(numOps) {
		t = c.Shared
	}
	for _, n := range c.PerOp {
		t += n
	}
	return t
}

// String is a stable description, e.g. "shared=4 lookup=1 retrieve=1 store=2".
func (c LaneConfig) String() string {
	s := fmt.Sprintf("shared=%d", c.Shared)
	ops := make([]int, 0, len(c.PerOp))
	for op := range c.PerOp {
		ops = append(ops, int(op))
	}
	sort.Ints(ops)
	for _, op := range ops {
		s += fmt.Sprintf(" %s=%d", Op(op), c.PerOp[Op(op)])
	}
	return s
}

// job is one tile of a task.
type job struct {
	ctx      context.Context
	op       Op
	run      func(ctx context.Context)
	fail     func(err error)
	enqueued time.Time
}

// queue is a FIFO served by a fixed set of workers. Submission never blocks.
type queue struct {
	name    string
	mu      sync.Mutex
	cond    *sync.Cond
	jobs    []job
	head    int
	closed  bool
	workers sync.WaitGroup
	depth   func(op Op, delta float64)
	waited  func(op Op, d time.Duration)
}

func newQueue(name string, n int, depth func(Op, float64), waited func(Op, time.Duration)) *queue {
	q := &queue{name: name, depth: depth, waited: waited}
	q.cond = sync.NewCond(&q.mu)
	q.workers.Add(n)
	for range n {
		go q.work()
	}
	return q
}

func (q *queue) push(j job) bool {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return false
	}
	j.enqueued = time.Now()
	q.jobs = append(q.jobs, j)
	q.mu.Unlock()
	q.depth(j.op, 1)
	q.cond.Signal()
	return true
}

func (q *queue) pop() (job, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.head == len(q.jobs) && !q.closed {
		q.cond.Wait()
	}
	if q.head == len(q.jobs) {
		return job{}, false
	}
	j := q.jobs[q.head]
	q.jobs[q.head] = job{}
	q.head++
	if q.head == len(q.jobs) {
		q.jobs, q.head = q.jobs[:0], 0
	} else if q.head > 1024 && q.head*2 > len(q.jobs) {
		n := copy(q.jobs, q.jobs[q.head:])
		q.jobs, q.head = q.jobs[:n], 0
	}
	return j, true
}

func (q *queue) work() {
	defer q.workers.Done()
	for {
		j, ok := q.pop()
		if !ok {
			return
		}
		q.depth(j.op, -1)
		q.waited(j.op, time.Since(j.enqueued))
		if err := j.ctx.Err(); err != nil {
			j.fail(fmt.Errorf("%s: queued %v: %w", j.op, time.Since(j.enqueued).Round(time.Microsecond), err))
			continue
		}
		j.run(j.ctx)
	}
}

// close stops accepting jobs, fails queued ones with ErrClosed and waits
// for the workers (each finishes its current tile) up to timeout.
func (q *queue) close(timeout time.Duration) bool {
	q.mu.Lock()
	q.closed = true
	rest := append([]job(nil), q.jobs[q.head:]...)
	q.jobs, q.head = nil, 0
	q.mu.Unlock()
	q.cond.Broadcast()
	for _, j := range rest {
		q.depth(j.op, -1)
		j.fail(ErrClosed)
	}
	done := make(chan struct{})
	go func() { q.workers.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// lanes routes each op to its queue.
type lanes struct {
	cfg    LaneConfig
	byOp   [numOps]*queue
	queues []*queue
}

func newLanes(cfg LaneConfig, depth func(Op, float64), waited func(Op, time.Duration)) (*lanes, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	l := &lanes{cfg: cfg}
	var shared *queue
	for op := Op(0); op < numOps; op++ {
		if n, ok := cfg.PerOp[op]; ok {
			q := newQueue(op.String(), n, depth, waited)
			l.byOp[op] = q
			l.queues = append(l.queues, q)
			continue
		}
		if shared == nil {
			shared = newQueue("shared", cfg.Shared, depth, waited)
			l.queues = append(l.queues, shared)
		}
		l.byOp[op] = shared
	}
	return l, nil
}

func (l *lanes) submit(j job) bool { return l.byOp[j.op].push(j) }

func (l *lanes) close(timeout time.Duration) bool {
	ok := true
	for _, q := range l.queues {
		ok = q.close(timeout) && ok
	}
	return ok
}
