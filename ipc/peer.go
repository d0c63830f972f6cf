package ipc

import (
	"errors"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// exitPoll is how long one poll of a pidfd waits before it re-checks stop.
const exitPoll = 500 * time.Millisecond

// WatchExit returns a channel that is closed once process pid has exited,
// or nil when that can never be known here: pid is not positive (SO_PEERCRED
// reports 0 for a peer in another pid namespace), pid is this process (an
// in-process client of the embedded server), or the kernel has no pidfd.
// The watch ends early, leaving the channel open, when stop is closed.
//
// The pidfd is opened now, so a pid recycled after this call is never
// mistaken for the peer. Called after the peer may already have exited, a
// recycled pid can only make the watch wait for the wrong process: a delay,
// never an early close, which is the safe direction for its one use (the
// server keeps a possibly-alive writer's L1 slots out of use until it is
// known dead).
func WatchExit(pid int, stop <-chan struct{}) <-chan struct{} {
	if pid <= 0 || pid == os.Getpid() {
		return nil
	}
	fd, err := unix.PidfdOpen(pid, 0)
	exited := make(chan struct{})
	switch {
	case errors.Is(err, unix.ESRCH):
		close(exited) // already gone
		return exited
	case err != nil:
		return nil
	}
	go func() {
		defer unix.Close(fd)
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			_, err := unix.Poll(pfd, int(exitPoll/time.Millisecond))
			switch {
			case err == nil && pfd[0].Revents&(unix.POLLIN|unix.POLLHUP) != 0:
				close(exited) // a pidfd is readable once its process has exited
				return
			case err == nil && pfd[0].Revents&unix.POLLNVAL != 0:
				return // cannot happen with our own fd; never report an exit we did not see
			case err != nil && !errors.Is(err, unix.EINTR):
				time.Sleep(exitPoll)
			}
			select {
			case <-stop:
				return
			default:
			}
		}
	}()
	return exited
}
