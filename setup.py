"""Builds the kvshim wheel: the Python package plus libkvshim.so.

`pip install .` / `pip wheel .` run `go build -buildmode=c-shared` into the
package directory, so the wheel carries the shared object and needs no Go
toolchain where it is installed. The wheel is platform-specific.
"""

import os
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
VERSION = (ROOT / "VERSION").read_text().strip()
(ROOT / "out").mkdir(exist_ok=True)  # setup.cfg puts egg-info and build output there


class BuildWithGo(build_py):
    """build_py that also builds libkvshim.so into the package."""

    def run(self) -> None:
        super().run()
        out = Path(self.build_lib) / "kvshim" / "libkvshim.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CGO_ENABLED="1")
        subprocess.run(
            ["go", "build", "-buildmode=c-shared", "-trimpath",
             "-ldflags", f"-X main.version={VERSION}", "-o", str(out), "./export"],
            cwd=ROOT, env=env, check=True,
        )
        # cgo writes a header next to the library; it is a build artefact.
        out.with_suffix(".h").unlink(missing_ok=True)


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # marks the wheel platform-specific
        return True


setup(
    name="kvshim",
    version=VERSION,
    description="A KV-cache tier for vLLM: shared-memory L1 and L2 storage behind a Go library",
    python_requires=">=3.10",
    package_dir={"": "python"},
    packages=["kvshim"],
    install_requires=[],
    extras_require={"demo": ["numpy"]},
    entry_points={"console_scripts": ["kvshim = kvshim.cli:main"]},
    cmdclass={"build_py": BuildWithGo},
    distclass=BinaryDistribution,
    zip_safe=False,
)
