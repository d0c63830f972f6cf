package hostproc

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvshim/kvshim/server/l2"
)

// fakeProc is a supervised process whose death the test decides.
type fakeProc struct {
	id      int
	dead    error
	stopped atomic.Bool
}

func (p *fakeProc) Err() error { return p.dead }

func TestSupervisorGet(t *testing.T) {
	errSpawn := errors.New("spawn failed")
	sentinel := errors.New("helper")
	for _, tc := range []struct {
		name      string
		cur       *fakeProc // installed by Start; nil: none
		age       time.Duration
		every     time.Duration
		spawnErr  error
		closed    bool // Close before Get
		closeMid  bool // Close while Spawn runs
		wantID    int  // the process Get returns; 0: an error
		wantErrIs []error
		wantStop  bool // the old process was stopped
	}{
		{name: "alive", cur: &fakeProc{id: 1}, wantID: 1},
		{name: "closed", cur: &fakeProc{id: 1}, closed: true, wantErrIs: []error{l2.ErrClosed}},
		{name: "dead, too soon: its cause", cur: &fakeProc{id: 1, dead: errors.New("exited 2")},
			every: time.Hour, wantErrIs: []error{}},
		{name: "none, too soon: not running", every: time.Hour,
			wantErrIs: []error{l2.ErrUnavailable, ErrNotRunning, sentinel}},
		{name: "dead: restarted", cur: &fakeProc{id: 1, dead: errors.New("exited 2")}, wantID: 2, wantStop: true},
		{name: "restart fails", cur: &fakeProc{id: 1, dead: errors.New("exited 2")}, spawnErr: errSpawn,
			wantErrIs: []error{l2.ErrUnavailable, errSpawn}},
		{name: "closed during restart", cur: &fakeProc{id: 1, dead: errors.New("exited 2")}, closeMid: true,
			wantErrIs: []error{l2.ErrClosed}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var spawned *fakeProc
			var restarts int
			s := &Supervisor[*fakeProc]{Name: "fake", Sentinel: sentinel, Every: tc.every,
				OnRestart: func(error) { restarts++ },
				Stop:      func(p *fakeProc) { p.stopped.Store(true) }}
			s.Spawn = func() (*fakeProc, error) {
				if tc.closeMid {
					s.Close()
				}
				if tc.spawnErr != nil {
					return nil, tc.spawnErr
				}
				spawned = &fakeProc{id: 2}
				return spawned, nil
			}
			s.Start(tc.cur)
			if tc.closed {
				s.Close()
			}
			p, err := s.Get()
			if tc.wantID != 0 {
				if err != nil || p == nil || p.id != tc.wantID {
					t.Fatalf("Get = %v, %v; want process %d", p, err, tc.wantID)
				}
				if s.Current() != p {
					t.Fatalf("Current = %v after Get returned %v", s.Current(), p)
				}
			} else {
				if err == nil {
					t.Fatalf("Get = %v, nil; want an error", p)
				}
				for _, want := range tc.wantErrIs {
					if !errors.Is(err, want) {
						t.Fatalf("Get error %q does not wrap %q", err, want)
					}
				}
				if tc.cur != nil && tc.cur.dead != nil && !tc.closeMid && tc.spawnErr == nil && err != tc.cur.dead {
					t.Fatalf("Get error %q; want the death's cause %q", err, tc.cur.dead)
				}
			}
			if tc.cur != nil && tc.cur.stopped.Load() != tc.wantStop {
				t.Fatalf("old process stopped = %v; want %v", tc.cur.stopped.Load(), tc.wantStop)
			}
			if tc.closeMid && (spawned == nil || !spawned.stopped.Load()) {
				t.Fatalf("the process spawned while closing was not stopped")
			}
			wantRestarts := int64(0)
			if tc.wantID == 2 {
				wantRestarts = 1
			}
			if s.Restarts() != wantRestarts {
				t.Fatalf("Restarts = %d; want %d", s.Restarts(), wantRestarts)
			}
		})
	}
}

// A restart waits Every after the previous one: a second death inside it
// fails fast, with no second spawn.
func TestSupervisorRestartsAtMostOncePerEvery(t *testing.T) {
	spawns := 0
	s := &Supervisor[*fakeProc]{Name: "fake", Every: time.Hour, Stop: func(*fakeProc) {},
		Spawn: func() (*fakeProc, error) { spawns++; return &fakeProc{id: 10 + spawns}, nil }}
	s.Start(&fakeProc{id: 1})
	s.last = time.Now().Add(-2 * time.Hour) // the first process is old
	s.Current().dead = errors.New("first death")
	p, err := s.Get()
	if err != nil || p.id != 11 {
		t.Fatalf("Get = %v, %v; want the restarted process 11", p, err)
	}
	p.dead = errors.New("second death")
	if _, err := s.Get(); err == nil || err.Error() != "second death" || spawns != 1 {
		t.Fatalf("Get = %v after %d spawns; want the second death's cause and one spawn", err, spawns)
	}
}

