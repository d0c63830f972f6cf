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
        from kvshim.demo import main as demo_main

        return demo_main(argv[2:])
    from kvshim import native

    return native.run_main(argv)
