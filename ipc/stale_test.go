package ipc

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"gotest.tools/v3/assert"
)

// deadSocket leaves a socket file nobody listens on at path, as a SIGKILLed
// server does, dated age ago.
func deadSocket(t *testing.T, path string, age time.Duration) {
	t.Helper()
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	assert.NilError(t, err)
	ln.SetUnlinkOnClose(false)
	assert.NilError(t, ln.Close())
	old := time.Now().Add(-age)
	assert.NilError(t, os.Chtimes(path, old, old))
}

func TestRemoveDeadSockets(t *testing.T) {
	dir := t.TempDir()
	p := func(n string) string { return filepath.Join(dir, n) }

	live, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: p("embedded-live.sock"), Net: "unixpacket"})
	assert.NilError(t, err)
	defer live.Close()
	old := time.Now().Add(-time.Hour)
	assert.NilError(t, os.Chtimes(p("embedded-live.sock"), old, old))

	deadSocket(t, p("embedded-dead.sock"), time.Hour)
	deadSocket(t, p("embedded-young.sock"), 0) // may be a server between bind and listen
	deadSocket(t, p("kvshim.sock"), time.Hour) // not an embedded server's name
	// Another uid's dead socket: only root can make one (chown).
	otherUID := os.Getuid() == 0
	if otherUID {
		deadSocket(t, p("embedded-other.sock"), time.Hour)
		assert.NilError(t, os.Lchown(p("embedded-other.sock"), 65534, 65534))
	} else {
		t.Log("not root: the other uid's socket is not tested")
	}
	assert.NilError(t, os.WriteFile(p("embedded-file.sock"), []byte("not a socket"), 0o600))
	old2 := time.Now().Add(-time.Hour)
	assert.NilError(t, os.Chtimes(p("embedded-file.sock"), old2, old2))
	assert.NilError(t, os.Symlink(p("embedded-dead.sock"), p("embedded-link.sock")))

	removed := RemoveDeadSockets(dir, "embedded-", ".sock", StaleSocketAge)
	assert.DeepEqual(t, removed, []string{p("embedded-dead.sock")})

	tests := []struct {
		name string
		kept bool
	}{
		{"embedded-dead.sock", false},
		{"embedded-live.sock", true},
		{"embedded-young.sock", true},
		{"kvshim.sock", true},
		{"embedded-file.sock", true},
		{"embedded-link.sock", true},
		{"embedded-other.sock", true},
	}
	for _, tc := range tests {
		if tc.name == "embedded-other.sock" && !otherUID {
			continue
		}
		_, err := os.Lstat(p(tc.name))
		assert.Equal(t, err == nil, tc.kept, "%s", tc.name)
	}
	// The live server still answers.
	c, err := net.Dial("unixpacket", p("embedded-live.sock"))
	assert.NilError(t, err)
	c.Close()
	// A missing directory is no error: nothing to clean.
	assert.Assert(t, RemoveDeadSockets(filepath.Join(dir, "missing"), "embedded-", ".sock", 0) == nil)
}
