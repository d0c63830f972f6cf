package hostproc

import "sync"

// Calls is the table of a process's requests in flight: each waits on a
// channel of one reply, and when the process's output ends every waiter
// gets the reply Fail makes, so no call waits for a dead process.
type Calls[R any] struct {
	mu      sync.Mutex
	pending map[uint64]chan R
	dead    error
}

// Err is nil until Fail, then the cause given to it.
func (c *Calls[R]) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dead
}

// Add registers id and returns the channel its reply arrives on, or the
// cause of death when the process is already dead.
func (c *Calls[R]) Add(id uint64) (chan R, error) {
	ch := make(chan R, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dead != nil {
		return nil, c.dead
	}
	if c.pending == nil {
		c.pending = map[uint64]chan R{}
	}
	c.pending[id] = ch
	return ch, nil
}

// Drop forgets id (its request could not be written).
func (c *Calls[R]) Drop(id uint64) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

// Deliver hands r to id's waiter; a reply for an unknown id is dropped.
func (c *Calls[R]) Deliver(id uint64, r R) {
	c.mu.Lock()
	ch := c.pending[id]
	delete(c.pending, id)
	c.mu.Unlock()
	if ch != nil {
		ch <- r
	}
}

// Fail records cause and answers every waiter with dead(id); later Adds
// fail with cause.
func (c *Calls[R]) Fail(cause error, dead func(id uint64) R) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dead = cause
	for id, ch := range c.pending {
		ch <- dead(id)
		delete(c.pending, id)
	}
}
