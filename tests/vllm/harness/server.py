"""A kvshim server in its own process (kvshim serve from libkvshim.so)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class ServerProcess:
    """A kvshim server in its own process: the library's ``kvshim serve``
    (kvshim_main) run by a fresh Python interpreter that loads
    libkvshim.so itself. ``kill()`` sends SIGKILL (no cleanup runs)."""

    def __init__(self, socket_path: str | os.PathLike[str], l1_size_gb: float = 0.125) -> None:
        self.socket = str(socket_path)
        self.l1_size_gb = l1_size_gb
        self.proc: Any = None

    def start(self, timeout_s: float = 30.0) -> ServerProcess:
        import subprocess
        import sys
        import time

        python_dir = str(Path(__file__).resolve().parents[3] / "python")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [python_dir, env.get("PYTHONPATH")]))
        code = (
            "import sys; from kvshim import native; "
            "sys.exit(native.run_main(['kvshim', 'serve', '--socket', sys.argv[1], "
            "'--l1-size-gb', sys.argv[2]]))"
        )
        self.log = Path(self.socket + ".log")
        with open(self.log, "w") as logf:  # a file, never a pipe that can fill
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, self.socket, str(self.l1_size_gb)],
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        # "kvshim serve: listening on ..." once the socket accepts.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if "listening on" in self.log.read_text():
                return self
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"kvshim serve did not start: {self.log.read_text()!r}")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
