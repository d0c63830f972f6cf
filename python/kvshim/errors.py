"""Exceptions for libkvshim's return codes (kvshim.h's KVSHIM_E* values)."""

from __future__ import annotations

import builtins

# kvshim.h's return codes, generated from the header (build/gen-abi.py).
from kvshim._abi import EBADH, ECLOSED, EINTERNAL, EINVAL, EIO, ENOSPC, ENOTSUP, EPANIC, ERANGE, ETIMEDOUT, OK

__all__ = [
    "EBADH", "ECLOSED", "EINTERNAL", "EINVAL", "EIO", "ENOSPC", "ENOTSUP", "EPANIC", "ERANGE", "ETIMEDOUT", "OK",
]


class KVShimError(Exception):
    """A libkvshim call failed; `code` is its KVSHIM_E* return code."""

    code = EINTERNAL

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(KVShimError, ValueError):
    code = EINVAL


class BadHandleError(KVShimError):
    code = EBADH


class PanicError(KVShimError):
    code = EPANIC


class BufferTooSmallError(KVShimError):
    code = ERANGE


class NotSupportedError(KVShimError):
    code = ENOTSUP


class TimeoutError(KVShimError, builtins.TimeoutError):  # noqa: A001 - mirrors KVSHIM_ETIMEDOUT
    code = ETIMEDOUT


class IOError(KVShimError, OSError):  # noqa: A001 - mirrors KVSHIM_EIO
    code = EIO


class NoSpaceError(KVShimError):
    code = ENOSPC


class ClosedError(KVShimError):
    code = ECLOSED


_BY_CODE: dict[int, type[KVShimError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        BadHandleError,
        PanicError,
        BufferTooSmallError,
        NotSupportedError,
        TimeoutError,
        IOError,
        NoSpaceError,
        ClosedError,
    )
}


def error_for(code: int, message: str) -> KVShimError:
    """The exception for a negative return code, carrying the last-error text."""
    return _BY_CODE.get(code, KVShimError)(message or f"libkvshim error {code}", code)
