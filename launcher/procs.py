"""The processes of a run on this machine: agents and workers whose command line names its run
directory (found in ``/proc``; Linux)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MODULES = ("emu.agent", "emu.worker")


def run_processes(run_dir: str | Path, modules: tuple[str, ...] = MODULES) -> dict[int, list[str]]:
    """``{pid: argv}`` of the live processes running one of ``modules`` (``python -m MODULE``)
    with ``run_dir`` (resolved) among their arguments; this process excluded."""
    needle = str(Path(run_dir).resolve())
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if needle in argv and any(m in argv for m in modules):
            found[int(entry.name)] = argv
    return found


def stop_run_processes(run_dir: str | Path, wait_s: float = 0.0, grace_s: float = 5.0) -> list[int]:
    """Make sure no agent or worker of ``run_dir`` outlives its job: wait up to ``wait_s`` for
    them to exit by themselves (nereusd told them to), then SIGTERM, and SIGKILL what is left
    after ``grace_s``. Returns the pids that were still running at the start."""
    pids = list(run_processes(run_dir))

    def alive() -> list[int]:
        return [p for p in pids if Path(f"/proc/{p}").exists()]

    for sig, wait in ((None, wait_s), (signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in alive() if sig is not None else ():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and alive():
            time.sleep(0.05)
        if not alive():
            break
    return pids
