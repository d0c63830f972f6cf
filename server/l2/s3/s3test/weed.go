// Package s3test starts a real S3 server for the s3 adapter's tests:
// SeaweedFS's `weed server -s3` (master, volume, filer and S3 gateway in one
// process) on loopback ports, with its data in a test directory and no
// identities configured (anonymous access).
//
// The binary is $KVSHIM_WEED, or the one build/seaweedfs.sh has built
// (build/seaweedfs.sh --cached); without either the tests skip. make test
// (build/test.sh part go) builds it first and sets KVSHIM_WEED.
package s3test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// WeedEnv names the weed binary.
const WeedEnv = "KVSHIM_WEED"

// ErrNoWeed: no weed binary; tests skip with it.
var ErrNoWeed = errors.New("s3test: no SeaweedFS weed binary")

// Binary locates weed.
func Binary() (string, error) {
	if p := os.Getenv(WeedEnv); p != "" {
		return p, nil
	}
	_, file, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(file), "..", "..", "..", "..", "build", "seaweedfs.sh")
	out, err := exec.Command(script, "--cached").Output()
	if err != nil {
		return "", fmt.Errorf("%w: set %s or run build/seaweedfs.sh (builds it once, ~16 min on 2 cores)", ErrNoWeed, WeedEnv)
	}
	return strings.TrimSpace(string(out)), nil
}

// Weed is a running SeaweedFS server.
type Weed struct {
	bin, dir string
	ports    []int
	Endpoint string // http://127.0.0.1:PORT, the S3 gateway

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	log  *os.File
}

// freePorts returns n distinct free loopback ports below 50000 (weed
// derives nothing from them since every port is given, but keeps them
// clear of the ephemeral range's top).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for tries := 0; len(ports) < n && tries < 1000; tries++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		if p := l.Addr().(*net.TCPAddr).Port; p < 50000 {
			ports = append(ports, p)
		}
	}
	if len(ports) < n {
		return nil, errors.New("s3test: no free ports")
	}
	return ports, nil
}

// Start starts weed with its data in dir and waits (at most 90 s) until it
// is ready for writes (see ready).
func Start(dir string) (*Weed, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	ports, err := freePorts(9)
	if err != nil {
		return nil, err
	}
	w := &Weed{bin: bin, dir: dir, ports: ports, Endpoint: "http://127.0.0.1:" + strconv.Itoa(ports[0])}
	if err := w.Restart(); err != nil {
		return nil, err
	}
	return w, nil
}

// Restart starts weed again on the same ports and data (after Kill).
func (w *Weed) Restart() error {
	data := filepath.Join(w.dir, "data")
	if err := os.MkdirAll(data, 0o700); err != nil {
		return err
	}
	log, err := os.OpenFile(filepath.Join(w.dir, "weed.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	p := func(i int) string { return strconv.Itoa(w.ports[i]) }
	cmd := exec.Command(w.bin, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-dir="+data,
		"-s3", "-s3.port="+p(0), "-s3.port.grpc="+p(1), "-s3.port.iceberg=0", "-s3.port.lance=0",
		"-master.port="+p(2), "-master.port.grpc="+p(3), "-volume.port="+p(4), "-volume.port.grpc="+p(5),
		"-filer.port="+p(6), "-filer.port.grpc="+p(7), "-filer.localSocket="+filepath.Join(w.dir, "filer.sock"),
		"-master.volumeSizeLimitMB=256", "-volume.max=64", "-volume.preStopSeconds=0")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("s3test: start %s: %w", w.bin, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	w.mu.Lock()
	w.cmd, w.done, w.log = cmd, done, log
	w.mu.Unlock()
	deadline := time.Now().Add(90 * time.Second)
	client := &http.Client{Timeout: 2 * time.Second}
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return fmt.Errorf("s3test: weed exited: %s", w.Tail())
		default:
		}
		if w.ready(client) {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	w.Kill()
	return fmt.Errorf("s3test: weed not ready for writes in 90 s (gateway up, a file id assigned): %s", w.Tail())
}

// ready: the S3 gateway answers an anonymous ListBuckets, and the master
// can assign a file id. The gateway answers 200 seconds before a volume
// server has registered and grown a writable volume; a PUT in that window
// fails with InternalError (seen on a loaded 2-core CI machine, where it
// failed TestS3ServerKilled's first store). The probe grows the default
// collection's volumes (7 here), and every bucket is a collection of its
// own: hence -volume.max=64, room for the tests' buckets.
func (w *Weed) ready(client *http.Client) bool {
	resp, err := client.Get(w.Endpoint + "/")
	if err != nil {
		return false
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return false
	}
	resp, err = client.Get("http://127.0.0.1:" + strconv.Itoa(w.ports[2]) + "/dir/assign")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var a struct {
		Fid string `json:"fid"`
	}
	return resp.StatusCode == http.StatusOK && json.NewDecoder(resp.Body).Decode(&a) == nil && a.Fid != ""
}

// Kill stops weed at once (SIGKILL) and waits for it.
func (w *Weed) Kill() {
	w.mu.Lock()
	cmd, done, log := w.cmd, w.done, w.log
	w.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
	}
	log.Close()
}

// Tail is the end of weed's log.
func (w *Weed) Tail() string {
	b, _ := os.ReadFile(filepath.Join(w.dir, "weed.log"))
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}