func TestCalls(t *testing.T) {
	var c Calls[string]
	a, err := c.Add(1)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := c.Add(2)
	d, _ := c.Add(3)
	c.Drop(3)
	c.Deliver(1, "one")
	c.Deliver(99, "nobody waits") // dropped, no panic
	if got := <-a; got != "one" {
		t.Fatalf("reply %q; want one", got)
	}
	cause := errors.New("exited")
	c.Fail(cause, func(id uint64) string { return "dead" })
	select {
	case got := <-b:
		if got != "dead" {
			t.Fatalf("reply %q; want dead", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Fail did not answer a waiter")
	}
	select {
	case got := <-d:
		t.Fatalf("a dropped id got %q", got)
	default:
	}
	if _, err := c.Add(4); err != cause || c.Err() != cause {
		t.Fatalf("Add after Fail = %v, Err = %v; want %v", err, c.Err(), cause)
	}
}

func TestPages(t *testing.T) {
	const page = 4
	for _, tc := range []struct {
		name  string
		pages int
		steps []string // "a N" alloc N bytes (want the offset after =), "f OFF N" free, "full N", "big N"
	}{
		{name: "first fit, page aligned", pages: 4, steps: []string{"a 1=0", "a 5=4", "a 4=12", "full 1"}},
		{name: "freed run reused", pages: 3, steps: []string{"a 4=0", "a 4=4", "a 4=8", "f 4 4", "a 3=4", "full 1"}},
		{name: "a run, not the sum", pages: 3, steps: []string{"a 4=0", "a 4=4", "a 4=8", "f 0 4", "f 8 4", "full 8", "a 4=0"}},
		{name: "zero bytes take a page", pages: 1, steps: []string{"a 0=0", "full 0"}},
		{name: "larger than the area", pages: 2, steps: []string{"big 9"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := NewPages(make([]byte, tc.pages*page), page)
			ctx := context.Background()
			for _, st := range tc.steps {
				var n, off, want int
				switch {
				case strings.HasPrefix(st, "a "):
					mustScan(t, st, "a %d=%d", &n, &want)
					got, err := p.Alloc(ctx, n, false)
					if err != nil || got != want {
						t.Fatalf("%s: Alloc = %d, %v", st, got, err)
					}
				case strings.HasPrefix(st, "f "):
					mustScan(t, st, "f %d %d", &off, &n)
					p.Free(off, n)
				case strings.HasPrefix(st, "full "):
					mustScan(t, st, "full %d", &n)
					if _, err := p.Alloc(ctx, n, false); !errors.Is(err, ErrFull) {
						t.Fatalf("%s: Alloc error %v; want ErrFull", st, err)
					}
				case strings.HasPrefix(st, "big "):
					mustScan(t, st, "big %d", &n)
					if _, err := p.Alloc(ctx, n, true); !errors.Is(err, ErrTooLarge) {
						t.Fatalf("%s: Alloc error %v; want ErrTooLarge", st, err)
					}
				}
			}
		})
	}
}

func mustScan(t *testing.T, s, format string, args ...any) {
	t.Helper()
	if _, err := fmt.Sscanf(s, format, args...); err != nil {
		t.Fatalf("step %q: %v", s, err)
	}
}

// A waiting Alloc is woken by a Free, and gives up with its context.
func TestPagesWait(t *testing.T) {
	p := NewPages(make([]byte, 8), 8)
	off, _ := p.Alloc(context.Background(), 8, false)
	got := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), 8, true)
		got <- err
	}()
	time.Sleep(10 * time.Millisecond) // usually parked by now; the test holds either way
	p.Free(off, 8)
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("woken Alloc: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Free did not wake a waiting Alloc")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := p.Alloc(ctx, 8, true); !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrFull) {
		t.Fatalf("Alloc past its deadline: %v; want DeadlineExceeded (not ErrFull: callers retry on that)", err)
	}
}

func TestTail(t *testing.T) {
	for _, tc := range []struct {
		name, write, want string
		max               int
	}{
		{name: "nothing written", max: 8, want: ""},
		{name: "kept whole", write: "abc", max: 8, want: "; host stderr: abc"},
		{name: "last bytes kept", write: "0123456789", max: 4, want: "; host stderr: 6789"},
		{name: "message bounded", write: strings.Repeat("x", 700) + "end", max: 1 << 10,
			want: "; host stderr: " + strings.Repeat("x", 597) + "end"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tl := &Tail{Max: tc.max, Label: "host stderr"}
			for i := range len(tc.write) { // byte by byte: trimming holds across writes
				_, _ = tl.Write([]byte{tc.write[i]})
			}
			if got := tl.Suffix(); got != tc.want {
				t.Fatalf("Suffix = %q; want %q", got, tc.want)
			}
		})
	}
}

// Stop asks by closing stdin; a child that ignores it is killed.
func TestChildStop(t *testing.T) {
	for _, tc := range []struct {
		name, script string
		wantKilled   bool
	}{
		{name: "exits at EOF", script: "cat >/dev/null"},
		{name: "ignores EOF", script: "trap '' TERM; cat >/dev/null; sleep 60", wantKilled: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command("sh", "-c", tc.script)
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			c := Watch(cmd, stdin)
			c.Stop(500 * time.Millisecond)
			select {
			case <-c.Exited:
			default:
				t.Fatal("Stop returned with the child running")
			}
			killed := strings.Contains(cmd.ProcessState.String(), "killed")
			if killed != tc.wantKilled {
				t.Fatalf("exit %q; killed = %v, want %v", cmd.ProcessState, killed, tc.wantKilled)
			}
		})
	}
}
