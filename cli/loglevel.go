package cli

import (
	"fmt"
	"log/slog"
	"os"
	"strings"
)

// LogLevelEnv names the environment variable that sets the log level of
// the library (every role: vLLM's connectors, the embedded server, the
// CLI); --log-level overrides it for a command.
const LogLevelEnv = "KVSHIM_LOG_LEVEL"

var logLevels = map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError}

// SetLogLevel sets the level of the default slog logger (the library logs
// through slog.Default) to one of debug, info, warn, error.
func SetLogLevel(name string) error {
	l, ok := logLevels[strings.ToLower(strings.TrimSpace(name))]
	if !ok {
		return fmt.Errorf("log level %q is not one of debug, info, warn, error", name)
	}
	slog.SetLogLoggerLevel(l)
	return nil
}

// LogLevelFromEnv applies $KVSHIM_LOG_LEVEL, if set. A bad value is
// reported once on stderr and ignored: a typo must not stop vLLM.
func LogLevelFromEnv() {
	if v := os.Getenv(LogLevelEnv); v != "" {
		if err := SetLogLevel(v); err != nil {
			fmt.Fprintf(os.Stderr, "kvshim: %s: %v; keeping info\n", LogLevelEnv, err)
		}
	}
}
