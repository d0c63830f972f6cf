#!/usr/bin/env python3
"""Fail when the handwritten kvshim.h and the library's exports disagree.

Compares every `kvshim_*` function declared in export/kvshim.h with the
functions cgo generated into the build header (what the .so really exports):
the same names, each with the same number of parameters. Usage:
check-header.py export/kvshim.h build/libkvshim.h
"""
import re
import sys

DECL = re.compile(r"(?:extern\s+)?[A-Za-z_][\w\s\*]*?\b(kvshim_\w+)\s*\(([^;{]*?)\)\s*;", re.S)


def functions(path: str) -> dict[str, int]:
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, int] = {}
    for name, params in DECL.findall(text):
        params = params.strip()
        out[name] = 0 if params in ("", "void") else params.count(",") + 1
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
            problems.append(f"{name}: {want[name]} parameters in the header, {have[name]} in the export")
    for p in problems:
        print("check-header:", p, file=sys.stderr)
    if not want:
        print("check-header: no kvshim_ functions found in the header", file=sys.stderr)
        return 1
    if not problems:
        print(f"check-header: {len(want)} functions agree")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
