package tier

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// recheck is how often a waiting lookup re-reads L1's prefetch bytes
// (clients free temporary objects without telling the controller).
const recheck = 2 * time.Millisecond

// admission is the byte budget of prefetch loads.
type admission struct {
	l1     L1
	budget uint64

	acceptedG, waitingG *atomic.Int64 // exported gauges

	mu       sync.Mutex
	accepted uint64 // admitted, not yet reserved in L1
	waiters  []chan struct{}
}

// publishLocked updates the exported gauges.
func (ad *admission) publishLocked() {
	ad.acceptedG.Store(int64(ad.accepted))
	ad.waitingG.Store(int64(len(ad.waiters)))
}

func (ad *admission) fits(n uint64) bool {
	return ad.l1.PrefetchBytes()+ad.accepted+n <= ad.budget
}

// acquire admits n bytes, waiting (FIFO) at most wait, and never past ctx.
func (ad *admission) acquire(ctx context.Context, n uint64, wait time.Duration) bool {
	ad.mu.Lock()
	if len(ad.waiters) == 0 && ad.fits(n) {
		ad.accepted += n
		ad.publishLocked()
		ad.mu.Unlock()
		return true
	}
	if wait <= 0 {
		ad.mu.Unlock()
		return false
	}
	me := make(chan struct{}, 1)
	ad.waiters = append(ad.waiters, me)
	ad.publishLocked()
	ad.mu.Unlock()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	tick := time.NewTicker(recheck)
	defer tick.Stop()
	for {
		select {
		case <-me:
		case <-tick.C:
		case <-timer.C:
			ad.leave(me)
			return false
		case <-ctx.Done():
			ad.leave(me)
			return false
		}
		ad.mu.Lock()
		if ad.waiters[0] == me && ad.fits(n) {
			ad.waiters = ad.waiters[1:]
			ad.accepted += n
			ad.publishLocked()
			ad.wakeHeadLocked()
			ad.mu.Unlock()
			return true
		}
		ad.mu.Unlock()
	}
}

func (ad *admission) leave(me chan struct{}) {
	ad.mu.Lock()
	for i, w := range ad.waiters {
		if w == me {
			ad.waiters = append(ad.waiters[:i], ad.waiters[i+1:]...)
			break
		}
	}
	ad.publishLocked()
	ad.wakeHeadLocked()
	ad.mu.Unlock()
}

func (ad *admission) wakeHeadLocked() {
	if len(ad.waiters) > 0 {
		select {
		case ad.waiters[0] <- struct{}{}:
		default:
		}
	}
}

// reserved moves n accepted bytes out of the count (they are now L1
// staging, or were never reserved) and wakes the queue head.
func (ad *admission) reserved(n uint64) {
	ad.mu.Lock()
	ad.accepted -= n
	ad.publishLocked()
	ad.wakeHeadLocked()
	ad.mu.Unlock()
}

// kick wakes the queue head (L1 prefetch bytes may have dropped).
func (ad *admission) kick() {
	ad.mu.Lock()
	ad.wakeHeadLocked()
	ad.mu.Unlock()
}
