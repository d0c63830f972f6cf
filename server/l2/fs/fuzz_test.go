package fs_test

import (
	"context"
	"encoding/binary"
	"hash/crc32"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvshim/kvshim/kv"
	"github.com/kvshim/kvshim/server/l2"
	"github.com/kvshim/kvshim/server/l2/fs"
	"github.com/kvshim/kvshim/server/l2/l2test"
)

// FuzzLoad: whatever bytes sit in an object file, a load never panics and
// reports StatusOK only for a well-formed file whose payload it returns.
func FuzzLoad(f *testing.F) {
	valid := func(p []byte) []byte {
		var tr [16]byte
		binary.LittleEndian.PutUint32(tr[0:], 0x324c564b)
		binary.LittleEndian.PutUint32(tr[4:], crc32.Checksum(p, crc32.MakeTable(crc32.Castagnoli)))
		binary.LittleEndian.PutUint64(tr[8:], uint64(len(p)))
		return append(append([]byte(nil), p...), tr[:]...)
	}
	f.Add(valid([]byte("hello")), 5)
	f.Add(valid(nil), 0)
	f.Add([]byte("short"), 5)
	f.Add(valid([]byte("hello"))[:10], 5)
	b, err := fs.Open(fs.Config{BasePath: f.TempDir()})
	if err != nil {
		f.Fatal(err)
	}
	cfg, err := l2.ParseAdapterConfig(`{"type":"fs","num_workers":1}`)
	if err != nil {
		f.Fatal(err)
	}
	a, err := l2.NewAdapter(b, cfg, nil, nil)
	if err != nil {
		f.Fatal(err)
	}
	k := l2test.Key(1)
	f.Fuzz(func(t *testing.T, file []byte, n int) {
		if n < 0 || n > 1<<16 {
			return
		}
		p := b.Path(k)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, file, 0o644); err != nil {
			t.Fatal(err)
		}
		dst := make([]byte, n)
		res, err := a.Load(context.Background(), []kv.Key{k}, [][]byte{dst}).Wait(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res[0].Status != l2.StatusOK {
			return
		}
		want := valid(dst)
		if string(want) != string(file) {
			t.Fatalf("served a load from a malformed file (%d bytes)", len(file))
		}
	})
}
