"""The engine's statuses and the exceptions they become (pure Python: importing this
module does not load the native library).

Every ``colibri_status`` of ``native/include/colibri.h`` has a :class:`ColibriError`
subclass here; ``colibri_lab.runtime._native.check`` is the one place that raises them, with the
engine's own message.
"""

from __future__ import annotations

# colibri_status values (colibri.h).
OK = 0
E_INVALID_ARG = 1
E_IO = 2
E_FORMAT = 3
E_VERSION = 4
E_CHECKSUM = 5
E_UNSUPPORTED = 6
E_NOMEM = 7
E_TOKEN_RANGE = 8
E_SEQ_TOO_LONG = 9
E_BUFFER_TOO_SMALL = 10
E_NUMERIC = 11
E_INTERNAL = 12


# Exceptions: one class per status, all ColibriError, each with .status and .message.


class ColibriError(RuntimeError):
    """An error reported by the Colibri engine.

    ``status`` is the ``colibri_status`` code, ``message`` the engine's explanation.
    """

    status: int = E_INTERNAL

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.status))


class ColibriInvalidArgError(ColibriError, ValueError):
    status = E_INVALID_ARG


class ColibriIOError(ColibriError, OSError):
    status = E_IO


class ColibriFormatError(ColibriError):
    status = E_FORMAT


class ColibriVersionError(ColibriError):
    status = E_VERSION


class ColibriChecksumError(ColibriError):
    status = E_CHECKSUM


class ColibriUnsupportedError(ColibriError):
    status = E_UNSUPPORTED


class ColibriNoMemoryError(ColibriError, MemoryError):
    status = E_NOMEM


class ColibriTokenRangeError(ColibriError, ValueError):
    status = E_TOKEN_RANGE


class ColibriSeqTooLongError(ColibriError, ValueError):
    status = E_SEQ_TOO_LONG


class ColibriBufferTooSmallError(ColibriError):
    status = E_BUFFER_TOO_SMALL


class ColibriNumericError(ColibriError, ArithmeticError):
    status = E_NUMERIC


class ColibriInternalError(ColibriError):
    status = E_INTERNAL


class ColibriClosedError(ColibriError):
    """A method was called on an Engine or Tokenizer after ``close()``."""

    status = E_INVALID_ARG


ERRORS: dict[int, type[ColibriError]] = {
    cls.status: cls
    for cls in (
        ColibriInvalidArgError,
        ColibriIOError,
        ColibriFormatError,
        ColibriVersionError,
        ColibriChecksumError,
        ColibriUnsupportedError,
        ColibriNoMemoryError,
        ColibriTokenRangeError,
        ColibriSeqTooLongError,
        ColibriBufferTooSmallError,
        ColibriNumericError,
        ColibriInternalError,
    )
}

__all__ = [n for n in list(globals()) if n.startswith(("Colibri", "E_"))] + ["ERRORS", "OK"]
