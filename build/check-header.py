#!/usr/bin/env python3
"""Fail when the handwritten kvshim.h and the library's exports disagree.

Compares every `kvshim_*` function declared in export/kvshim.h with the
functions cgo generated into the build header (what the .so really exports):
the same names, each with the same return type and the same parameter
types, in order. Types are compared as C sees them: `const` and parameter
names dropped, `kvshim_handle` read as its typedef, int64_t. (The Python
side is held to kvshim.h by tests/test_abi_header.py.) Usage:
check-header.py export/kvshim.h build/libkvshim.h
"""
import re
import sys

DECL = re.compile(r"(?:extern\s+)?([A-Za-z_][\w\s\*]*?)\s*\b(kvshim_\w+)\s*\(([^;{]*?)\)\s*;", re.S)
TYPEDEFS = {"kvshim_handle": "int64_t"}


def ctype(decl: str, named: bool = True) -> str:
    """'const uint32_t *tokens' -> 'uint32_t*'; 'char** argv' -> 'char**'."""
    d = re.sub(r"\b(?:const|extern)\b", " ", decl)
    d = re.sub(r"\s*\*\s*", " * ", d).split()
    if named and len(d) > 1 and re.fullmatch(r"[A-Za-z_]\w*", d[-1]):
        d = d[:-1]  # the parameter's name
    words = [TYPEDEFS.get(w, w) for w in d]
    return " ".join(w for w in words if w != "*") + "*" * words.count("*")


def functions(path: str) -> dict[str, tuple[str, list[str]]]:
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, tuple[str, list[str]]] = {}
    for ret, name, params in DECL.findall(text):
        params = " ".join(params.split())
        types = [] if params in ("", "void") else [ctype(p) for p in params.split(",")]
        out[name] = (ctype(ret.split("\n")[-1], named=False), types)
    return out


def main() -> int:
    want, have = functions(sys.argv[1]), functions(sys.argv[2])
    problems = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            problems.append(f"{name}: declared in {sys.argv[1]} but not exported by the library")
        elif name not in want:
            problems.append(f"{name}: exported by the library but missing from {sys.argv[1]}")
        elif want[name] != have[name]:
            (wr, wp), (hr, hp) = want[name], have[name]
            problems.append(f"{name}: {wr} ({', '.join(wp)}) in the header, {hr} ({', '.join(hp)}) in the export")
    for p in problems:
        print("check-header:", p, file=sys.stderr)
    if not want:
        print("check-header: no kvshim_ functions found in the header", file=sys.stderr)
        return 1
    if not problems:
        print(f"check-header: {len(want)} functions agree (names, return and parameter types)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
