"""A worker waiting on a stopped helper process (its vLLM engine) withholds its liveness beat, so
the agent's stall watchdog takes it (emu/liveness.py, emu.worker.main.start_liveness_beat). The
helper here is a real spawned process stamping the shared clock, stopped with SIGSTOP."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

from emu import liveness
from emu.liveness import ProcessBeat
from emu.worker.main import start_liveness_beat


def _helper(stamp) -> None:   # the helper process: stamps, then idles as an engine between requests
    ProcessBeat.start_stamping(stamp, interval_s=0.05)
    time.sleep(60)


def _beats(fd: int) -> int:
    try:
        return len(os.read(fd, 4096))
    except BlockingIOError:
        return 0


def test_a_stopped_helper_withholds_the_workers_beat_only_while_the_worker_waits_on_it(monkeypatch):
    monkeypatch.setattr(liveness, "SILENT_S", 0.5)
    ctx = multiprocessing.get_context("spawn")
    beat = ProcessBeat(ctx, "vLLM engine tp0/1")
    proc = ctx.Process(target=_helper, args=(beat.stamp,), daemon=True)
    proc.start()
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    thread = start_liveness_beat(write_fd, 0.05)
    try:
        deadline = time.monotonic() + 60
        while not beat.stamp.value:   # the helper's interpreter is starting (torch imported first)
            assert time.monotonic() < deadline and proc.is_alive()
            time.sleep(0.05)
        with beat.waiting():
            time.sleep(1.0)
            assert liveness.silent_helper() is None and _beats(read_fd) > 5   # alive: the worker beats
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(1.0)   # past SILENT_S
            name, silent_s = liveness.silent_helper()
            assert name == "vLLM engine tp0/1" and silent_s > 0.5
            _beats(read_fd)
            time.sleep(0.5)
            assert _beats(read_fd) == 0   # withheld: the agent's watchdog will take the worker
        assert liveness.silent_helper() is None   # the worker no longer waits on it: its silence is not ours
        time.sleep(0.3)
        assert _beats(read_fd) > 0
        with beat.waiting():
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.3)
            assert liveness.silent_helper() is None   # stamping again
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        os.close(read_fd)   # the beat thread ends on the broken pipe (before its fd number can be reused)
        thread.join(5)
        os.close(write_fd)
