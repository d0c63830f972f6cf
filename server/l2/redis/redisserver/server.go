// Package redisserver starts a throwaway redis-server on loopback for tests
// and benchmarks (no persistence, random port, killed on Stop).
package redisserver

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrNoBinary is returned when redis-server is not on PATH.
var ErrNoBinary = errors.New("redis-server not found on PATH (Debian: apt-get install -y redis-server)")

// Server is one redis-server process.
type Server struct {
	Addr string
	Port int
	cmd  *exec.Cmd
	done chan struct{}
}

// Binary returns the redis-server path or ErrNoBinary.
func Binary() (string, error) {
	p, err := exec.LookPath("redis-server")
	if err != nil {
		return "", ErrNoBinary
	}
	return p, nil
}

// Start runs redis-server on 127.0.0.1 with a free port, working directory
// dir, plus extra arguments (e.g. "--cluster-enabled", "yes"), and waits
// (up to 10 s) until it answers PING.
func Start(dir string, extra ...string) (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		args := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", dir,
			"--logfile", filepath.Join(dir, fmt.Sprintf("redis-%d.log", port))}, extra...)
		cmd := exec.Command(bin, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("redisserver: start: %w", err)
		}
		s := &Server{Addr: fmt.Sprintf("127.0.0.1:%d", port), Port: port, cmd: cmd, done: make(chan struct{})}
		go func() { _ = cmd.Wait(); close(s.done) }()
		if err := s.waitReady(10 * time.Second); err == nil {
			return s, nil
		}
		s.Kill()
	}
	return nil, errors.New("redisserver: redis-server did not become ready")
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (s *Server) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case <-s.done:
			return errors.New("exited")
		default:
		}
		if reply, err := s.Command("PING"); err == nil && reply == "+PONG" {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return errors.New("timeout")
}

// Command sends one inline command and returns the first reply line.
func (s *Server) Command(args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", s.Addr, time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(b.String())); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimRight(line, "\r\n"), err
}

// Pause stops the process (SIGSTOP): connections stay open, nothing answers.
// It returns once every thread has stopped: kill(2) returns before a
// thread running on another core takes the signal, and in that window the
// server still answers.
func (s *Server) Pause() {
	_ = s.cmd.Process.Signal(syscall.SIGSTOP)
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && !stopped(s.cmd.Process.Pid); {
		time.Sleep(500 * time.Microsecond)
	}
}

// stopped says whether every thread of process pid is stopped (state T or
// t in /proc; a thread that exited meanwhile counts as stopped).
func stopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false
	}
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, t.Name()))
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) || (b[i+2] != 'T' && b[i+2] != 't') {
			return false
		}
	}
	return true
}

// Kill kills the process (SIGKILL) and waits for it (bounded).
func (s *Server) Kill() {
	_ = s.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
	}
}

// Pid is the process id.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

// Cluster starts n cluster-enabled servers and joins them into one cluster
// of n masters with redis-cli (waits up to 20 s for the cluster to be ok).
func Cluster(dir string, n int) ([]*Server, error) {
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, errors.New("redis-cli not found on PATH (Debian: apt-get install -y redis-tools)")
	}
	var srvs []*Server
	fail := func(err error) ([]*Server, error) {
		for _, s := range srvs {
			s.Kill()
		}
		return nil, err
	}
	var addrs []string
	for i := 0; i < n; i++ {
		d := filepath.Join(dir, strconv.Itoa(i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fail(err)
		}
		s, err := Start(d, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "2000")
		if err != nil {
			return fail(err)
		}
		srvs = append(srvs, s)
		addrs = append(addrs, s.Addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	out, err := exec.Command(cli, args...).CombinedOutput()
	if err != nil {
		return fail(fmt.Errorf("redis-cli --cluster create: %v: %s", err, out))
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok := true
		for _, s := range srvs {
			info, err := exec.Command(cli, "-p", strconv.Itoa(s.Port), "cluster", "info").Output()
			if err != nil || !strings.Contains(string(info), "cluster_state:ok") {
				ok = false
				break
			}
		}
		if ok {
			return srvs, nil
		}
		if time.Now().After(deadline) {
			return fail(errors.New("cluster did not reach cluster_state:ok"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}
