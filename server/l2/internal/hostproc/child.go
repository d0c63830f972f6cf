package hostproc

import (
	"io"
	"os/exec"
	"time"
)

// Child is a started command whose stdin carries its requests: closing
// stdin is how it is asked to finish its calls and exit.
type Child struct {
	Cmd    *exec.Cmd
	Stdin  io.WriteCloser
	Exited chan struct{} // closed once Cmd.Wait returns
}

// Watch returns the Child of a started cmd and reaps it in the background.
func Watch(cmd *exec.Cmd, stdin io.WriteCloser) *Child {
	c := &Child{Cmd: cmd, Stdin: stdin, Exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.Exited) }()
	return c
}

// Stop closes stdin (the child exits at EOF) and kills it when it has not
// exited after timeout.
func (c *Child) Stop(timeout time.Duration) {
	_ = c.Stdin.Close()
	select {
	case <-c.Exited:
		return
	case <-time.After(timeout):
	}
	c.Kill()
}

// Kill ends the child at once (SIGKILL) and waits for it, bounded.
func (c *Child) Kill() {
	_ = c.Cmd.Process.Kill()
	select {
	case <-c.Exited:
	case <-time.After(5 * time.Second):
	}
}
