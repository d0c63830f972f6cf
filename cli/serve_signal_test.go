package cli

import (
	"bufio"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"gotest.tools/v3/assert"
	is "gotest.tools/v3/assert/cmp"

	"github.com/kvshim/kvshim/internal/testkit"
)

// TestServeSignalProcess re-executes the test binary as `kvshim serve` (see
// TestMain), reads it with stat from this process, and stops it with a
// real signal.
func TestServeSignalProcess(t *testing.T) {
	for _, s := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(signalName(s), func(t *testing.T) {
			sock := socketPath(t)
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(os.Environ(), childEnv+"=--socket "+sock+" --l1-size-gb 0.01")
			var stderr testkit.Buffer
			cmd.Stderr = &stderr
			pipe, err := cmd.StdoutPipe()
			assert.NilError(t, err)
			assert.NilError(t, cmd.Start())
			exited := make(chan error, 1)
			lines := make(chan string, 16)
			go func() {
				sc := bufio.NewScanner(pipe)
				for sc.Scan() {
					lines <- sc.Text()
				}
				close(lines)
				exited <- cmd.Wait()
			}()
			t.Cleanup(func() { cmd.Process.Kill() })

			next := func(what string) string {
				select {
				case l, ok := <-lines:
					assert.Assert(t, ok, "child ended before printing %s; stderr: %s", what, stderr.String())
					return l
				case <-time.After(10 * time.Second):
					t.Fatalf("no %s from the child within 10 s; stderr: %s", what, stderr.String())
					return ""
				}
			}
			assert.Check(t, is.Regexp(readyRE, next("ready line")+"\n"))
			code, out, errOut := runCmd("stat", "--socket", sock, "--json")
			assert.Equal(t, code, 0, errOut)
			assert.Check(t, is.Contains(out, `{"name":"kvshim_l1_capacity_bytes","labels":{},"value":10735616}`))

			assert.NilError(t, cmd.Process.Signal(s))
			summary := next("summary line")
			m := summaryRE.FindStringSubmatch(summary + "\n")
			assert.Assert(t, m != nil, "summary %q", summary)
			assert.Equal(t, m[1], signalName(s))
			select {
			case err := <-exited:
				assert.NilError(t, err, "exit status; stderr: %s", stderr.String())
			case <-time.After(10 * time.Second):
				t.Fatalf("child did not exit within 10 s after %v", s)
			}
			_, err = os.Stat(sock)
			assert.Check(t, errors.Is(err, fs.ErrNotExist), "socket left behind")
		})
	}
}
