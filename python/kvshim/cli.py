"""The `kvshim` console command.

`demo` is Python (it drives the library the way the vLLM connector does);
every other command runs in Go through kvshim_main.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    argv[0] = "kvshim"
    if len(argv) > 1 and argv[1] == "demo":
        return _demo(argv[2:])
    from kvshim import native

    return native.run_main(argv)


def _demo(args: list[str]) -> int:
    """Runs the demo; a missing optional package or a failure is one line on
    stderr and an exit code, never a traceback (the demo's own argparse
    reports bad flags the same way, exit 2)."""
    from kvshim.errors import KVShimError

    try:
        from kvshim.demo import main as demo_main

        return demo_main(args)
    except ModuleNotFoundError as e:
        print(f"kvshim demo: needs the Python package {e.name!r}: pip install 'kvshim[demo]'", file=sys.stderr)
        return 2
    except (KVShimError, OSError, ValueError) as e:
        print(f"kvshim demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
