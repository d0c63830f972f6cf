package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/kvshim/kvshim/ipc"
)

// snapshot is one STATS answer: the server's numbers by name, exactly as
// the metrics export them (on the wire labelled ones are named
// "name{key=value,key2=value2}", e.g. "kvshim_l1_objects{state=resident}").
// `kvshim stat --json` prints it with the labels as fields (printJSON).
type snapshot struct {
	Socket string
	Server string // server instance id
	Stats  map[string]float64
	order  []string // names in the server's order
}

// fetchStats connects to socket as a tool client and asks for STATS; the
// whole exchange ends within timeout.
func fetchStats(socket string, timeout time.Duration) (*snapshot, error) {
	deadline := time.Now().Add(timeout)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	c, err := ipc.DialConfig(socket, ipc.Hello{Role: ipc.RoleTool}, timeout,
		&ipc.ClientConfig{CallTimeout: timeout, Logger: quiet})
	if err != nil {
		return nil, explainDial(socket, timeout, err)
	}
	defer c.Close()
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	resp, err := c.Stats(ctx)
	if err != nil {
		if errors.Is(err, ipc.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("the server at %s did not answer STATS within %v", socket, timeout)
		}
		return nil, fmt.Errorf("STATS from %s failed: %w", socket, err)
	}
	s := &snapshot{Socket: socket, Server: c.Server().String(), Stats: make(map[string]float64, len(resp.Stats))}
	for _, st := range resp.Stats {
		if _, dup := s.Stats[st.Name]; !dup {
			s.order = append(s.order, st.Name)
		}
		s.Stats[st.Name] = st.Value
	}
	return s, nil
}

// explainDial turns a dial failure into a sentence for the operator.
func explainDial(socket string, timeout time.Duration, err error) error {
	switch {
	case errors.Is(err, syscall.ENOTSOCK):
		return fmt.Errorf("%s is not a socket: pass the socket of a 'kvshim serve' (--socket)", socket)
	case errors.Is(err, syscall.ENOENT):
		return fmt.Errorf("no kvshim server at %s (no socket file; start one with 'kvshim serve')", socket)
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("no kvshim server at %s (stale socket: nothing is listening)", socket)
	case errors.Is(err, ipc.ErrTimeout):
		return fmt.Errorf("the server at %s did not answer within %v", socket, timeout)
	}
	return fmt.Errorf("cannot connect to %s: %w", socket, err)
}

func runStat(args []string, _ Info, stdout, stderr io.Writer) int {
	fs := newFlagSet("stat", "Print a running server's numbers (the same ones its metrics export).")
	socket := fs.String("socket", ipc.DefaultSocketPath(), "Unix socket of the server")
	asJSON := fs.Bool("json", false, "print one JSON object: {socket, server, metrics: [{name, labels: {key: value}, value}]}")
	timeout := fs.Duration("timeout", 2*time.Second, "give up when the server has not answered within this `duration`")
	if code, ok := fs.parse(args, stdout, stderr); !ok {
		return code
	}
	switch {
	case *timeout <= 0:
		fmt.Fprintf(stderr, "kvshim stat: --timeout must be > 0, got %v\n", *timeout)
		return 2
	case *socket == "":
		fmt.Fprintln(stderr, "kvshim stat: --socket must not be empty")
		return 2
	}
	snap, err := fetchStats(*socket, *timeout)
	if err != nil {
		fmt.Fprintf(stderr, "kvshim stat: %v\n", err)
		return 1
	}
	if *asJSON {
		return printJSON(stdout, snap)
	}
	printSnapshot(stdout, snap)
	return 0
}

// jsonMetric is one number of `kvshim stat --json`, as the Prometheus
// exposition names it: jq '.metrics[] | select(.name == "kvshim_l1_objects"
// and .labels.state == "resident") | .value'.
type jsonMetric struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels"`
	Value  *float64          `json:"value"` // null for NaN and ±Inf
}

// printJSON prints s as one line: {"socket", "server", "metrics": [...]},
// the metrics in the server's order, labels always an object ({} when
// none).
func printJSON(w io.Writer, s *snapshot) int {
	out := struct {
		Socket  string       `json:"socket"`
		Server  string       `json:"server"`
		Metrics []jsonMetric `json:"metrics"`
	}{s.Socket, s.Server, make([]jsonMetric, 0, len(s.order))}
	for _, n := range s.order {
		name, labels := splitStatName(n)
		m := jsonMetric{Name: name, Labels: map[string]string{}}
		for _, l := range labels {
			m.Labels[l[0]] = l[1]
		}
		// encoding/json refuses NaN and ±Inf; none is expected, but one
		// odd number must not hide the others.
		if v := s.Stats[n]; !math.IsNaN(v) && !math.IsInf(v, 0) {
			m.Value = &v
		}
		out.Metrics = append(out.Metrics, m)
	}
	if err := json.NewEncoder(w).Encode(out); err != nil {
		return 1
	}
	return 0
}

// labelStart finds where a label "key=" begins after a comma, so that a
// comma inside a value (an adapter's name) does not split it.
var labelStart = regexp.MustCompile(`,[a-zA-Z_][a-zA-Z0-9_]*=`)

// splitStatName splits a STATS name, "name{k=v,k2=v2}", into the metric
// name and its labels in order.
func splitStatName(n string) (name string, labels [][2]string) {
	i := strings.IndexByte(n, '{')
	if i < 0 || !strings.HasSuffix(n, "}") {
		return n, nil
	}
	name, body := n[:i], n[i+1:len(n)-1]
	var parts []string
	for {
		loc := labelStart.FindStringIndex(body)
		if loc == nil {
			parts = append(parts, body)
			break
		}
		parts = append(parts, body[:loc[0]])
		body = body[loc[0]+1:]
	}
	for _, p := range parts {
		k, v, _ := strings.Cut(p, "=")
		labels = append(labels, [2]string{k, v})
	}
	return name, labels
}

func init() {
	commands["stat"] = command{"print a running server's L1, object, hold, lookup and session numbers", runStat}
}
