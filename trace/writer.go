package trace

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/ipc"
	"github.com/apache/arrow/go/v17/arrow/memory"
	"golang.org/x/sys/unix"
)

// Options configure a Writer. Zero values take the defaults.
type Options struct {
	Source    string        // "server", "worker", ...: in every record and file name
	MaxBytes  int64         // rotate a kind's file once it holds this many bytes (default 64 MiB)
	MaxAge    time.Duration // rotate a kind's file once it is this old (default 5 min)
	Buffer    int           // records queued before Emit drops (default 16384)
	BatchRows int           // rows per record batch (default 4096)
	Flush     time.Duration // a partial batch is written after this long (default 1 s)
}

// Suffix is the file name suffix of a closed trace file; a file still
// being written ends in Suffix+".part" (it has no Arrow footer yet).
const Suffix = ".arrow"

// Writer writes records to Arrow IPC files in a directory, one file series
// per kind, rotated by size and age. Emit never blocks: when the queue is
// full the record is dropped and counted. A nil *Writer is off (every
// method is a no-op), so callers hold one and call it unconditionally.
type Writer struct {
	dir  string
	opt  Options
	pid  int32
	q    chan Record
	stop chan struct{}
	done chan struct{}
	once sync.Once

	written, dropped atomic.Uint64
	files            atomic.Uint64 // files closed
	mu               sync.Mutex    // errs
	errs             []error
}

