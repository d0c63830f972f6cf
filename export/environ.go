package main

/*
#include <stdlib.h>
extern char **environ;
static char *kvshim_environ_at(int i) { return environ[i]; }
*/
import "C"

import (
	"os"
	"strings"
)

// A Go runtime loaded into a running process (dlopen, as libkvshim.so is)
// takes its environment from the block that follows argv on the process's
// initial stack, not from libc's environ. Programs that rewrite their
// process title reuse that block: setproctitle, which vLLM calls in every
// engine-core and worker process ("VLLM::EngineCore"), moves environ to the
// heap and overwrites the original, so Go saw an empty environment there
// (XDG_RUNTIME_DIR, KVSHIM_LIBCUDA, KVSHIM_LOG_LEVEL ignored; the embedded
// server's socket went to /tmp/kvshim-UID). libc's environ is the process's
// real environment (putenv and os.environ edits included): Go's copy is
// filled from it before anything reads a variable.
func init() { syncEnviron() }

func syncEnviron() {
	for i := 0; ; i++ {
		p := C.kvshim_environ_at(C.int(i))
		if p == nil {
			return
		}
		k, v, ok := strings.Cut(C.GoString(p), "=")
		if !ok || k == "" {
			continue
		}
		if cur, set := os.LookupEnv(k); !set || cur != v {
			os.Setenv(k, v)
		}
	}
}
