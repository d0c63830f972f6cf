package ipc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvshim/kvshim/kv"
	"golang.org/x/sys/unix"
	"gotest.tools/v3/assert"
)

// The two-process tests re-execute the test binary with KVSHIM_IPC_CHILD set;
// TestMain then runs the child role instead of the tests.
const childEnv = "KVSHIM_IPC_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		if err := runChild(role); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(3)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func runChild(role string) error {
	switch role {
	case "ring-writer": // fd 3: ring mapping; write records, then die mid-record
		size, _ := strconv.ParseUint(os.Getenv("KVSHIM_RING_SIZE"), 10, 64)
		seg, err := MapSegment(1, 3, size)
		if err != nil {
			return err
		}
		r, err := AttachRing(seg.Mem(), RingOptions{})
		if err != nil {
			return err
		}
		for i := 0; i < 1000; i++ {
			if err := r.Write(RecordFrame, payloadFor(i, i%300), nil, time.Now().Add(5*time.Second)); err != nil {
				return err
			}
		}
		if _, err := r.Claim(RecordFrame, 100, time.Now().Add(5*time.Second)); err != nil {
			return err
		}
		return unix.Kill(os.Getpid(), unix.SIGKILL)
	case "client", "client-die":
		c, err := Dial(os.Getenv("KVSHIM_SOCK"), Hello{Role: RoleWorker}, 5*time.Second)
		if err != nil {
			return err
		}
		ctx := context.Background()
		ar, err := c.Alloc(ctx, &AllocReq{Hashes: make([]kv.Hash, 64), Sizes: fill(64, 128)})
		if err != nil {
			return err
		}
		for i, l := range ar.Locs {
			b, err := c.Resolve(l)
			if err != nil {
				return err
			}
			b[0] = byte(i + 1)
		}
		if _, err := c.Commit(ctx, &CommitReq{Hashes: make([]kv.Hash, 64)}); err != nil {
			return err
		}
		if role == "client" {
			return c.Close()
		}
		c.submitMu.Lock()
		if _, err := c.tx.Claim(RecordFrame, 64, time.Now().Add(time.Second)); err != nil {
			return err
		}
		return unix.Kill(os.Getpid(), unix.SIGKILL)
	case "populate":
		return runPopulateChild()
	case "dial":
		_, err := Dial(os.Getenv("KVSHIM_SOCK"), Hello{Role: RoleTool}, 5*time.Second)
		return err
	case "listen": // serve handshakes on KVSHIM_SOCK (any uid) until stdin closes
		ln, err := Listen(os.Getenv("KVSHIM_SOCK"), &ServerConfig{AllowUIDs: []uint32{0}})
		if err != nil {
			return err
		}
		go func() {
			for {
				if _, err := ln.Accept(); err != nil {
					return
				}
			}
		}()
		fmt.Println("ready")
		b := make([]byte, 1)
		os.Stdin.Read(b)
		return ln.Close()
	}
	return fmt.Errorf("unknown role %q", role)
}

func fill(n int, v uint64) []uint64 {
	s := make([]uint64, n)
	for i := range s {
		s[i] = v
	}
	return s
}

func child(t *testing.T, role string, env ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append(env, childEnv+"="+role)...)
	return cmd
}

// A writer process SIGKILLed with a record in progress: the reader gets
// every committed record, then ErrPeerStalled instead of hanging.
func TestTwoProcessRingWriterKilled(t *testing.T) {
	const capacity = 1 << 14
	seg, err := CreateSegment(1, RingSize(capacity))
	assert.NilError(t, err)
	defer seg.Close()
	r, err := InitRing(seg.Mem(), capacity, RingOptions{StallTimeout: 300 * time.Millisecond, WaitSlice: 20 * time.Millisecond})
	assert.NilError(t, err)
	fd, err := unix.Dup(seg.Fd())
	assert.NilError(t, err)
	f := os.NewFile(uintptr(fd), "ring")
	cmd := child(t, "ring-writer", "KVSHIM_RING_SIZE="+strconv.FormatUint(RingSize(capacity), 10))
	cmd.ExtraFiles = []*os.File{f}
	out := &strings.Builder{}
	cmd.Stderr = out
	assert.NilError(t, cmd.Start())
	f.Close()
	for i := 0; i < 1000; i++ {
		_, p, err := r.Read(time.Now().Add(10 * time.Second))
		assert.NilError(t, err, "record %d; child: %s", i, out)
		assert.DeepEqual(t, p, payloadFor(i, i%300))
		r.Release()
	}
	_, _, err = r.Read(time.Now().Add(10 * time.Second))
	assert.Assert(t, errors.Is(err, ErrPeerStalled), "%v", err)
	err = cmd.Wait()
	ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
	assert.Assert(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child: %v %s", err, out)
}

// Client in another process: handshake over the socket, segments over
// SCM_RIGHTS, calls over the rings, writes into L1 visible to the server.
// A second client is SIGKILLed mid-record; the server ends that session
// and keeps serving.
func TestTwoProcessClient(t *testing.T) {
	ts := startServer(t, nil)
	cmd := child(t, "client", "KVSHIM_SOCK="+ts.path)
	out, err := cmd.CombinedOutput()
	assert.NilError(t, err, "%s", out)
	seg, _ := ts.l.Segments().Get(1)
	assert.Equal(t, seg.Mem()[0], byte(1))
	assert.Equal(t, seg.Mem()[63*128], byte(64))
	errs := ts.waitEnded(t, 1)
	assert.Assert(t, errors.Is(errs[0], ErrPeerGone) || errors.Is(errs[0], ErrClosed), "%v", errs[0])

	cmd = child(t, "client-die", "KVSHIM_SOCK="+ts.path)
	out, err = cmd.CombinedOutput()
	ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
	assert.Assert(t, ws.Signaled(), "%v %s", err, out)
	errs = ts.waitEnded(t, 2)
	assert.Assert(t, errors.Is(errs[1], ErrPeerGone) || errors.Is(errs[1], ErrPeerStalled), "%v", errs[1])

	c := dialTest(t, ts.path)
	assert.NilError(t, c.Ping(context.Background()))
}

// A real client running as another uid is refused by SO_PEERCRED. Needs
// root (to start the child as nobody); skipped otherwise.
func TestTwoProcessWrongUID(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a child under another uid; TestCheckPeerCred covers the check")
	}
	dir, err := os.MkdirTemp("", "kvshim-uid-")
	assert.NilError(t, err)
	defer os.RemoveAll(dir)
	assert.NilError(t, os.Chmod(dir, 0o755))
	bin := filepath.Join(dir, "ipc.test")
	data, err := os.ReadFile(os.Args[0])
	assert.NilError(t, err)
	assert.NilError(t, os.WriteFile(bin, data, 0o755))
	sockDir := filepath.Join(dir, "s")
	ts := startServerPath(t, filepath.Join(sockDir, "kvshim.sock"), nil)
	assert.NilError(t, os.Chmod(sockDir, 0o777)) // let the other uid reach the socket
	assert.NilError(t, os.Chmod(ts.path, 0o666))
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = []string{childEnv + "=dial", "KVSHIM_SOCK=" + ts.path}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	assert.Assert(t, err != nil, "%s", out)
	assert.Assert(t, strings.Contains(string(out), "uid 65534") && strings.Contains(string(out), "permission"), "%s", out)
}
