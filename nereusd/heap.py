"""The long-lived processes' heap: set-up objects kept out of the cyclic garbage collector."""

from __future__ import annotations

import gc


def settle_heap() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach (``gc.freeze``),
    after a full collection; call once set-up is done (imports, tokenizer, dataset, registry) and
    before anything is created that must be collectable later.

    Why: CPython's full (generation-2) collection traverses every container object, and it runs
    whenever the objects allocated since the last one exceed a quarter of the long-lived ones, or
    when a worker calls ``gc.collect()`` to free a released engine's reference cycles.
    - nereusd: a boundary at 8,192 workers allocates tens of thousands of objects (every
      worker's args and result), so one or two full collections land in every boundary, each over
      the whole start-up heap. ``scripts/bench_control.py`` (1,024 agents, 8,192 workers)
      measured 170–370 ms per such collection and 300–540 ms of collection per boundary
      (``gc.callbacks``); with the set-up heap frozen its boundaries took 400–580 ms instead of
      420–780 ms.
    - A worker (:meth:`emu.worker.runtime.WorkerRuntime.build`, before its first engine): the
      collection after each build and ``transition_finish`` took 0.36–0.37 s of the demo's
      0.45–0.65 s transitions (the ``collect`` phase of the journal's ``transition`` events).

    Frozen objects are never freed if they become cyclic garbage, which is what set-up state is
    for in a process that lives as long as its job; what is allocated later is collected as
    before.
    """
    gc.collect()
    gc.freeze()