// Open creates dir if needed and starts a writer into it.
func Open(dir string, opt Options) (*Writer, error) {
	if dir == "" {
		return nil, errors.New("trace: no directory")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	if opt.Source == "" {
		opt.Source = "kvshim"
	}
	opt.Source = strings.NewReplacer("/", "_", "-", "_").Replace(opt.Source)
	if opt.MaxBytes <= 0 {
		opt.MaxBytes = 64 << 20
	}
	if opt.MaxAge <= 0 {
		opt.MaxAge = 5 * time.Minute
	}
	if opt.Buffer <= 0 {
		opt.Buffer = 16384
	}
	if opt.BatchRows <= 0 {
		opt.BatchRows = 4096
	}
	if opt.Flush <= 0 {
		opt.Flush = time.Second
	}
	w := &Writer{dir: dir, opt: opt, pid: int32(os.Getpid()), q: make(chan Record, opt.Buffer),
		stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	return w, nil
}

// On reports whether w writes anything.
func (w *Writer) On() bool { return w != nil }

// Mono is the host-wide monotonic clock (CLOCK_MONOTONIC) in ns.
func Mono() int64 {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return time.Now().UnixNano()
	}
	return ts.Nano()
}

// Emit queues r; it never blocks. A full queue drops r (counted).
func (w *Writer) Emit(r Record) {
	if w == nil {
		return
	}
	if r.Mono == 0 {
		r.Mono = Mono()
	}
	if r.Wall == 0 {
		r.Wall = time.Now().UnixNano()
	}
	select {
	case w.q <- r:
	default:
		w.dropped.Add(1)
	}
}

// Stats are a writer's counters.
type Stats struct{ Written, Dropped, Files uint64 }

// Stats returns the records written and dropped so far and the files closed.
func (w *Writer) Stats() Stats {
	if w == nil {
		return Stats{}
	}
	return Stats{w.written.Load(), w.dropped.Load(), w.files.Load()}
}

// Close writes what is queued, closes the files and returns the first
// write error (the writer keeps going after one, dropping that batch).
func (w *Writer) Close() error {
	if w == nil {
		return nil
	}
	w.once.Do(func() { close(w.stop) })
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	return errors.Join(w.errs...)
}

func (w *Writer) fail(err error) {
	w.mu.Lock()
	if len(w.errs) == 0 {
		slog.Warn("kvshim: trace write failed", "dir", w.dir, "err", err)
	}
	if len(w.errs) < 8 {
		w.errs = append(w.errs, err)
	}
	w.mu.Unlock()
}

// series is the open file and pending batch of one kind.
type series struct {
	kind   Kind
	cols   []column
	b      *array.RecordBuilder
	rows   int
	f      *os.File
	fw     *ipc.FileWriter
	path   string
	opened time.Time
}

func (w *Writer) run() {
	defer close(w.done)
	mem := memory.NewGoAllocator()
	var ss [NumKinds]*series
	for k := range NumKinds {
		ss[k] = &series{kind: k, cols: columnsOf(k), b: array.NewRecordBuilder(mem, Schema(k))}
	}
	tick := time.NewTicker(w.opt.Flush)
	defer tick.Stop()
	var added uint64
	add := func(r *Record) {
		added++
		r.Source, r.PID = w.opt.Source, w.pid
		s := ss[r.Kind%NumKinds]
		for i, c := range s.cols {
			c.append(s.b.Field(i), r)
		}
		s.rows++
		if s.rows >= w.opt.BatchRows {
			w.flush(s)
		}
	}
	flushAll := func(closing bool) {
		for _, s := range ss {
			w.flush(s)
			if s.fw != nil && (closing || time.Since(s.opened) >= w.opt.MaxAge) {
				w.closeFile(s)
			}
		}
	}
	for {
		select {
		case r := <-w.q:
			add(&r)
		case <-tick.C:
			flushAll(false)
		case <-w.stop:
			for {
				select {
				case r := <-w.q:
					add(&r)
					continue
				default:
				}
				break
			}
			if added > 0 || w.dropped.Load() > 0 {
				r := Record{Kind: KindWriter, Event: "close", Rank: -1, Written: added, Dropped: w.dropped.Load()}
				r.Mono, r.Wall = Mono(), time.Now().UnixNano()
				add(&r)
			}
			flushAll(true)
			for _, s := range ss {
				s.b.Release()
			}
			return
		}
	}
}

// flush writes s's pending rows as one record batch, opening a file if
// none is open and rotating it once it is past MaxBytes.
func (w *Writer) flush(s *series) {
	if s.rows == 0 {
		return
	}
	rec := s.b.NewRecord()
	defer rec.Release()
	n := s.rows
	s.rows = 0
	if s.fw == nil {
		if err := w.openFile(s); err != nil {
			w.fail(err)
			w.dropped.Add(uint64(n))
			return
		}
	}
	if err := s.fw.Write(rec); err != nil {
		w.fail(fmt.Errorf("trace: %s: %w", s.path, err))
		w.dropped.Add(uint64(n))
		return
	}
	w.written.Add(uint64(n))
	if fi, err := s.f.Stat(); err == nil && fi.Size() >= w.opt.MaxBytes {
		w.closeFile(s)
	}
}

// fileSeq numbers the files of every Writer of the process: two writers
// of one source in one directory (a server restarted in the same process)
// opened in the same second would otherwise pick the same name, and the
// second would truncate the first's .part file and steal its rename.
var fileSeq atomic.Int64

func (w *Writer) openFile(s *series) error {
	now := time.Now()
	name := fmt.Sprintf("%s-%d-%s-%s-%04d%s", w.opt.Source, w.pid, s.kind, now.UTC().Format("20060102T150405"), fileSeq.Add(1), Suffix)
	s.path = filepath.Join(w.dir, name)
	// O_EXCL: never truncate a file another writer is still writing
	f, err := os.OpenFile(s.path+".part", os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o666)
	if err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	fw, err := ipc.NewFileWriter(f, ipc.WithSchema(Schema(s.kind)))
	if err != nil {
		f.Close()
		os.Remove(f.Name())
		return fmt.Errorf("trace: %w", err)
	}
	s.f, s.fw, s.opened = f, fw, now
	return nil
}

// closeFile writes the footer and renames the file to its final name.
func (w *Writer) closeFile(s *series) {
	err := s.fw.Close()
	if cerr := s.f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(s.path+".part", s.path)
	}
	if err != nil {
		w.fail(fmt.Errorf("trace: %s: %w", s.path, err))
	} else {
		w.files.Add(1)
	}
	s.f, s.fw = nil, nil
}
