"""A stop that a signal handler asks for, kept until the program takes it (nereusd and the
local launcher)."""

from __future__ import annotations

import signal


class SignalStop:
    """A signal handler (:meth:`handler`) that raises ``exc_type(signal name)`` and remembers the
    stop until :meth:`taken`.

    An exception raised while a C extension's destructor runs (pyzmq's ``Frame.__dealloc__``) is
    printed as "Exception ignored" and dropped: nereusd ran on until the launcher's SIGKILL, and
    the job ended ``crashed`` instead of ``interrupted`` (the suite, 2026-12-06). So the
    program's loops also call :meth:`raise_pending`, and the code that handles the stop calls
    :meth:`taken`, so that the shutdown's own loops run."""

    def __init__(self, exc_type: type[BaseException]) -> None:
        self.exc_type = exc_type
        self.pending: str | None = None

    def handler(self, signum: int, _frame: object) -> None:
        self.pending = signal.Signals(signum).name
        raise self.exc_type(self.pending)

    def raise_pending(self) -> None:
        """Raise the stop a signal asked for that no code has taken yet."""
        if self.pending is not None:
            raise self.exc_type(self.pending)

    def taken(self) -> None:
        self.pending = None
