"""kvshim: a KV-cache tier for vLLM whose logic lives in libkvshim.so (Go).

Importing this package loads nothing native: the Go runtime does not survive
fork(), and vLLM forks worker processes after importing connectors. The
library is loaded on first use, by `kvshim.native.library()`.
"""

from kvshim.errors import (
    BadHandleError,
    ClosedError,
    KVShimError,
    NoSpaceError,
    NotSupportedError,
    TimeoutError,  # noqa: A004 - kvshim.TimeoutError subclasses the builtin
)

__all__ = [
    "BadHandleError",
    "ClosedError",
    "KVShimError",
    "NoSpaceError",
    "NotSupportedError",
    "TimeoutError",
]
