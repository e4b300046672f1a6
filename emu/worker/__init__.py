"""The per-device worker process: joins the torch.distributed world and runs nereusd's tasks.

- :mod:`~emu.worker.main` — the process (``python -m emu.worker``): socket loop, rendezvous;
- :mod:`~emu.worker.world` — joining a world generation through nereusd's store;
- :mod:`~emu.worker.runtime` — the task handlers (build, generate, score, train, checkpoints);
- :mod:`~emu.worker.transition_tasks` — transition, weight-sync and world re-formation handlers.
"""
