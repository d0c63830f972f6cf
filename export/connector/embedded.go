package connector

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/kvshim/kvshim/ipc"
	"github.com/kvshim/kvshim/server"
	"github.com/kvshim/kvshim/trace"
)

// embedded servers by socket path, shared by the handles of one process and
// stopped when the last of them releases its reference.
var embedded struct {
	mu sync.Mutex
	m  map[string]*embeddedServer
}

type embeddedServer struct {
	srv     *server.Server
	trace   *trace.Writer         // nil: off
	metrics *server.MetricsServer // nil: off
	refs    int
}

// ServerConfig is the embedded server's configuration for socket: the
// server's defaults, overridden by the keys of c that are set.
func (c *Config) ServerConfig(socket string) server.Config {
	sc := server.DefaultConfig()
	sc.Socket = socket
	if c.L1SizeGB > 0 {
		sc.L1SizeGB = c.L1SizeGB
	}
	if c.L1PrefaultGB != nil {
		sc.L1PrefaultGB = *c.L1PrefaultGB
	}
	if c.HoldTTLS > 0 {
		sc.HoldTTL = time.Duration(c.HoldTTLS * float64(time.Second))
	}
	sc.L2Adapters = c.L2Adapters
	sc.MetricsPort = c.MetricsPort
	return sc
}

// AcquireEmbedded returns a reference to the embedded server listening on
// socket, starting it with c's settings when this process runs none there
// yet (a second handle's settings do not restart it). release drops the
// reference; the last one stops the server, its trace and its metrics
// listener. info is what /metrics reports as the build.
func AcquireEmbedded(socket string, c *Config, info server.BuildInfo) (release func() error, err error) {
	embedded.mu.Lock()
	defer embedded.mu.Unlock()
	if embedded.m == nil {
		embedded.m = map[string]*embeddedServer{}
	}
	e := embedded.m[socket]
	if e == nil {
		if e, err = startEmbedded(socket, c, info); err != nil {
			return nil, err
		}
		embedded.m[socket] = e
	}
	e.refs++
	var once sync.Once
	return func() (err error) {
		once.Do(func() {
			embedded.mu.Lock()
			defer embedded.mu.Unlock()
			if e.refs--; e.refs > 0 {
				return
			}
			delete(embedded.m, socket)
			err = errors.Join(e.metrics.Close(), e.srv.Close(), e.trace.Close())
		})
		return err
	}, nil
}

func startEmbedded(socket string, c *Config, info server.BuildInfo) (*embeddedServer, error) {
	sc := c.ServerConfig(socket)
	if err := ipc.EnsureSocketDir(filepath.Dir(socket)); err != nil {
		return nil, err
	}
	// vLLM's default --shutdown-timeout 0 SIGKILLs the engine core, so an
	// embedded server rarely removes its socket, and each run has a new
	// engine id: the dead ones go here (ours, nobody listening).
	ipc.RemoveDeadSockets(filepath.Dir(socket), "embedded-", ".sock", ipc.StaleSocketAge)
	srv, err := server.Start(sc, nil, server.Options{})
	if err != nil {
		return nil, fmt.Errorf("embedded server: %w", err)
	}
	e := &embeddedServer{srv: srv}
	if c.TraceDir != "" {
		if e.trace, err = trace.Open(c.TraceDir, trace.Options{Source: "server"}); err != nil {
			srv.Close()
			return nil, fmt.Errorf("kvshim.trace_dir: %w", err)
		}
		srv.Core.SetTrace(e.trace)
	}
	if sc.MetricsPort != 0 {
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(sc.MetricsPort)))
		if err != nil {
			srv.Close()
			e.trace.Close()
			return nil, fmt.Errorf("kvshim.metrics_port: %w", err)
		}
		e.metrics = srv.Core.ServeMetrics(ln, info)
	}
	return e, nil
}

// embeddedRefs is how many references the server on socket has (0: none
// runs); for tests.
func embeddedRefs(socket string) int {
	embedded.mu.Lock()
	defer embedded.mu.Unlock()
	if e := embedded.m[socket]; e != nil {
		return e.refs
	}
	return 0
}
