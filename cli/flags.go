package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// flagSet wraps flag.FlagSet so that a bad flag is reported as one line
// naming the command and what a good value looks like (the flag package
// alone says "parse error" and prints the whole usage).
type flagSet struct {
	*flag.FlagSet
	cmd, head string // command name; usage text above the flag list
}

func newFlagSet(cmd, head string) *flagSet {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return &flagSet{FlagSet: fs, cmd: cmd, head: head}
}

// parse parses args. ok is false when the command must return code at
// once: 0 after --help (usage printed on stdout), 2 after a bad flag
// (reported on stderr). Every command also takes --log-level.
func (fs *flagSet) parse(args []string, stdout, stderr io.Writer) (code int, ok bool) {
	level := fs.String("log-level", "", "log `level`: debug, info, warn or error (default: $KVSHIM_LOG_LEVEL, else info)")
	err := fs.Parse(args)
	if err == nil && *level != "" {
		err = SetLogLevel(*level)
		if err != nil {
			err = fmt.Errorf("--log-level: %w", err)
		}
	}
	switch {
	case err == nil && fs.NArg() > 0:
		fmt.Fprintf(stderr, "kvshim %s: unexpected argument %q (%s takes only flags)\n", fs.cmd, fs.Arg(0), fs.cmd)
	case err == nil:
		return 0, true
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "usage: kvshim %s [flags]\n\n%s\n\nflags:\n", fs.cmd, fs.head)
		fs.printDefaults(stdout)
		return 0, false
	default:
		fmt.Fprintf(stderr, "kvshim %s: %v\n", fs.cmd, err)
	}
	fmt.Fprintf(stderr, "run 'kvshim %s --help' for the flags\n", fs.cmd)
	return 2, false
}

// printDefaults lists the flags spelled as the docs spell them: --name.
func (fs *flagSet) printDefaults(w io.Writer) {
	fs.VisitAll(func(f *flag.Flag) {
		name, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if name != "" {
			line += " " + name
		}
		fmt.Fprintf(w, "%s\n    \t%s\n", line, strings.ReplaceAll(usage, "\n", "\n    \t"))
	})
}

// withDefault appends the default to a usage text (Func flags show none).
func withDefault(usage string, def any, zero bool) string {
	if zero {
		return usage
	}
	return fmt.Sprintf("%s (default %v)", usage, def)
}

// Duration is a duration flag whose error says what a duration looks like.
func (fs *flagSet) Duration(name string, def time.Duration, usage string) *time.Duration {
	p := &def
	fs.Func(name, withDefault(usage, def, def == 0), func(s string) error {
		v, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("want a duration such as 500ms, 90s or 30m (%v)", err)
		}
		*p = v
		return nil
	})
	return p
}

// Float64 is a number flag.
func (fs *flagSet) Float64(name string, def float64, usage string) *float64 {
	p := &def
	fs.Func(name, withDefault(usage, def, def == 0), func(s string) error {
		v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil {
			return fmt.Errorf("want a number such as 16 or 0.5")
		}
		*p = v
		return nil
	})
	return p
}

// Int is a whole-number flag.
func (fs *flagSet) Int(name string, def int, usage string) *int {
	p := &def
	fs.Func(name, withDefault(usage, def, def == 0), func(s string) error {
		v, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("want a whole number")
		}
		*p = v
		return nil
	})
	return p
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string { return strings.Join(*s, " ") }

func (s *stringList) Set(v string) error {
	*s = append(*s, v)
	return nil
}
