package ipc

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"gotest.tools/v3/assert"

	"github.com/kvshim/kvshim/internal/testkit"
)

func TestLogLimiter(t *testing.T) {
	var l logLimiter
	t0 := time.Unix(1000, 0)
	ok, n := l.allow(t0)
	assert.Assert(t, ok)
	assert.Equal(t, n, 0)
	for i := range 5 {
		ok, _ = l.allow(t0.Add(time.Duration(i) * time.Second))
		assert.Assert(t, !ok, "line %d passed inside the window", i)
	}
	ok, n = l.allow(t0.Add(warnEvery))
	assert.Assert(t, ok)
	assert.Equal(t, n, 5, "the next line reports the ones held back")
	ok, _ = l.allow(t0.Add(warnEvery + time.Second))
	assert.Assert(t, !ok)
	assert.Equal(t, l.flush(), 1)
	assert.Equal(t, l.flush(), 0)
}

// TestUnexpectedSocketMessagesRateLimited: a client that floods its socket
// with messages the server does not expect gets one WARN line for them
// (plus one summary when the session ends), not one per message, and its
// session keeps working.
func TestUnexpectedSocketMessagesRateLimited(t *testing.T) {
	var logs testkit.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	l, err := Listen(filepath.Join(t.TempDir(), "kvshim.sock"), &ServerConfig{Logger: log, SQCapacity: 1 << 16, CQCapacity: 1 << 16})
	assert.NilError(t, err)
	served := make(chan struct{})
	conns := make(chan *ServerConn, 1)
	go func() {
		defer close(served)
		c, err := l.Accept()
		if err != nil {
			return
		}
		conns <- c
		c.Serve(ServiceHandler(&testService{l: l, conn: c, mu: &sync.Mutex{}, next: new(uint64)}))
	}()
	t.Cleanup(func() { l.Close(); <-served })

	c, err := DialConfig(l.Path(), Hello{Role: RoleScheduler}, 5*time.Second, &ClientConfig{Logger: quietLog})
	assert.NilError(t, err)
	const flood = 500
	for range flood {
		assert.NilError(t, sendSock(c.uc, 99, []byte("junk"), -1))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	assert.NilError(t, c.Ping(ctx), "ignored messages must not end the session")
	// Let the server read them all before the session ends.
	sc := <-conns
	testkit.Eventually(t, 10*time.Second, "the server to read every stray message", func() bool {
		sc.strays.mu.Lock()
		defer sc.strays.mu.Unlock()
		return sc.strays.suppressed == flood-1
	})
	c.Close()
	testkit.Eventually(t, 10*time.Second, "the summary of the ignored messages in the log", func() bool {
		return strings.Contains(logs.String(), "ignored more unexpected socket messages")
	})
	out := logs.String()
	var warned, summary int
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.Contains(line, "ignoring unexpected socket message"):
			warned++
		case strings.Contains(line, "ignored more unexpected socket messages") && strings.HasSuffix(line, " suppressed=499"):
			summary++
		}
	}
	assert.Equal(t, warned, 1, "%s", out)
	assert.Equal(t, summary, 1, "%s", out)
}
