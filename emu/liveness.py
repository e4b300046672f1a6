"""Liveness of the processes a worker waits on (its vLLM engine), folded into the worker's own beat.

A worker beats from a thread (:func:`emu.worker.main.start_liveness_beat`) and its agent kills a
worker whose beat is silent for the site's ``liveness.worker_stall_s``. A worker waiting on a
helper process of its own keeps beating even when that process is stopped or frozen, so the step
would wait forever. Such a process stamps a shared clock from a thread of its own
(:class:`ProcessBeat`); while the worker waits on it (:meth:`ProcessBeat.waiting`) and the stamp
is older than :data:`SILENT_S`, the worker withholds its own beat. The agent's watchdog then
takes the worker as stalled (cause ``worker_stalled``), and the helper with it (it dies with its
worker: ``PR_SET_PDEATHSIG``, ``SIGKILL``, which also ends a stopped process).

What stays uncaught here: a helper that beats but makes no progress (a live-locked loop);
nereusd's straggler rule (:meth:`~nereusd.daemon.task_dispatch.TaskDispatch._kill_stragglers`)
catches that when other workers of the task returned or wait for it in a collective.

A worker's beat also says whether its main thread is waiting on peers (:func:`waiting_on_peers`):
blocked in a ``torch.distributed`` call, or inside :func:`peer_wait` (the waits of asynchronous
point-to-point work). A worker that waits there for long is held up by another one; the one
its peers wait for is the straggler.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator

SILENT_S = 5.0
"""A helper whose clock is older than this, while its worker waits on it, is silent (its thread
stamps every :data:`STAMP_S`; a busy 2-core machine delays a thread by well under a second)."""
STAMP_S = 0.5

_watched: dict[int, "ProcessBeat"] = {}


class ProcessBeat:
    """A monotonic clock (``time.monotonic``, system-wide on Linux) shared with a helper process.

    Args:
        ctx: the multiprocessing context the helper is started from (``spawn``).
        name: what the worker's log calls the helper.
    """

    def __init__(self, ctx, name: str) -> None:
        self.stamp = ctx.Value("d", 0.0, lock=False)   # 0: not stamped yet (the helper is starting)
        self.name = name
        self._waiting = 0

    @staticmethod
    def start_stamping(stamp, interval_s: float = STAMP_S) -> threading.Thread:
        """In the helper process: stamp ``stamp`` (this object's :attr:`stamp`) every ``interval_s``."""
        def run() -> None:
            while True:
                stamp.value = time.monotonic()
                time.sleep(interval_s)

        thread = threading.Thread(target=run, name="liveness-stamp", daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The worker waits on the helper inside this block (its silence counts only here)."""
        self._waiting += 1
        _watched[id(self)] = self
        try:
            yield
        finally:
            self._waiting -= 1
            if not self._waiting:
                _watched.pop(id(self), None)

    def silent_s(self) -> float:
        """Seconds since the helper's last stamp while the worker waits on it (0 otherwise, and
        before its first stamp: a starting interpreter imports torch before it can stamp)."""
        last = self.stamp.value
        return time.monotonic() - last if self._waiting and last else 0.0


def silent_helper(bound_s: float | None = None) -> tuple[str, float] | None:
    """``(name, seconds)`` of a helper the worker waits on that is silent beyond ``bound_s``
    (default :data:`SILENT_S`)."""
    bound_s = SILENT_S if bound_s is None else bound_s
    for beat in list(_watched.values()):
        silent = beat.silent_s()
        if silent > bound_s:
            return beat.name, silent
    return None


_peer_waits = 0
"""Depth of :func:`peer_wait` blocks on the main thread."""
_TORCH_DISTRIBUTED = ("/torch/distributed/", "\\torch\\distributed\\")


@contextlib.contextmanager
def peer_wait() -> Iterator[None]:
    """The main thread waits on peers inside this block (``work.wait()`` of asynchronous sends,
    receives and broadcasts, which leave no ``torch.distributed`` frame on the stack)."""
    global _peer_waits
    _peer_waits += 1
    try:
        yield
    finally:
        _peer_waits -= 1


def waiting_on_peers(main_ident: int | None = None) -> bool:
    """Whether the main thread (``main_ident``, default the interpreter's main thread) is waiting
    on other workers: inside :func:`peer_wait`, or its innermost Python frame is in
    ``torch.distributed`` (a collective, a send or receive, a barrier: blocked in C++ below it).
    Read from the beat thread; a sample, not a lock-step view."""
    if _peer_waits:
        return True
    ident = main_ident if main_ident is not None else threading.main_thread().ident
    frame = sys._current_frames().get(ident)
    return frame is not None and any(part in frame.f_code.co_filename for part in _TORCH_DISTRIBUTED)
