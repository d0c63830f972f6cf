package ipc

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
)

// WatchExit closes its channel for an exited process and stays open for a
// live one (and for this process).
func TestWatchExit(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	assert.Assert(t, WatchExit(os.Getpid(), stop) == nil)
	assert.Assert(t, WatchExit(0, stop) == nil)
	child := exec.Command("sleep", "60")
	assert.NilError(t, child.Start())
	ch := WatchExit(child.Process.Pid, stop)
	select {
	case <-ch:
		t.Fatal("exit reported for a live process")
	case <-time.After(700 * time.Millisecond):
	}
	child.Process.Kill()
	child.Wait()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatal("exit not seen")
	}
}

// A socket answered by another user's process is refused before the hello
// (the process could feed the client any bytes), unless that uid is listed.
func TestClientRefusesServerOfOtherUID(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run the server as another uid")
	}
	dir, err := os.MkdirTemp("", "kvshim-uid-") // t.TempDir's parent is private
	assert.NilError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	assert.NilError(t, os.Chmod(dir, 0o777))
	sock := filepath.Join(dir, "other", "kvshim.sock")
	// The test binary sits in a private build directory: run a copy.
	bin := filepath.Join(dir, "ipc.test")
	self, err := os.ReadFile(os.Args[0])
	assert.NilError(t, err)
	assert.NilError(t, os.WriteFile(bin, self, 0o755))
	srv := child(t, "listen", "KVSHIM_SOCK="+sock)
	srv.Path, srv.Args[0] = bin, bin
	srv.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	stdin, err := srv.StdinPipe()
	assert.NilError(t, err)
	out, err := srv.StdoutPipe()
	assert.NilError(t, err)
	srv.Stderr = os.Stderr
	assert.NilError(t, srv.Start())
	t.Cleanup(func() { stdin.Close(); srv.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	assert.NilError(t, err)
	assert.Equal(t, line, "ready\n")

	_, err = Dial(sock, Hello{Role: RoleTool}, 2*time.Second)
	assert.Assert(t, errors.Is(err, ErrPermission), "%v", err)
	assert.ErrorContains(t, err, "uid 65534")

	c, err := DialConfig(sock, Hello{Role: RoleTool}, 2*time.Second, &ClientConfig{ServerUIDs: []uint32{65534}})
	assert.NilError(t, err)
	c.Close()
}

// One uid's live sessions are bounded: past the limit a hello is refused
// with a message naming it, and a session that ends makes room again.
func TestSessionsPerUIDLimit(t *testing.T) {
	ts := startServer(t, &ServerConfig{MaxSessionsPerUID: 2})
	a, err := Dial(ts.path, Hello{Role: RoleTool}, 2*time.Second)
	assert.NilError(t, err)
	b, err := Dial(ts.path, Hello{Role: RoleTool}, 2*time.Second)
	assert.NilError(t, err)
	defer b.Close()
	_, err = Dial(ts.path, Hello{Role: RoleTool}, 2*time.Second)
	assert.Assert(t, errors.Is(err, ErrRefused), "%v", err)
	assert.ErrorContains(t, err, "already has 2 sessions")
	a.Close()
	testkit.EventuallyShowing(t, 5*time.Second, "room after a session ended", func() bool {
		var c *Client
		if c, err = Dial(ts.path, Hello{Role: RoleTool}, 2*time.Second); err != nil {
			return false
		}
		c.Close()
		return true
	}, func() string { return fmt.Sprint(err) })
}

// Paths the kernel would refuse with "invalid argument", and paths that are
// not sockets, get errors that say so; a missing parent directory of the
// socket is a reported typo, not created.
func TestSocketPathErrors(t *testing.T) {
	long := "/tmp/" + strings.Repeat("d", MaxSocketPath) + ".sock"
	_, err := Listen(long, nil)
	assert.ErrorContains(t, err, "holds at most 107")
	_, err = Dial(long, Hello{Role: RoleTool}, time.Second)
	assert.ErrorContains(t, err, "holds at most 107")

	dir := t.TempDir()
	file := filepath.Join(dir, "regular")
	assert.NilError(t, os.WriteFile(file, []byte("x"), 0o600))
	_, err = Dial(file, Hello{Role: RoleTool}, time.Second)
	assert.Assert(t, errors.Is(err, syscall.ENOTSOCK), "%v", err)
	_, err = Listen(file, nil)
	assert.ErrorContains(t, err, "is not a socket")
	_, statErr := os.Stat(file)
	assert.NilError(t, statErr, "the regular file was removed")

	_, err = Listen(filepath.Join(dir, "typo", "sub", "kvshim.sock"), nil)
	assert.ErrorContains(t, err, "does not exist (a typo?)")
	l, err := Listen(filepath.Join(dir, "sub", "kvshim.sock"), nil)
	assert.NilError(t, err)
	l.Close()
}
