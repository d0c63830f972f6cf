"""The Python side of the C ABI against export/kvshim.h, the one source of
truth: the return codes in kvshim.errors (and the exception each maps to),
ABI_MAJOR/ABI_MINOR (python/kvshim/_abi.py, generated from it), and the ctypes signature of every function in
kvshim.native._SIGNATURES. A function added to, removed from or changed in
the header fails here until the Python side follows (build/check-header.py
holds the header to the library's exports the same way)."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvshim import errors, native

HEADER = Path(__file__).resolve().parent.parent / "export" / "kvshim.h"

# C parameter types (const dropped, spaces normalised) -> ctypes.
C_TYPES: dict[str, object] = {
    "kvshim_handle": ctypes.c_int64,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "char *": ctypes.c_char_p,
    "void *": ctypes.c_void_p,
    "char **": ctypes.POINTER(ctypes.c_char_p),
    "kvshim_handle *": ctypes.POINTER(ctypes.c_int64),
    "int *": ctypes.POINTER(ctypes.c_int),
    "int64_t *": ctypes.POINTER(ctypes.c_int64),
    "uint32_t *": ctypes.POINTER(ctypes.c_uint32),
    "uint64_t *": ctypes.POINTER(ctypes.c_uint64),
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
}


def header_text() -> str:
    text = HEADER.read_text(encoding="utf-8")
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def header_codes() -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+KVSHIM_(OK|E[A-Z]+)\s+(-?\d+)", header_text(), re.M)}


def param_type(param: str) -> str:
    """'const uint32_t *tokens' -> 'uint32_t *'; 'char **argv' -> 'char **'."""
    p = re.sub(r"\bconst\b", "", param).strip()
    m = re.fullmatch(r"([A-Za-z_]\w*)\s*(\**)\s*[A-Za-z_]\w*", p)
    assert m, f"cannot read the parameter {param!r}"
    return m[1] + (" " + m[2] if m[2] else "")


def header_functions() -> dict[str, tuple[str, list[str]]]:
    out = {}
    for m in re.finditer(r"^\s*([A-Za-z_][\w\s\*]*?)\s*\b(kvshim_\w+)\s*\(([^;{]*?)\)\s*;", header_text(), re.M | re.S):
        params = " ".join(m[3].split())
        out[m[2]] = (m[1].strip(), [] if params in ("", "void") else [param_type(p) for p in params.split(",")])
    return out


def test_header_parses():
    # Guards the parsers: a header they cannot read must not pass as empty.
    assert {"OK", "EINVAL", "EBADH", "EPANIC", "EINTERNAL"} <= set(header_codes())
    assert {"kvshim_open", "kvshim_close", "kvshim_take_output", "kvshim_worker_engine_copy"} <= set(header_functions())


def test_abi_version_matches():
    ver = {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+KVSHIM_ABI_(MAJOR|MINOR)\s+(\d+)", header_text(), re.M)}
    assert (ver["MAJOR"], ver["MINOR"]) == (native.ABI_MAJOR, native.ABI_MINOR)


def test_generated_abi_module_is_current():
    """python/kvshim/_abi.py is what build/gen-abi.py makes of the header now
    (`make lib` regenerates it; a header edited without it fails here)."""
    gen = HEADER.parent.parent / "build" / "gen-abi.py"
    out = subprocess.run([sys.executable, str(gen), "--print", str(HEADER)], check=True, capture_output=True, text=True)
    assert (HEADER.parent.parent / "python" / "kvshim" / "_abi.py").read_text(encoding="utf-8") == out.stdout


def test_abi_rule_same_major_and_at_least_the_minor(monkeypatch):
    """The version rule: the real library's version passes; a newer minor
    passes; an older minor or another major is refused, naming both."""
    lib = ctypes.CDLL(os.environ["KVSHIM_LIBRARY"])
    assert native.check_abi(lib.kvshim_abi_version(), "lib") == (native.ABI_MAJOR, native.ABI_MINOR)
    assert native.check_abi(native.ABI_MAJOR * 1000 + native.ABI_MINOR + 3, "lib") == (
        native.ABI_MAJOR, native.ABI_MINOR + 3)
    for bad in ((native.ABI_MAJOR + 1) * 1000, (native.ABI_MAJOR - 1) * 1000 + 999):
        with pytest.raises(ImportError, match=rf"needs {native.ABI_MAJOR}\.{native.ABI_MINOR}"):
            native.check_abi(bad, "lib")
    monkeypatch.setattr(native, "ABI_MINOR", native.ABI_MINOR + 1)
    with pytest.raises(ImportError, match="a minor at least"):
        native.check_abi(lib.kvshim_abi_version(), "lib")


@pytest.mark.parametrize("name", sorted(header_codes()))
def test_code_constant_and_exception(name):
    code = header_codes()[name]
    assert getattr(errors, name, None) == code, f"kvshim.errors.{name} must be {code} (kvshim.h: KVSHIM_{name})"
    if code == errors.OK:
        return
    exc = errors.error_for(code, "msg")
    assert exc.code == code and str(exc) == "msg"
    if name == "EINTERNAL":
        assert type(exc) is errors.KVShimError
    else:
        assert type(exc) is not errors.KVShimError, f"KVSHIM_{name} has no exception class of its own"


def test_no_python_code_missing_from_header():
    codes = header_codes()
    python = {n: v for n, v in vars(errors).items() if re.fullmatch(r"OK|E[A-Z]+", n) and isinstance(v, int)}
    assert python == codes
    for cls in errors._BY_CODE.values():
        assert cls.code in codes.values(), cls


def test_signatures_match_header():
    funcs = header_functions()
    assert set(native._SIGNATURES) == set(funcs), (
        f"in kvshim.h only: {sorted(set(funcs) - set(native._SIGNATURES))}; "
        f"in _SIGNATURES only: {sorted(set(native._SIGNATURES) - set(funcs))}"
    )
    for name, (ret, params) in sorted(funcs.items()):
        assert ret == "int", f"{name} returns {ret}: native.library() sets restype c_int for every function"
        want = [C_TYPES[p] for p in params]
        assert native._SIGNATURES[name] == want, f"{name}: kvshim.h says ({', '.join(params)})"


def test_library_exports_every_signature():
    lib = native.library()
    for name in native._SIGNATURES:
        fn = getattr(lib, name)
        assert fn.restype is ctypes.c_int and fn.argtypes == native._SIGNATURES[name]


def test_param_type_reader():
    assert param_type("const uint32_t *tokens") == "uint32_t *"
    assert param_type("char **argv") == "char **"
    assert param_type("kvshim_handle h") == "kvshim_handle"
    with pytest.raises(AssertionError):
        param_type("unsigned long long x")
