"""EMU state on a worker: units, primitives, the transition executor, checkpoints, device memory.

- :mod:`~emu.state.unit` — EMUs, logical state and shard holdings;
- :mod:`~emu.state.primitives` — Split/Merge/Extend/Destroy over torch.distributed;
- :mod:`~emu.state.executor` — runs a transition DAG's ops on this rank;
- :mod:`~emu.state.checkpoint` — DCP checkpoints of holdings (the fallback);
- :mod:`~emu.state.devmem` — device memory accounting and virtual devices.
"""
