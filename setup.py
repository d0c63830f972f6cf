"""Builds the kvshim wheel: the Python package plus libkvshim.so.

`pip wheel .` / `make wheel` build the shared object with `make lib`, the same
command as `make` (cgo build, the kvshim.h check, the version stamp
VERSION+commit), and copy out/libkvshim.so into the package, so the wheel
needs no Go toolchain where it is installed.

The binding is ctypes and the .so does not link libpython, so one wheel serves
every CPython >= 3.10: it is tagged py3-none-manylinux_2_NN_ARCH, where 2.NN
is the newest glibc symbol version the .so needs (read from its ELF version
requirements below; 2.34 for a build on glibc >= 2.34, where dlopen and
pthread_* moved into libc). A .so that links anything outside the manylinux
library set fails the build instead of getting a tag it does not deserve.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:  # setuptools >= 70.1 carries bdist_wheel
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools with the wheel package
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
VERSION = (ROOT / "VERSION").read_text().strip()
(ROOT / "out").mkdir(exist_ok=True)  # setup.cfg puts egg-info and build output there

# The libraries a manylinux wheel may link without shipping them (PEP 599/600).
MANYLINUX_LIBS = {
    "libc.so.6", "libpthread.so.0", "libdl.so.2", "libm.so.6", "librt.so.1", "libresolv.so.2",
    "libutil.so.1", "libnsl.so.1", "libgcc_s.so.1", "libstdc++.so.6",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
}


def elf_dependencies(path: Path) -> tuple[list[str], dict[str, set[str]]]:
    """DT_NEEDED libraries and the symbol versions required of each
    (SHT_GNU_verneed), read from a little-endian ELF64 shared object."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise RuntimeError(f"{path}: not a little-endian ELF64 file")
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = struct.unpack_from("<16sHHIQQQIHHHHHH", data)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(strtab: int, off: int) -> str:
        start = sections[strtab][4] + off
        return data[start:data.index(b"\0", start)].decode()

    needed: list[str] = []
    versions: dict[str, set[str]] = {}
    for _, sh_type, _, _, offset, size, link, info, _, _ in sections:
        if sh_type == 6:  # SHT_DYNAMIC
            for pos in range(offset, offset + size, 16):
                tag, val = struct.unpack_from("<qQ", data, pos)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(string(link, val))
        elif sh_type == 0x6FFFFFFE:  # SHT_GNU_verneed: info entries
            pos = offset
            for _ in range(info):
                _, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", data, pos)
                names = versions.setdefault(string(link, file_off), set())
                apos = pos + aux
                for _ in range(cnt):
                    _, _, _, name_off, anext = struct.unpack_from("<IHHII", data, apos)
                    names.add(string(link, name_off))
                    apos += anext
                pos += nxt
    return needed, versions


def manylinux_tag(lib: Path) -> str:
    """manylinux_2_NN_ARCH for lib: NN from the newest GLIBC_2.NN it requires."""
    needed, versions = elf_dependencies(lib)
    outside = sorted(set(needed) - MANYLINUX_LIBS)
    if outside:
        raise RuntimeError(f"{lib} links {outside}, outside the manylinux set: it cannot be tagged manylinux")
    glibc = [(2, 17)]  # the oldest manylinux baseline (manylinux2014)
    for vers in versions.values():
        for v in vers:
            m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", v)
            if m:
                glibc.append((int(m[1]), int(m[2])))
            elif not re.fullmatch(r"(GLIBC_PRIVATE|GCC_[\d.]+|GLIBCXX_[\d.]+|CXXABI_[\d.]+)", v):
                raise RuntimeError(f"{lib} requires symbol version {v}, unknown to manylinux")
            elif v == "GLIBC_PRIVATE":
                raise RuntimeError(f"{lib} uses GLIBC_PRIVATE symbols: it cannot be tagged manylinux")
    major, minor = max(glibc)
    arch = platform.machine()
    return f"manylinux_{major}_{minor}_{arch}"


def make_lib() -> Path:
    """Runs `make lib` (the Makefile's own build, header check and stamp
    included) and returns out/libkvshim.so."""
    if not (ROOT / "Makefile").exists() or not (ROOT / "export").is_dir():
        raise RuntimeError("building kvshim needs the source tree (Makefile, Go sources): build from a git clone")
    make = os.environ.get("MAKE", "make")
    # PYTHON runs build/check-header.py (stdlib only): this interpreter.
    subprocess.run([make, "-C", str(ROOT), "lib", f"PYTHON={sys.executable}"], check=True)
    return ROOT / "out" / "libkvshim.so"


class BuildWithMake(build_py):
    """build_py that also puts `make lib`'s libkvshim.so into the package."""

    def run(self) -> None:
        super().run()
        out = Path(self.build_lib) / "kvshim" / "libkvshim.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(make_lib(), out)
        out.chmod(0o755)


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # installs into platlib, like any native wheel
        return True


class ManylinuxWheel(bdist_wheel):
    """One wheel for every CPython: py3-none-manylinux_2_NN_ARCH."""

    def get_tag(self) -> tuple[str, str, str]:
        build_lib = Path(self.get_finalized_command("build_py").build_lib)
        return "py3", "none", manylinux_tag(build_lib / "kvshim" / "libkvshim.so")


setup(
    name="kvshim",
    version=VERSION,
    description="A KV-cache tier for vLLM: shared-memory L1 and L2 storage behind a Go library",
    license="Apache-2.0",
    python_requires=">=3.10",
    classifiers=[
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    ],
    package_dir={"": "python"},
    packages=["kvshim", "kvshim.vllm"],  # kvshim.vllm: the connector package
    install_requires=[],
    extras_require={"demo": ["numpy"]},
    entry_points={"console_scripts": ["kvshim = kvshim.cli:main"]},
    cmdclass={"build_py": BuildWithMake, "bdist_wheel": ManylinuxWheel},
    distclass=BinaryDistribution,
    zip_safe=False,
)
