"""A stop whose signal's exception was lost still stops nereusd (:class:`nereusd.daemon.app.Terminated`)."""

from __future__ import annotations

import os
import signal

import pytest

from nereusd.daemon.app import STOP, Terminated
from nereusd.daemon.control_plane import ControlPlane
from nereusd.daemon.main import _on_signal


def test_a_signal_whose_exception_a_destructor_swallowed_stops_the_next_poll():
    """SIGTERM arrived while pyzmq's ``Frame.__dealloc__`` ran: Python printed "Exception
    ignored" and nereusd ran on until the launcher's SIGKILL (a ``crashed`` job in the suite,
    2026-12-06). The handler records the signal; the control plane's next poll raises it; once
    the daemon has taken the stop, polls (its shutdown waits on them) run again."""
    control = ControlPlane("tcp://127.0.0.1:0")
    control.interrupted = STOP.raise_pending
    previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Terminated:
            pass   # as a C destructor would: the exception is dropped
        with pytest.raises(Terminated, match="SIGTERM"):
            control.poll(0)
        STOP.taken()
        control.poll(0)   # the shutdown's polls
    finally:
        signal.signal(signal.SIGTERM, previous)
        STOP.taken()
        control.close()
