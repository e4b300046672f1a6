"""``python -m emu.worker``: the worker process (see :mod:`emu.worker.main`)."""

from emu.worker.main import main

main()
