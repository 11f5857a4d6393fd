"""Exceptions raised by gpufeed. Each carries ``code``: the daemon's stable error code name
(``"UnknownDataset"``, ``"BadRequest"``, ``"CorruptData"``, ...) where the daemon sent one, else None."""

from typing import Optional


class Error(Exception):
    """Base class of gpufeed's errors."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.code = code


class ConnectError(Error):
    """The daemon's socket could not be connected."""


class DaemonError(Error):
    """The daemon refused a request or ended the session; ``code`` says why."""


class InvalidSpecError(Error, ValueError):
    """The stream options break a rule of the protocol; nothing was sent."""


class AllSlotsHeldError(Error, RuntimeError):
    """Every slot of the stream is held by batches (or arrays taken from them) not yet released:
    the next batch would never come. Release one, or copy data out of held arrays, and ask again."""


class ProtocolError(Error):
    """The daemon sent something out of place; the session is over."""


class SessionError(Error):
    """The session ended (the daemon went away, or an earlier error ended it)."""


class CudaError(Error):
    """A CUDA driver call failed while mapping or synchronising a device batch."""
