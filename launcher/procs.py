"""The processes of a run on this machine: agents and workers whose command line names its run
directory (found in ``/proc``; Linux)."""

from __future__ import annotations

import os
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
