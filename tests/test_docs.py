"""docs/operating.md's environment table is complete: every variable the
code, its tests, scripts and benchmarks read (getenv, os.Getenv/LookupEnv,
an `...Env = "NAME"` constant, os.environ, a shell ${NAME...}) is a row of
it. A variable added without a row fails here, with its name and file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# How the tree reads a variable, per kind of file; group 1 is the name.
READS = [
    re.compile(r'(?:os\.Getenv|os\.LookupEnv|getenv|t\.Setenv)\(\s*"([A-Z][A-Z0-9_]+)"'),
    re.compile(r'\b\w*Env\s*=\s*"([A-Z][A-Z0-9_]+)"'),  # Go: const FooEnv = "KVSHIM_FOO"
    re.compile(r'os\.environ(?:\.get)?[\[(]\s*"([A-Z][A-Z0-9_]+)"'),
    re.compile(r'os\.getenv\(\s*"([A-Z][A-Z0-9_]+)"'),
    re.compile(r"\$\{([A-Z][A-Z0-9_]+):?[-=]"),  # shell: ${NAME:-default}
]
# Read by kvshim but defined by others (the standard environment, vLLM, CUDA,
# the Go and Python toolchains, CI): not kvshim's to document.
FOREIGN = re.compile(
    r"^(HOME|PATH|USER|TMPDIR|XDG_RUNTIME_DIR|CI|PWD|LANG|LC_ALL|TERM|GOPATH|GOFLAGS|GOCACHE|GOMODCACHE|CGO_\w+|"
    r"GOMAXPROCS|GODEBUG|GORACE|PYTHONPATH|PYTHONHASHSEED|VIRTUAL_ENV|PIP_\w+|LD_\w+|CUDA_\w+|NVIDIA_\w+|VLLM_\w+|"
    r"OMP_\w+|MKL_\w+|HF_\w+|TRANSFORMERS_\w+|TOKENIZERS_\w+|TORCH_\w+|DEBIAN_FRONTEND|SUDO_\w+|RUNNER_\w+|GITHUB_\w+|"
    r"LMCACHE_\w+|MC_\w+|AWS_\w+|PYENV_ROOT|UV_\w+|PROMETHEUS_\w+|PYTEST_\w+|COVERAGE_\w+|SHELL|NPROC|CC|GO|MAKE|PYTHON|OUT)$"
)
SOURCES = (".go", ".py", ".sh", ".c", ".h", ".mk")


def _read_variables() -> dict[str, str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found: dict[str, str] = {}
    for name in files:
        path = ROOT / name
        if name == "tests/test_docs.py" or not (name.endswith(SOURCES) or path.name in ("Makefile", "run")):
            continue  # this file's patterns name no variable
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for pattern in READS:
            for m in pattern.finditer(text):
                found.setdefault(m.group(1), name)
    return found


def test_every_variable_read_is_in_the_environment_table() -> None:
    doc = (ROOT / "docs" / "operating.md").read_text()
    table = doc[doc.index("## Environment variables"):]
    table = table[: table.index("\n## ", 1)]
    rows = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    found = _read_variables()
    assert "KVSHIM_LIBRARY" in found and "KVSHIM_LOOKUP_PATH" in found  # the scan sees Python and Go reads
    missing = {v: f for v, f in found.items() if v not in rows and not FOREIGN.match(v)}
    assert not missing, f"read but not in docs/operating.md's environment table: {missing}"
