package ipc

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// StaleSocketAge is how old a socket file must be before RemoveDeadSockets
// may remove it: a server that has bound its socket but not yet called
// listen(2) also refuses connections, for microseconds; a file this old is
// past that window by far.
const StaleSocketAge = 5 * time.Second

// RemoveDeadSockets removes the sockets in dir whose names start with prefix
// and end with suffix that nobody listens on: the leftovers of servers that
// died without closing (vLLM SIGKILLs its engine core at shutdown, so every
// embedded server of a vLLM run leaves one, each under a new engine id).
//
// A file is removed only if all of these hold: it is a socket (not a
// symlink, not a regular file), it is owned by this process's uid, it is
// older than minAge, and a connect to it is refused (ECONNREFUSED: no
// listener). Anything else, a live server's socket included, is left as it
// is. It returns the paths removed; errors on single files are logged and
// skipped (a cleanup must never stop a server from starting).
func RemoveDeadSockets(dir, prefix, suffix string, minAge time.Duration) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	uid := uint32(os.Getuid())
	var removed []string
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, prefix) || !strings.HasSuffix(name, suffix) || e.Type()&os.ModeSocket == 0 {
			continue
		}
		path := filepath.Join(dir, name)
		var st unix.Stat_t
		if unix.Lstat(path, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK || st.Uid != uid {
			continue
		}
		if time.Since(time.Unix(st.Mtim.Unix())) < minAge {
			continue
		}
		if !refused(path) {
			continue
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			slog.Warn("kvshim ipc: cannot remove a dead server's socket", "path", path, "err", err)
			continue
		}
		removed = append(removed, path)
	}
	if len(removed) > 0 {
		slog.Info("kvshim ipc: removed the sockets of dead servers (nobody listening)", "dir", dir, "count", len(removed))
	}
	return removed
}

// refused reports whether a connect to the socket at path is refused: no
// process listens on it. A timeout or a full backlog (EAGAIN) means a live,
// busy server, and is not a refusal.
func refused(path string) bool {
	c, err := net.DialTimeout("unixpacket", path, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}
