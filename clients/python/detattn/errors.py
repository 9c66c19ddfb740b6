"""Exceptions mirroring libdetattn's statuses: every failed call raises a DetattnError (or
the subclass for its status) carrying the gRPC status code, its name and the daemon's
message."""

from __future__ import annotations

from ._lib import STATUS_NAMES, errmsg


class DetattnError(Exception):
    """A call failed. ``code`` is the gRPC status number, ``status`` its name (as
    ``detattn_status_name``), ``message`` the daemon's or the library's message."""

    code = 2

    def __init__(self, code: int, message: str, call: str = ""):
        self.code = code
        self.status = STATUS_NAMES.get(code, "UNKNOWN_STATUS")
        self.message = message
        self.call = call
        super().__init__(f"{call + ': ' if call else ''}{self.status}: {message}")


class Cancelled(DetattnError):
    code = 1


class Unknown(DetattnError):
    code = 2


class InvalidArgument(DetattnError):
    code = 3


class DeadlineExceeded(DetattnError):
    code = 4


class NotFound(DetattnError):
    code = 5


class AlreadyExists(DetattnError):
    code = 6


class PermissionDenied(DetattnError):
    code = 7


class ResourceExhausted(DetattnError):
    code = 8


class FailedPrecondition(DetattnError):
    code = 9


class Aborted(DetattnError):
    code = 10


class OutOfRange(DetattnError):
    code = 11


class Unimplemented(DetattnError):
    code = 12


class Internal(DetattnError):
    code = 13


class Unavailable(DetattnError):
    code = 14


class DataLoss(DetattnError):
    code = 15


# One subclass per status of DETATTN_STATUS_MAP (OK excepted), by number.
_BY_CODE = {cls.code: cls for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                                      PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                                      Unimplemented, Internal, Unavailable, DataLoss)}


def error(code: int, call: str = "") -> DetattnError:
    """The exception for status ``code``, with this thread's last message (read it on the
    thread that made the failed call, right after it)."""
    return _BY_CODE.get(code, DetattnError)(code, errmsg(), call)


def check(code: int, call: str) -> None:
    """Raises the exception for ``code`` unless it is OK (0)."""
    if code != 0:
        raise error(code, call)
