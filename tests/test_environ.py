"""The library reads the process's real environment (libc's environ), not
the block after argv that Go's runtime reads when it is loaded into a running
process: vLLM's engine-core and worker processes rewrite their title with
setproctitle, which overwrites that block, and kvshim then saw no variables
at all (XDG_RUNTIME_DIR ignored: the embedded server's socket went to
/tmp/kvshim-UID; KVSHIM_LIBCUDA and KVSHIM_LOG_LEVEL ignored). Found under a
real `vllm serve` (tests/e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import os, sys
os.environ["XDG_RUNTIME_DIR"] = sys.argv[1]  # set after start: only libc's environ has it
if sys.argv[2] == "title":
    import setproctitle
    setproctitle.setproctitle("VLLM::EngineCore")
from kvshim import native
native.run_main(["kvshim", "stat"])
"""


@pytest.mark.parametrize("how", ["os.environ", "title"])
def test_the_library_sees_variables_set_after_start_and_after_setproctitle(tmp_path: Path, how: str) -> None:
    if how == "title":
        pytest.importorskip("setproctitle")
    d = tmp_path / "xdg"
    d.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(d), how], capture_output=True, text=True, timeout=60, env=env)
    assert f"no kvshim server at {d}/kvshim/kvshim.sock" in p.stderr, p.stderr
